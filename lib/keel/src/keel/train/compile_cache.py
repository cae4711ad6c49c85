"""Where a training step's compiled programs are cached, and one compile per program at a time.

XLA programs depend on shapes, layout and transport, not on the run's rates (those are the step's
inputs: `keel.train.optimizer.Optimizer`), so the points of a sweep, a longer rerun and every
attempt of a step compile the same programs. JAX's persistent compilation cache keeps them:

- `JAX_COMPILATION_CACHE_DIR`, when the user chose one;
- for a step whose output is on this machine, this machine's cache in keel's cache folder
  (`$KEEL_CACHE_DIR/jax`, else `$XDG_CACHE_HOME/keel/jax`, else `~/.cache/keel/jax`): every run
  here shares it;
- for a step on shared storage (`gs://`, ...), the step's own `.keel/jax_cache`, which its later
  attempts read wherever they run;
- none for `memory://`, which no later process can read.

Steps that start together (a sweep's points) would each compile the same program at once, so a
compile into a local cache first takes a lock named after the program (`lease`): the first step
compiles it, the others wait and then load it from the cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
import time

import jax

from keel.executor import storage
from keel.executor.inputs import cache_dir
from keel.executor.status import keel_path

CHOSEN_ENV = "JAX_COMPILATION_CACHE_DIR"


def machine_cache() -> str:
    """This machine's cache of compiled programs, in keel's cache folder (`inputs.cache_dir`)."""
    return os.path.join(cache_dir(), "jax")


def cache_for(output_path: str) -> tuple[str | None, str]:
    """(the cache a step writing to `output_path` uses, or None; how to name it on the console)."""
    chosen = os.environ.get(CHOSEN_ENV)
    if chosen:
        return chosen, CHOSEN_ENV
    if not storage.is_shared_between_processes(output_path):
        return None, "none for memory://"
    if storage.is_local(output_path):
        return machine_cache(), f"this machine's ({CHOSEN_ENV} chooses another)"
    return keel_path(output_path, "jax_cache"), "the step's own, on shared storage"


def use(output_path: str, label: str = "train") -> None:
    """Point JAX's persistent compilation cache where `cache_for` says, and say what it holds (on a
    line that starts with `[label]`)."""
    cache, kind = cache_for(output_path)
    if cache is None:
        return
    found = sum(name.endswith("-cache") for name in storage.list_names(cache))  # JAX's entries, not keel's locks
    configure(cache)
    held = (f"{found} compiled programs (compiles they cover load instead)" if found
            else "empty (the first run compiles everything)")
    print(f"[{label}] compilation cache {cache}, {kind}: {held}", flush=True)


def configure(cache: str) -> None:
    """Compile through the persistent cache in `cache`, keeping every program (small ones too)."""
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@contextlib.contextmanager
def lease(lowered):
    """Hold the lock on `lowered`'s program while compiling it into a local cache (a no-op
    otherwise, and in a multi-process run, whose processes compile their shares together).
    Yields how many seconds it waited for another process's compile of the same program."""
    cache = jax.config.jax_compilation_cache_dir
    if not cache or not storage.is_local(cache) or jax.process_count() > 1:
        yield 0.0
        return
    locks = os.path.join(cache, "keel-compiling")
    os.makedirs(locks, exist_ok=True)
    program = hashlib.sha256(lowered.as_text().encode()).hexdigest()[:32]
    with open(os.path.join(locks, program), "a") as lock:
        t0 = time.perf_counter()
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield time.perf_counter() - t0


_hits = threading.local()
_registering = threading.Lock()
_registered = False


def hits_during(fn):
    """(fn(), how many programs it loaded from the persistent cache on this thread)."""
    global _registered
    with _registering:
        if not _registered:
            jax.monitoring.register_event_listener(_count_hit)
            _registered = True
    before = getattr(_hits, "count", 0)
    result = fn()
    return result, getattr(_hits, "count", 0) - before


def _count_hit(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _hits.count = getattr(_hits, "count", 0) + 1
