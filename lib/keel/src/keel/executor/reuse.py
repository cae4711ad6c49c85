"""Reuse across names: a finished output serves every step that does the same work.

Each finished step is indexed under its content hash (`Identities.content_hash`: its function by
name and source, config, input files and dependencies' content, not its name) in
`{prefix}/.keel/content/`. A step that has not run under its own path, but whose content hash
points at a finished output, is `cached` there: its dependents read that output, and nothing is
computed twice because two experiments named the same work differently. The entry is checked
exactly as a cache hit is (status SUCCESS, manifest intact), and its step.json must record the
entry's content hash: an entry whose output is gone, damaged, or since remade by other work (a
`--force` rerun of its step under edited code) is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

from keel.executor import code, storage
from keel.executor.status import KEEL_DIR, SUCCESS, Status, read_record, read_status, verify_manifest
from keel.executor.step import Step

INDEX = "content"


@dataclass(frozen=True)
class Reused:
    """A finished output of the same work under another name."""

    name: str
    output_path: str
    status: Status


def index(prefix: str) -> str:
    """The folder of the index."""
    return storage.join(prefix, KEEL_DIR, INDEX)


def entry(prefix: str, content_hash: str) -> str:
    """The index entry of one content hash."""
    return storage.join(index(prefix), f"{content_hash}.json")


def find(prefix: str, content_hash: str, own_path: str) -> Reused | None:
    """The finished output the entry of `content_hash` names, if it is another path, still intact
    and still that work."""
    entry_url = entry(prefix, content_hash)
    try:
        found = storage.read_json(entry_url)
    except ValueError:  # torn by a crash: as if absent (the next finished step rewrites it)
        return None
    if not isinstance(found, dict) or not isinstance(found.get("output"), str) or not isinstance(found.get("name"), str):
        return None
    path = storage.join(prefix, found["output"])
    if path == own_path:
        return None
    status = read_status(path)
    if status is None or status.state != SUCCESS or verify_manifest(path, status) is not None:
        return None
    record = read_record(path)
    if record is None or record.get("content_hash") != content_hash:
        return None
    return Reused(found["name"], path, status)


def reusable(step: Step) -> bool:
    """Whether the index serves `step`: not when it declares `no_outputs` (nothing to reuse), nor
    when its function has no fingerprint (`code.fingerprint`): no source to read (a REPL lambda,
    a builtin: its name says nothing of its work), or a partial's argument or a callable object's
    attribute with no canonical encoding (which of two such values did the work cannot be told)."""
    return not step.no_outputs and code.fingerprint(step.fn) is not None


def record(prefix: str, content_hash: str, step: Step, output_path: str, known: set[str] | None = None) -> None:
    """Index a finished output under its content hash (skipped when `known`, the index's listing,
    holds the entry, or the step is not `reusable`)."""
    if not reusable(step) or (known is not None and f"{content_hash}.json" in known):
        return
    relative = storage.relative_to(output_path, prefix)
    if relative is None:  # an output outside the prefix (not keel's to index)
        return
    storage.write_json(entry(prefix, content_hash), {"name": step.name, "output": relative})


def indexed(prefix: str) -> set[str]:
    """The entries of the index, in one listing."""
    return set(storage.list_names(index(prefix)))
