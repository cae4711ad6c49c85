"""The spike guard (`TrainConfig.spike_guard`): a loss spike rolls the run back and skips its batch.

The loop hands each training step to `SpikeGuard.step`, which runs it and judges its loss:

- a loss, gradient norm or update norm that is not finite is a spike; without a guard it fails
  the step (`NonFiniteTraining`, naming the step);
- with a guard, so is a loss more than `threshold` robust deviations above the median of the last
  `window` good steps, and `min_rise` (a fraction of that median) above it. The robust deviation
  is one step's noise: 1.4826 x the median absolute deviation of the window's step-to-step changes,
  over sqrt(2), so the steady fall of the loss early in a run does not count as noise. The history
  restarts where a mixture phase starts (the data changes on purpose); until `min_history` steps
  are known again only non-finite values are spikes. A resumed run takes the history of the steps
  before its checkpoint from `metrics.jsonl`, so it judges each step as the uninterrupted run did
  (a guarded run therefore logs every step: `TrainConfig` refuses `log_every` > 1 with a guard);
  one that finds no such history says it judges without it.

A spike at step s is blamed on the batch step s read: its loss came from weights that passed every
check so far, on that batch. The guard throws the step's update away and hands back its newest
snapshot of the train state (step p <= s: kept in host memory at the start and every
`snapshot_every` steps, each process its own shards). The loop reads the batches again from
step p's and replays p..s-1, which passed (the step is bit-exact, so their metrics, evaluations and
checkpoints are not written twice); the spiking batch is skipped, so step s trains on the batch
after it and the run still makes `num_steps` updates (every later step reads one batch further on;
mixture phases, which the data fixes by batch, move by as many batches). A spike again at a later
step is blamed on its own batch in turn; the spike after `max_rollbacks` rollbacks raises
`SpikeGuardGaveUp` naming every spike.

Every rollback is a console line, a `metrics.jsonl` row at the spike step (`spike/rollback_from`,
`spike/rollback_to`, `spike/skipped_batch`, `spike/loss`, `spike/threshold`, `spike/rollbacks`) and
an entry in `spike_guard.json` under the step's output (one of its outputs, so `--force` starts
without it). A resumed run reads that file and skips the same batches without spiking on them
again. The loop's closing line says how many rollbacks the run took and which batches it skipped,
and records it as a warning of its keel step (`SpikeGuard.finish`), so `keel run` and `keel status`
report a SUCCESS with a warning; the dashboard marks each rollback on the loss chart.

Fault injection, to watch it work: `KEEL_POISON_BATCHES="37,52:padding"` spoils batches 37 and 52
(those steps 37 and 52 read when nothing was skipped before them) before a step sees them, each
as its `:kind` says: `noise` (the default) puts random ids below the batch's largest in every
position (garbage within the vocabulary: a finite loss spike), `padding` marks every position as
padding (segment id -1: no token to predict, so the mean loss is 0/0, NaN). Unset, nothing is
touched.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from keel.executor import step_warnings, storage
from keel.spec.metrics import METRICS_FILE, latest_by_step, read_metrics
from keel.spec.mixture import first_step_reading

SPIKE_FILE = "spike_guard.json"
"""The rollbacks of a run, under its output path: {"rollbacks": [{"spike_step", "rolled_back_to",
"skipped_batch", "loss", "threshold", "why"}, ...]}; absent when the run never rolled back."""
MAD_TO_SIGMA = 1.4826
"""The median absolute deviation times this is a standard deviation for normal noise."""
POISON_ENV = "KEEL_POISON_BATCHES"
FINITE_METRICS = ("train/loss", "train/grad_norm", "train/update_norm")
"""Metrics that must stay finite every step; the first NaN or infinity is a spike (fails the step
when there is no guard). The update's norm covers the weights the step leaves: an update whose
norm is not finite from a finite gradient (a projection dividing by a zero norm, an overflow in the
optimizer) would otherwise pass, and the next step's spike be blamed on an innocent batch."""


def _not_finite(values: dict[str, float]) -> dict[str, float]:
    """The metrics of `values` that are not finite, but the update's norm where the gradient's is
    not finite either (it follows from it)."""
    bad = {k: float(v) for k, v in values.items() if not np.isfinite(v)}
    if "train/grad_norm" in bad:
        bad.pop("train/update_norm", None)
    return bad


class NonFiniteTraining(FloatingPointError):
    """The loss, gradient norm or update norm stopped being a finite number."""


