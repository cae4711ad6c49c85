"""The resolved run: everything a training step will be, worked out once from its declaration.

`resolve(config)` checks the declaration (`checks.check_train_step`, the one validator) and derives
what both `keel plan` and the trainer read, so that the fact sheet and the run cannot drift:

- the parameter table: every leaf of the model by its real path (`MoELMConfig.parameter_axes`),
  with its named axes, master dtype, placement on the rack mesh (`keel.spec.placement`'s rule
  table, from which the runtime builds its partition specs), optimizer group
  (`keel.spec.train.optimizer_group`, which the optimizer calls too) and optimizer-state arrays;
- the transport timeline, each phase with the capacity factor its transport will run with (the
  running step checks what its MoE kernels report they ran against it, `keel.train.layout`).

- the train state as the trainer lays it out at any step (`state_at`): every array of the
  model and the optimizer state with its shape, dtype, partition spec, memory kind (host offload)
  and bytes per device. The running step records its live state in the same form
  (`.keel/layout.json`, `keel.train.layout`) and refuses to train on any difference;
- each optimizer group's learning rate at any step (`lr_at`), which the running step checks
  against its optax schedules.

Plain data and arithmetic, no jax: the 535B run resolves in milliseconds.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from keel.spec.placement import Axes, Placement, place, shards
from keel.spec.topology import RackTopology
from keel.spec.transports import TransportSpec
from keel.spec.checks import check_train_step
from keel.spec.dtypes import DTYPE_BYTES
from keel.spec.train import DEVICE, MOMENTS, STACK_AXES, TrainStepConfig, TransportPhase, optimizer_group, peak_lr


@dataclass(frozen=True)
class Parameter:
    """One array leaf of the model as the run holds it."""

    path: str
    axes: Axes
    dtype: str
    rule: str
    """The placement rule that decided where it lives."""
    placement: Placement | None
    """Mesh axes per array axis (None: no topology declared, so no mesh)."""
    group: str
    """Optimizer group: muonh, adamh, adam, adamw or frozen (never updated by the optimizer)."""
    state_placement: Placement | None
    """Where its optimizer-state arrays live: the parameter's placement unless its rule places the
    weight only (`keel.spec.placement`: the token embedding's moments are FSDP)."""

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.axes)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def trained(self) -> bool:
        return self.group != "frozen"

    @property
    def moments(self) -> int:
        """Optimizer-state arrays kept for it, in the master dtype, placed by `state_placement`."""
        return MOMENTS[self.group]


@dataclass(frozen=True)
class TransportRun:
    """One phase of the transport timeline, as the trainer builds it."""

    start_step: int
    end_step: int
    """Last step of the phase (inclusive)."""
    transport: str
    capacity_factor: float | None
    """What the fixed-capacity transports size their buffers with; None for the others."""
    num_waves: int
    phase: TransportPhase

    @property
    def spec(self) -> TransportSpec:
        """What the MoE kernel is handed while this phase runs: the transport with this capacity."""
        return TransportSpec(self.transport, capacity_factor=self.capacity_factor, num_waves=self.num_waves)


