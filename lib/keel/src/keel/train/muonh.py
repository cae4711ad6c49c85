"""MuonH (Muon with a norm-preserving "hyperball" update) on each parameter's logical matrices.

Keel stores matrices with articulated axes (q is [layers, embed, heads, head_size]), so "the last
two dims" is not the matrix: Newton-Schulz would orthogonalise one [heads, head_size] slice per
input row, and the hyperball would freeze each row's norm. The matrices are found from the Haliax
axis names instead (`matrix_axes`, the one rule), the way Levanter's MuonH flattens a
`haliax.nn.Linear`'s In axes and Out axes into one matrix (Linear modules are flattened first with
Levanter's own helpers, so their `__IN__` / `__OUT__` axes are the two sides).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import haliax as hax
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P
from levanter.optim.util import (
    NEWTON_SCHULZ_COEFFICIENTS,
    flatten_linear_layers,
    norm_preserving_update,
    unflatten_linear_layers,
)

from keel.spec.matrices import matrix_axes

Schedule = Callable[[jax.Array], jax.Array]


class MuonHState(NamedTuple):
    count: jax.Array
    momentum: optax.Updates


def scale_by_muonh(
    lr: Schedule, *, momentum: float, nesterov: bool, ns_steps: int, eps: float, dtype=jnp.bfloat16,
    loop_elements: int | None = None,
) -> optax.GradientTransformation:
    """MuonH: Nesterov momentum, Newton-Schulz orthogonalisation per logical matrix (computed in
    `dtype`: the hero's bf16), hyperball update. Each Newton-Schulz loop holds at most
    `loop_elements` per device: the resolved run's `newton_schulz_elements_per_device`, or without
    one the largest parameter's matrices (`_muonh_updates`).

    The update keeps each logical matrix's Frobenius norm at its initial value (Levanter's
    `norm_preserving_update` on the same matrix), so MuonH matrices need no weight decay.
    """
    def init_fn(params):
        for param in jax.tree.leaves(flatten_linear_layers(params), is_leaf=_is_named):  # refuse non-matrices early
            _check_matrix(param)
        return MuonHState(count=jnp.zeros([], jnp.int32), momentum=optax.tree_utils.tree_zeros_like(params))

    def update_fn(updates, state, params):
        buf = jax.tree.map(lambda m, g: momentum * m + g, state.momentum, updates)
        direction = jax.tree.map(lambda m, g: momentum * m + g, buf, updates) if nesterov else buf
        leaves, tree = jax.tree.flatten(flatten_linear_layers(params), is_leaf=_is_named)
        directions = tree.flatten_up_to(flatten_linear_layers(direction))
        stepped = _muonh_updates(leaves, directions, lr(state.count), ns_steps, eps, dtype, loop_elements)
        return unflatten_linear_layers(direction, tree.unflatten(stepped)), MuonHState(
            count=optax.safe_increment(state.count), momentum=buf)

    return optax.GradientTransformation(init_fn, update_fn)


def _is_named(x) -> bool:
    return isinstance(x, hax.NamedArray)


def _check_matrix(param) -> None:
    if _is_named(param):
        matrix_axes(param.axes)
    elif param.ndim != 2:
        raise ValueError(f"MuonH: an unnamed array of shape {param.shape} is not a matrix: give it Haliax axes")


class _Matrices(NamedTuple):
    """One parameter's logical matrices as a batch `[*stack, rows, cols]` with rows <= cols, for
    orthogonalising together with others of the same `group`, and how to put the result back."""

    param: jax.Array
    update: jax.Array
    group: tuple  # equal for parameters whose batches concatenate along their first dim
    restore: Callable[[jax.Array], object]


def _as_matrices(param, update) -> _Matrices:
    """A parameter and its update as batches of whole logical matrices (`matrix_axes`), each
    transposed to have no more rows than columns: the polar factor of a transpose is the transpose
    of the polar factor, and the Frobenius norms are the same. Stacks that no mesh axis splits
    become one batch dimension, so every such matrix of a shape joins one group."""
    if not _is_named(param):  # a plain 2-D array (init_fn refused any other): a group of its own
        return _Matrices(param[None], update[None], ("own", id(param)), lambda out: out[0])
    stack, rows, cols = matrix_axes(param.axes)
    order = (*stack, *rows, *cols)
    p, spec = _whole_matrices(param.rearrange(order).array, len(stack))
    u, _ = _whole_matrices(update.rearrange(order).array, len(stack))
    num_rows, num_cols = math.prod(ax.size for ax in rows), math.prod(ax.size for ax in cols)
    stack_spec = tuple(spec)[: len(stack)] if spec is not None else ()
    if any(stack_spec):  # a split stack keeps its dims and their split; it groups only with its like
        batch = tuple(ax.size for ax in stack)
        group = (batch[1:], stack_spec) if not stack_spec[0] else ("own", id(param))
    else:
        batch, group = (math.prod(ax.size for ax in stack),), ()
    transpose = num_rows > num_cols

    def as_batch(x):
        x = x.reshape(*batch, num_rows, num_cols)
        return jnp.swapaxes(x, -1, -2) if transpose else x

    def restore(out):
        out = (jnp.swapaxes(out, -1, -2) if transpose else out).reshape(p.shape)
        out = out if spec is None else jax.sharding.reshard(out, spec)
        return hax.named(out, order).rearrange(param.axes)

    shape = (min(num_rows, num_cols), max(num_rows, num_cols))
    return _Matrices(as_batch(p), as_batch(u), (*group, shape, p.dtype, u.dtype), restore)


def _muonh_updates(params: list, updates: list, rate, steps: int, eps: float, dtype, loop_elements: int | None) -> list:
    """The hyperball update of each parameter: every logical matrix orthogonalised, its norm kept.

    Parameters of a group (`_as_matrices`) go through one batched Newton-Schulz loop together, up
    to `loop_elements` on a device: the plan's bound (`ResolvedRun.newton_schulz_elements_per_device`,
    the x of what `keel plan` prints as `newton_schulz_loop`), which a parameter laid out larger than
    the plan says is refused against; None, outside a resolved run, is the largest parameter's
    size. Each loop compiles to kernels of its own:
    tiny_moe's 20 MuonH parameters took 20 loops one per parameter, 11 bounded by its largest
    parameter, and take 4 now, one per group (what `GroupedOptimizerConfig.newton_schulz_batch`
    allows it): its training step compiles in 10.1 s instead of 12.3 s with the 11 (1,045 fusions
    against 1,214; 2 cores, fresh processes, 2 pairs), its steps no slower (172 against 181 ms,
    medians of 27 interleaved)."""
    def one(p, u):
        orthogonal = _newton_schulz(u.astype(dtype), steps, eps).astype(jnp.float32)
        return norm_preserving_update(p, orthogonal, rate).astype(u.dtype)

    batches = [_as_matrices(p, u) for p, u in zip(params, updates)]
    largest = max((_per_device(b.param) for b in batches), default=0)
    budget = largest if loop_elements is None else loop_elements
    if largest > budget:
        raise ValueError(f"MuonH: a parameter gathers {largest:,} elements per device for Newton-Schulz, more than "
                         f"the resolved run's {budget:,} (newton_schulz_elements_per_device): the live layout is not "
                         "the planned one")
    loops: dict[tuple, list[list[int]]] = {}  # group -> its loops, each the parameters it batches
    for index, batch in enumerate(batches):
        group = loops.setdefault(batch.group, [[]])
        if group[-1] and sum(_per_device(batches[i].param) for i in group[-1]) + _per_device(batch.param) > budget:
            group.append([])
        group[-1].append(index)
    stepped: list = [None] * len(batches)
    for members in (loop for group in loops.values() for loop in group):
        fn = one
        for _ in range(batches[members[0]].param.ndim - 2):
            fn = jax.vmap(fn)
        out = fn(jnp.concatenate([batches[i].param for i in members]),
                 jnp.concatenate([batches[i].update for i in members]))
        start = 0
        for i in members:
            size = batches[i].param.shape[0]
            stepped[i] = batches[i].restore(out[start : start + size])
            start += size
    return stepped


def _per_device(x: jax.Array) -> int:
    """Elements of `x` on one device."""
    sharding = jax.typeof(x).sharding
    return x.size if sharding.mesh.empty else math.prod(sharding.shard_shape(x.shape))


def _whole_matrices(x: jax.Array, num_stack: int):
    """x with its matrix dims (all but the first `num_stack`) unsplit, and x's own spec.

    FSDP splits a matrix's rows over devices; Newton-Schulz multiplies whole matrices, so they are
    gathered for it (and the result split back like the parameter). Stack dims keep their split.
    """
    sharding = jax.typeof(x).sharding
    if sharding.mesh.empty:
        return x, None
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    return jax.sharding.reshard(x, P(*spec[:num_stack], *(None,) * (x.ndim - num_stack))), P(*spec)


def _newton_schulz(x: jax.Array, steps: int, eps: float) -> jax.Array:
    """Levanter's quintic Newton-Schulz iteration (its coefficients) toward the polar factor of x.

    Levanter's own `zeropower_via_newtonschulz5` pins a (data, model) sharding constraint, which
    an explicit-axis mesh rejects; this is the same iteration without it. The iterations are one
    `scan` over the coefficient table rather than unrolled: before MuonH batched parameters
    (`_muonh_updates`) each had its own iteration, and unrolled they gave tiny_moe's training
    step 18,274 optimised HLO instructions against 15,178 (compile 19.5 s against 18.1 s, medians
    of 4 interleaved). On one matrix the
    two give the same bits; inside a whole step XLA fuses them differently, so losses differ in
    their last bits.
    """
    table = NEWTON_SCHULZ_COEFFICIENTS["quintic"]
    coefficients = jnp.asarray([table[i % len(table)] for i in range(steps)], jnp.float32)
    x = x / (jnp.linalg.norm(x) + eps)
    transpose = x.shape[0] > x.shape[1]
    if transpose:
        x = x.T

    def iteration(x, abc):
        a, b, c = abc.astype(x.dtype)  # as the Python floats were: x's dtype
        gram = x @ x.T
        return a * x + (b * gram + c * gram @ gram) @ x, None

    x, _ = jax.lax.scan(iteration, x, coefficients)
    return x.T if transpose else x
