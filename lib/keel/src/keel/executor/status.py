"""What a step leaves in its output's hidden `.keel/` folder: its record and its status.

`step.json` records what runs (identity, resolved config, dependencies, provenance) and which
attempt, started when; it is written as the attempt starts, so an attempt without a status is
RUNNING (or died: the lease tells). `status` is written once, as the attempt ends: SUCCESS with the
manifest of the files the step produced, FAILED or INTERRUPTED with why. A rerun first drops the
previous attempt's status, so a SUCCESS never outlives the outputs it describes.

Two files per attempt, each replaced whole (write, then rename), are all a crash can interrupt:
before the status is in place, the step is not finished. Nothing is fsynced: a process that dies
loses none of its writes; after a machine crash, a status torn on disk reads as no status, and a
cache hit still checks every output against the manifest. Outputs written before the manifest
moved into the status (a separate `manifest.json`) still read as finished.

The manifest records each local file's size, mtime and BLAKE2b hash (fast, and in the standard
library); a cache hit stats every file and re-hashes only those whose size or mtime changed, so a
file rewritten in place at the same size is caught while an untouched output costs one stat.
A status file that is not keel's (valid JSON of another shape) reads as a FAILED attempt naming
the file, so the step reruns instead of `plan` crashing.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, fields

from keel.executor import step_warnings, storage

KEEL_DIR = ".keel"
RUNNING, SUCCESS, FAILED, INTERRUPTED = "RUNNING", "SUCCESS", "FAILED", "INTERRUPTED"
STATUS, RECORD = "status", "step.json"
HOST = "host"
"""The host an attempt away from the launcher's threads ran on (`job.ran_on`): a cluster worker's,
not the driver's that step.json's provenance names. Each attempt writes its own."""


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
    """SUCCESS only: {"files": {relative path: {"size", and for local files "mtime_ns", "blake2b"}}, "total_bytes"}."""
    attempts: list | None = None
    """The earlier attempts of this launch that failed or were preempted and were retried
    ({"attempt", "state", "error"}), oldest first; None when the first attempt is the last."""
    code: str | None = None
    """The fingerprint of the step function's source that made this attempt (`code.py`)."""
    warnings: list | None = None
    """What the attempt recorded with `keel.executor.warn` (`step_warnings.py`): a SUCCESS to look at."""
    inputs: dict | None = None
    """SUCCESS only: the `output_digest` of each step it read, by step name, as it read them. An
    input made again since with other content leaves this output stale (`plan.inputs_made_again`)."""

    @property
    def duration(self) -> float | None:
        return None if self.finished is None else self.finished - self.started


def read_status(output_path: str) -> Status | None:
    """How the last attempt ended; RUNNING while an attempt has started (step.json) and not ended;
    None when no attempt started."""
    record = _read(output_path, STATUS)
    if record is not None:
        return _status_from(record, keel_path(output_path, STATUS))
    started = _read(output_path, RECORD)
    if started is None:
        return None
    if not isinstance(started, dict) or not isinstance(started.get("attempt"), int) or not isinstance(started.get("started"), (int, float)):
        return _not_keels(keel_path(output_path, RECORD), "no attempt number and start time")
    return Status(RUNNING, started["attempt"], started["started"])


_STATUS_FIELDS = {f.name for f in fields(Status)}


def _status_from(record, where: str) -> Status:
    """The Status a record holds, or a FAILED one that names the file when it is not keel's."""
    if not isinstance(record, dict):
        return _not_keels(where, f"a JSON {type(record).__name__}, not an object")
    missing = sorted({"state", "attempt", "started"} - record.keys())
    unknown = sorted(record.keys() - _STATUS_FIELDS)
    if missing or unknown or record["state"] not in (RUNNING, SUCCESS, FAILED, INTERRUPTED):
        why = f"missing {', '.join(missing)}" if missing else f"unknown fields {', '.join(unknown)}" if unknown else f"unknown state {record['state']!r}"
        return _not_keels(where, why)
    if isinstance(record["attempt"], bool) or not isinstance(record["attempt"], int) or isinstance(record["started"], bool) \
            or not isinstance(record["started"], (int, float)):
        return _not_keels(where, "an attempt or start time that is not a number")
    if record["state"] == SUCCESS and not isinstance(record.get("manifest"), (dict, type(None))):
        return _not_keels(where, "a manifest that is not an object")
    if not isinstance(record.get("warnings"), (list, type(None))):
        return _not_keels(where, "warnings that are not a list")
    inputs = record.get("inputs")
    if inputs is not None and not (isinstance(inputs, dict) and all(isinstance(d, str) for d in inputs.values())):
        return _not_keels(where, "inputs that are not step names and digests")
    return Status(**record)


def _not_keels(where: str, why: str) -> Status:
    return Status(FAILED, 0, 0.0, 0.0, f"{where} is not a status keel wrote ({why}); the next `keel run` reruns the step and replaces it")


def _read(output_path: str, name: str) -> dict | None:
    """The JSON record, or None when it is absent or was torn by a machine crash (not fsynced)."""
    try:
        return storage.read_json(keel_path(output_path, name))
    except ValueError:
        return None


def read_record(output_path: str) -> dict | None:
    """The step's step.json, or None when it is absent, torn by a crash (it is not fsynced) or not
    keel's (not an object): such a record cannot say what work its output is."""
    record = _read(output_path, RECORD)
    return record if isinstance(record, dict) else None


