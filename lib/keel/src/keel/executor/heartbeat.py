"""The heartbeat of a step in a process of its own: a file its work touches at each unit of
progress (every training step, and every event a training run prints: a compile finished, a
validation, a checkpoint), which the launcher watches when the step declares
`progress_timeout_s`.

A process that is stopped (SIGSTOP), deadlocked or spinning without finishing a step keeps its
lease alive through the launcher, so nothing else would ever notice it. The file's format is
Levanter's (`levanter.recovery.detection.touch_heartbeat`: "<step> <time>", replaced whole, so its
supervisor could watch a keel step too); it is written here because that module imports jax, which
a step that beats need not load. The launcher only reads the file's mtime.

A step on a cluster beats into its output's `.keel/heartbeat` on the shared store, which its
launcher reads a few times per timeout (`keel.executor.cluster`). An object store takes one write
per object per second or so, so a beat there waits REMOTE_BEAT_S after the last one.
"""

from __future__ import annotations

import os
import time

from keel.executor import storage

ENV = "KEEL_HEARTBEAT"
"""Where the step's process writes its heartbeat; set by the launcher when it watches one."""

FILE = "heartbeat"

REMOTE_BEAT_S = 2.0
"""Least seconds between two beats written to an object store."""

_last_remote_beat = 0.0


def path() -> str | None:
    """The heartbeat file this process should touch, or None when nobody watches it."""
    return os.environ.get(ENV) or None


def beat(step: int) -> None:
    """Say "still making progress, at `step`" when the launcher watches this process; else nothing."""
    global _last_remote_beat
    target = path()
    if target is None:
        return
    data = f"{step} {time.time()}\n".encode()
    if storage.is_local(target):
        storage.replace_local(storage.split(target)[1], data)
    elif time.monotonic() - _last_remote_beat >= REMOTE_BEAT_S:
        try:
            storage.write_atomic(target, data)
        except Exception:  # noqa: BLE001 - a beat is best-effort: a lost one reads as silence, never as the step's error
            return
        _last_remote_beat = time.monotonic()


class Watch:
    """A launcher's look at one step's heartbeat: how long the step has been silent. A store that
    does not answer is no news for a look or two (a passing error neither kills a job nor gives up
    on one), but no news for longer than the timeout is silence too: a heartbeat that cannot be read
    (a permission, a path that went away) must not switch `progress_timeout_s` off for good."""

    def __init__(self, heartbeat: str, started: float):
        self.heartbeat, self.started = heartbeat, started
        self._unread_since: float | None = None

    def silent_for(self, now: float) -> tuple[float, str]:
        """(seconds of silence, why): since the last beat, or since the reads started failing."""
        age = seconds_since(self.heartbeat, self.started, now)
        if age is not None:
            self._unread_since = None
            return age, f"its heartbeat {self.heartbeat} stopped"
        self._unread_since = self._unread_since or now
        return now - self._unread_since, f"its heartbeat {self.heartbeat} could not be read"


def seconds_since(heartbeat: str, started: float, now: float) -> float | None:
    """Seconds since the last beat (a local path or a store's URL), or since `started` (wall clock)
    when there was none yet; None when the store did not answer (`Watch` says how long)."""
    try:
        fs, where = storage.split(heartbeat)
        last = fs.modified(where).timestamp() if not storage.is_local(heartbeat) else os.stat(where).st_mtime
    except FileNotFoundError:
        last = started
    except Exception:  # noqa: BLE001 - gcsfs/s3fs raise HTTP and timeout errors of their own
        return None
    return now - max(last, started)
