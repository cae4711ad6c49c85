"""One pytest-xdist worker more than the cores, for the test files that mostly wait.

On 2 cores the suite is CPU-bound, yet a few files spend most of their time waiting: on a local
Iris cluster starting and its jobs' polls, on launchers sleeping in their steps and on leases, on
steps timing out, on a browser polling a page. On one of two workers they left a core idle beside
whatever the other ran (78 core-seconds of a 12.7-minute run, /proc/stat), and beside each other
they left both idle. Here they run on a worker of their own, beside one worker per core that runs
every other file, so the cores compile and train while those files wait. A third worker that took
any file was slower (13.5 minutes against 12.7, 11% more CPU): it ran three trainings on two cores.

`WAITING_FILES` names them (the controller, which schedules, sees test ids, not markers). The
extra worker exists only where xdist picks the number of workers (`-n auto`); given `-n N`
without one more worker than the cores, files go to workers as pytest-xdist's `loadfile` sends
them. Once every other file is handed out, the core workers take waiting files too, so a
selection of mostly waiting files does not end on one worker. tests/conftest.py wires this in.
"""

from __future__ import annotations

import os
from pathlib import PurePath

from xdist.scheduler import LoadFileScheduling

WAITING_FILES = frozenset({
    "test_cluster_dispatch.py",  # a local Iris cluster starting, its jobs' polls
    "test_dashboard.py",  # a browser polling the page
    "test_executor_concurrency.py",  # launchers sleeping in their steps, leases
    "test_executor_interrupt.py",  # steps ticking to their end, signals
    "test_executor_leases.py",  # launchers sleeping in their steps, leases
    "test_executor_supervision.py",  # stalled steps timing out, retries
})
MAX_CORE_WORKERS = 4  # each worker's trainings hold a few GiB


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def auto_workers() -> int:
    """A worker per core (at most `MAX_CORE_WORKERS`), and one for the waiting files."""
    return min(cores(), MAX_CORE_WORKERS) + 1


def is_waiting(scope: str) -> bool:
    """Whether a test file (a `loadfile` scope: its path from the rootdir) is one of `WAITING_FILES`."""
    return PurePath(scope).name in WAITING_FILES


class WaitingWorkerScheduling(LoadFileScheduling):
    """`loadfile` in the collection's order, but with more workers than cores the last worker runs
    only the waiting files, and the others take those only once every other file is handed out."""

    def _waiting_node(self):
        """The last worker (gw2 of gw0-gw2) while there is one more than the core workers."""
        nodes = self.nodes
        if len(nodes) <= min(cores(), MAX_CORE_WORKERS):
            return None
        return max(nodes, key=lambda node: int(node.gateway.id.removeprefix("gw")))

    def _next_scope(self, node) -> str | None:
        """The first queued file this node may run: the waiting worker's own files, or for a core
        worker every other file first; None when it may run none of those queued."""
        waiting_node = self._waiting_node()
        if waiting_node is None:
            return next(iter(self.workqueue), None)
        waiting = [scope for scope in self.workqueue if is_waiting(scope)]
        if node is waiting_node:
            return waiting[0] if waiting else None
        others = [scope for scope in self.workqueue if not is_waiting(scope)]
        return others[0] if others else (waiting[0] if waiting else None)

    def _assign_work_unit(self, node) -> None:
        scope = self._next_scope(node)
        if scope is None:  # the waiting worker of a selection without waiting files
            node.shutdown()
            return
        self.workqueue.move_to_end(scope, last=False)  # the base class hands out the first
        super()._assign_work_unit(node)

    def _reschedule(self, node) -> None:
        if not node.shutting_down and self.workqueue and self._next_scope(node) is None:
            node.shutdown()  # nothing queued is this worker's: it finishes what it holds and stops
            return
        super()._reschedule(node)