def mark_running(output_path: str, previous: Status | None, record: dict) -> Status:
    """Start the next attempt: write `record` (step.json) with its number and start time, then
    drop the previous attempt's status (a forced rerun rewrites outputs its SUCCESS describes)."""
    status = Status(RUNNING, attempt=(previous.attempt + 1) if previous else 1, started=time.time())
    write_running_record(output_path, status, record)
    if previous is not None:
        storage.delete_file(keel_path(output_path, STATUS))
        step_warnings.clear(output_path)  # each attempt starts with no warnings
        storage.delete_file(keel_path(output_path, HOST))  # an earlier attempt's worker, not this one's
    return status


def write_running_record(output_path: str, running: Status, record: dict) -> None:
    """Write the running attempt's step.json: at its start (`mark_running`), and again where the
    step deleted it."""
    _write(output_path, RECORD, {**record, "attempt": running.attempt, "started": running.started})


NO_OUTPUTS_ERROR = ("the step wrote no files under its output path (a step writes its results there); "
                    "write them, or declare Step(..., no_outputs=True) for a step whose effect is elsewhere")


def mark_finished(output_path: str, running: Status, error: str | None = None, *, interrupted: bool = False,
                  no_outputs: bool = False, attempts: list | None = None, code: str | None = None,
                  inputs: dict | None = None) -> Status:
    """SUCCESS (with the manifest of the outputs as they are now), FAILED (with `error`) or
    INTERRUPTED (stopped on request; `error` says how to resume). A step that wrote no file is
    FAILED unless it declares `no_outputs`: an empty SUCCESS would only fail its dependents later.
    `attempts` lists the earlier attempts of this launch that were retried; `code` fingerprints
    the step function that ran; `inputs` when the outputs it read were made (`Status.inputs`); the
    warnings the attempt recorded (`step_warnings.warn`) go in too."""
    state = INTERRUPTED if interrupted else FAILED if error else SUCCESS
    manifest = _manifest(output_path) if state == SUCCESS else None
    if manifest is not None and not manifest["files"] and not no_outputs:
        state, error, manifest = FAILED, NO_OUTPUTS_ERROR, None
    status = Status(state, running.attempt, running.started, time.time(), error, manifest, attempts or None, code,
                    step_warnings.read(output_path) or None, inputs if state == SUCCESS else None)
    _write(output_path, STATUS, {k: v for k, v in vars(status).items() if v is not None or k not in ("warnings", "inputs")})
    return status


def _write(output_path: str, name: str, record: dict) -> None:
    """Replace the record whole, on one line: indenting it took a tenth of a trivial step's time
    (`python -m json.tool .keel/step.json` indents it)."""
    storage.write_json(keel_path(output_path, name), record, indent=None)


def _manifest(output_path: str) -> dict:
    """Every file the step produced: size, and for local files mtime and BLAKE2b hash."""
    if not storage.is_local(output_path):
        sizes = storage.file_sizes(output_path, skip_dir=KEEL_DIR)
        return {"files": {rel: {"size": size} for rel, size in sorted(sizes.items())}, "total_bytes": sum(sizes.values())}
    root = storage.split(output_path)[1]
    stats = storage.local_file_stats(root, skip_dir=KEEL_DIR)
    files = {rel: {"size": size, "mtime_ns": mtime, "blake2b": content_hash(os.path.join(root, rel))}
             for rel, (size, mtime) in sorted(stats.items())}
    return {"files": files, "total_bytes": sum(size for size, _ in stats.values())}


def output_digest(status: Status) -> str:
    """What a finished output holds, as its dependents record having read it (`Status.inputs`): its
    files' sizes and content hashes, so an output made again with the same bytes is the same input.
    Where the manifest has no content hashes (object stores) or no files, the time it was made
    counts too: there, every remake is another input."""
    files = {rel: {k: v for k, v in entry.items() if k != "mtime_ns"} for rel, entry in (status.manifest or {}).get("files", {}).items()}
    hashed = bool(files) and all("blake2b" in entry for entry in files.values())
    text = json.dumps({"files": files, "made": None if hashed else status.finished}, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def content_hash(path: str) -> str:
    """BLAKE2b of a local file: about twice SHA-256's speed, streamed in chunks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "blake2b").hexdigest()


def verify_manifest(output_path: str, status: Status, no_outputs: bool = True) -> str | None:
    """None when every file of a SUCCESS status's manifest is present with its recorded size (and,
    where recorded, content: a file whose size or mtime changed is re-hashed), else why not.
    Outputs finished before the manifest moved into the status have it in manifest.json."""
    manifest = status.manifest if status.manifest is not None else storage.read_json(keel_path(output_path, "manifest.json"))
    if manifest is None:
        return "no manifest: the step never finished writing its outputs"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(isinstance(e, dict) and isinstance(e.get("size"), int) for e in files.values()):
        return "a manifest keel did not write (it lists no files with their sizes)"
    if not files:
        return None if no_outputs else NO_OUTPUTS_ERROR
    local = storage.is_local(output_path)
    root = storage.split(output_path)[1]
    present = (storage.local_file_stats(root, skip_dir=KEEL_DIR) if local
               else {rel: (size, None) for rel, size in storage.file_sizes(output_path, skip_dir=KEEL_DIR).items()})
    for rel, entry in files.items():
        size, mtime = present.get(rel, (None, None))
        if size is None:
            return f"output file {rel} is missing"
        if size != entry["size"]:
            return f"output file {rel} has {size} bytes, the manifest recorded {entry['size']}"
        if local and "blake2b" in entry and mtime != entry.get("mtime_ns") and content_hash(os.path.join(root, rel)) != entry["blake2b"]:
            return f"output file {rel} was changed after the step finished (its content hash differs from the manifest's)"
    return None
