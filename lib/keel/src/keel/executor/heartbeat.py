"""The heartbeat of a step in a process of its own: a file its work touches at each unit of
progress (every training step), which the launcher watches when the step declares
`progress_timeout_s`.

A process that is stopped (SIGSTOP), deadlocked or spinning without finishing a step keeps its
lease alive through the launcher, so nothing else would ever notice it. The file's format is
Levanter's (`levanter.recovery.detection.touch_heartbeat`: "<step> <time>", replaced whole, so its
supervisor could watch a keel step too); it is written here because that module imports jax, which
a step that beats need not load. The launcher only reads the file's mtime.
"""

from __future__ import annotations

import os
import time

from keel.executor import storage

ENV = "KEEL_HEARTBEAT"
"""Where the step's process writes its heartbeat; set by the launcher when it watches one."""

FILE = "heartbeat"


def path() -> str | None:
    """The heartbeat file this process should touch, or None when nobody watches it."""
    return os.environ.get(ENV) or None


def beat(step: int) -> None:
    """Say "still making progress, at `step`" when the launcher watches this process; else nothing."""
    target = path()
    if target is None:
        return
    storage.replace_local(target, f"{step} {time.time()}\n".encode())


def seconds_since(heartbeat: str, started: float, now: float) -> float:
    """Seconds since the last beat, or since `started` (wall clock) when there was none yet."""
    try:
        last = os.stat(heartbeat).st_mtime
    except FileNotFoundError:
        last = started
    return now - max(last, started)