class SpikeGuardGaveUp(RuntimeError):
    """A loss spike came after the declared number of rollbacks."""


def check_finite(step: int, values: dict[str, Any]) -> None:
    """Raise `NonFiniteTraining` naming the step and metric (reads the scalars: a sync per step)."""
    bad = _not_finite(jax.device_get(values))
    if bad:
        shown = ", ".join(f"{k} = {v}" for k, v in bad.items())
        raise NonFiniteTraining(
            f"training diverged at step {step}: {shown}; nothing from this attempt is cached. Lower the learning "
            "rate (TrainConfig.optimizer), raise warmup (TrainConfig.schedule), check the data or declare "
            "TrainConfig.spike_guard, then run again"
        )


def read_record(output_path: str) -> dict[str, Any]:
    return storage.read_json(storage.join(output_path, SPIKE_FILE)) or {"rollbacks": []}


def describe_rollbacks(rollbacks: list[dict[str, Any]]) -> str:
    """'2 rollbacks (skipped batch 17 at step 17, batch 24 at step 23)'."""
    each = ", ".join(f"{'skipped batch' if i == 0 else 'batch'} {r['skipped_batch']} at step {r['spike_step']}"
                     for i, r in enumerate(rollbacks))
    return f"{len(rollbacks)} rollback{'s' if len(rollbacks) != 1 else ''} ({each})"


@dataclasses.dataclass
class Rollback:
    """What the loop does after a spike: carry on from `to_step` with the state laid out as `layout`."""

    to_step: int
    layout: Any


