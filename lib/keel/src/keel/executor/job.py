"""The function every dispatched step runs, wherever fray runs it: call `fn`, keep the log.
Module-level and built from picklable parts so that a cluster task can run it. The job writes no
status and no manifest: the driver, which holds the step's lease, records both once the job has
finished (`status.mark_finished`), so a job orphaned by a dead driver never marks a step done.

A multi-replica cluster job runs `fn` on every replica (`fn` joins them through jax.distributed,
see `replicas.py`), and each returns only once every replica has written its outputs. Replica 0
keeps `log.txt`, the others log to `log.replica<N>.txt`, so the replicas never race on keel's files.

A step's function returns None: keel keeps files, so a returned value would be dropped unseen and
fails the step instead; so does a step that writes files outside its output path (`writes.py`).
A step running in the launcher's threads that calls `os._exit` would end keel itself with that exit
code and no summary; there the call raises `StepExited` in the step.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import os
import socket
import sys
import tempfile
import threading
import traceback

from keel.executor import heartbeat, interrupt, logs, step_warnings, storage, writes
from keel.executor.collector import no_cycle_collection
from keel.executor.replicas import replica_index, wait_for_replicas
from keel.executor.status import HOST, keel_path
from keel.executor.step import StepFunction


STAGED_LOG_PREFIX = "keel-log-"
"""A step whose output is not on a local disk writes its log into a local temporary file of this name
and uploads it when the step ends (`run_step_job`)."""


def _upload_log(log_file: str, target: str) -> None:
    """Append the staged log to the step's log (after the earlier attempts' lines, as locally). One
    that cannot be uploaded (the store answers 503) is said, and the step's outcome stands: its
    outputs are written. The file stays where it was staged, which a child's launcher uploads again
    as the child ends (`child.collect`)."""
    try:
        storage.append_local_file(log_file, target)
    except Exception as exc:  # noqa: BLE001 - a lost log is named, never the step's failure
        print(f"[keel] the step's log could not be uploaded to {target} ({type(exc).__name__}: {exc}); its lines "
              f"are in {log_file} on {socket.gethostname()}", file=sys.stderr, flush=True)
        return
    os.remove(log_file)


def log_url(output_path: str) -> str:
    return keel_path(output_path, "log.txt")


def ran_on(output_path: str, record: dict) -> str | None:
    """The host the step (`record`: its step.json) ran on: the one its job recorded (`HOST`),
    else the driver's for a step without resources, which only the driver's host runs; None for a
    step with resources that recorded none (sent to a cluster before keel recorded workers, or run
    in the launcher's threads): nothing says which machine it shared."""
    recorded = storage.read_text(keel_path(output_path, HOST))
    if recorded or record.get("resources") is not None:
        return recorded or None
    return record.get("provenance", {}).get("host")


class _LazyLog:
    """A line-buffered log file opened (appending) on the first write: a step that prints nothing
    leaves no log file and costs no open."""

    def __init__(self, path: str):
        self.path = path
        self._file = None

    @property
    def opened(self) -> bool:
        return self._file is not None

    def file(self):
        """The open file, opened now if nothing was written yet."""
        if self._file is None:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._file = open(self.path, "a", buffering=1)
        return self._file

    def write(self, text: str) -> int:
        if self._file is None and not text:
            return 0
        return self.file().write(text)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class StepReturnedValue(TypeError):
    """The step's function returned something; keel keeps only the files it writes."""


class StepExited(RuntimeError):
    """A step in the launcher called `os._exit`, which would have ended the launcher."""


_in_step = threading.local()
_process_exit = os._exit
_launcher_pid: int | None = None  # a process a step forks (a multiprocessing pool's worker) exits as it means to


def _guarded_exit(code: int = 0) -> None:
    if os.getpid() == _launcher_pid and getattr(_in_step, "active", False):
        raise StepExited(f"the step called os._exit({code}), which would end `keel run` itself: return (or raise) "
                         "instead, or declare the step isolated=True to run it in a process of its own")
    _process_exit(code)


def guard_process_exit() -> None:
    """Make `os._exit` inside a step running in this process's threads raise `StepExited` instead."""
    global _launcher_pid
    _launcher_pid = os.getpid()
    os._exit = _guarded_exit


def _call_step(fn, resolved_config, in_launcher: bool, whole_process: bool) -> None:
    if whole_process and isinstance(fn, StepFunction):
        # The process runs this step alone, so what importing its function builds (a training
        # step's jax, Levanter and wandb: some 380,000 objects) lives as long as the process: it is
        # frozen out of the cycle collector's reach, which would walk it in every full collection. It
        # is frozen before the collector resumes: the first collection after the import would walk
        # all of it once (0.15-0.2 s on the main thread before the first step).
        with no_cycle_collection():
            fn = fn.resolve()
            gc.freeze()
    _in_step.active = in_launcher
    try:
        returned = fn(resolved_config)
    finally:
        _in_step.active = False
    if returned is not None:
        shown = repr(returned)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise StepReturnedValue(f"{getattr(fn, '__qualname__', fn)} returned {shown}, which keel would drop: a step writes "
                                "its results as files under config.output_path and returns None")


@contextlib.contextmanager
def _crash_stacks_into(log: _LazyLog):
    """While a process runs only this step, a crash in native code (a compiler's SIGSEGV, an XLA
    CHECK's SIGABRT) writes every thread's Python stack into the step's log before the process dies:
    the traceback a Python error would have left, which the launcher's FAILED line points to."""
    faulthandler.enable(file=log.file(), all_threads=True)
    try:
        yield
    finally:
        faulthandler.disable()


def run_step_job(fn, resolved_config, output_path: str, in_launcher: bool = False, watch: bool = False,
                 whole_process: bool = False, prefix: str | None = None, heartbeat_at: str | None = None) -> None:
    """Run one step: its outputs land under `output_path`, its log in `.keel/log.txt`.

    With `in_launcher` (in-process steps of a local run) the log file is created on the step's
    first line of output, so a step that prints nothing has none; a failing step always has one
    (its traceback); and `os._exit` raises in the step (`guard_process_exit`). Jobs elsewhere
    (child processes, cluster tasks) always leave their log file. With `watch`, a step that wrote
    files outside its output path (or into another step's output under `prefix`, the graph's) raises
    `writes.StepWroteOutside` once it returns (its own error, if it raised, comes first);
    `whole_process` watches every thread of this process, which runs only this step (an isolated
    step's child), not just the calling thread, lets `warn()` from any of its threads record on this
    step (`step_warnings.py`) and sends every thread's output to the step's log (`logs.capture`).
    A cluster job of a step declaring `progress_timeout_s` gets `heartbeat_at`, where it beats on
    the shared store: an argument, not an environment variable, because a cluster may rewrite the
    job's environment (a local Iris worker maps the paths under /tmp in it into its sandbox).
    """
    if heartbeat_at is not None:
        os.environ[heartbeat.ENV] = heartbeat_at
    storage.make_folder(output_path)
    replica = replica_index()
    if replica == 0 and not in_launcher:  # a child process's host (the driver's) or a cluster worker's
        storage.write_atomic(keel_path(output_path, HOST), socket.gethostname())
    target = log_url(output_path) if replica == 0 else keel_path(output_path, f"log.replica{replica}.txt")
    local = storage.is_local(output_path)
    log_file = storage.split(target)[1] if local else tempfile.mktemp(prefix=STAGED_LOG_PREFIX)
    log = _LazyLog(log_file)
    if not in_launcher:  # open it now, so that it exists even when the step prints nothing
        log.file()
    try:
        try:
            with logs.capture(log, whole_process=whole_process), step_warnings.running(output_path, whole_process=whole_process), \
                    _crash_stacks_into(log) if whole_process else contextlib.nullcontext():
                with writes.watched(output_path, whole_process=whole_process, prefix=prefix) if watch else \
                        contextlib.nullcontext() as watching:
                    _call_step(fn, resolved_config, in_launcher=in_launcher, whole_process=whole_process)
                if watching is not None:
                    watching.check()
                wait_for_replicas(f"keel: outputs of {output_path} written")  # the job ends with every replica's outputs
        except interrupt.StepInterrupted as stopped:  # asked for, not a failure: one line, no traceback
            log.write(f"[keel] interrupted: {stopped}\n")
            raise
        except BaseException:
            log.write(traceback.format_exc())
            raise
        finally:
            log.flush()
            if not local and log.opened:
                log.close()
                _upload_log(log_file, target)
    finally:
        log.close()

