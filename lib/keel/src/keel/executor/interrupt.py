"""A process-wide "please stop" flag, set by the first Ctrl-C (SIGINT) or SIGTERM.

Long steps (training) poll `requested()` at their own safe points (a step boundary), save what
they need to resume, and raise `StepInterrupted`; the executor then marks the step INTERRUPTED,
never SUCCESS, so the next `keel run` resumes it. The flag lives here, in the jax-free executor,
so that step code of any kind can read it without importing the runner.
"""

from __future__ import annotations

import threading

_requested = threading.Event()

EXIT_INTERRUPTED = 130
"""The exit code of a process stopped by an interruption (128 + SIGINT), keel's own included."""


class StepInterrupted(Exception):
    """A step stopped early on request; `resume` says what the next run starts from."""

    def __init__(self, message: str, resume: str = ""):
        super().__init__(message)
        self.resume = resume


def request() -> None:
    _requested.set()


def requested() -> bool:
    return _requested.is_set()


def clear() -> None:
    """Forget an earlier request (a new run in the same process starts uninterrupted)."""
    _requested.clear()
