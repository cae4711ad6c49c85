"""Load one checkpoint of a training step: the model alone, as the training loop held it.

The exemplar is what the loop starts from (a freshly initialised model on the run's mesh, cast to
its master dtype), and `keel.train.checkpoint.restore_like` reads the checkpoint's `model` subtree
into it. The checkpoint format has no device layout in it, so a checkpoint written by several
processes (say 2 x 4 devices) loads in one process holding the same 8 devices.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from keel.executor import storage
from keel.trained.config import TrainedModel


@dataclasses.dataclass
class LoadedModel:
    """A restored model split as the loop's jitted functions take it, and where it lives."""

    lm: Any
    """The `keel.train.lm.KeelLM` of the run's model config on `mesh`."""
    mesh: Any
    topology: Any
    arrays: Any
    """The model's arrays (its float arrays in the run's master dtype)."""
    static: Any
    shardings: Any
    phase: Any
    """The `TransportPhase` in force when the checkpoint was written (the loop's last evaluation used it)."""
    compute_dtype: Any


def checkpoint_path(ref: TrainedModel) -> str:
    """The directory of the checkpoint `ref` names; FileNotFoundError listing the run's checkpoints."""
    from keel.train.checkpoint import checkpoint_root

    root = checkpoint_root(ref.run)
    path = storage.join(root, f"step-{ref.step}")
    if not storage.exists(storage.join(path, "metadata.json")):
        present = sorted(storage.list_names(root), key=lambda n: int(n.rsplit("-", 1)[-1]))
        raise FileNotFoundError(
            f"{ref.run} has no complete checkpoint at step {ref.step} (present: {', '.join(present) or 'none'}); "
            "evaluate 'final' or a step kept by TrainConfig.permanent_checkpoint_every"
        )
    return path


def load_model(ref: TrainedModel) -> LoadedModel:
    """Restore the model of checkpoint `ref` on the mesh of its run's topology (all local devices without one)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from keel.mesh.mesh import build_mesh
    from keel.mesh.topology import RackTopology
    from keel.train.checkpoint import restore_like
    from keel.train.lm import KeelLM
    from keel.train.step import default_transport

    path = checkpoint_path(ref)
    topology = ref.topology or RackTopology(racks=1, gpus_per_rack=len(jax.devices()))
    mesh = build_mesh(topology)
    lm = KeelLM(ref.model, mesh, remat=False)
    with jax.set_mesh(mesh):
        model = lm.init(jax.random.PRNGKey(ref.train.seed))
        model = jax.tree.map(lambda x: x.astype(ref.train.master_dtype) if eqx.is_inexact_array(x) else x, model)
    arrays, static = eqx.partition(model, eqx.is_array)
    arrays = restore_like({"model": arrays}, path)["model"]  # the loop saves {"step", "model", "opt_state"}
    phase = ref.train.transport_at(ref.step - 1) or default_transport(topology)
    return LoadedModel(lm=lm, mesh=mesh, topology=topology, arrays=arrays, static=static,
                       shardings=jax.tree.map(lambda x: x.sharding, arrays), phase=phase,
                       compute_dtype=jnp.dtype(ref.train.compute_dtype))
