"""Phased data mixtures: named token caches and the weights to draw them with, per training phase.

A component is a tokenize step (or `output_of` one) or an `External` cache root; either way it
resolves to a directory holding `train/` (and usually `validation/`) Levanter caches of
`{"input_ids", "segment_ids"}` sequences. Phases start at training steps; `block_size` is the
number of sequences per mixture block (Levanter's `MixtureDataset` deals exact per-block counts),
and every phase must start on a block boundary: `check_batch_size` says so before training starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from keel.executor.step import OutputOf, Step
from keel.spec.data import TokenizeConfig

_SUM_TOLERANCE = 1e-6
SINGLE = "data"
"""The component name of a single token cache (`Mixture.single`): `eval/data/loss` in its metrics."""


INT32_READS = 2**31
"""Sequences a component may serve before a phase starts (Levanter's int32 count; `check_read_counts`)."""


def first_step_reading(batch: int, skipped) -> int:
    """The first step that reads batch `batch` (a phase's start), or the next batch when it was
    skipped: earlier than its number by each batch a spike guard skipped before it (`skipped`)."""
    return batch - sum(1 for b in skipped if b < batch)


class MixtureError(ValueError):
    """A mixture declared with weights or phases that cannot be used."""


def _floor_draws(shares: dict[str, float], block_size: int) -> dict[str, int]:
    """floor(share x block) per component, sorted by name, after normalising the shares again, as
    Levanter's `MixtureDataset` computes them (the rest of a block goes to the largest)."""
    total = sum(shares.values())
    return {name: int(shares[name] / total * block_size) for name in sorted(shares)}


@dataclass(frozen=True)
class MixturePhase:
    """From training step `start_step` on, draw component `name` with probability `weights[name]`."""

    start_step: int
    weights: dict[str, float]


@dataclass(frozen=True)
class Mixture:
    """Named components and their weights per phase.

    Each phase's weights must sum to 1 unless `normalize=True`, which rescales each phase to sum
    to 1 (say so explicitly when declaring counts or shares that do not add up). Components
    missing from a phase have weight 0 in it.
    """

    components: dict[str, Any]
    phases: tuple[MixturePhase, ...]
    normalize: bool = False
    block_size: int = 2048

    def __post_init__(self):
        if not self.components:
            raise MixtureError("Mixture.components is empty: name at least one token cache")
        if not self.phases:
            raise MixtureError("Mixture.phases is empty: give at least one MixturePhase(start_step=0, weights=...)")
        if not 0 < self.block_size < 2**16:
            raise MixtureError(f"Mixture.block_size must be in [1, 65535] (Levanter's limit), got {self.block_size}")
        previous = None
        for i, phase in enumerate(self.phases):
            where = f"Mixture phase {i} (start_step={phase.start_step})"
            if previous is None and phase.start_step != 0:
                raise MixtureError(f"{where}: the first phase must start at step 0")
            if previous is not None and phase.start_step <= previous:
                raise MixtureError(f"{where}: phase starts must strictly increase (previous phase starts at {previous})")
            previous = phase.start_step
            for name, weight in phase.weights.items():
                if name not in self.components:
                    raise MixtureError(f"{where}: weight for unknown component {name!r}; components: {sorted(self.components)}")
                if not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
                    raise MixtureError(f"{where}: component {name!r} has weight {weight!r}; weights must be finite "
                                       "numbers >= 0")
            total = sum(phase.weights.values())
            if total <= 0:
                raise MixtureError(f"{where}: weights sum to {total}; at least one component needs a positive weight")
            if not self.normalize and abs(total - 1.0) > _SUM_TOLERANCE:
                raise MixtureError(
                    f"{where}: weights sum to {total:.6g}, not 1; fix them or declare Mixture(..., normalize=True)"
                )
            drawn = _floor_draws(self._shares(phase), self.block_size)  # as Levanter draws, to the last bit
            for name, weight in phase.weights.items():
                if weight > 0 and drawn[name] == 0:
                    raise MixtureError(
                        f"{where}: component {name!r} has {weight / total:.3g} of the weight, less than one sequence "
                        f"of a block of {self.block_size} as Levanter rounds it, so it would never be drawn: raise "
                        f"Mixture.block_size to at least {int(total / weight) + 1}, or drop the component from the phase"
                    )

    @staticmethod
    def constant(components: dict[str, Any], weights: dict[str, float], **kwargs) -> "Mixture":
        """A single-phase mixture."""
        return Mixture(components, (MixturePhase(0, weights),), **kwargs)

    @staticmethod
    def single(cache: Any) -> "Mixture":
        """One token cache as a mixture: the component "data", always drawn."""
        return Mixture.constant({SINGLE: cache}, {SINGLE: 1.0})

    def tokenized_seq_len(self) -> int | None:
        """The sequence length its components were tokenized at, read from their keel tokenize steps;
        None when none of them is one (an External cache). Components that disagree are an error."""
        lengths = {}
        for name, cache in self.components.items():
            step = cache.step if isinstance(cache, OutputOf) else cache
            if isinstance(step, Step) and isinstance(step.config, TokenizeConfig):
                lengths[name] = step.config.seq_len
        if len(set(lengths.values())) > 1:
            raise MixtureError(f"Mixture components were tokenized at different lengths ({lengths}): tokenize them at "
                               "one seq_len")
        return next(iter(lengths.values()), None)

    @property
    def is_single(self) -> bool:
        """One component in one phase: a plain token cache, with no mixture to describe."""
        return len(self.components) == 1 and len(self.phases) == 1

    def phase_weights(self) -> list[tuple[int, dict[str, float]]]:
        """(start_step, weights summing to 1) per phase, every component listed."""
        return [(phase.start_step, self._shares(phase)) for phase in self.phases]

    def _shares(self, phase: "MixturePhase") -> dict[str, float]:
        total = sum(phase.weights.values())
        return {name: phase.weights.get(name, 0.0) / total for name in self.components}

    def block_counts(self) -> list[dict[str, int]]:
        """Per phase, the sequences each component gets in every block of `block_size`, as Levanter's
        `MixtureDataset` draws them: floor(share x block), the rest to the component with the most
        (the first by name). What a phase trains on: a share below 1 / block_size is refused, others
        lose up to one sequence per block (a test pins this to Levanter's own rule)."""
        out = []
        for _, weights in self.phase_weights():
            counts = _floor_draws(weights, self.block_size)
            largest = max(counts, key=counts.get)
            counts[largest] += self.block_size - sum(counts.values())
            out.append(counts)
        return out

    def sequence_schedule(self, batch_size: int) -> list[tuple[int, dict[str, float]]]:
        """The phases in sequence indices (what Levanter's MixtureDataset takes): step x batch size."""
        self.check_batch_size(batch_size)
        return [(step * batch_size, weights) for step, weights in self.phase_weights()]

    def sequences_drawn(self, batch_size: int, num_steps: int) -> dict[str, int]:
        """About how many sequences each component serves over `num_steps` steps (whole blocks as
        `block_counts` draws them; the last, partial block at most its per-block count)."""
        served = dict.fromkeys(self.components, 0)
        schedule, total = self.sequence_schedule(batch_size), num_steps * batch_size
        ends = [start for start, _ in schedule[1:]] + [total]
        for counts, (start, _), end in zip(self.block_counts(), schedule, ends):
            blocks, rest = divmod(max(min(end, total) - start, 0), self.block_size)
            for name, per_block in counts.items():
                served[name] += per_block * blocks + min(per_block, rest)
        return served

    def check_read_counts(self, batch_size: int) -> None:
        """Levanter's `MixtureDataset` keeps the sequences each component served before a phase in
        int32 and starts the phase's reads there: past 2**31 the count wraps silently, and the phase
        rereads sequences trained on and never reads the ones due. Refused here, naming the phase.
        Within a phase the batches' reads count in int64 (`get_batch` takes its block ids as an
        int64 array), so a phase may read any number of sequences."""
        for i, phase in enumerate(self.phases[1:]):
            served = self.sequences_drawn(batch_size, phase.start_step)  # phases start on block boundaries: exact
            name = max(served, key=served.get)
            if served[name] >= INT32_READS:
                raise MixtureError(
                    f"component {name!r} has served {served[name]:,} sequences when phase {i + 1} starts (step "
                    f"{phase.start_step:,}), past the {INT32_READS:,} Levanter's MixtureDataset counts "
                    "in int32 (it would wrap and reread trained data): split the component into several caches, "
                    "each counted on its own"
                )

    def check_batch_size(self, batch_size: int) -> None:
        """Every phase must start on a mixture block boundary at this (constant) batch size."""
        if batch_size <= 0:
            raise MixtureError(f"batch size must be positive, got {batch_size}")
        for i, phase in enumerate(self.phases):
            first_sequence = phase.start_step * batch_size
            if first_sequence % self.block_size:
                raise MixtureError(
                    f"Mixture phase {i} starts at step {phase.start_step}, sequence {first_sequence} at batch size "
                    f"{batch_size}, which is not a multiple of block_size={self.block_size}; choose a block_size "
                    f"that divides {first_sequence} (e.g. {math.gcd(first_sequence, self.block_size) or batch_size})"
                )
