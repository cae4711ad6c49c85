"""Compute layout: parameters gathered for use, tokens split over the batch axes.

FSDP's gather brings a module's parameters into the layout the computation uses.

Two Haliax idioms silently undo the batch split under an explicit mesh, so the model uses the
helpers below instead (measured on `tiny_moe`'s training step: they were 27 all-gathers of whole
activations per step, every device then computing on every token):

- `x * w` for a replicated parameter w (a norm gain, a conv tap) broadcasts w to x's full shape,
  a replicated array, so the backward pass all-gathers x-sized cotangents to sum w's gradient (and
  `x + w`, the router bias, gathers x itself): `times` and `plus` broadcast in place instead;
- `flatten_axes` of [Batch, Pos] into a token axis reshapes without an out sharding, which comes
  out replicated: `flatten_tokens` / `unflatten_tokens` keep tokens split as the batch was.

Parameters rest FSDP-split over `embed` (see keel.mesh); under an explicit mesh an op between a
split weight and a batch-split activation is a sharding error rather than a silent all-gather, so
each block gathers its own weights when it runs (one layer at a time inside the scan; autodiff
turns the gather into a reduce-scatter of the gradients). Routed expert weights stay split over
`experts`: the transports move tokens to them instead.
"""

import haliax as hax
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray
from jax.sharding import PartitionSpec as P
from jax.sharding import get_abstract_mesh, reshard

from keel.spec.placement import is_routed_experts
from keel.spec.topology import BATCH_AXES


def gathered(module):
    """`module` with every NamedArray except routed expert weights replicated on the current mesh."""
    mesh = get_abstract_mesh()
    if mesh.empty:
        return module

    def gather(leaf):
        if isinstance(leaf, NamedArray) and not is_routed_experts({ax.name for ax in leaf.axes}):
            return hax.named(reshard(leaf.array, P(*([None] * leaf.ndim))), leaf.axes)
        return leaf

    return jax.tree.map(gather, module, is_leaf=lambda x: isinstance(x, NamedArray))


def token_axes() -> tuple[str, ...]:
    """The current mesh's axes that split a flat token dimension (the batch axes it has)."""
    mesh = get_abstract_mesh()
    return () if mesh.empty else tuple(a for a in BATCH_AXES if a in mesh.shape)


def split_tokens(array: jax.Array) -> jax.Array:
    """`array` with its leading (token) dimension split over the batch axes, the rest whole."""
    axes = token_axes()
    return reshard(array, P(axes, *([None] * (array.ndim - 1)))) if axes else array


def times(x: NamedArray, w: NamedArray) -> NamedArray:
    """x * w for a parameter w whose axes are some of x's: the product keeps x's axes and layout."""
    return hax.named(x.array * _in_place(w, x), x.axes)


def plus(x: NamedArray, w: NamedArray) -> NamedArray:
    """x + w for a parameter w whose axes are some of x's (e.g. a bias): keeps x's axes and layout."""
    return hax.named(x.array + _in_place(w, x), x.axes)


def _in_place(w: NamedArray, x: NamedArray) -> jax.Array:
    """w's array with x's axis order and size-1 axes where w has none: numpy broadcasting."""
    names = {ax.name for ax in w.axes}
    aligned = w.rearrange(tuple(ax for ax in x.axes if ax.name in names)).array
    return aligned.reshape([ax.size if ax.name in names else 1 for ax in x.axes])


def flatten_tokens(x: NamedArray, Batch: Axis, Pos: Axis, Token: str) -> NamedArray:
    """x [Batch, Pos, ...] as [Token, ...] (token = b * Pos + p), split as the batch was."""
    rest = tuple(ax for ax in x.axes if ax.name not in (Batch.name, Pos.name))
    array = x.rearrange((Batch, Pos, *rest)).array
    flat = _reshape(array, (Batch.size * Pos.size, *(ax.size for ax in rest)), lead=_split_of(array, 0))
    return hax.named(flat, (Axis(Token, Batch.size * Pos.size), *rest))


def unflatten_tokens(x: NamedArray, Token: str, Batch: Axis, Pos: Axis) -> NamedArray:
    """The inverse of `flatten_tokens`: x [Token, ...] as [Batch, Pos, ...]."""
    Tok = x.resolve_axis(Token)
    rest = tuple(ax for ax in x.axes if ax.name != Token)
    array = x.rearrange((Tok, *rest)).array
    return hax.named(_reshape(array, (Batch.size, Pos.size, *(ax.size for ax in rest)), lead=_split_of(array, 0)),
                     (Batch, Pos, *rest))


def _split_of(array: jax.Array, dim: int):
    """The mesh axes dimension `dim` of `array` is split over (None: whole, or no explicit mesh)."""
    sharding = getattr(jax.typeof(array), "sharding", None)
    spec = getattr(sharding, "spec", None)
    return spec[dim] if spec is not None and len(spec) > dim else None


def _reshape(array: jax.Array, shape: tuple[int, ...], *, lead) -> jax.Array:
    if get_abstract_mesh().empty or lead is None:
        return jnp.reshape(array, shape)
    return jnp.reshape(array, shape, out_sharding=P(lead, *([None] * (len(shape) - 1))))
