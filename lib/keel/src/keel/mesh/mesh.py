"""From a `RackTopology` to a JAX mesh, and the partition spec of every named array on it.

Axes (all Explicit): `replica_dcn` (racks) x `data` x `expert` x `model` (inside a rack). Where
each parameter lives is `keel.spec.placement`'s rule table (the planner counts bytes from the very
same table); activations put `batch` over (`replica_dcn`, `data`, `expert`) and name `vocab` to
`model` in the compute mapping so Levanter's fused cross-entropy shard_map sees the lm_head's
layout.

On hardware with slices (TPU multislice) racks are the slices; with several processes they are
contiguous blocks of processes; on one process (CPU with simulated devices) they are contiguous
blocks of `jax.devices()`. Levanter's `MeshConfig` is not used: it refuses a DCN axis > 1 on one
CPU process (CPU devices have no slice index), which the simulated racks need.
"""

import contextlib

import haliax as hax
import jax
import numpy as np
from haliax import NamedArray
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from levanter.utils.jax_utils import leaf_key_paths

from keel.spec.placement import place
from keel.spec.topology import BATCH_AXES, MESH_AXES, RackTopology


def run_topology(declared: RackTopology | None) -> RackTopology:
    """The topology a step's mesh is laid out on: the declared one, else (a run declaring none,
    which trains in one process) every device jax sees as one rack. The training step and the
    steps that load its checkpoints both read it here."""
    return declared or RackTopology(racks=1, gpus_per_rack=len(jax.devices()))


def build_mesh(topology: RackTopology, devices=None) -> Mesh:
    """The explicit (replica_dcn, data, expert, model) mesh; racks are contiguous device blocks."""
    devices = list(jax.devices() if devices is None else devices)
    topology.check_device_count(len(devices))
    ordered = sorted(devices, key=_rack_key(devices, topology.racks))
    shape = tuple(topology.axis_sizes[name] for name in MESH_AXES)
    return Mesh(np.array(ordered, dtype=object).reshape(shape), MESH_AXES, axis_types=(AxisType.Explicit,) * 4)


def _rack_key(devices, racks: int):
    """Sort key grouping each rack's devices together: by slice, else process, else given order."""
    slices = {getattr(d, "slice_index", None) for d in devices}
    if None not in slices and len(slices) == racks:
        return lambda d: (d.slice_index, d.process_index, d.id)
    position = {id(d): i for i, d in enumerate(devices)}
    return lambda d: (d.process_index, position[id(d)])


def compute_axis_mapping() -> dict[str, tuple[str, ...] | str]:
    """Logical -> mesh axes for activations (Haliax `axis_mapping`). A flat `token` axis (the MoE's
    [batch x position]) is split like the batch: left out, Haliax would gather it onto every device."""
    return {"batch": BATCH_AXES, "token": BATCH_AXES, "vocab": "model"}


def partition_spec(array: NamedArray, mesh: Mesh, path: str = "") -> P:
    """Where a parameter with these named axes and this path lives (`placement.RULES`; the train
    state, optimizer state included, is placed from the resolved run, `keel.train.layout`)."""
    _, placement = place(path, tuple((ax.name, ax.size) for ax in array.axes), dict(mesh.shape))
    return P(*placement)


def tree_shardings(tree, mesh: Mesh):
    """A NamedSharding in place of every NamedArray (and plain array) of a pytree such as a model or an
    optimizer state shaped like it: a prefix tree for `jax.device_put` and jit's in/out_shardings.
    Leaves are placed by their axes alone (paths relative to the tree are not the model's)."""
    def sharding(leaf):
        spec = partition_spec(leaf, mesh) if isinstance(leaf, NamedArray) else P()
        return NamedSharding(mesh, spec)

    return jax.tree.map(sharding, tree, is_leaf=lambda x: isinstance(x, NamedArray))


def model_shardings(model, mesh: Mesh):
    """The NamedSharding of every leaf of a whole model, placed by its path and axes."""
    def is_named(x):
        return isinstance(x, NamedArray)

    paths = leaf_key_paths(model, is_leaf=is_named)
    return jax.tree.map(lambda leaf, path: NamedSharding(mesh, partition_spec(leaf, mesh, path) if is_named(leaf) else P()),
                        model, paths, is_leaf=is_named)


def shard_model(model, mesh: Mesh):
    """The model's arrays placed per `model_shardings`."""
    return jax.device_put(model, model_shardings(model, mesh))


def shard_batch(array: NamedArray, mesh: Mesh) -> NamedArray:
    """Place a [Batch, ...] array with its batch over (replica_dcn, data, expert)."""
    if array.axes[0].name != "batch":
        raise ValueError(f"shard_batch expects the batch axis first, got axes {array.axes}")
    return jax.device_put(array, NamedSharding(mesh, P(BATCH_AXES, *([None] * (array.ndim - 1)))))


@contextlib.contextmanager
def use_mesh(mesh: Mesh):
    """Make `mesh` current for jax and the compute axis mapping current for Haliax."""
    with jax.set_mesh(mesh), hax.axis_mapping(compute_axis_mapping()):
        yield

