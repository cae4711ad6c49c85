"""Python's cycle collector, held while a process builds large graphs of long-lived objects.

Planning a graph, importing a training step's modules and tracing a program each allocate hundreds
of thousands of dicts, tuples and objects, nearly none of them cyclic garbage. Every 700
allocations the collector walks the young ones, and now and then every object in the process, for
nothing: holding it saves 10-20% of a plan's time, and 1 s of the 7 s a training step's imports
took.
"""

from __future__ import annotations

import contextlib
import gc
import threading

_held = 0  # blocks inside `no_cycle_collection`, on any thread
_held_lock = threading.Lock()
_was_enabled = False  # the collector's state when the first of them began


@contextlib.contextmanager
def no_cycle_collection():
    """Hold the cycle collector for the block. Reference counting still frees what is dropped; the
    collector resumes, as it was, when the last such block ends: blocks on several threads (a
    program traced in the background while another is traced here) overlap."""
    global _held, _was_enabled
    with _held_lock:
        if _held == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _held += 1
    try:
        yield
    finally:
        with _held_lock:
            _held -= 1
            if _held == 0 and _was_enabled:
                gc.enable()
