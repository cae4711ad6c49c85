"""Load one checkpoint of a training step: the model alone, as the training loop held it.

The exemplar is the shape of what the loop starts from (the model's arrays in its master dtype,
laid out as the run's resolved plan says; no array is computed), and
`keel.train.checkpoint.restore_like` reads the checkpoint's `model` subtree into it (Levanter's
`load_checkpoint(..., subpath="model")`, each array placed by the exemplar's sharding), as the
loop's resume does: initialising a model only to overwrite it cost an XLA compile per load. The
checkpoint format has no device layout in it, so a checkpoint written by several processes (say
2 x 4 devices) loads in one process holding the same 8 devices.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from keel.executor import storage
from keel.executor.step import External
from keel.mesh.mesh import build_mesh, run_topology
from keel.spec.resolved import resolve
from keel.spec.train import TrainStepConfig
from keel.spec.trained import TrainedModel
from keel.train.checkpoint import checkpoint_root, restore_like
from keel.train.compile_ahead import abstract
from keel.train.layout import planned_shardings
from keel.train.lm import KeelLM


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
    transport: Any
    """The `TransportSpec` in force when the checkpoint was written (the loop's last evaluation used
    it), with the resolved run's capacity."""
    compute_dtype: Any


def checkpoint_path(ref: TrainedModel) -> str:
    """The directory of the checkpoint `ref` names; FileNotFoundError listing the run's checkpoints."""
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
    """Restore the model of checkpoint `ref` on the mesh its run laid out (`run_topology`)."""
    path = checkpoint_path(ref)
    topology = run_topology(ref.topology)
    checkpoint = External("trained/checkpoint", ref.run, version=f"step-{ref.step}")  # resolve needs data; any will do
    plan = resolve(TrainStepConfig(model=ref.model, data=checkpoint, train=ref.train, topology=topology))
    mesh = build_mesh(topology)
    lm = KeelLM(ref.model, mesh, remat=False)

    def initial(key):
        model = lm.init(key)
        return eqx.filter(jax.tree.map(lambda x: x.astype(ref.train.master_dtype) if eqx.is_inexact_array(x) else x,
                                       model), eqx.is_array)

    key = jax.eval_shape(jax.random.PRNGKey, ref.train.seed)  # only shapes are wanted: no program makes a key
    with jax.set_mesh(mesh):
        shapes = eqx.filter_eval_shape(initial, key)
        state = {"step": jax.ShapeDtypeStruct((), jnp.int32), "model": shapes, "opt_state": ()}
        shardings = planned_shardings(plan, state, mesh)["model"]
    static = eqx.partition(eqx.filter_eval_shape(lm.init, key), lambda x: isinstance(x, jax.ShapeDtypeStruct))[1]
    # the loop saves {"step", "model", "opt_state"}; its model is read straight into the planned shardings
    arrays = restore_like(abstract(shapes, shardings), path, subpath="model")
    return LoadedModel(lm=lm, mesh=mesh, topology=topology, arrays=arrays, static=static, shardings=shardings,
                       transport=plan.transport_at(ref.step - 1).spec,
                       compute_dtype=jnp.dtype(ref.train.compute_dtype))
