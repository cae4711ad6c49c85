"""Warnings a step records about its own outcome: a SUCCESS that a person should look at.

A step that finished but whose result is suspect (a training loss that never moved from its first
value, a run the spike guard rolled back) calls

    from keel.executor import warn
    warn("the training loss stayed at 6.93 from step 0 to 300: lower the learning rate")

from anywhere in its own code while it runs (its thread in the launcher, or any thread of an
isolated step's process): the message is appended to `.keel/warnings.json` under its output,
and when the attempt ends keel moves the list into the step's status (`Status.warnings`). The
step stays SUCCESS (and cached); `keel run` reports it as done with warnings in its summary, and
`keel status` (and `status --json`) lists them under the step. Each attempt starts with none.

`warn` only records: print the message too when the step's log should show it. Called where no
step runs (a notebook, a unit test), it records nothing and returns False; `output_path=` names the
step explicitly (e.g. from a thread the step started in the launcher).
"""

from __future__ import annotations

import contextlib
import threading

from keel.executor import storage

FILE = "warnings.json"
MAX_KEPT = 50
"""A step that warns more often keeps its first MAX_KEPT messages and a count of the rest."""

_lock = threading.Lock()
_local = threading.local()
_process_output: str | None = None


def warn(message: str, output_path: str | None = None) -> bool:
    """Record `message` as a warning of the step running here (or of the step whose output is
    `output_path`); False when no step runs in this thread or process."""
    path = output_path or getattr(_local, "output_path", None) or _process_output
    if path is None:
        return False
    with _lock:
        kept, more = _load(path)
        if len(kept) < MAX_KEPT:
            kept.append(str(message))
        else:
            more += 1
        storage.write_json(_url(path), {"warnings": kept, "more": more}, indent=None)
    return True


def _url(output_path: str) -> str:
    return storage.join(output_path, ".keel", FILE)  # status.keel_path (status.py reads these)


def _load(output_path: str) -> tuple[list[str], int]:
    try:
        found = storage.read_json(_url(output_path))
    except ValueError:  # torn by a machine crash: start over
        found = None
    if not isinstance(found, dict) or not isinstance(found.get("warnings"), list):
        return [], 0
    more = found.get("more")
    return [str(m) for m in found["warnings"]], more if isinstance(more, int) else 0


def read(output_path: str) -> list[str]:
    """The warnings the running (or last) attempt recorded, in order."""
    kept, more = _load(output_path)
    return kept + ([f"... and {more} more warning{'s' if more > 1 else ''}"] if more else [])


def clear(output_path: str) -> None:
    """Drop an earlier attempt's warnings as the next one starts."""
    storage.delete_file(_url(output_path))


@contextlib.contextmanager
def running(output_path: str, *, whole_process: bool):
    """While the block runs, `warn()` without a path records on `output_path`: from this thread,
    or from any thread of this process when it runs only this step."""
    global _process_output
    if whole_process:
        _process_output = output_path
    previous, _local.output_path = getattr(_local, "output_path", None), output_path
    try:
        yield
    finally:
        _local.output_path = previous
        if whole_process:
            _process_output = None
