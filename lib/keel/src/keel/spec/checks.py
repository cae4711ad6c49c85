"""Consistency checks of a training step's declaration, run by the planner before any figure.

Every problem is a `PlanError` whose message starts with the field path
(`train.batch_size`, `data.phases[2].start_step`, `train.transports[1].transport`, ...) and says
how to fix it: a declaration that cannot run should fail in `keel plan`, not on 704 GPUs.
"""

from __future__ import annotations

import re

from keel.executor.step import StepDeclarationError
from keel.spec.topology import TopologyError
from keel.spec.data_steps import data_step_problem
from keel.spec.matrices import AxisName, matrix_axes
from keel.spec.mixture import Mixture
from keel.spec.model import AttentionBackend
from keel.spec.train import CLAIM_FIGURES, TrainStepConfig, optimizer_group
from keel.spec.transports import TRANSPORTS


BACKEND_PLATFORMS = {AttentionBackend.SPLASH: "tpu", AttentionBackend.NVTE: "gpu"}
"""Attention kernels that run on one platform only: Pallas splash on TPUs, Transformer Engine on GPUs."""
FLASH_BLOCK = 1024
"""Levanter's jax_flash block: a sequence of at least one block must be whole blocks (shorter ones
take its vanilla path)."""


class PlanError(StepDeclarationError):
    """A training step's declaration is inconsistent; the message names the field (`keel plan`
    reports it as a declaration error)."""


def mixture_phases(data: Mixture) -> list[tuple[int, dict[str, float]]]:
    """(start_step, {component: weight}) per phase of a training step's mixture; [] for a single
    cache (`Mixture.is_single`), which has no phases to tell apart."""
    if data.is_single:
        return []
    return [(int(p.start_step), {str(k): float(v) for k, v in p.weights.items()}) for p in data.phases]


