"""Compute layout: parameters gathered for use, tokens split over the batch axes.

FSDP's gather brings a module's parameters into the layout the computation uses.

Parameters rest FSDP-split over `embed` (see keel.mesh); under an explicit mesh an op between a
split weight and a batch-split activation is a sharding error rather than a silent all-gather, so
each block gathers its own weights when it runs (one layer at a time inside the scan; autodiff
turns the gather into a reduce-scatter of the gradients). Routed expert weights stay split over
`experts`: the transports move tokens to them instead.
"""

import haliax as hax
import jax
from haliax import NamedArray
from jax.sharding import PartitionSpec as P
from jax.sharding import get_abstract_mesh, reshard


def gathered(module):
    """`module` with every NamedArray except routed expert weights replicated on the current mesh."""
    mesh = get_abstract_mesh()
    if mesh.empty:
        return module

    def gather(leaf):
        if isinstance(leaf, NamedArray) and not is_routed_expert_weight(leaf):
            return hax.named(reshard(leaf.array, P(*([None] * leaf.ndim))), leaf.axes)
        return leaf

    return jax.tree.map(gather, module, is_leaf=lambda x: isinstance(x, NamedArray))


def is_routed_expert_weight(array: NamedArray) -> bool:
    names = {ax.name for ax in array.axes}
    return "experts" in names and "expert_mlp" in names


BATCH_AXES = ("replica_dcn", "data", "expert")


def token_axes() -> tuple[str, ...]:
    """The current mesh's axes that split a flat token dimension (the batch axes it has)."""
    mesh = get_abstract_mesh()
    return () if mesh.empty else tuple(a for a in BATCH_AXES if a in mesh.shape)


def split_tokens(array: jax.Array) -> jax.Array:
    """`array` with its leading (token) dimension split over the batch axes, the rest whole."""
    axes = token_axes()
    return reshard(array, P(axes, *([None] * (array.ndim - 1)))) if axes else array
