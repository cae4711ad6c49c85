"""The training step function: `train_step(TrainStepConfig)` trains keel's MoE LM under the output path.

It first resolves the run exactly as `keel plan` does (`keel.spec.resolved`: the same checks, the
same parameter table and transport timeline), then checks what only the running process can see
(its devices and platform), all before any data is read or anything compiled. The training loop
is handed that resolved run and lays out, types and schedules the state from it alone.
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from keel.executor.replicas import join_replicas
from keel.mesh.mesh import build_mesh, run_topology
from keel.spec.checks import mixture_phases
from keel.spec.resolved import ResolvedRun, resolve
from keel.spec.topology import BATCH_AXES
from keel.spec.train import TrainStepConfig
from keel.spec.transports import check_transport_supported
from keel.train import compile_cache
from keel.train.batches import training_datasets
from keel.train.checkpoint import check_store
from keel.train.data_checks import check_token_caches, record_run_data
from keel.train.lm import KeelLM
from keel.train.loop import LoopInputs, train

logger = logging.getLogger(__name__)


def train_step(config: TrainStepConfig) -> None:
    """Train (or resume training) to `config.train.num_steps`; results land under `config.output_path`."""
    check_store(config.output_path)
    join_replicas(config.coordinator)  # a multi-host step: its replicas become one jax.distributed world (no-op alone)
    if config.topology is None:  # the run's mesh is every device of this one process, as one rack
        if jax.process_count() > 1:  # a hand-made Step (`default_train` refuses it: `resources_problem`)
            raise ValueError(f"TrainStepConfig.topology is None on {jax.process_count()} processes: one rack across "
                             "hosts puts the expert and FSDP axes on their slow link; declare "
                             "topology=RackTopology(racks=..., gpus_per_rack=...)")
        config = dataclasses.replace(config, topology=run_topology(None))
    plan = resolve(config)
    if config.train.compilation_cache:
        compile_cache.use(config.output_path)
    topology = config.topology
    tokenizer = check_step_config(plan, num_devices=len(jax.devices()), platform=jax.default_backend())
    if jax.process_index() == 0:
        record_run_data(config.output_path, tokenizer, config.data)  # what its evaluations' caches are held to
    mesh = build_mesh(topology)
    train_data, val_data = training_datasets(
        config.data, seq_len=config.train.seq_len, batch_size=config.train.batch_size, seed=config.train.seed
    )
    inputs = LoopInputs(
        lm=KeelLM(config.model, mesh, remat=config.train.remat),
        mesh=mesh,
        batch_axes=BATCH_AXES,
        train_data=train_data,
        val_data=val_data,
        plan=plan,
        phase_starts={start: f"phase {i}" for i, (start, _) in enumerate(mixture_phases(config.data))},
    )
    train(plan.config.train, inputs, config.output_path)


def check_step_config(plan: ResolvedRun, *, num_devices: int, platform: str) -> dict | None:
    """What only the running process can check (the declaration itself is `resolve`'s): its platform
    against the declared hardware's, its device count against the topology, each transport against
    its platform, and the token caches it reads against the model and the run
    (`data_checks.check_token_caches`); the caches' tokenizer identity."""
    config = plan.config
    hardware = config.hardware
    if hardware is not None and hardware.platform != platform:
        raise RuntimeError(f"the step declares hardware {hardware.name!r} (platform {hardware.platform}), but its process's "
                           f"jax runs on {platform}: run it where that hardware is (JAX_PLATFORMS and XLA_FLAGS come "
                           "from the hardware, Hardware.process_env), or declare the hardware it runs on")
    config.topology.validate(config.model, config.train.batch_size, num_devices=num_devices)
    for phase in plan.transports:
        check_transport_supported(phase.transport, platform)
    return check_token_caches(config)