def check_train_step(config: TrainStepConfig, where: str = "") -> None:
    """Raise `PlanError` for the first inconsistency between model, data, train, topology and hardware."""
    prefix = f"{where}: " if where else ""

    def fail(message: str) -> None:
        raise PlanError(prefix + message)

    model, train, topo, hw = config.model, config.train, config.topology, config.hardware
    if train.seq_len > model.max_seq_len:
        fail(f"train.seq_len={train.seq_len} exceeds model.max_seq_len={model.max_seq_len}: shorten the sequences "
             "or raise max_seq_len")
    backend = model.attention_backend
    if hw is not None and backend in BACKEND_PLATFORMS and hw.platform != BACKEND_PLATFORMS[backend]:
        fail(f"model.attention_backend='{backend.value}' runs on {BACKEND_PLATFORMS[backend]} only, and hardware "
             f"{hw.name!r} is {hw.platform}: use '{AttentionBackend.JAX_FLASH.value}' or '{AttentionBackend.VANILLA.value}'")
    if backend is AttentionBackend.JAX_FLASH and train.seq_len and train.seq_len > FLASH_BLOCK and train.seq_len % FLASH_BLOCK:
        fail(f"train.seq_len={train.seq_len} with model.attention_backend='jax_flash': its blocks are {FLASH_BLOCK} "
             f"tokens, so use a multiple of {FLASH_BLOCK} (or below it), or attention_backend='vanilla'")
    if topo is not None:
        try:
            topo.validate(model, train.batch_size)
        except TopologyError as e:
            fail(f"topology: {e}")
        if hw is not None and topo.gpus_per_rack != hw.gpus_per_rack:
            fail(f"topology.gpus_per_rack={topo.gpus_per_rack} differs from hardware.gpus_per_rack={hw.gpus_per_rack} "
                 f"({hw.name}): use the hardware's value")
        if hw is not None and topo.hbm_per_gpu_gb is not None and topo.hbm_per_gpu_gb != hw.hbm_per_device_gb:
            fail(f"topology.hbm_per_gpu_gb={topo.hbm_per_gpu_gb} differs from hardware.hbm_per_device_gb="
                 f"{hw.hbm_per_device_gb}: drop it from the topology or make them agree")
    for i, phase in enumerate(train.transports):
        if TRANSPORTS[phase.transport].moves_tokens and (topo is None or topo.expert_parallel < 2):
            fail(f"train.transports[{i}].transport={phase.transport!r} moves tokens over the expert axis, but "
                 + ("no topology is declared" if topo is None else f"topology.expert_parallel={topo.expert_parallel}")
                 + ": declare a topology with expert_parallel > 1, or use 'local'")
        if not TRANSPORTS[phase.transport].moves_tokens and topo is not None and topo.expert_parallel > 1:
            fail(f"train.transports[{i}].transport={phase.transport!r} computes every expert on every GPU, so each "
                 f"layer would gather whole the experts topology.expert_parallel={topo.expert_parallel} splits, which "
                 "keel plan does not count: use a transport that moves tokens (e.g. 'fixed_all_to_all' or 'ring'), "
                 "or topology.expert_parallel=1")
        local_experts = topo.experts_per_device(model) if topo is not None else model.num_experts
        if phase.num_waves > 1 and local_experts % phase.num_waves:
            fail(f"train.transports[{i}].num_waves={phase.num_waves} must divide the {local_experts} experts per GPU "
                 "(num_experts / expert_parallel): each wave sends to an equal share of them")
        if hw is not None and not hw.supports_transport(phase.transport):
            fail(f"train.transports[{i}].transport={phase.transport!r} is not supported by hardware {hw.name!r} "
                 "(hardware.supports_ragged_all_to_all is False): use 'fixed_all_to_all', 'fixed_pooled_all_to_all' "
                 "or 'ring'")
    problem = data_step_problem(config)
    if problem:
        fail(problem)
    starts = [start for start, _ in mixture_phases(config.data)]
    for i, start in enumerate(starts):
        if start >= train.num_steps:
            fail(f"data.phases[{i}].start_step={start} is at or after the last step (train.num_steps={train.num_steps}): "
                 "move the phase earlier or train longer")
    try:  # phases on mixture-block boundaries
        config.data.check_batch_size(train.batch_size)
    except ValueError as e:
        fail(f"data.block_size / train.batch_size: {e}")
    try:
        config.data.check_read_counts(train.batch_size)
    except ValueError as e:
        fail(f"data.phases: {e}")
    parameters = model.parameter_axes()
    for path, axes in parameters.items():
        if optimizer_group(train.optimizer, path) == "muonh":
            try:
                matrix_axes([AxisName(*axis) for axis in axes])
            except ValueError as e:
                fail(f"train.optimizer.muonh_params puts {path} in MuonH, which is no matrix: {e}")
    decay = train.weight_decay_change
    if decay and not any(re.search(pattern, path) for pattern in decay.groups for path in parameters):
        fail(f"train.weight_decay_change.groups={list(decay.groups)} match no parameter, so nothing would be decayed; "
             f"the paths are like {', '.join(sorted(parameters)[:4])} (keel plan lists every one)")
    offload = train.host_offload.master_weights_until_step
    if offload is not None and offload > train.num_steps:
        fail(f"train.host_offload.master_weights_until_step={offload} is after train.num_steps={train.num_steps}")
    facts = config.facts
    if facts is not None:
        for i, seen in enumerate(facts.observed):
            if not 0 <= seen.step < train.num_steps or seen.step_seconds <= 0:  # steps are 0 .. num_steps - 1
                fail(f"facts.observed[{i}]: step {seen.step} must lie in [0, train.num_steps={train.num_steps}) and "
                     f"step_seconds={seen.step_seconds} must be positive")
        if facts.projected_steps_per_day is not None and facts.projected_steps_per_day <= 0:
            fail(f"facts.projected_steps_per_day={facts.projected_steps_per_day} must be positive")
        if facts.projected_steps_per_day is not None and not facts.observed:
            fail("facts.projected_steps_per_day needs an observed speed to project from: declare facts.observed")
        for i, claim in enumerate(facts.claims):
            if claim.figure not in CLAIM_FIGURES:
                fail(f"facts.claims[{i}].figure={claim.figure!r} is not a figure the planner derives: use one of "
                     f"{', '.join(sorted(CLAIM_FIGURES))}")