class SpikeGuard:
    """Runs each training step, judges it, keeps snapshots and rolls back (see the module docstring).

    `config` None: no guard, only the finiteness check. `state` is the train state at `start`, laid
    out as `layout` (`keel.train.offload.Layout`); `event` prints a console line; `write_row(step,
    values)` adds a metrics row; `writer` is the process that writes `spike_guard.json`; the loss
    history starts again at each of `restarts` (the mixture's phase starts).
    """

    def __init__(self, config, output_path: str, *, start: int, state, layout, event: Callable[[str], None],
                 write_row: Callable[[int, dict[str, Any]], None], writer: bool, restarts: tuple[int, ...] = ()):
        self.config, self.output_path, self.event, self.write_row, self.writer = config, output_path, event, write_row, writer
        self.restarts = sorted(restarts)  # batches where the loss history starts again (mixture phases)
        self.rollbacks: list[dict[str, Any]] = read_record(output_path)["rollbacks"] if config else []
        self.skipped = {r["skipped_batch"] for r in self.rollbacks}
        self.replay_until = start  # steps before it have been trained and reported in this attempt
        self.losses = _earlier_losses(output_path, start, config) if config else []  # (step, loss) of good steps
        if config and start and not self.losses:
            event(f"spike guard: resuming at step {start} without the losses before it ({METRICS_FILE} holds none): "
                  f"only a loss, gradient norm or update norm that is not finite counts as a spike until "
                  f"{config.min_history} steps are known again, "
                  "so this run may skip other batches than an uninterrupted one")
        self.snapshot = _Snapshot(start, layout, state) if config else None
        later = sorted(b for b in self.skipped if b >= self.batch_index(start))
        if later:
            event(f"spike guard: skipping batch{'es' if len(later) > 1 else ''} {', '.join(map(str, later))} as an "
                  f"earlier attempt did ({SPIKE_FILE})")

    def batch_index(self, step: int) -> int:
        """The batch step `step` reads: the step-th batch the guard has not skipped."""
        index = step
        for skipped in sorted(self.skipped):
            if skipped <= index:
                index += 1
        return index

    def first_step_reading(self, batch: int) -> int:
        """The first step that reads batch `batch` or, when it was skipped, the next one after it."""
        return first_step_reading(batch, self.skipped)

    def batches(self, loader, step: int):
        """(batch index, batch) for step `step` on, from a Levanter loader, without the skipped batches."""
        index = self.batch_index(step)
        source = loader.iter_from_step(index)
        try:
            for batch in source:
                if index in self.skipped:
                    self.event(f"batch {index} skipped (the spike guard rolled back a spike on it)")
                else:
                    yield index, batch
                index += 1
        finally:
            source.close()

    def replaying(self, step: int) -> bool:
        """Step `step` is being trained again after a rollback: it passed, and was reported, before."""
        return step < self.replay_until

    def step(self, step: int, index: int, state, run: Callable[[Any], tuple[Any, dict[str, Any]]], layout):
        """(state, metrics, rollback) after training step `step` on batch `index` with `run(state) ->
        (state, metrics)`; after a spike, (the snapshot's state, None, where the loop goes on)."""
        state, metrics = run(state)
        values = {k: float(v) for k, v in jax.device_get({k: metrics[k] for k in FINITE_METRICS}).items()}
        if self.config is None:
            check_finite(step, values)
            return state, metrics, None
        spike = self._judge(step, values)
        if spike is not None:
            return self._roll_back(step, index, values["train/loss"], *spike)
        self.losses.append((step, values["train/loss"]))
        del self.losses[:-(self.config.window + self.config.snapshot_every)]  # a rollback goes back at most snapshot_every
        completed = step + 1
        if completed % self.config.snapshot_every == 0 and completed > self.snapshot.step:
            self.snapshot = _Snapshot(completed, layout, state)
        return state, metrics, None

    def finish(self) -> str | None:
        """'2 rollbacks (...)' when the run rolled back (in this attempt or an earlier one), else
        None; a run that rolled back is recorded as a warning of its keel step, so `keel run` and
        `keel status` never show it as a plain SUCCESS (called by the writing process at the end)."""
        return warn_of_rollbacks(self.rollbacks)

    # ------------------------------------------------------------------ pieces
    def _judge(self, step: int, values: dict[str, float]) -> tuple[str, float | None] | None:
        """(why, threshold) when step `step` spiked, else None."""
        bad = _not_finite(values)
        if bad:
            return ", ".join(f"{k} = {v}" for k, v in bad.items()) + " is not finite", None
        c = self.config
        phase = max((r for r in self.restarts if r <= self.batch_index(step)), default=0)  # the data's, by batch
        since = first_step_reading(phase, self.skipped)
        recent = [loss for s, loss in self.losses if since <= s < step][-c.window:]
        if len(recent) < c.min_history:  # at least 2 (`SpikeGuardConfig`)
            return None
        median = statistics.median(recent)
        changes = [b - a for a, b in zip(recent, recent[1:])]
        typical = statistics.median(changes)
        deviation = MAD_TO_SIGMA * statistics.median(abs(d - typical) for d in changes) / math.sqrt(2)
        threshold = median + max(c.threshold * deviation, c.min_rise * abs(median))
        loss = values["train/loss"]
        if loss <= threshold:
            return None
        return (f"train/loss = {loss:.4f} is above {threshold:.4f} (the median {median:.4f} of the last {len(recent)} "
                f"steps + max({c.threshold:g} x {deviation:.4f} robust deviation, {c.min_rise:g} x median))"), threshold

    def _roll_back(self, step: int, index: int, loss: float, why: str, threshold: float | None):
        c, to = self.config, self.snapshot.step
        shown_loss = loss if math.isfinite(loss) else str(loss)
        if len(self.rollbacks) >= c.max_rollbacks:
            earlier = ", ".join(str(r["spike_step"]) for r in self.rollbacks)
            self.write_row(step, {"spike/gave_up_at": step, "spike/loss": shown_loss, "spike/rollbacks": len(self.rollbacks)})
            self.event(f"step {step}: loss spike: {why}; giving up after {len(self.rollbacks)} rollbacks")
            raise SpikeGuardGaveUp(
                f"loss spike at step {step} after {len(self.rollbacks)} rollback{'s' if len(self.rollbacks) != 1 else ''} "
                f"(SpikeGuardConfig.max_rollbacks={c.max_rollbacks}): {why}"
                + (f"; rolled back before: spikes at steps {earlier}, their batches skipped" if earlier else "")
                + f". Spikes at steps {', '.join([*(str(r['spike_step']) for r in self.rollbacks), str(step)])}: check the "
                "data there, or raise max_rollbacks (execution-only: the same run resumes from its checkpoint)"
            )
        self.rollbacks.append({"spike_step": step, "rolled_back_to": to, "skipped_batch": index, "loss": shown_loss,
                               "threshold": threshold, "why": why})
        self.skipped.add(index)
        if self.writer:
            storage.write_json(storage.join(self.output_path, SPIKE_FILE), {"rollbacks": self.rollbacks})
        self.write_row(step, {"spike/rollback_from": step, "spike/rollback_to": to, "spike/skipped_batch": index,
                              "spike/loss": shown_loss, "spike/threshold": threshold,
                              "spike/rollbacks": len(self.rollbacks)})
        replay = f", replaying steps {to}-{step - 1}" if to < step else ""
        self.event(f"step {step}: LOSS SPIKE: {why}. Rolled back to step {to}{replay} and skipping batch {index} "
                   f"(rollback {len(self.rollbacks)} of at most {c.max_rollbacks})")
        self.replay_until = max(self.replay_until, step)
        self.losses = [(s, x) for s, x in self.losses if s < to]
        return self.snapshot.restore(), None, Rollback(to, self.snapshot.layout)


