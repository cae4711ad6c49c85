"""Compile the loop's step functions ahead of their first call, on a background thread.

A jitted function compiles at its first call, so the run stands still for it. But a step
function's arguments are known long before: the train state's shapes and shardings follow from
the model and optimizer declarations alone (`jax.eval_shape`), and the batch's from the config.
XLA compiles outside the GIL, so a function lowered from those abstract arguments compiles on a
second thread while the first one initialises the model, opens the data and runs the first
validation pass. On a CPU the compiles themselves gain little from overlapping: XLA:CPU
runs them together, but one step's compile already keeps the cores busy (tiny_moe's step,
evaluation and init on 2 cores: 58.0 s of wall time in three threads, 55.7 s one after the other),
so what overlaps is the rest: `tiny_moe`'s first step now comes 26.5 s after its step starts
instead of 32.9 s (with bytecode compiled at install and the layout fixes of keel.model.layout,
which cut the compile itself).

One worker thread compiles in submission order (two compiles at once would only share the same
cores); `now` compiles on the calling thread, for the function needed at once. The worker is a
daemon: an interrupted run does not wait for a compile nobody will use. Every compile goes
through the persistent compilation cache under its program's lock (`keel.train.compile_cache`),
and says whether it was loaded from there instead.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import jax

from keel.executor.collector import no_cycle_collection
from keel.train import compile_cache


def run_once_options() -> dict:
    """Compiler options for a program that runs once per process (the train state's init). XLA
    spends most of such a compile optimising the random-number code of every parameter's init,
    which then runs for a fraction of a second. At backend optimisation level 1 tiny_moe's init
    compiled in 5.6 s instead of 8.7 s, with bit-identical arrays. On XLA:CPU level 0 goes further:
    tiny_moe's model init alone compiles for one device in 2.2 CPU s instead of 2.9, its run
    records "compiled the initial state" in 3.9-4.2 s instead of 4.6-5.4 s beside the step's
    compile, and its first step came 0.4 s sooner on 2 cores (15.4 against 15.8 s, means of 5
    interleaved pairs). The init then runs in 0.05 s instead of 0.007 s, and about 4% of its values
    differ in the last bit (LLVM contracts multiply-adds differently). An accelerator's backend
    keeps level 1, which is what was measured there."""
    return {"xla_backend_optimization_level": 0 if jax.default_backend() == "cpu" else 1}


CPU_STEPS = {"xla_backend_optimization_level": 1}
"""Compiler options for training steps and evaluations on XLA:CPU. Most of a CPU step's compile is
code generation for some 800 small fused kernels (13.8 of 20 s in XLA's own trace of tiny_moe's
step), while the step's time goes to the matrix products, which are library calls either way.
Measured on 2 cores, each pair in one process: tiny_moe's training step compiles in 18.3 s instead
of 21.7 s (and 20.7 against 23.8 s), small_moe's in 22.0 instead of 24.3 s. Steps alternated
between the two executables ran within noise of each other (tiny_moe 348 against 339 ms,
small_moe 2.38 against 2.48 s, medians of 30 and 15 steps; an earlier 10% slowdown, measured one
executable after the other, did not reproduce), with bit-identical losses. On an accelerator the
step's kernels are the run's speed: its backend keeps its default level."""


def step_options() -> dict | None:
    """The compiler options of the training steps and evaluations this process compiles (for its
    devices: `jax.default_backend()`). The loop's compiles and the eval step's own call of
    `eval_loss_fn` must agree on them, or the eval step cannot load the program the run compiled."""
    return CPU_STEPS if jax.default_backend() == "cpu" else None


@dataclass
class Pending:
    """One function being compiled for fixed abstract arguments; `get()` waits for the executable."""

    what: str
    future: Future
    ahead: bool
    seconds: float = 0.0  # the compile's own wall time, once done
    loaded: bool = False  # from the persistent compilation cache (keel.train.compile_cache), not compiled
    queued: float = 0.0  # of `seconds`, waiting for another process compiling the same program
    waited: float | None = None  # how long the first `get` stood waiting (None: never asked yet)
    lowered: threading.Event = field(default_factory=threading.Event)  # traced and lowered (or failed): XLA's part is left

    def get(self):
        if self.waited is None:
            t0 = time.perf_counter()
            try:
                return self.future.result()
            finally:
                self.waited = time.perf_counter() - t0
        return self.future.result()


class Compiler:
    """Compiles `jitted.lower(*abstract_args)` under a mesh, with this process's `step_options`,
    ahead (background) or now."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.options = step_options()
        self._jobs: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None

    def ahead(self, what: str, jitted, *abstract_args) -> Pending:
        pending = Pending(what, Future(), ahead=True)
        self._jobs.put((pending, jitted, abstract_args))
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="keel-compile-ahead", daemon=True)
            self._worker.start()
        return pending

    def now(self, what: str, jitted, *abstract_args) -> Pending:
        with jax.set_mesh(self.mesh):
            return compile_now(what, jitted, *abstract_args, options=self.options)

    def _work(self) -> None:
        while True:
            pending, jitted, args = self._jobs.get()
            with jax.set_mesh(self.mesh):
                _compile(pending, jitted, args, self.options)


def compile_now(what: str, jitted, *args, options: dict | None = None) -> Pending:
    """Compile `jitted.lower(*args)` on this thread, under the current mesh, with `options` added to
    the jit's own. Like every compile here it goes through the persistent compilation cache under
    its program's lock, so runs of one program that start together (a sweep's points) compile it
    once: the first to take the lock compiles, the others wait and load it."""
    pending = Pending(what, Future(), ahead=False)
    _compile(pending, jitted, args, options)
    return pending


def _compile(pending: Pending, jitted, args, options: dict | None) -> None:
    t0 = time.perf_counter()
    try:
        # Tracing tiny_moe's step ran ~175 young collections and a full one over the process's ~10^6
        # objects and freed nothing: 1.95 s with the collector, 1.60 s without (medians of 5).
        with no_cycle_collection():
            try:
                lowered = jitted.lower(*args)
            finally:
                pending.lowered.set()
        with compile_cache.lease(lowered) as pending.queued:
            executable, hits = compile_cache.hits_during(lambda: lowered.compile(compiler_options=options))
    except BaseException as e:  # delivered to whoever asks for the function
        pending.seconds = time.perf_counter() - t0
        pending.future.set_exception(e)
        return
    pending.seconds, pending.loaded = time.perf_counter() - t0, hits > 0
    pending.future.set_result(executable)


def abstract(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of `tree`'s arrays (arrays or ShapeDtypeStructs) carrying `shardings`."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
