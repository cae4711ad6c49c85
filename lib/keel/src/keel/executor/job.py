"""The function every dispatched step runs, wherever fray runs it: call `fn`, keep the log,
write the manifest. Module-level and built from picklable parts so that a cluster task can run it.
"""

from __future__ import annotations

import os
import tempfile
import traceback

from keel.executor import logs, storage
from keel.executor.status import keel_path, write_manifest


def log_url(output_path: str) -> str:
    return keel_path(output_path, "log.txt")


def run_step_job(fn, resolved_config, output_path: str) -> None:
    """Run one step: its outputs and manifest land under `output_path`, its log in `.keel/log.txt`."""
    fs, path = storage.split(output_path)
    fs.makedirs(path, exist_ok=True)
    target = log_url(output_path)
    local = storage.is_local(output_path)
    log_file = storage.split(target)[1] if local else tempfile.mktemp(prefix="keel-log-")
    os.makedirs(os.path.dirname(log_file), exist_ok=True)
    with open(log_file, "a", buffering=1) as log:
        try:
            with logs.capture(log):
                fn(resolved_config)
        except BaseException:
            log.write(traceback.format_exc())
            raise
        finally:
            log.flush()
            if not local:
                fs.put_file(log_file, storage.split(target)[1])
                os.remove(log_file)
    write_manifest(output_path)
