"""What a step leaves in its output's hidden `.keel/` folder: its record and its status.

`step.json` records what runs (identity, resolved config, dependencies, provenance) and which
attempt, started when; it is written as the attempt starts, so an attempt without a status is
RUNNING (or died: the lease tells). `status` is written once, as the attempt ends: SUCCESS with the
manifest of the files the step produced, FAILED or INTERRUPTED with why. A rerun first drops the
previous attempt's status, so a SUCCESS never outlives the outputs it describes.

Two files per attempt, each replaced whole (write, then rename), are all a crash can interrupt:
before the status is in place, the step is not finished. Nothing is fsynced: a process that dies
loses none of its writes; after a machine crash, a status torn on disk reads as no status, and a
cache hit still checks every output's size against the manifest. Outputs written before the
manifest moved into the status (a separate `manifest.json`) still read as finished.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from keel.executor import storage

KEEL_DIR = ".keel"
RUNNING, SUCCESS, FAILED, INTERRUPTED = "RUNNING", "SUCCESS", "FAILED", "INTERRUPTED"
STATUS, RECORD = "status", "step.json"
_HASH_LIMIT = 1 << 20  # sha256 only files up to 1 MiB: cheap, and enough to catch a small rewrite


def keel_path(output_path: str, name: str) -> str:
    return storage.join(output_path, KEEL_DIR, name)


@dataclass(frozen=True)
class Status:
    state: str
    attempt: int
    started: float
    finished: float | None = None
    error: str | None = None
    manifest: dict | None = None
    """SUCCESS only: {"files": {relative path: {"size", "sha256" (small local files)}}, "total_bytes"}."""

    @property
    def duration(self) -> float | None:
        return None if self.finished is None else self.finished - self.started


def read_status(output_path: str) -> Status | None:
    """How the last attempt ended; RUNNING while an attempt has started (step.json) and not ended;
    None when no attempt started."""
    record = _read(output_path, STATUS)
    if record is not None:
        return Status(**record)
    started = _read(output_path, RECORD)
    return None if started is None else Status(RUNNING, started["attempt"], started["started"])


def _read(output_path: str, name: str) -> dict | None:
    """The JSON record, or None when it is absent or was torn by a machine crash (not fsynced)."""
    try:
        return storage.read_json(keel_path(output_path, name))
    except ValueError:
        return None


def mark_running(output_path: str, previous: Status | None, record: dict) -> Status:
    """Start the next attempt: write `record` (step.json) with its number and start time, then
    drop the previous attempt's status (a forced rerun rewrites outputs its SUCCESS describes)."""
    status = Status(RUNNING, attempt=(previous.attempt + 1) if previous else 1, started=time.time())
    _write(output_path, RECORD, {**record, "attempt": status.attempt, "started": status.started})
    if previous is not None:
        storage.delete_file(keel_path(output_path, STATUS))
    return status


def mark_finished(output_path: str, running: Status, error: str | None = None, *, interrupted: bool = False) -> Status:
    """SUCCESS (with the manifest of the outputs as they are now), FAILED (with `error`) or
    INTERRUPTED (stopped on request; `error` says how to resume)."""
    state = INTERRUPTED if interrupted else FAILED if error else SUCCESS
    manifest = _manifest(output_path) if state == SUCCESS else None
    status = Status(state, running.attempt, running.started, time.time(), error, manifest)
    _write(output_path, STATUS, vars(status))
    return status


def _write(output_path: str, name: str, record: dict) -> None:
    """Replace the record whole, on one line: indenting it took a tenth of a trivial step's time
    (`python -m json.tool .keel/step.json` indents it)."""
    storage.write_json(keel_path(output_path, name), record, indent=None)


def _manifest(output_path: str) -> dict:
    """Every file the step produced (size, and sha256 for small local files)."""
    sizes = storage.file_sizes(output_path, skip_dir=KEEL_DIR)
    files = {}
    local = storage.is_local(output_path)
    for rel, size in sorted(sizes.items()):
        entry = {"size": size}
        if local and size <= _HASH_LIMIT:
            entry["sha256"] = hashlib.sha256(storage.read_local(storage.split(storage.join(output_path, rel))[1])).hexdigest()
        files[rel] = entry
    return {"files": files, "total_bytes": sum(sizes.values())}


def verify_manifest(output_path: str, status: Status) -> str | None:
    """None when every file of a SUCCESS status's manifest is present with its recorded size, else
    why not. Outputs finished before the manifest moved into the status have it in manifest.json."""
    manifest = status.manifest if status.manifest is not None else storage.read_json(keel_path(output_path, "manifest.json"))
    if manifest is None:
        return "no manifest: the step never finished writing its outputs"
    files = manifest["files"]
    if not files:
        return None
    present = storage.file_sizes(output_path, skip_dir=KEEL_DIR)
    for rel, entry in files.items():
        size = present.get(rel)
        if size is None:
            return f"output file {rel} is missing"
        if size != entry["size"]:
            return f"output file {rel} has {size} bytes, the manifest recorded {entry['size']}"
    return None
