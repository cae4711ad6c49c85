"""The function every dispatched step runs, wherever fray runs it: call `fn`, keep the log.
Module-level and built from picklable parts so that a cluster task can run it. The job writes no
status and no manifest: the driver, which holds the step's lease, records both once the job has
finished (`status.mark_finished`), so a job orphaned by a dead driver never marks a step done.

A multi-replica cluster job runs `fn` on every replica (`fn` joins them through jax.distributed,
see `replicas.py`), and each returns only once every replica has written its outputs. Replica 0
keeps `log.txt`, the others log to `log.replica<N>.txt`, so the replicas never race on keel's files.
"""

from __future__ import annotations

import os
import tempfile
import traceback

from keel.executor import logs, storage
from keel.executor.replicas import replica_index, wait_for_replicas
from keel.executor.status import keel_path


def log_url(output_path: str) -> str:
    return keel_path(output_path, "log.txt")


class _LazyLog:
    """A line-buffered log file opened (appending) on the first write: a step that prints nothing
    leaves no log file and costs no open."""

    def __init__(self, path: str):
        self.path = path
        self._file = None

    @property
    def opened(self) -> bool:
        return self._file is not None

    def write(self, text: str) -> int:
        if self._file is None:
            if not text:
                return 0
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._file = open(self.path, "a", buffering=1)
        return self._file.write(text)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def run_step_job(fn, resolved_config, output_path: str, lazy_log: bool = False) -> None:
    """Run one step: its outputs land under `output_path`, its log in `.keel/log.txt`.

    With `lazy_log` (in-process steps of a local run) the log file is created on the step's first
    line of output, so a step that prints nothing has none; a failing step always has one (its
    traceback). Jobs elsewhere (child processes, cluster tasks) always leave their log file.
    """
    fs, path = storage.split(output_path)
    storage.make_folder(output_path)
    replica = replica_index()
    target = log_url(output_path) if replica == 0 else keel_path(output_path, f"log.replica{replica}.txt")
    local = storage.is_local(output_path)
    log_file = storage.split(target)[1] if local else tempfile.mktemp(prefix="keel-log-")
    log = _LazyLog(log_file)
    if not lazy_log:  # open it now, so that it exists even when the step prints nothing
        os.makedirs(os.path.dirname(log_file), exist_ok=True)
        log._file = open(log_file, "a", buffering=1)
    try:
        try:
            with logs.capture(log):
                fn(resolved_config)
                wait_for_replicas(f"keel: outputs of {output_path} written")  # the job ends with every replica's outputs
        except BaseException:
            log.write(traceback.format_exc())
            raise
        finally:
            log.flush()
            if not local and log.opened:
                log.close()
                fs.put_file(log_file, storage.split(target)[1])
                os.remove(log_file)
    finally:
        log.close()

