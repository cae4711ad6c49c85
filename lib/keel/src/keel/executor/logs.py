"""Per-step logs while steps run concurrently in threads of one process.

`sys.stdout`, `sys.stderr` and the root logger are shared by all threads, so a router sends what a
step's thread writes to that step's log file as well as to the terminal. A process that runs one
step only (an isolated step's child) routes every thread's writes to it: the step's own threads
(compiling ahead, a tracker's) print there too.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from typing import IO

_local = threading.local()
_process_log: IO[str] | None = None  # the log of the one step this process runs, for threads it started


def _current() -> IO[str] | None:
    return getattr(_local, "log", None) or _process_log


def _write(log: IO[str], text: str) -> None:
    """Into the step's log; a log another thread is closing as its step ends takes no more lines,
    and must not fail the print that wrote them (which the terminal still gets)."""
    try:
        log.write(text)
    except (ValueError, OSError):
        pass


class _TeeStream:
    def __init__(self, stream: IO[str]):
        self._stream = stream

    def write(self, text: str) -> int:
        log = _current()
        if log is not None:
            _write(log, text)
        return self._stream.write(text)

    def flush(self) -> None:
        log = _current()
        if log is not None:
            try:
                log.flush()
            except (ValueError, OSError):
                pass
        self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _ThreadLogHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        log = _current()
        if log is not None:
            _write(log, self.format(record) + "\n")


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
def capture(log: IO[str], *, whole_process: bool = False):
    """Route this thread's prints and log records into `log` while the block runs; with
    `whole_process` (this process runs only this step), every other thread's as well."""
    global _process_log
    _install()
    previous = getattr(_local, "log", None)
    _local.log = log
    if whole_process:
        _process_log = log
    try:
        yield
    finally:
        _local.log = previous
        if whole_process:
            _process_log = None
