"""Per-step logs while steps run concurrently in threads of one process.

`sys.stdout`, `sys.stderr` and the root logger are shared by all threads, so a router sends what a
step's thread writes to that step's log file as well as to the terminal.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from typing import IO

_local = threading.local()


def _current() -> IO[str] | None:
    return getattr(_local, "log", None)


class _TeeStream:
    def __init__(self, stream: IO[str]):
        self._stream = stream

    def write(self, text: str) -> int:
        log = _current()
        if log is not None:
            log.write(text)
        return self._stream.write(text)

    def flush(self) -> None:
        log = _current()
        if log is not None:
            log.flush()
        self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _ThreadLogHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        log = _current()
        if log is not None:
            log.write(self.format(record) + "\n")


_install_lock = threading.Lock()
_installed = False


def _install() -> None:
    """Tee `sys.stdout`/`sys.stderr` (again, if something replaced them since: a test harness's
    capture, a caller's redirect) and add the log handler once."""
    global _installed
    with _install_lock:
        for name in ("stdout", "stderr"):
            if not isinstance(getattr(sys, name), _TeeStream):
                setattr(sys, name, _TeeStream(getattr(sys, name)))
        if _installed:
            return
        handler = _ThreadLogHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger().addHandler(handler)
        if logging.getLogger("keel").level == logging.NOTSET:  # keel's own events (resume, switches) at INFO
            logging.getLogger("keel").setLevel(logging.INFO)
        _installed = True


@contextlib.contextmanager
def capture(log: IO[str]):
    """Route this thread's prints and log records into `log` while the block runs."""
    _install()
    previous = _current()
    _local.log = log
    try:
        yield
    finally:
        _local.log = previous