@dataclass(frozen=True)
class StateLeaf:
    """One array of the train state as it lives on the mesh: the unit the live check compares.

    Paths: `step`; `model/<parameter path>`; `opt_state/<parameter path>/<i>` for the i-th
    optimizer-state array kept for that parameter (MuonH's momentum; Adam's two moments).
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: tuple
    """Per array axis: None (replicated), a mesh axis, or a tuple of mesh axes it is split over."""
    memory_kind: str
    bytes_per_device: int

    def record(self) -> dict:
        """The JSON form `keel plan --json` prints and `.keel/layout.json` holds."""
        return {"path": self.path, "shape": list(self.shape), "dtype": self.dtype, "spec": spec_json(self.spec),
                "memory_kind": self.memory_kind, "bytes_per_device": self.bytes_per_device}


def spec_json(spec) -> list:
    """A partition spec as JSON: per axis null, a mesh axis name, or a list of names."""
    return [list(e) if isinstance(e, (tuple, list)) else e for e in spec]


def bytes_per_device(shape: tuple[int, ...], spec, dtype: str, mesh_axes: dict[str, int]) -> int:
    """Bytes of one device's shard: each axis split over its mesh axes (rounded up, as jax pads)."""
    total = DTYPE_BYTES[dtype]
    for size, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        total *= -(-size // shards((entry,), mesh_axes))
    return total


@dataclass(frozen=True)
class ResolvedRun:
    config: TrainStepConfig
    mesh_axes: dict[str, int] | None
    parameters: tuple[Parameter, ...]
    transports: tuple[TransportRun, ...]

    @property
    def tokens_per_device(self) -> int:
        """Tokens in one device's share of the batch (a topology's `batch_shards` split the batch)."""
        train = self.config.train
        return train.batch_size // self.config.topology.batch_shards * train.seq_len

    def per_device(self, parameter: Parameter) -> float:
        """Entries of `parameter` that one device holds."""
        return parameter.size / shards(parameter.placement or (), self.mesh_axes or {})

    def transport_at(self, step: int) -> TransportRun:
        return next(t for t in reversed(self.transports) if t.start_step <= step)

    def state_at(self, step: int) -> tuple[StateLeaf, ...]:
        """Every array of the train state while step `step` runs, as the trainer lays it out: the
        parameters in the master dtype, each optimizer-state array typed like its parameter and
        placed by its `state_placement` (the embedding's split though its weight is whole), in the
        memory kinds `HostOffload.memory_kinds_at(step)` gives; sorted by path (as the live record is,
        so the two files diff line by line)."""
        if self.mesh_axes is None:
            raise ValueError("the run declares no topology, so it has no mesh to lay its state out on")
        kinds, master = self.config.train.host_offload.memory_kinds_at(step), self.config.train.master_dtype
        leaves = [StateLeaf("step", (), "int32", (), DEVICE, 4)]
        for p in self.parameters:
            spec = p.placement
            leaves.append(StateLeaf(f"model/{p.path}", p.shape, master, spec, kinds["master_weights"],
                                    bytes_per_device(p.shape, spec, master, self.mesh_axes)))
        for p in self.parameters:
            for i in range(p.moments):
                leaves.append(StateLeaf(f"opt_state/{p.path}/{i}", p.shape, master, p.state_placement,
                                        kinds["optimizer_state"], bytes_per_device(p.shape, p.state_placement, master,
                                                                                   self.mesh_axes)))
        return tuple(sorted(leaves, key=lambda leaf: leaf.path))

    def newton_schulz_elements_per_device(self) -> int:
        """The most elements one Newton-Schulz loop of MuonH holds on a device, which the training
        loop's optimizer batches its loops within (`keel.train.muonh`): the largest MuonH parameter
        with each logical matrix gathered whole (its FSDP-split rows come together) while stack
        axes (layers, experts) keep their split, or `newton_schulz_batch` elements, whichever is
        more, and never more than every MuonH parameter together. 0 without MuonH."""
        opt = self.config.train.optimizer
        if getattr(opt, "newton_schulz_dtype", None) is None or self.mesh_axes is None:
            return 0
        held = [math.prod(-(-size // shards((entry,), self.mesh_axes)) if name in STACK_AXES else size
                          for (name, size), entry in zip(p.axes, p.placement or ()))
                for p in self.parameters if p.group == "muonh"]
        return min(sum(held), max(max(held, default=0), opt.newton_schulz_batch))

    def newton_schulz_bytes_per_device(self) -> int:
        """What MuonH's Newton-Schulz holds at once on a device: one loop's elements
        (`newton_schulz_elements_per_device`) in the declared Newton-Schulz dtype. 0 without MuonH."""
        elements = self.newton_schulz_elements_per_device()
        return elements and DTYPE_BYTES[self.config.train.optimizer.newton_schulz_dtype] * elements

    @property
    def warmup_steps(self) -> int:
        train = self.config.train
        return math.floor(train.schedule.warmup_fraction * train.num_steps)

    def lr_at(self, step: int) -> dict[str, float]:
        """Each trained optimizer group's learning rate at `step`: linear warmup from 0 over
        floor(warmup_fraction x steps), then linear decay to decay_to_fraction x peak at the end."""
        train = self.config.train
        warmup = self.warmup_steps
        decay = train.num_steps - warmup
        out = {}
        for group in sorted({p.group for p in self.parameters if p.trained}):
            peak = peak_lr(train.optimizer, group)
            if step < warmup:
                out[group] = peak * step / warmup
            else:
                done = min(step - warmup, decay) / decay if decay else 1.0
                out[group] = peak + (train.schedule.decay_to_fraction * peak - peak) * done
        return out


def resolve(config: TrainStepConfig, name: str = "") -> ResolvedRun:
    """Check the declaration (a `PlanError` names the field) and resolve the run."""
    check_train_step(config, name)
    rates = config.train.optimizer.at(config.model, config.train)  # a law's rates, at this run's final size
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, optimizer=rates))
    model, train, topo = config.model, config.train, config.topology
    mesh_axes = topo.axis_sizes if topo is not None else None
    parameters = []
    for path, axes in model.parameter_axes().items():
        rule, placement = place(path, axes, mesh_axes) if mesh_axes else ("no mesh", None)
        state_placement = place(path, axes, mesh_axes, state=True)[1] if mesh_axes else None
        parameters.append(Parameter(path, axes, train.master_dtype, rule, placement,
                                    optimizer_group(train.optimizer, path), state_placement))
    phases = train.transports or (default_transport(topo),)
    transports = tuple(
        TransportRun(p.start_step, (phases[i + 1].start_step if i + 1 < len(phases) else train.num_steps) - 1,
                     p.transport, p.capacity(model), p.num_waves, p)
        for i, p in enumerate(phases)
    )
    return ResolvedRun(config, mesh_axes, tuple(parameters), transports)


def default_transport(topology: RackTopology | None) -> TransportPhase:
    """Without a declared timeline: the dropless ring across an expert axis, else local experts."""
    return TransportPhase(0, "ring" if topology is not None and topology.expert_parallel > 1 else "local")
