"""What a step leaves in its output's hidden `.keel/` folder: status, record and manifest.

`status` says RUNNING / SUCCESS / FAILED / INTERRUPTED with the attempt number and times; `step.json` records
what ran (identity, resolved config, dependencies, provenance); `manifest.json` lists the files the
step produced. SUCCESS is written only after the manifest, so a cache hit can always be verified.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass

from keel.executor import storage

KEEL_DIR = ".keel"
RUNNING, SUCCESS, FAILED, INTERRUPTED = "RUNNING", "SUCCESS", "FAILED", "INTERRUPTED"
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

    @property
    def duration(self) -> float | None:
        return None if self.finished is None else self.finished - self.started


def read_status(output_path: str) -> Status | None:
    record = storage.read_json(keel_path(output_path, "status"))
    return None if record is None else Status(**record)


def write_status(output_path: str, status: Status) -> None:
    storage.write_json(keel_path(output_path, "status"), asdict(status))


def mark_running(output_path: str, previous: Status | None) -> Status:
    status = Status(RUNNING, attempt=(previous.attempt + 1) if previous else 1, started=time.time())
    write_status(output_path, status)
    return status


def mark_finished(output_path: str, running: Status, error: str | None = None, *, interrupted: bool = False) -> Status:
    """SUCCESS, FAILED (with `error`) or INTERRUPTED (stopped on request; `error` says how to resume)."""
    state = INTERRUPTED if interrupted else FAILED if error else SUCCESS
    status = Status(state, running.attempt, running.started, time.time(), error)
    write_status(output_path, status)
    return status


def write_manifest(output_path: str) -> dict:
    """Record every file the step produced (size, and sha256 for small local files)."""
    sizes = storage.file_sizes(output_path, skip_dir=KEEL_DIR)
    files = {}
    local = storage.is_local(output_path)
    for rel, size in sorted(sizes.items()):
        entry = {"size": size}
        if local and size <= _HASH_LIMIT:
            with open(storage.split(storage.join(output_path, rel))[1], "rb") as f:
                entry["sha256"] = hashlib.sha256(f.read()).hexdigest()
        files[rel] = entry
    manifest = {"files": files, "total_bytes": sum(sizes.values())}
    storage.write_json(keel_path(output_path, "manifest.json"), manifest)
    return manifest


def verify_manifest(output_path: str) -> str | None:
    """None when every file of the manifest is present with its recorded size, else why not."""
    manifest = storage.read_json(keel_path(output_path, "manifest.json"))
    if manifest is None:
        return "no manifest.json: the step never finished writing its outputs"
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
