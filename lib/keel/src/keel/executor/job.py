"""The function every dispatched step runs, wherever fray runs it: call `fn`, keep the log,
write the manifest. Module-level and built from picklable parts so that a cluster task can run it.

A multi-replica cluster job runs `fn` on every replica (`fn` joins them through jax.distributed,
see `replicas.py`). Replica 0 alone keeps `log.txt` and writes the manifest, after every replica
finished writing, so the replicas never race on keel's files; the others log to
`log.replica<N>.txt`.
"""

from __future__ import annotations

import os
import tempfile
import traceback

from keel.executor import logs, storage
from keel.executor.replicas import replica_index, wait_for_replicas
from keel.executor.status import keel_path, write_manifest


def log_url(output_path: str) -> str:
    return keel_path(output_path, "log.txt")


def run_step_job(fn, resolved_config, output_path: str) -> None:
    """Run one step: its outputs and manifest land under `output_path`, its log in `.keel/log.txt`."""
    fs, path = storage.split(output_path)
    fs.makedirs(path, exist_ok=True)
    replica = replica_index()
    target = log_url(output_path) if replica == 0 else keel_path(output_path, f"log.replica{replica}.txt")
    local = storage.is_local(output_path)
    log_file = storage.split(target)[1] if local else tempfile.mktemp(prefix="keel-log-")
    os.makedirs(os.path.dirname(log_file), exist_ok=True)
    with open(log_file, "a", buffering=1) as log:
        try:
            with logs.capture(log):
                fn(resolved_config)
                wait_for_replicas(f"keel: outputs of {output_path} written")  # then the manifest lists them all
        except BaseException:
            log.write(traceback.format_exc())
            raise
        finally:
            log.flush()
            if not local:
                fs.put_file(log_file, storage.split(target)[1])
                os.remove(log_file)
    if replica == 0:
        write_manifest(output_path)