def warn_of_rollbacks(rollbacks: list[dict[str, Any]]) -> str | None:
    """'2 rollbacks (...)', recorded as a warning of the running keel step; None when there were none.
    A rerun that finds the run already trained (it trains no step) says it too, from the record."""
    if not rollbacks:
        return None
    said = describe_rollbacks(rollbacks)
    step_warnings.warn(f"the spike guard rolled this run back: {said}; see {SPIKE_FILE}")
    return said


def _earlier_losses(output_path: str, start: int, config) -> list[tuple[int, float]]:
    """(step, training loss) of the steps before `start` that `metrics.jsonl` holds: a resumed run's history."""
    if not start:
        return []
    try:
        losses = latest_by_step(read_metrics(storage.join(output_path, METRICS_FILE)), "train/loss")
    except FileNotFoundError:
        return []  # said by the caller
    except OSError as exc:  # a store that failed to answer: judging without the history would differ silently
        raise OSError(f"the spike guard cannot read the losses before step {start} from "
                      f"{storage.join(output_path, METRICS_FILE)} ({exc}): rerun the step once the store answers") from exc
    return [(s, x) for s, x in losses.items() if s < start][-(config.window + config.snapshot_every):]


class _Snapshot:
    """The train state at `step` in host memory: each array's sharding and this process's distinct
    shards, so it goes back to exactly where it was (memory kinds included), one process or many."""

    def __init__(self, step: int, layout, state):
        self.step, self.layout = step, layout
        self.arrays = jax.tree.map(_HostArray.of, state)

    def restore(self):
        return jax.tree.map(lambda h: h.to_device(), self.arrays, is_leaf=lambda x: isinstance(x, _HostArray))


@dataclasses.dataclass
class _HostArray:
    shape: tuple[int, ...]
    dtype: Any
    sharding: Any
    shards: dict[tuple, Any]

    @staticmethod
    def _key(index, shape) -> tuple:
        return tuple(s.indices(n) for s, n in zip(index, shape))

    @classmethod
    def of(cls, x) -> "_HostArray":
        shards: dict[tuple, Any] = {}
        for shard in x.addressable_shards:
            key = cls._key(shard.index, x.shape)
            if key not in shards:
                shards[key] = np.array(shard.data)  # a copy: the device buffer is donated to the next step
        return cls(x.shape, x.dtype, x.sharding, shards)

    def to_device(self):
        return jax.make_array_from_callback(self.shape, self.sharding, lambda index: self.shards[self._key(index, self.shape)])


def poison_from_env(index: int, batch: dict[str, Any]) -> dict[str, Any]:
    """Batch `index`, spoiled when `KEEL_POISON_BATCHES` names it (fault injection for tests and the
    tutorial; see the module docstring); otherwise the batch itself."""
    named = os.environ.get(POISON_ENV, "").strip()
    if not named:
        return batch
    kinds = {int(s): k.strip() or "noise" for s, _, k in (e.partition(":") for e in named.split(",") if e.strip())}
    if index not in kinds:
        return batch
    kind = kinds[index]
    if kind == "noise":
        field = "input_ids"
        spoil = lambda x: jax.random.randint(jax.random.PRNGKey(index), x.shape, 0, jnp.max(x) + 1, x.dtype)  # noqa: E731
    elif kind == "padding":
        field = "segment_ids"
        spoil = lambda x: jnp.full_like(x, -1)  # noqa: E731
    else:
        raise ValueError(f"{POISON_ENV}: poison kind {kind!r} of batch {index} is unknown: use 'noise' or 'padding'")
    print(f"[train] fault injection ({POISON_ENV}): batch {index} is poisoned ({kind})", flush=True)
    return {**batch, field: jax.jit(spoil, out_shardings=batch[field].sharding)(batch[field])}
