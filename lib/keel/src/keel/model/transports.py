"""Expert dispatch: run the routed experts on a flat batch of tokens with a chosen transport.

Every transport computes the same function, out[t] = sum_j w[t, j] * expert_{e[t, j]}(x[t]),
except for assignments a fixed-capacity transport drops (counted and returned). The expert
parallel ones are Levanter's grug kernels (`levanter.grug.grug_moe.moe_mlp`) called on the raw
arrays behind our named ones; keel adds only what grug lacks:

- `dense`: grug has no all-experts reference, and tests need one that shares no code with the
  kernels under test.
- `local`: grug refuses its grouped local kernel when the mesh has an expert axis, so keel runs
  that kernel inside its own shard_map over the token shards with the experts gathered; on
  XLA:CPU it runs keel's tiled kernel instead (tiled_experts.py: grug's uses ragged_dot, ~15x
  slower there).
"""

import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import NamedArray
from jax import shard_map
from jax.sharding import AbstractMesh, get_abstract_mesh, reshard
from jax.sharding import PartitionSpec as P
from levanter.grug.grug_moe import moe_mlp

from keel.model.axes import TOP_K
from keel.model.layout import split_tokens, token_axes
from keel.model.tiled_experts import tiled_expert_mlp
from keel.spec.transports import TransportSpec, check_transport_supported, kernel_capacity_factor

_GRUG_NAMES = {
    "fixed_all_to_all": "fixed_all_to_all",
    "ring": "ring",
    "fixed_pooled_all_to_all": "fixed_pooled_wave_all_to_all",
    "ragged_all_to_all": "ragged_all_to_all",
}


def dispatch(
    x: NamedArray,
    selected: NamedArray,
    weights: NamedArray,
    valid: NamedArray,
    gate: NamedArray,
    up: NamedArray,
    down: NamedArray,
    *,
    transport: TransportSpec,
    capacity_factor: float,
) -> tuple[NamedArray, jax.Array, float | None]:
    """x [Token, Latent], selected/weights [Token, TopK], valid [Token]; expert weights
    gate/up [Experts, Latent, ExpertMlp], down [Experts, ExpertMlp, Latent].

    Returns (out [Token, Latent], dropped assignments: int32 scalar over the global batch, the
    capacity factor the kernel was called with: None where no assignment can be dropped). The
    third is the kernel's own report, which the training loop checks against the resolved run.
    Invalid (padding) tokens get a zero output and are never counted as dropped.
    """
    check_transport_supported(transport, jax.default_backend())
    if transport.name == "dense":
        return _dense(x, selected, weights, valid, gate, up, down), jnp.zeros((), jnp.int32), None

    Token, Latent = x.axes
    TopK = selected.resolve_axis(TOP_K)
    raw = dict(
        x=split_tokens(x.rearrange((Token, Latent)).array),
        selected=split_tokens(selected.rearrange((Token, TopK)).array),
        weights=split_tokens(weights.rearrange((Token, TopK)).array),
        valid=split_tokens(valid.array),
    )
    w13 = jnp.concatenate([gate.array, up.array], axis=-1)  # [E, Latent, 2F], gate first (grug's layout)
    w2 = down.array
    sized = None
    if transport.name == "local":
        out, dropped = _local(raw, w13, w2)
    else:
        mesh = get_abstract_mesh()
        expert_size = 1 if mesh.empty else int(mesh.shape.get("expert", 1))
        declared = capacity_factor if transport.capacity_factor is None else transport.capacity_factor
        factor = kernel_capacity_factor(transport.name, declared, expert_size)  # ring: dropless
        out, counts = moe_mlp(
            raw["x"],
            raw["selected"],
            raw["weights"],
            w13,
            w2,
            token_valid=raw["valid"],
            implementation=_GRUG_NAMES[transport.name],
            mesh=mesh,
            capacity_factor=factor,
            pooled_transport_capacity_factor=factor,
            num_expert_waves=transport.num_waves,
            report_capacity_overflow=True,
        )
        dropped = counts.dropped
        # grug runs its dropless local kernel without an expert axis of 2 or more: no capacity then
        sized = None if transport.name == "ring" or expert_size < 2 else factor
    return hax.named(out, (Token, Latent)), dropped.astype(jnp.int32), sized


def _local(raw: dict, w13: jax.Array, w2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A dropless grouped kernel on each token shard, all experts gathered onto every device:
    grug's scatter kernel on accelerators, keel's tiled batched matmuls on XLA:CPU."""
    no_mesh = AbstractMesh((), ())

    def run(x, selected, weights, valid, w13, w2):
        if jax.default_backend() == "cpu":
            return tiled_expert_mlp(x, selected, weights, valid, w13, w2), jnp.zeros((), jnp.int32)
        out, counts = moe_mlp(
            x, selected, weights, w13, w2, token_valid=valid, implementation="scatter", mesh=no_mesh,
            report_capacity_overflow=True,
        )
        return out, counts.dropped

    axes = token_axes()
    if not axes:
        return run(raw["x"], raw["selected"], raw["weights"], raw["valid"], w13, w2)

    def run_shard(*args):
        out, dropped = run(*args)
        return out, jax.lax.psum(dropped, axes)

    t2 = P(axes, None)
    return shard_map(
        run_shard,
        mesh=get_abstract_mesh(),
        in_specs=(t2, t2, t2, P(axes), P(None, None, None), P(None, None, None)),
        out_specs=(t2, P()),
        check_vma=False,
    )(raw["x"], raw["selected"], raw["weights"], raw["valid"], _replicate(w13), _replicate(w2))


def _dense(x, selected, weights, valid, gate, up, down) -> NamedArray:
    """Every expert on every token, weighted by a dense [Token, Experts] routing matrix."""
    gate, up, down = (hax.named(_replicate(w.array), w.axes) for w in (gate, up, down))
    Experts, Latent = gate.axes[0], gate.axes[1]
    TopK = selected.resolve_axis(TOP_K)
    ExpertMlp = gate.axes[2]
    dense_w = hax.sum(hnn.one_hot(selected, Experts, dtype=weights.dtype) * weights, axis=TopK)
    dense_w = dense_w * valid.astype(weights.dtype)
    hidden = hnn.silu(hax.dot(x, gate, axis=Latent)) * hax.dot(x, up, axis=Latent)
    per_expert = hax.dot(hidden, down, axis=ExpertMlp)  # [Token, Experts, Latent]
    return hax.dot(per_expert, dense_w, axis=Experts).astype(x.dtype)


def _replicate(a: jax.Array) -> jax.Array:
    mesh = get_abstract_mesh()
    if mesh.empty:
        return a
    return reshard(a, P(*([None] * a.ndim)))
