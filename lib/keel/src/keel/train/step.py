"""The training step function: `train_step(TrainStepConfig)` trains keel's MoE LM under the output path.

Everything that can be wrong with the declaration (topology vs devices, experts vs expert
parallelism, batch vs shards, a transport the platform cannot run, sequences longer than the
model's) is checked here before any data is read or anything compiled.
"""

from __future__ import annotations

import logging

from keel.mesh.topology import BATCH_AXES, RackTopology
from keel.train.config import TrainStepConfig, TransportPhase

logger = logging.getLogger(__name__)


def train_step(config: TrainStepConfig) -> None:
    """Train (or resume training) to `config.train.num_steps`; results land under `config.output_path`."""
    import jax

    from keel.executor.replicas import join_replicas
    from keel.mesh.mesh import build_mesh
    from keel.train.batches import training_datasets
    from keel.train.lm import KeelLM
    from keel.train.loop import LoopInputs, train

    join_replicas(config.coordinator)  # a multi-host step: its replicas become one jax.distributed world (no-op alone)
    topology = config.topology or RackTopology(racks=1, gpus_per_rack=len(jax.devices()))
    check_step_config(config, topology, num_devices=len(jax.devices()), platform=jax.default_backend())
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
        default_transport=default_transport(topology),
    )
    train(config.train, inputs, config.output_path)


def default_transport(topology: RackTopology) -> TransportPhase:
    """Without a declared timeline: the dropless ring across an expert axis, else local experts."""
    return TransportPhase(0, "ring" if topology.expert_parallel > 1 else "local")


def check_step_config(config: TrainStepConfig, topology: RackTopology, *, num_devices: int, platform: str) -> None:
    """Raise a ValueError naming the field and the fix for anything that would fail mid-run."""
    from keel.model.transport_spec import check_transport_supported

    model, train = config.model, config.train
    topology.validate(model, train.batch_size, num_devices=num_devices)
    if train.seq_len > model.max_seq_len:
        raise ValueError(
            f"TrainConfig.seq_len={train.seq_len} exceeds MoELMConfig.max_seq_len={model.max_seq_len}: "
            "shorten the sequences or raise max_seq_len"
        )
    for phase in train.transports or (default_transport(topology),):
        check_transport_supported(phase.transport, platform)
        if phase.transport not in ("dense", "local") and topology.expert_parallel < 2:
            raise ValueError(
                f"TrainConfig.transports: {phase.transport!r} (from step {phase.start_step}) moves tokens over the "
                "expert axis, but RackTopology.expert_parallel=1: set expert_parallel > 1 or use 'local'"
            )
