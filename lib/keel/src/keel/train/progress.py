"""What a training run tells the person watching it: one updating bar on a terminal, plain lines
everywhere else, and the events that matter (compiling, validation, checkpoints, transport and
mixture-phase changes, a final summary).

On a terminal the bar is drawn on the process's own stdout (not through keel's log tee), so
`log.txt` gets the events as plain lines and never the bar's carriage returns. Without a terminal
(CI, a pipe, a file), or with `KEEL_PROGRESS=lines` (set by the executor when several training
steps share one console), progress is a plain line every `LINE_EVERY_S` seconds.
"""

from __future__ import annotations

import os
import sys
import time

from levanter.recovery.faults import maybe_inject
from tqdm import tqdm

from keel.executor import heartbeat, step_warnings

LINE_EVERY_S = 15.0
MIN_LOSS_DROP = 0.01
"""A finished run whose training loss never went this fraction below its first value did not
learn (a learning rate far too large or too small, frozen weights): its summary says so."""
MIN_STEPS_TO_JUDGE = 10


def loss_never_moved(losses: list[float], min_drop: float = MIN_LOSS_DROP) -> str | None:
    """A warning when the training `losses` (one per step, in order) never went `min_drop` of the
    first below it, or None; a run that learns drops far more within its first steps."""
    finite = [x for x in losses if x == x and abs(x) != float("inf")]
    if len(finite) < MIN_STEPS_TO_JUDGE:
        return None
    first, lowest = finite[0], min(finite)
    if lowest <= first * (1 - min_drop):
        return None
    return (f"warning: the training loss never went {min_drop:.0%} below its first value ({first:.4f}; lowest "
            f"{lowest:.4f}) in {len(losses)} steps: the run did not learn; check the learning rate (far too large "
            "or too small) and that the weights are trained")


def process_age() -> float | None:
    """Seconds since this process started (Linux's /proc: its start tick against the uptime), or
    None where that cannot be read. A training step runs in a process of its own, so this is the
    step's time from launch: interpreter, imports, setup and compiles."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class Progress:
    """Progress of one run from `start` to `total` steps; `name` labels every line."""

    def __init__(self, name: str, start: int, total: int, *, enabled: bool = True):
        self.name, self.start, self.total, self.enabled = name, start, total, enabled
        terminal = sys.__stdout__
        self._bar = None
        if enabled and terminal is not None and terminal.isatty() and os.environ.get("KEEL_PROGRESS") != "lines":
            self._bar = tqdm(total=total, initial=start, file=terminal, desc=name, unit="step", dynamic_ncols=True,
                             leave=False)
        self._t0 = time.perf_counter()
        self._timed_from: tuple[int, float] | None = None  # (step, time) after the first compiled step
        self._last_line = 0.0
        self._losses: list[float] = []  # this process's training losses, for `loss_never_moved`
        self.first_step_after: float | None = None
        """Seconds from the process's start to its first finished step (`process_age`)."""
        self._completed = start

    def event(self, text: str) -> None:
        """A line worth keeping: printed (and so in log.txt), above the bar. Also a heartbeat (a
        compile finished, an evaluation, a checkpoint), so the launcher's `progress_timeout_s`
        measures the longest single piece of work, not the time between two steps around it."""
        heartbeat.beat(self._completed)
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.clear()
        print(f"[train] {self.name}: {text}", flush=True)
        if self._bar is not None:
            self._bar.refresh()

    def compiled(self, what: str, seconds: float, how: str, *, loaded: bool = False, queued: float = 0.0) -> None:
        """`loaded`: from the compilation cache; `queued`: of `seconds`, waiting for another run's
        compile of the same program (`keel.train.compile_cache.lease`)."""
        done = f"loaded {what} from the compilation cache" if loaded else f"compiled {what}"
        after = f" ({queued:.1f}s of it waiting for another run compiling it)" if queued >= 0.1 else ""
        self.event(f"{done} in {seconds:.1f}s{after}, {how}")

    def step(self, completed: int, *, loss: float, tokens_per_s: float, transport: str, phase: str | None) -> None:
        """After each optimizer step: the heartbeat the launcher may watch (`Step.progress_timeout_s`),
        the fault `LEVANTER_FAULT_KIND`/`LEVANTER_FAULT_STEP` inject (`levanter.recovery.faults`: a
        SIGKILL, SIGSTOP, raised error or spin at that step; the launcher drops them on a retry),
        then the bar's postfix, or a plain line now and then."""
        heartbeat.beat(completed)
        if os.environ.get("LEVANTER_FAULT_KIND", "none") != "none":  # a fault injected on purpose, to test recovery
            maybe_inject(completed)
        self._losses.append(loss)
        self._completed = completed
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._timed_from is None:
            self._timed_from = (completed, now)  # the first step includes compilation: time from here
            self.first_step_after = process_age()
            if self.first_step_after is not None:
                self.event(f"first step done {self.first_step_after:.1f}s after the process started")
        eta = self.eta(completed, now)
        fields = {"loss": f"{loss:.4f}", "tok/s": f"{tokens_per_s:,.0f}", "eta": eta, "transport": transport}
        if phase:
            fields["phase"] = phase
        if self._bar is not None:
            self._bar.n = completed
            self._bar.set_postfix(fields, refresh=True)
        elif now - self._last_line >= LINE_EVERY_S or completed == self.total:
            self._last_line = now
            shown = ", ".join(f"{k} {v}" for k, v in fields.items())
            print(f"[train] {self.name}: step {completed}/{self.total}, {shown}", flush=True)

    def eta(self, completed: int, now: float | None = None) -> str:
        if self._timed_from is None or completed <= self._timed_from[0]:
            return "?"
        step0, t0 = self._timed_from
        per_step = ((now or time.perf_counter()) - t0) / (completed - step0)
        return _eta(per_step * (self.total - completed))

    def close(self) -> None:
        """Take the bar down; a run that went from its first step to its last here and never
        learned says so (a resumed run saw only its end, where a small drop is normal), in its log
        and as a warning of its step (`keel.executor.warn`), which `keel run` and `keel status` show."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        warning = loss_never_moved(self._losses) if self.start == 0 and self._completed == self.total else None
        self._losses = []
        if warning:
            self.event(warning)
            if self.enabled:  # the primary process: one warning per run, not one per replica
                step_warnings.warn(warning.removeprefix("warning: "))

    @property
    def wall_seconds(self) -> float:
        return time.perf_counter() - self._t0
