"""The resolved run: everything a training step will be, worked out once from its declaration.

`resolve(config)` checks the declaration (`checks.check_train_step`, the one validator) and derives
what both `keel plan` and the trainer read, so that the fact sheet and the run cannot drift:

- the parameter table: every leaf of the model by its real path (`MoELMConfig.parameter_axes`),
  with its named axes, master dtype, placement on the rack mesh (`keel.mesh.placement`'s rule
  table, from which the runtime builds its partition specs), optimizer group
  (`train.config.optimizer_group`, which the optimizer calls too) and optimizer-state arrays;
- the transport timeline, each phase with the capacity factor its transport will run with.

Plain data and arithmetic, no jax: the 535B run resolves in milliseconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from keel.mesh.placement import Axes, Placement, place, shards
from keel.plan.checks import check_train_step
from keel.train.config import MOMENTS, TrainStepConfig, TransportPhase, optimizer_group


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
        """fp32 optimizer-state arrays kept for it (they are placed like the parameter)."""
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


@dataclass(frozen=True)
class ResolvedRun:
    config: TrainStepConfig
    mesh_axes: dict[str, int] | None
    parameters: tuple[Parameter, ...]
    transports: tuple[TransportRun, ...]

    def parameter(self, path: str) -> Parameter:
        found = next((p for p in self.parameters if p.path == path), None)
        if found is None:
            raise KeyError(f"the model has no parameter {path!r}")
        return found

    def per_device(self, parameter: Parameter) -> float:
        """Entries of `parameter` that one device holds."""
        return parameter.size / shards(parameter.placement or (), self.mesh_axes or {})


def resolve(config: TrainStepConfig, name: str = "") -> ResolvedRun:
    """Check the declaration (a `PlanError` names the field) and resolve the run."""
    check_train_step(config, name)
    model, train, topo = config.model, config.train, config.topology
    mesh_axes = topo.axis_sizes if topo is not None else None
    parameters = []
    for path, axes in model.parameter_axes().items():
        rule, placement = place(path, axes, mesh_axes) if mesh_axes else ("no mesh", None)
        parameters.append(Parameter(path, axes, train.master_dtype, rule, placement, optimizer_group(train.optimizer, path)))
    phases = train.transports
    transports = tuple(
        TransportRun(p.start_step, (phases[i + 1].start_step if i + 1 < len(phases) else train.num_steps) - 1,
                     p.transport, p.capacity(model), p.num_waves, p)
        for i, p in enumerate(phases)
    )
    return ResolvedRun(config, mesh_axes, tuple(parameters), transports)
