"""Where a training run reports: JSON lines under its output path, wandb, and a loss-curve PNG.

The JSON-lines file is the record keel itself reads (tests, plots, resume checks); wandb is for
people. The wandb run id comes from the step's identity (its output directory ends in
`<name>-<identity hash>`), so a rerun of the same step resumes the same wandb run and two different
steps never share one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
from typing import Any, Callable, Mapping

import fsspec
import wandb
from levanter.tracker import Tracker
from levanter.tracker.wandb import WandbTracker

from keel.executor import storage
from keel.spec.metrics import METRICS_FILE, latest_by_step, read_metrics

logger = logging.getLogger(__name__)

LOSS_PLOT_FILE = "loss.png"


def run_id_for(output_path: str) -> str:
    """The tracker run id of the step writing to `output_path`: `<last name segment>-<hash>`."""
    base = output_path.rstrip("/").rsplit("/", 1)[-1]
    run_id = re.sub(r"[^A-Za-z0-9_\-]", "_", base)
    if not run_id:
        raise ValueError(f"output_path {output_path!r} has no final segment to derive a run id from")
    return run_id


def wandb_mode() -> str:
    """`WANDB_MODE` when set; otherwise online only when an API key is present, else offline."""
    mode = os.environ.get("WANDB_MODE")
    if mode:
        return mode
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


class MetricsLog(Tracker):
    """Append-only JSON lines, one record per step (train) or evaluation. A Levanter tracker, beside
    wandb's; it keeps per-step metrics only (summaries, hyperparameters and artifacts belong to
    wandb and the step's own files).

    On a local disk every record is appended and flushed. An object store cannot append (gcsfs
    turns append into overwrite and uploads nothing below 5 MiB; `memory://` refuses it), so there
    the file is rewritten whole (`storage.write_atomic`): at the end, whenever a checkpoint save
    starts (`flush`; a resume then finds every record up to its checkpoint) and otherwise at most
    every `REWRITE_SECONDS`, or 20 times the last rewrite's duration when that is longer (a long
    run's file stays within 5% of its time). A killed attempt loses only records past its last
    checkpoint, which the resumed run writes again.

    A record is `{"step": int, <metric>: float, ...}`; a train record's step is the index of the
    update (0-based), an evaluation's the number of updates done before it. A run resumed from the
    checkpoint after `resume_at` updates first drops what the attempt that died wrote past it (train
    records of step >= resume_at, evaluations after it), so every step has exactly one record. A
    spike guard's rollback is a record at its spike step (`spike/...`, no `train/loss`), always kept.
    """

    name = "metrics.jsonl"
    REWRITE_SECONDS = 10.0

    def __init__(self, path: str, *, writer: bool = True, resume_at: int = 0):
        """`writer=False` (every process of a multi-process run but the first) writes nothing."""
        self.path = path
        self._file = None  # a local disk: appended to
        self._lines: list[str] | None = None  # an object store: every record, rewritten whole
        self._rewritten_at, self._rewrite_seconds = 0.0, 0.0
        if writer:
            fs, plain = fsspec.core.url_to_fs(path)
            fs.makedirs(os.path.dirname(plain) or ".", exist_ok=True)
            if fs.exists(plain):
                _drop_records_after(path, resume_at)
            if storage.is_local(path):
                self._file = fsspec.open(path, "a").open()
            else:
                self._lines = [storage.read_text(path) or ""]
                self.flush()  # the file is there from the start, as on a local disk

    def log(self, metrics: Mapping[str, Any], *, step: int | None, commit: bool | None = None) -> None:
        record = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        elif self._lines is not None:
            self._lines.append(json.dumps(record) + "\n")
            if time.monotonic() - self._rewritten_at >= max(self.REWRITE_SECONDS, 20 * self._rewrite_seconds):
                self.flush()

    def flush(self) -> None:
        """Every record so far on storage (an object store's file rewritten now)."""
        if self._lines is None:
            return
        t0 = time.monotonic()
        storage.write_atomic(self.path, "".join(self._lines))
        self._rewritten_at = time.monotonic()
        self._rewrite_seconds = self._rewritten_at - t0

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
        self.flush()

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        pass

    def log_summary(self, metrics: dict[str, Any]) -> None:
        pass

    def log_artifact(self, artifact_path, *, name: str | None = None, type: str | None = None) -> None:
        pass


def _is_eval(record: Mapping[str, Any]) -> bool:
    return any(k.startswith("eval/") for k in record)


def _drop_records_after(path: str, resume_at: int) -> None:
    """Rewrite the file without the records a resume at `resume_at` will write again, and without
    a line torn by the attempt that died (the next record would be appended onto it, and both lost)."""
    text = storage.read_text(path) or ""
    records = read_metrics(path)
    torn = sum(1 for line in text.splitlines() if line.strip()) - len(records)
    unterminated = bool(text) and not text.endswith("\n")  # whole or torn, the next row would join its line
    # The evaluation at the checkpoint's own step is not repeated on resume, except at step 0; nor is
    # a spike guard's rollback (keel.train.spike_guard: the resumed run skips its batch by the record).
    kept = [r for r in records if r["step"] < resume_at or (0 < r["step"] == resume_at and _is_eval(r))
            or "spike/rollback_from" in r]
    if len(kept) == len(records) and not torn and not unterminated:
        return
    storage.write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
    logger.info("Resuming at step %d: dropped %d metric records past the checkpoint", resume_at, len(records) - len(kept))
    if torn:
        logger.warning("Resuming at step %d: dropped %d torn line(s) of %s that the attempt before left", resume_at, torn, path)


def _plain(value: Any) -> Any:
    if isinstance(value, (str, bool, int)) or value is None:
        return value
    return float(value)


def run_name(output_path: str) -> str:
    """A run's short name: its output directory without the identity hash (`tiny_moe-06e3eec1ee` -> `tiny_moe`)."""
    base = output_path.rstrip("/").rsplit("/", 1)[-1]
    stem, _, tail = base.rpartition("-")
    return stem if stem and re.fullmatch(r"[0-9a-f]{6,}", tail) else base


def plot_loss_curves(metrics_path: str, png_path: str, *, title: str | None = None,
                     marks: Mapping[int, str] | None = None) -> dict[str, Any]:
    """Train and validation loss against step, and below them MoE health (dropped fraction, router
    balance) and throughput; `marks` draws a labelled line at each step (transport switches,
    mixture phases). Written as a PNG with matplotlib's Agg backend; returns what it drew (title,
    marks, the series of each panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = latest_by_step(records, "train/loss")
    val = latest_by_step(records, "eval/loss")
    fig, (ax, health) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=(3, 2))
    ax.plot(list(train), list(train.values()), label="train", linewidth=1)
    if val:
        ax.plot(list(val), list(val.values()), "o-", label="validation")
    ax.set_ylabel("loss")
    ax.set_title(title or run_name(metrics_path.rsplit("/", 1)[0]), fontsize=9)
    for name, colour in (("moe/dropped_fraction", "tab:red"), ("moe/router_balance", "tab:purple")):
        series = latest_by_step(records, name)
        if series:
            health.plot(list(series), list(series.values()), color=colour, linewidth=1, label=name.split("/")[1])
    health.set_ylabel("MoE health")
    health.set_xlabel("step")
    speed = latest_by_step(records, "throughput/tokens_per_s")
    if speed:
        twin = health.twinx()
        twin.plot(list(speed), list(speed.values()), color="tab:gray", linewidth=0.8, alpha=0.7, label="tokens/s")
        twin.set_ylabel("tokens/s")
        twin.legend(loc="upper right", fontsize=7)
    for step, label in sorted((marks or {}).items()):
        for axis in (ax, health):
            axis.axvline(step, color="black", linestyle=":", linewidth=0.8)
        ax.annotate(label, (step, 1), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right", fontsize=7)
    ax.legend()
    if health.lines:
        health.legend(loc="upper left", fontsize=7)
    for axis in (ax, health):
        axis.grid(alpha=0.3)
    fig.tight_layout()
    with fsspec.open(png_path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    drawn = {"title": ax.get_title(), "marks": {int(note.xy[0]): note.get_text() for note in ax.texts},
             "panels": [[line.get_label() for line in axis.lines if not line.get_label().startswith("_")]
                        for axis in fig.axes]}
    plt.close(fig)
    return drawn


def open_wandb(output_path: str, *, project: str, entity: str | None, tags: tuple[str, ...] = ()) -> WandbTracker:
    """A Levanter wandb tracker for this step's run (mode from `wandb_mode()`), named and resumed by
    the step's identity, its files kept next to the run when the output path is local.

    The run is opened with `wandb.init` and wrapped in Levanter's `WandbTracker`, not through
    `WandbConfig.init`: that one also registers an exit hook which starts a thread at interpreter
    shutdown (Python refuses it: a traceback after every run) and can only be removed by its
    private name. Only the writing process calls this.
    """
    wandb_dir = None
    if "://" not in output_path:
        wandb_dir = os.path.join(output_path, "wandb_files")
        os.makedirs(wandb_dir, exist_ok=True)
    run_id = run_id_for(output_path)
    run = wandb.init(project=project, entity=entity, name=run_id, id=run_id, tags=list(tags), mode=wandb_mode(),
                     resume="allow", dir=wandb_dir, save_code=False)
    return _WandbRun(run)


class OpenedLater(Tracker):
    """A tracker opened on a thread of its own once `open()` is called; what is logged before it has
    opened is kept, in order, and sent first.

    The loop opens wandb this way after its first step: `wandb.init` imports its launch and public
    APIs (pydantic models) and its first log OpenTelemetry, and all that Python holds the interpreter
    lock that the step's lowering and the checkpoint restore need: a resumed tiny_moe reached its
    first step 6.2-6.9 s after its start with wandb opened first, 5.7-6.1 s with it opened after.
    A tracker that fails to open still fails the run: its error is raised by the next call after
    it, at the latest by `finish`. (Levanter's `BackgroundTracker` sends an opened tracker's calls
    from a thread, but it opens the tracker first and only logs a failure, so it is no substitute.)
    """

    def __init__(self, open_tracker: Callable[[], Tracker], *, name: str, timeout_s: float = 300.0):
        self.name, self._open_tracker, self._timeout_s = name, open_tracker, timeout_s
        self._lock = threading.Lock()
        self._pending: list[tuple[str, tuple, dict]] = []
        self._tracker: Tracker | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        """Whether anything asked it to open (the loop does after its first step)."""
        return self._thread is not None

    def open(self) -> None:
        """Start opening (once); calls until it has opened are queued."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._open, name=f"keel-open-{self.name}", daemon=True)
            self._thread.start()

    def _open(self) -> None:
        try:
            tracker = self._open_tracker()
            while True:  # send what was queued meanwhile, then hand the tracker over to the callers
                with self._lock:
                    queued, self._pending = self._pending, []
                    if not queued:
                        self._tracker = tracker
                        return
                for method, args, kwargs in queued:
                    getattr(tracker, method)(*args, **kwargs)
        except BaseException as e:  # raised in the caller's thread, at its next call
            with self._lock:
                self._error = e

    def _call(self, method: str, *args, **kwargs) -> None:
        with self._lock:
            self._raise_if_failed()
            if self._tracker is None:
                self._pending.append((method, args, kwargs))
                return
        getattr(self._tracker, method)(*args, **kwargs)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the {self.name} tracker failed to open or to send a record: {self._error}") from self._error

    def log(self, metrics: Mapping[str, Any], *, step: int | None, commit: bool | None = None) -> None:
        self._call("log", dict(metrics), step=step, commit=commit)

    def log_hyperparameters(self, hparams: dict[str, Any]) -> None:
        self._call("log_hyperparameters", dict(hparams))

    def log_summary(self, metrics: dict[str, Any]) -> None:
        self._call("log_summary", dict(metrics))

    def log_artifact(self, artifact_path, *, name: str | None = None, type: str | None = None) -> None:
        self._call("log_artifact", artifact_path, name=name, type=type)

    def finish(self) -> None:
        """Open it if nothing has (a run with no step left to train), wait for it and what it was sent
        meanwhile, then finish it."""
        self.open()
        self._thread.join(self._timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the {self.name} tracker did not open within {self._timeout_s:g}s: its run "
                               "may be incomplete; check its service (for wandb: WANDB_MODE, the network)")
        self._raise_if_failed()
        self._tracker.finish()


class _WandbRun(WandbTracker):
    """Levanter's wandb tracker that says, once, when wandb refuses rows, and shuts wandb's service
    down when it finishes, not at interpreter exit.

    wandb takes a run's steps in order only: the rows of steps it already holds (an earlier
    attempt's, on a resumed online run; those a spike guard's replay goes over again) are refused,
    with a warning in the log once per 500 steps. The replayed losses are the same values, and
    `metrics.jsonl` holds every row, but the console says so: wandb's curve is not this attempt's."""

    _refused = False

    def log(self, metrics: Mapping[str, Any], *, step: int | None, commit: bool | None = None) -> None:
        if step is not None and not self._refused and int(step) < self.run.step:
            self._refused = True
            print(f"[wandb] run {self.run.id} already holds rows up to step {self.run.step - 1} (an earlier attempt's, "
                  f"or a spike guard's replay's): wandb keeps those and refuses this attempt's rows from step {step} to "
                  f"{self.run.step - 1}; {METRICS_FILE} in the step's output holds this attempt's", flush=True)
        super().log(metrics, step=step, commit=commit)

    def finish(self) -> None:
        super().finish()
        wandb.teardown()


def main(argv: list[str] | None = None) -> None:
    """On demand: `python -m keel.train.tracking OUTPUT_PATH` redraws OUTPUT_PATH/loss.png (also mid-run)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m keel.train.tracking OUTPUT_PATH  (a training step's output directory)")
    output_path = args[0].rstrip("/")
    plot_loss_curves(f"{output_path}/{METRICS_FILE}", f"{output_path}/{LOSS_PLOT_FILE}")
    print(f"{output_path}/{LOSS_PLOT_FILE}")


if __name__ == "__main__":
    main()
