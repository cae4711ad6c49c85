"""Run a graph: the steps that are not cached, in dependency order, concurrently where they can be.

A run that would start a step reading an External path that holds no file is refused before any step
starts, from the same plan the run then follows. Each step is claimed with a lease on its output
path (so concurrent launchers run it once), recorded in `step.json` (which marks the attempt
RUNNING), dispatched (an `isolated` step in a child process of its own, see `child.py`, at most one
per core of this machine at a time, see `resources.machine_cores`; steps that declare `resources=`
to the cluster client when one is given, see `cluster.py`; other steps as jobs of fray's in-process
client, or of `client=` when one is given) and, once the job has finished,
marked SUCCESS in one write that carries the manifest of its outputs (see `status.py`). Bookkeeping
per step: the lease (create, delete), `step.json` and `status` (each written whole), and after a
SUCCESS the content-index entry `{prefix}/.keel/content/<hash>.json` (`reuse.py`); the log file only
if the step prints, `.keel/heartbeat` only if it declares `progress_timeout_s`. A failure marks the
step FAILED, stops its dependents, lets independent branches finish and is reported with the step's
name, output path, exception and log. So does a write outside the step's output: beside its folder
(`_Beside`, seen from here, blamed on the step whose watch saw it written, or, for a step no watch
covers, on that step unless another was seen writing it) or anywhere else (`writes.py`, seen in the
step's own thread or process). A step that recorded warnings (`step_warnings.py`) is SUCCESS, and
the report lists it with them (`RunReport.warned`).

A launcher records an attempt's end only while the step is still its own: one suspended (SIGSTOP, a
paused VM) past its lease's timeout may have been taken over meanwhile. It then records nothing (no
status, no content-index entry), says so, and waits for the launcher that took the step over, whose
run decides, as for any step another launcher runs.

Ctrl-C (SIGINT) or SIGTERM, the first time: no new step starts, the running ones are asked to stop
at their next safe point (training steps checkpoint; a cluster job cannot be asked, so it is
terminated), and each is marked INTERRUPTED, never SUCCESS; a step another launcher is running is
no longer waited for. The report names them and the launcher exits 130. The second time: child
processes and cluster jobs are killed, running steps marked INTERRUPTED, leases released, and the
launcher exits at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import hashlib
import heapq
import math
import os
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Callable

from keel.executor import code, heartbeat, interrupt, reuse, step_warnings, storage, writes
from keel.executor import lease as leases
from keel.executor.lease import ClusterJob
from keel.executor.job import guard_process_exit, log_url, run_step_job
from keel.executor.plan import CACHED, EMPTY_EXTERNAL, EXTERNAL, Graph, StepPlan, plan_graph, select
from keel.executor.provenance import _secret_values, provenance, scrub
from keel.executor.resolve import resolve_config
from keel.executor.resources import machine_cores, oom_kills
from keel.executor.identity import HASH_CHARS
from keel.executor.status import (KEEL_DIR, RECORD, SUCCESS, Status, keel_path, mark_finished, mark_running, output_digest, read_record, read_status,
                                  verify_manifest, write_running_record)
from keel.executor.step import DeclaresDevices, Step, StepDeclarationError

_MAX_WAIT_POLL_S = 1.0
_NOT_STARTED = "not started"  # a step's outcome: the run was interrupted while another launcher ran it
_SIGNAL_POLL_S = 0.2
_TELL_HELD_S = 1.0
"""How long a step waits for a core before the console says so: a step just started that turns out
to wait for another launcher gives its core back within milliseconds (`Runner._holding`)."""
_SAME_CTRL_C_S = 1.0


class StepFailed(RuntimeError):
    """A step's function raised (or its job failed); names the step, its output and its log."""

    def __init__(self, step: str, output_path: str, error: str, log: str):
        super().__init__(f"step {step} failed\n  output: {output_path}\n  error: {error}\n  log: {log}")
        self.step, self.output_path, self.error, self.log = step, output_path, error, log


class StepStopped(RuntimeError):
    """A step stopped on request (Ctrl-C, SIGTERM) before it finished; it is INTERRUPTED, not cached."""

    def __init__(self, step: str, output_path: str, why: str):
        super().__init__(f"step {step} was interrupted: {why}\n  output: {output_path}")
        self.step, self.output_path, self.why = step, output_path, why


@dataclasses.dataclass(frozen=True)
class StepWarned:
    """A step that finished SUCCESS but recorded warnings (`step_warnings.py`)."""

    step: str
    output_path: str
    warnings: list[str]
    log: str

    def __str__(self) -> str:
        shown = "\n".join(f"  warning: {w}" for w in self.warnings)
        return (f"step {self.step} is SUCCESS with {_count(len(self.warnings), 'warning')}:\n{shown}\n"
                f"  output: {self.output_path}\n  log: {self.log}")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


@dataclasses.dataclass
class RunReport:
    plans: list[StepPlan]
    ran: list[str] = dataclasses.field(default_factory=list)
    reused: list[str] = dataclasses.field(default_factory=list)
    failures: list[StepFailed] = dataclasses.field(default_factory=list)
    blocked: list[str] = dataclasses.field(default_factory=list)
    interrupted: list[StepStopped] = dataclasses.field(default_factory=list)
    not_started: list[str] = dataclasses.field(default_factory=list)
    """Steps left unstarted because the run was interrupted."""
    warned: list[StepWarned] = dataclasses.field(default_factory=list)
    """Steps that ran to SUCCESS with warnings (`keel.executor.warn`): done, cached, to look at."""

    @property
    def ok(self) -> bool:
        return not self.failures and not self.blocked and not self.interrupted and not self.not_started


def default_client(max_concurrent: int):
    from fray.local_backend import LocalClient

    return LocalClient(max_threads=max_concurrent)


def _step_record(graph: Graph, step: Step, resolved, launch: dict, secrets: list[str] | None = None) -> dict:
    """What `step.json` records of the step (`mark_running` adds the attempt); `launch` is this
    launch's provenance (the same for all its steps), already scrubbed with `secrets` (the secret
    values `scrub` cuts out; looked up when None)."""
    record = scrub(
        {
            "name": step.name,
            "identity": graph.identities.payload(step),
            "hash": graph.identities.hash(step),
            # the work this output is, for the index (`_index_cached`): its code may change while it stays cached
            "content_hash": graph.identities.content_hash(step) if reuse.reusable(step) else None,
            "config": _plain(resolved),
            "dependencies": {d.name: graph.path(d) for d in step.deps},
            "description": step.description,
            "resources": step.resources.describe() if step.resources else None,
            **({"overrides": graph.overrides[step.name]} if step.name in graph.overrides else {}),
        },
        secrets,
    )
    record["provenance"] = launch if secrets is not None else scrub(launch)
    return record


def _plain(value):
    """The resolved config as JSON, execution-only fields included (they are part of what ran)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"__class__": type(value).__qualname__, **{f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _refuse_empty_externals(plans: list[StepPlan], chosen: set[int]) -> None:
    """Refuse to start a run whose chosen steps read an External path that holds no file (and
    declares no version): each of them would start, then fail, or worse, read nothing."""
    needed = {id(d) for p in plans if id(p.step) in chosen for d in p.step.deps}
    empty = [p for p in plans if p.state == EXTERNAL and id(p.step) in needed and p.reason == EMPTY_EXTERNAL]
    if empty:
        shown = "; ".join(f"{p.name} at {p.output_path}" for p in empty)
        raise StepDeclarationError(f"no files at the path of external input {shown}: put the data there or fix the "
                                   "External's path (a declared version= stands for files keel does not list)")


def _refuse_isolated_in_memory(plans: list[StepPlan], chosen: set[int]) -> None:
    """Refuse to start a run whose chosen isolated step writes under `memory://`: that store lives in
    the launcher's memory, so the step's own process could not write there, and running it in the
    launcher instead would drop what isolation promises (its declared environment, the stall kill of
    `progress_timeout_s`) without a word."""
    for p in plans:
        if id(p.step) in chosen and getattr(p.step, "isolated", False) and not storage.is_shared_between_processes(p.output_path):
            raise StepDeclarationError(
                f"{p.name} is isolated (it runs in a process of its own, with its declared environment"
                f"{' and progress_timeout_s' if p.step.progress_timeout_s else ''}), but its output {p.output_path} lives in "
                "this process's memory, which that process cannot reach: give a prefix on disk or a shared store (gs://, s3://)")


class Runner:
    """`client` runs the steps in the driver (default: an in-process `LocalClient`); `cluster`, when
    given, runs the steps that declare `resources=`."""

    def __init__(self, graph: Graph, *, client=None, cluster=None, max_concurrent: int = 8, force: re.Pattern | None = None,
                 lease_timeout: float = leases.DEFAULT_TIMEOUT_S, echo: Callable[[str], None] = print):
        problem = leases.timeout_problem(os.environ.get(leases.TIMEOUT_ENV))
        if problem is None and not leases.SHORTEST_TIMEOUT_S <= lease_timeout < math.inf:
            problem = f"lease_timeout={lease_timeout!r}: give at least {leases.SHORTEST_TIMEOUT_S:g} s"
        if problem is not None:  # a timeout of 0 had launchers take each other's leases over and over
            raise ValueError(problem)
        self.graph = graph
        self._secrets = _secret_values()  # once per launch: scrubbing each step.json reuses them
        self._launch = scrub(provenance(), self._secrets)
        self.cluster = cluster
        self.max_concurrent = max(1, max_concurrent)
        self.process_slots = min(self.max_concurrent, machine_cores())
        self.client = client
        self.force = force
        self.lease_timeout = lease_timeout
        self.echo = echo
        # re-entrant: Ctrl-C's handler (`_on_signal`) runs on the main thread between two bytecodes,
        # also while the scheduler there holds it (counting the cores held): a plain lock waited for itself forever
        self._lock = threading.RLock()
        self._core_freed = threading.Condition(self._lock)
        self._children: dict = {}  # live child processes of isolated steps: (their folder, the step's log) (`keel.executor.child`)
        self._active: dict[str, tuple[Status, leases.Lease]] = {}  # output path -> (RUNNING status, lease)
        self._warned: dict[str, list[str]] = {}  # output path -> the warnings of its successful attempt
        self._stopping, self._stopping_since = False, 0.0
        self._isolated_in_run = 0
        # output paths of the started steps that hold one of `process_slots`, for a process of their own:
        # not while they wait for another launcher running them (`_claim`)
        self._holding: set[str] = set()
        guard_process_exit()

    def run(self, only: re.Pattern | None = None) -> RunReport:
        plans = plan_graph(self.graph, self.force)
        chosen = select(plans, only)
        _refuse_empty_externals(plans, chosen)
        _refuse_isolated_in_memory(plans, chosen)
        self._index_cached(plans)
        for p in plans:  # what `keel plan` says of a cached output made by code since edited
            if p.state == CACHED and p.reused_from is None and p.reason:
                self.echo(f"[keel] note  {p.name}: {p.reason}")
        report = RunReport(plans)
        if not chosen:
            return report
        self._isolated_in_run = sum(1 for p in plans if id(p.step) in chosen and getattr(p.step, "isolated", False))
        interrupt.clear()
        restore = self._catch_signals()
        try:
            return self._schedule(plans, chosen, report)
        finally:
            restore()

    def _index_cached(self, plans: list[StepPlan]) -> None:
        """Index the finished outputs this graph holds under their content hashes, so the same work
        under another name finds them (an entry lost, or another prefix's copy); one listing of the
        index, a write only for what it lacks. Only an output whose step.json records that content
        hash is the work it names: one cached across an edit of its (or an ancestor's) function was
        made by the old code."""
        try:
            known = reuse.indexed(self.graph.prefix)
        except OSError as exc:
            self._not_indexed("the finished outputs", exc)
            return
        for p in plans:
            if p.state != CACHED or p.reused_from is not None or not isinstance(p.step, Step) or not reuse.reusable(p.step):
                continue
            content = self.graph.identities.content_hash(p.step)
            if f"{content}.json" not in known and (read_record(p.output_path) or {}).get("content_hash") == content:
                self._index(content, p.step, p.output_path, known)

    def _index(self, content: str, step: Step, output_path: str, known: set[str] | None = None) -> None:
        """Index a finished output for reuse under other names; the index is a cache, so a write
        that fails is named on the console, and the step stays finished."""
        try:
            reuse.record(self.graph.prefix, content, step, output_path, known)
        except OSError as exc:
            self._not_indexed(step.name, exc)

    def _not_indexed(self, what: str, exc: OSError) -> None:
        self.echo(f"[keel] warn  {what}: not indexed for reuse under other names ({type(exc).__name__}: {exc}); "
                  f"finished all the same, but the same work declared under another name runs again until "
                  f"{reuse.index(self.graph.prefix)} can be written")

    def _schedule(self, plans: list[StepPlan], chosen: set[int], report: RunReport) -> RunReport:
        """Start each chosen step, in plan order and at most `max_concurrent` at a time (of them at
        most `process_slots` in processes of their own), once its chosen dependencies are done (the
        others are cached or external). A step held back for a core lets the next ready step that
        needs none start first. A finished step updates only its own dependents: no scan of every
        waiting step per finished one."""
        by_id = {id(p.step): p for p in plans}
        order = {key: i for i, key in enumerate(by_id)}
        waiting: dict[int, int] = {}  # step not started yet -> how many of its dependencies are not done
        dependents: dict[int, list[int]] = {}
        for key in chosen:
            deps = {id(d) for d in by_id[key].step.deps} & chosen
            waiting[key] = len(deps)
            for dep in deps:
                dependents.setdefault(dep, []).append(key)
        ready = [(order[key], key) for key, left in waiting.items() if left == 0]
        heapq.heapify(ready)

        def block(broken: list[int]) -> None:
            """Skip every step that depends, directly or not, on a step that failed or stopped."""
            blocked, stack = [], [key for b in broken for key in dependents.get(b, ())]
            broken.clear()
            while stack:
                key = stack.pop()
                if waiting.pop(key, None) is not None:
                    blocked.append(key)
                    stack.extend(dependents.get(key, ()))
            for key in sorted(blocked, key=order.get):
                report.blocked.append(by_id[key].name)
                self.echo(f"[keel] skip  {by_id[key].name}: a dependency failed")

        running: dict[Future, StepPlan] = {}
        held_since: dict[int, float] = {}  # steps waiting for a core: since when
        told: set[int] = set()  # those the console was told of
        broken: list[int] = []  # failed or stopped since the last round
        with ThreadPoolExecutor(max_workers=self.max_concurrent, thread_name_prefix="keel-step") as pool:
            while waiting or running:
                if self._stopping and waiting:  # every step not started yet, even one a failure would skip
                    report.not_started.extend(by_id[key].name for key in sorted(waiting, key=order.get))
                    waiting.clear()
                    ready.clear()
                block(broken)
                held_back = []  # ready, but every core already runs a step process
                while ready and len(running) < self.max_concurrent:
                    entry = heapq.heappop(ready)
                    plan = by_id[entry[1]]
                    if self._in_own_process(plan.step) and not self._take_core(plan.output_path):
                        held_back.append(entry)
                        since = held_since.setdefault(entry[1], time.monotonic())
                        if entry[1] not in told and time.monotonic() - since >= _TELL_HELD_S:
                            told.add(entry[1])
                            self._tell_held(plan.name)
                        continue
                    del waiting[entry[1]]
                    running[pool.submit(self._execute, plan)] = plan
                for entry in held_back:
                    heapq.heappush(ready, entry)
                if not running:
                    if waiting:
                        raise RuntimeError(f"keel: cannot schedule {[by_id[k].name for k in waiting]}: dependencies unresolved")
                    continue
                # A bounded wait: a signal delivered to another thread runs its Python handler only
                # when the main thread wakes, so the main thread must wake up now and then.
                finished, _ = wait(list(running), timeout=_SIGNAL_POLL_S, return_when=FIRST_COMPLETED)
                for future in finished:
                    plan = running.pop(future)
                    self._give_core(plan.output_path)
                    try:
                        outcome = future.result()
                    except StepFailed as failure:
                        report.failures.append(failure)
                        self.echo(f"[keel] FAIL  {plan.name}: {failure.error.splitlines()[-1] if failure.error else ''}")
                        broken.append(id(plan.step))
                        continue
                    except StepStopped as stopped:
                        report.interrupted.append(stopped)
                        self.echo(f"[keel] STOP  {plan.name}: {stopped.why}")
                        broken.append(id(plan.step))
                        continue
                    if outcome == _NOT_STARTED:
                        report.not_started.append(plan.name)
                        continue
                    (report.ran if outcome == "ran" else report.reused).append(plan.name)
                    if outcome == "ran" and self._warned.get(plan.output_path):
                        report.warned.append(StepWarned(plan.name, plan.output_path, self._warned.pop(plan.output_path),
                                                        _log_or_none(plan.output_path)))
                    for key in dependents.get(id(plan.step), ()):
                        if key in waiting:
                            waiting[key] -= 1
                            if waiting[key] == 0:
                                heapq.heappush(ready, (order[key], key))
        return report

    def _on_cluster(self, step: Step) -> bool:
        """Whether the step goes to the cluster: it declares resources and this run has a cluster."""
        return step.resources is not None and self.cluster is not None

    def _in_own_process(self, step: Step) -> bool:
        """Whether the step runs in a child process on this machine (`isolated`, not sent to a cluster)."""
        return step.isolated and not self._on_cluster(step)

    def _take_core(self, output_path: str) -> bool:
        """Whether the step holds a core for its process: it did, or one was free and it took it."""
        with self._lock:
            if output_path not in self._holding:
                if len(self._holding) >= self.process_slots:
                    return False
                self._holding.add(output_path)
            return True

    def _give_core(self, output_path: str) -> None:
        with self._lock:
            if output_path in self._holding:
                self._holding.discard(output_path)
                self._core_freed.notify_all()

    def _tell_held(self, name: str) -> None:
        self.echo(f"[keel] wait  {name}: every core of this machine ({self.process_slots}) already runs a step in a "
                  "process of its own; it starts when one ends")

    def _wait_for_core(self, plan: StepPlan) -> None:
        """Until the step holds a core for its process, or the run stops. A step that waited for
        another launcher gave its core back, which others may have taken since; the launcher then
        left the step to this one (its attempt failed, or its lease expired)."""
        tell_at: float | None = time.monotonic() + _TELL_HELD_S
        with self._lock:
            while not self._take_core(plan.output_path) and not self._stopping:
                if tell_at is not None and time.monotonic() >= tell_at:
                    tell_at = None
                    self._tell_held(plan.name)
                self._core_freed.wait(timeout=_SIGNAL_POLL_S)

    def _claim(self, plan: StepPlan) -> tuple[leases.Lease | None, Status | None]:
        """The lease on the step's output and its last status; no lease when another launcher
        finished the step meanwhile, and neither when the run was interrupted while waiting for it.
        Taking over an expired lease kills the step process it still runs on this host (its launcher
        stopped or stuck), so that one process writes the output; one that will not die fails the step."""
        forced = bool(self.force and self.force.search(plan.name))
        out_of_date = plan.status.finished if plan.remade_inputs else None  # only a newer output is finished
        delay, told = 0.02, None
        while True:
            lease, holder = leases.try_acquire(plan.output_path, self.lease_timeout)
            status = read_status(plan.output_path)
            finished = (status is not None and status.state == SUCCESS and status.finished != out_of_date
                        and verify_manifest(plan.output_path, status, no_outputs=plan.step.no_outputs) is None)
            if lease is not None:
                if finished and not forced:
                    lease.release()
                    return None, status
                if holder is not None:
                    self.echo(f"[keel] take  {plan.name}: its lease was held by {holder.describe()}")
                if lease.adopts is not None:
                    self._adopt_job(plan, lease, forced)
                if holder is not None:
                    stray = holder.stray_step_process()
                    if stray is not None:
                        from keel.executor.child import discard

                        if not leases.stop_stray_step_process(stray.pid):
                            lease.release()
                            raise StepFailed(plan.name, plan.output_path,
                                             f"the step's process of the launcher whose lease expired (pid {stray.pid}) "
                                             "still runs and did not die when killed: stop it, then run again",
                                             _log_or_none(plan.output_path))
                        discard(stray.workdir, log_url(plan.output_path))  # its silent launcher will not
                        self.echo(f"[keel] take  {plan.name}: its step's process (pid {stray.pid}) still ran, its "
                                  "launcher silent: killed it, so that one process writes the output")
                return lease, status
            if finished and not forced:
                return None, status
            if self._stopping:
                return None, None
            # Another launcher holds a live lease: wait for its outcome (or for its lease to expire),
            # holding none of this machine's cores meanwhile.
            if holder is not None and holder.epoch != told:
                told = holder.epoch
                self.echo(f"[keel] wait  {plan.name}: another launcher is running it ({holder.describe()})")
            self._give_core(plan.output_path)
            time.sleep(delay)
            delay = min(delay * 2, _MAX_WAIT_POLL_S)

    def _adopt_job(self, plan: StepPlan, lease: leases.Lease, forced: bool) -> None:
        """The launcher before this one ran the step in a cluster job that may still run (its lease
        names it): this one's first attempt adopts it, or, where the run starts the step from an
        empty output (--force, inputs made again), stops it first (`_stop_adopted_job`). A launcher
        with no cluster could do neither and would run the step beside it: the step fails naming
        the job, and the released lease names it for the next launcher."""
        from keel.executor.cluster import FORGET_JOB

        job = lease.adopts.id or lease.adopts.name
        if not self._on_cluster(plan.step):
            lease.release()
            raise StepFailed(plan.name, plan.output_path,
                             f"the launcher before this one ran the step in cluster job {job}, which may still run "
                             "and write the output, and this launcher has no cluster to take it over on: run with "
                             f"--cluster (or KEEL_CLUSTER); or, {FORGET_JOB}", _log_or_none(plan.output_path))
        what = ("is stopped before its output is emptied for this run" if forced or plan.remade_inputs else
                "is adopted while it still runs (else started again), so that one job writes the output")
        self.echo(f"[keel] take  {plan.name}: its cluster job {job} {what}")

    def _stop_adopted_job(self, plan: StepPlan, resolved, lease: leases.Lease) -> None:
        """Stop the cluster job the launcher before ran the step in (`_adopt_job`), before a run
        that starts from an empty output empties it: left running, it would write into the new run."""
        from keel.executor.cluster import stop_job

        job, lease.adopts = lease.adopts, None
        try:
            said = stop_job(self.cluster, self._cluster_request(plan.step, resolved, plan.output_path, job.name)[0],
                            expected_id=job.id)
        except Exception as exc:  # noqa: BLE001 - the lease, released, still names the job for the next launcher
            raise StepFailed(plan.name, plan.output_path, str(exc), _log_or_none(plan.output_path)) from None
        lease.runs_job(None)
        self.echo(f"[keel] take  {plan.name}: {said}")

    def _execute(self, plan: StepPlan) -> str:
        if plan.remade_inputs and self._inputs_unchanged(plan):
            self.echo(f"[keel] keep  {plan.name}: its inputs were made again with the content it read")
            return "reused"
        try:
            return self._claim_and_run(plan)
        except OSError as exc:  # keel's own records could not be written: a full disk, a quota
            error = _with_hint(f"keel could not record the step under its output: {type(exc).__name__}: {exc}")
            raise StepFailed(plan.name, plan.output_path, error, _log_or_none(plan.output_path)) from None

    def _claim_and_run(self, plan: StepPlan) -> str:
        """Claim and run the step; one whose lease another launcher took over meanwhile is then waited
        for like any step another launcher runs."""
        while True:
            lease, previous = self._claim(plan)
            if lease is None and previous is None:
                self.echo(f"[keel] stop  {plan.name}: no longer waiting for the launcher running it (it goes on)")
                return _NOT_STARTED
            if lease is None:
                self.echo(f"[keel] reuse {plan.name} (finished by another launcher)")
                return "reused"
            if self._in_own_process(plan.step):
                self._wait_for_core(plan)
            if self._stopping:  # interrupted while the step waited for a free thread, its lease or a core: it never starts
                lease.release()
                self.echo(f"[keel] stop  {plan.name}: not started, the run is interrupted")
                return _NOT_STARTED
            try:
                return self._run_claimed(plan, lease, previous)
            except LeaseLost as lost:
                self.echo(f"[keel] lost  {plan.name}: this launcher lost its lease to {lost.holder} while running: its "
                          "result is not recorded; the holder's run decides")
            finally:
                with self._lock:
                    self._active.pop(plan.output_path, None)
                self._release(plan, lease)

    def _release(self, plan: StepPlan, lease: leases.Lease) -> None:
        """Let the step's lease go. One that cannot be written (a full disk) expires by itself: that
        is said, and the step's own outcome stands (it was replaced by a failure to record it)."""
        try:
            lease.release()
        except OSError as exc:
            self.echo(f"[keel] warn  {plan.name}: its lease could not be released ({type(exc).__name__}: {exc}); "
                      f"another launcher can take the step over once it expires, within {self.lease_timeout:.0f} s")

    def _run_claimed(self, plan: StepPlan, lease: leases.Lease, previous: Status | None) -> str:
        step: Step = plan.step  # type: ignore[assignment]
        resolved = resolve_config(step.config, plan.output_path, self.graph.path)
        record = _step_record(self.graph, step, resolved, self._launch, self._secrets)
        starts_clean = plan.remade_inputs or bool(self.force and self.force.search(plan.name))
        if lease.adopts is not None and starts_clean:
            self._stop_adopted_job(plan, resolved, lease)
        if previous is not None and starts_clean:
            # --force (or an input made again) starts clean: no old checkpoint resumes, and no old run's lines lead its log
            storage.delete_contents(plan.output_path, keep=KEEL_DIR)
            for name in storage.list_names(storage.join(plan.output_path, KEEL_DIR)):
                if name.startswith("log.") and name.endswith(".txt"):
                    storage.delete_file(keel_path(plan.output_path, name))
        status = self._attempts(plan, step, resolved, record, previous, lease)
        self._index(self.graph.identities.content_hash(step), step, plan.output_path)
        warned = f", with {_count(len(status.warnings), 'warning')}: {status.warnings[0]}" if status.warnings else ""
        self.echo(f"[keel] done  {plan.name} in {status.duration:.2f}s{warned}")
        if status.warnings:
            with self._lock:
                self._warned[plan.output_path] = list(status.warnings)
        return "ran"

    def _attempts(self, plan: StepPlan, step: Step, resolved, record: dict, previous: Status | None, lease) -> Status:
        """Run the step until an attempt succeeds, is stopped on request, or its declared retries
        (`Step.retries`) are spent; each attempt is recorded, the last status lists the earlier ones."""
        earlier: list[dict] = []
        left = {"failure": step.retries.on_failure, "preemption": step.retries.on_preemption}
        while True:
            running = mark_running(plan.output_path, previous, record)
            with self._lock:
                self._active[plan.output_path] = (running, lease)
            how = f"attempt {running.attempt}, retrying" if earlier else plan.reason
            self.echo(f"[keel] start {plan.name} -> {plan.output_path}" + (f" ({how})" if how else ""))
            inputs = self._read_inputs(step)  # what the attempt reads: not what another launcher makes meanwhile
            beside = _Beside.before(plan.output_path, watched=self._watched(step))
            try:
                self._dispatch(step, resolved, plan.output_path, running.attempt, lease, retry=bool(earlier))
                if self._removed_keels_folder(plan.output_path, running, record, lease):
                    raise StepRemovedKeelsFolder(
                        f"the step removed {KEEL_DIR}/ from its output folder (keel's lease and record of the running "
                        "step: meanwhile another launcher could take the step over); a step that starts from an empty "
                        f"folder deletes what is in it but {KEEL_DIR}/, not the folder itself")
            except interrupt.StepInterrupted as exc:
                why = f"{exc}; `keel run` again resumes it" + (f" from {exc.resume}" if exc.resume else "")
                self._finish(plan.output_path, lease, running, error=why, interrupted=True, attempts=list(earlier))
                raise StepStopped(step.name, plan.output_path, why) from None
            except BaseException as exc:  # noqa: BLE001 - every failure is recorded, then retried or reported
                self._removed_keels_folder(plan.output_path, running, record, lease)  # so that the failure is recorded
                kind = "preemption" if isinstance(exc, StepPreempted) else "failure"
                error = str(exc) if isinstance(exc, (ChildStepError, StepPreempted)) else "".join(traceback.format_exception_only(type(exc), exc)).strip()
                error = _with_hint(error)
                previous = self._finish(plan.output_path, lease, running, error=error, attempts=list(earlier))
                earlier.append({"attempt": running.attempt, "state": kind, "error": error,
                                **({"warnings": previous.warnings} if previous.warnings else {})})
                if left[kind] > 0 and not self._stopping and getattr(exc, "may_run", None) is None:
                    left[kind] -= 1
                    self.echo(f"[keel] retry {plan.name}: attempt {running.attempt} ended by {kind} ({error.splitlines()[-1]}); "
                              f"{left[kind]} more {kind} retr{'y' if left[kind] == 1 else 'ies'} after this one")
                    continue
                # nothing declared, or the run is stopping (a stall kill cut its last checkpoint short): resume by hand
                if kind == "preemption" and (self._stopping or not step.retries.on_preemption):
                    why = f"{error}; `keel run` again resumes it"
                    self._finish(plan.output_path, lease, running, error=why, interrupted=True, attempts=earlier[:-1])
                    raise StepStopped(step.name, plan.output_path, why) from None
                if len(earlier) > 1:
                    error = f"failed after {len(earlier)} attempts: " + "; ".join(f"attempt {a['attempt']} ({a['state']}): {a['error'].splitlines()[-1]}" for a in earlier)
                    self._finish(plan.output_path, lease, running, error=error, attempts=earlier[:-1])
                raise StepFailed(step.name, plan.output_path, error, _log_or_none(plan.output_path)) from exc
            strays = beside.written(self._owned_names)
            if strays:
                error = (f"the step wrote {', '.join(strays)} beside its output folder, in {plan.output_path.rsplit('/', 1)[0]}: "
                         "a step writes only under config.output_path (those files were left where they are)")
                self._finish(plan.output_path, lease, running, error=error, attempts=earlier)
                raise StepFailed(step.name, plan.output_path, error, _log_or_none(plan.output_path))
            self._warn_of_inputs_made_again(step, plan.output_path, inputs)
            status = self._finish(plan.output_path, lease, running, no_outputs=step.no_outputs, attempts=earlier, code=code.fingerprint(step.fn),
                                  inputs=inputs)
            if status.state != SUCCESS:
                raise StepFailed(step.name, plan.output_path, status.error or "", _log_or_none(plan.output_path))
            return status

    @staticmethod
    def _removed_keels_folder(output_path: str, running: Status, record: dict, lease: leases.Lease) -> bool:
        """Whether the step removed keel's `.keel/` folder (its output folder deleted and made again,
        say); then the attempt's record and lease are written again, so that its failure is recorded
        (it was reported as a lease lost to another launcher, and left no record, so every rerun
        repeated it)."""
        if storage.exists(keel_path(output_path, RECORD)):
            return False
        storage.forget_made_folders()
        write_running_record(output_path, running, record)
        with contextlib.suppress(OSError):
            lease.heartbeat()
        return True

    def _read_inputs(self, step: Step) -> dict[str, str]:
        """The `output_digest` of each finished step it is made from (`Status.inputs`), by name."""
        read = {}
        for dep in step.keyed_deps:
            status = read_status(self.graph.path(dep)) if isinstance(dep, Step) else None
            if status is not None and status.state == SUCCESS:
                read[dep.name] = output_digest(status)
        return read

    def _warn_of_inputs_made_again(self, step: Step, output_path: str, read: dict[str, str]) -> None:
        """An input another launcher made again while the step ran, or is making again (`--force`):
        the step read the earlier one. Its status records the inputs as it started, so the next plan
        runs it again."""
        now = self._read_inputs(step)
        remade = sorted(name for name in read.keys() | now.keys() if read.get(name) != now.get(name))
        if remade:
            step_warnings.warn(f"{', '.join(remade)}: made again while it ran (by another launcher); it read the earlier "
                               "output, so the next `keel run` runs it again", output_path=output_path)

    def _inputs_unchanged(self, plan: StepPlan) -> bool:
        """Whether an output planned again because an input is made again read inputs with the
        content they have now (a deterministic step forced, a damaged output restored)."""
        recorded = plan.status.inputs if plan.status is not None else None
        return bool(recorded) and self._read_inputs(plan.step) == recorded

    @staticmethod
    def _finish(output_path: str, lease: leases.Lease, running: Status, **how) -> Status:
        """`mark_finished`, while the step is still this launcher's; else `LeaseLost`, recording nothing."""
        holder = _taken_over(output_path, lease, running)
        if holder is not None:
            raise LeaseLost(holder)
        return mark_finished(output_path, running, **how)

    @functools.cached_property
    def _owned_names(self) -> dict[str, set[str]]:
        """Folder -> the names the graph's steps own directly in it (their outputs, the folders above)."""
        owned: dict[str, set[str]] = {}
        for step in self.graph.steps():
            folder, _, name = self.graph.path(step).rpartition("/")
            while folder and folder.startswith(self.graph.prefix):
                owned.setdefault(folder, set()).add(name)
                folder, _, name = folder.rpartition("/")
        return owned

    def _watched(self, step: Step) -> bool:
        """Whether `writes.py` watches where the step writes: not on a cluster, nor when it declares no outputs."""
        return not step.no_outputs and not self._on_cluster(step)

    @staticmethod
    def _cluster_request(step: Step, resolved, output_path: str, job_name: str):
        """(the fray JobRequest running the step on the cluster as `job_name`, the heartbeat it writes)."""
        from fray.types import Entrypoint, JobRequest, create_environment

        env = _process_env(resolved, processes=step.resources.replicas)
        beat = keel_path(output_path, heartbeat.FILE) if step.progress_timeout_s else None  # on the shared store
        return JobRequest(
            name=job_name,
            entrypoint=Entrypoint.from_callable(run_step_job, args=(step.fn, resolved, output_path),
                                                kwargs={"heartbeat_at": beat}),
            resources=step.resources.to_fray(),
            environment=create_environment(env_vars=env) if env else None,
        ), beat

    def _dispatch(self, step: Step, resolved, output_path: str, attempt: int, lease: leases.Lease, retry: bool = False) -> None:
        from fray.types import Entrypoint, JobRequest

        job_name = cluster_job_name(step.name, output_path, attempt)
        if self._on_cluster(step):
            from keel.executor.cluster import ClusterJobStalled, ClusterJobSuperseded, run_on_cluster

            adopting, lease.adopts = lease.adopts, None  # a job taken over with the lease: adopted while it runs
            if adopting is not None:
                job_name = adopting.name
            request, beat = self._cluster_request(step, resolved, output_path, job_name)
            # named before submitting (a launcher taking the lease over then adopts the job), and no job is
            # submitted once the step is another launcher's: it would run beside that one's
            lease.runs_job(ClusterJob(job_name, adopting.id if adopting is not None else None))
            if lease.taken_over() is not None:
                raise ClusterJobSuperseded("another launcher took the step over before its cluster job was submitted")
            left = None  # what the lease names once this attempt is over: a job that may still run
            try:
                run_on_cluster(self.cluster, request, step.resources.describe(), beat, step.progress_timeout_s,
                               superseded=lambda: lease.superseded, handed_over=lease.handed_over,
                               adopts=adopting.id if adopting is not None else None,
                               submitted=lambda job_id: lease.runs_job(ClusterJob(job_name, job_id)))
            except BaseException as exc:
                if getattr(exc, "may_run", None) is not None:  # not retried: the next attempt would run beside it
                    left = ClusterJob(job_name, exc.may_run)  # this attempt's job, or the one it could not adopt
                elif isinstance(exc, ClusterJobStalled):
                    raise StepPreempted(str(exc)) from None
                raise
            finally:
                lease.runs_job(left)  # the next launcher, or this one's next attempt, is told of a job that may run
            return
        if step.isolated:  # never under memory:// (`_refuse_isolated_in_memory`)
            self._run_in_child(step, resolved, output_path, lease, retry)
            return
        with self._lock:
            if self.client is None:
                self.client = default_client(self.max_concurrent)
        # In the driver a step that prints nothing leaves no log file (one file fewer per step).
        entry = Entrypoint.from_callable(run_step_job, args=(step.fn, resolved, output_path),
                                         kwargs={"in_launcher": True, "watch": self._watched(step), "prefix": self.graph.prefix})
        self.client.submit(JobRequest(name=job_name, entrypoint=entry)).wait(raise_on_failure=True)

    def _run_in_child(self, step: Step, resolved, output_path: str, lease: leases.Lease, retry: bool) -> None:
        from keel.executor.child import collect, start_child

        env = _process_env(resolved, processes=1)
        if min(self._isolated_in_run, self.process_slots) > 1:  # several share this console: plain lines, no bars
            env = {**env, "KEEL_PROGRESS": "lines"}
        beat = _heartbeat_file(output_path) if step.progress_timeout_s else None
        if beat:
            env = {**env, heartbeat.ENV: beat}
        oom_kills_before = oom_kills()
        with self._lock:
            if self._stopping:
                raise interrupt.StepInterrupted("the run was interrupted before the step started")
            # A retry runs without an injected fault, or the fault would fire again at the same step
            # forever (as Levanter's supervisor does).
            process, workdir = start_child(step.fn, resolved, output_path, env, drop=_FAULT_ENV if retry else (),
                                           watch=self._watched(step), prefix=self.graph.prefix)
            self._children[process] = (workdir, log_url(output_path))
        try:
            lease.runs_in(process.pid)  # live while the step's process is, should this launcher die
            outcome = collect(process, workdir, beat, step.progress_timeout_s, log=log_url(output_path),
                              oom_kills_before=oom_kills_before)
        finally:
            with self._lock:
                self._children.pop(process, None)
            lease.runs_in(None)
            if beat and not storage.is_local(output_path):  # its file beside the launcher's temporary files
                with contextlib.suppress(OSError):
                    os.remove(beat)
        writes.wrote_beside(outcome.beside, storage.split(output_path)[1])
        if outcome.state == "interrupted" or (outcome.state == "killed" and self._stopping):
            raise interrupt.StepInterrupted(outcome.message, outcome.resume)
        if outcome.state in ("killed", "stalled"):
            raise StepPreempted(outcome.message)
        if outcome.state != "succeeded":
            raise ChildStepError(outcome.message)

    # ------------------------------------------------------------------ interruption
    def _catch_signals(self) -> Callable[[], None]:
        """Handle SIGINT/SIGTERM while the run lasts (main thread only); returns the restorer."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        return lambda: [signal.signal(sig, handler) for sig, handler in previous.items()]

    def _on_signal(self, signum, _frame) -> None:
        if self._stopping:
            if time.monotonic() - self._stopping_since < _SAME_CTRL_C_S:
                return  # one Ctrl-C seen twice: from the terminal and forwarded by a wrapper (`uv run`)
            self._abort()
        self._stopping, self._stopping_since = True, time.monotonic()
        interrupt.request()  # in-process steps that poll it stop too
        with self._lock:
            children, active = list(self._children), list(self._active)
        for process in children:
            _signal_quietly(process, signal.SIGINT)
        on_cluster = " (a cluster job is terminated: it resumes from its last checkpoint)" if self.cluster is not None else ""
        self.echo(f"[keel] {signal.Signals(signum).name}: stopping {len(active)} running step(s) at their next "
                  f"safe point (training steps checkpoint first){on_cluster}; starting nothing new. Press Ctrl-C again "
                  "to abort now.")

    def _abort(self) -> None:
        """The second signal: kill child processes (removing their folders, their staged logs uploaded)
        and cluster jobs, mark running steps INTERRUPTED, free their leases, exit. Exits whatever
        fails on the way (a full disk, the likely reason for pressing Ctrl-C twice): a step that could
        not be marked stays RUNNING, and the next run takes its lease over."""
        from keel.executor.child import abandon

        try:
            with self._lock:
                children, active = dict(self._children), dict(self._active)
            for process, (workdir, log) in children.items():
                abandon(process, workdir, log)
            terminated = set()
            if self.cluster is not None:
                from keel.executor.cluster import terminate_live_jobs

                terminated = terminate_live_jobs()
            for output_path, (running, lease) in active.items():
                try:
                    if terminated and lease.job is not None and lease.job.id in terminated:
                        lease.runs_job(None)  # the next launcher has no job to adopt (one not terminated stays named)
                    if _taken_over(output_path, lease, running) is None:
                        mark_finished(output_path, running, error="aborted by a second Ctrl-C; `keel run` again "
                                      "resumes it from its last checkpoint", interrupted=True)
                    lease.release()
                except Exception as exc:  # noqa: BLE001 - the others are marked all the same
                    print(f"keel: could not mark {output_path} interrupted ({type(exc).__name__}: {exc}); the next run "
                          "takes it over", file=sys.stderr, flush=True)
            names = ", ".join(p.rsplit("/", 1)[-1] for p in active) or "nothing"
            print(f"keel: aborted; interrupted: {names}. Run the same `keel run` again to resume.", file=sys.stderr, flush=True)
        finally:
            os._exit(interrupt.EXIT_INTERRUPTED)


def _forget_launcher_signals() -> None:
    """In a process a step forks (a multiprocessing pool's worker), Ctrl-C and SIGTERM act as they
    would in any process, not as the launcher's stop logic it inherited."""
    for sig, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
        if getattr(signal.getsignal(sig), "__func__", None) is Runner._on_signal:
            signal.signal(sig, default)


os.register_at_fork(after_in_child=_forget_launcher_signals)


def _log_or_none(output_path: str) -> str:
    """The step's log, or that it has none: a step that printed nothing leaves no log file."""
    url = log_url(output_path)
    return url if storage.exists(url) else f"{url} (no output)"


_FAULT_ENV = ("LEVANTER_FAULT_KIND", "LEVANTER_FAULT_STEP")
"""`levanter.recovery.faults`' fault-injection settings (named here: that module imports jax)."""

_DISK_FULL = ("No space left on device", "Disk quota exceeded")


def _with_hint(error: str) -> str:
    """The error, with what to do when it says the disk is full."""
    if any(text in error for text in _DISK_FULL):
        return error + "; the disk holding the outputs is full: free space there or pass another --prefix, then run again (finished steps stay cached)"
    return error


def _heartbeat_file(output_path: str) -> str:
    """`.keel/heartbeat` of a local output; beside the launcher's temporary files for a remote one
    (a heartbeat is read every second: an object store is no place for it), named by this launcher
    too: a launcher resumed after another took the step over removes its own file, not the other's
    live one (whose silence then counted from its start, and a healthy step was killed as stalled)."""
    if storage.is_local(output_path):
        beat = storage.split(keel_path(output_path, heartbeat.FILE))[1]
        os.makedirs(os.path.dirname(beat), exist_ok=True)
        return beat
    stem = os.path.join(tempfile.gettempdir(), f"keel-heartbeat-{output_path.rsplit('/', 1)[-1]}-{_whole_path_digest(output_path)}-")
    for left in glob.glob(glob.escape(stem) + "*"):  # a killed launcher's, which removed nothing
        pid = left[len(stem):]
        if pid.isdigit() and not leases.process_lives(int(pid)):
            with contextlib.suppress(OSError):
                os.remove(left)
    return f"{stem}{os.getpid()}"


def cluster_job_name(name: str, output_path: str, attempt: int) -> str:
    """One job per attempt (a retry's log is its own, never the previous attempt's lines too), named
    by the output it writes, prefix included: fray adopts a running job of the same name, so the same
    step run under two prefixes at once must never share one (the hash in an output's folder name
    does not depend on the prefix)."""
    return re.sub(r"[^a-zA-Z0-9_.-]", "-", f"{name}-{_whole_path_digest(output_path)}-attempt{attempt}")


def _whole_path_digest(output_path: str) -> str:
    """A short digest of the whole output path, prefix included (the hash in the folder's name is
    the config's, the same under every prefix)."""
    return hashlib.sha256(output_path.encode()).hexdigest()[:12]


def _process_env(resolved, processes: int) -> dict[str, str]:
    """What each of the step's `processes` needs in its environment, as its config declares."""
    return resolved.process_env(processes=processes) if isinstance(resolved, DeclaresDevices) else {}


class StepRemovedKeelsFolder(RuntimeError):
    """The step deleted keel's `.keel/` folder under its output (its output folder, removed and made again)."""


class LeaseLost(Exception):
    """Another launcher took the step over while this one ran it (this one was suspended past its lease's
    timeout): this launcher records nothing of its attempt. `holder` names the other launcher."""

    def __init__(self, holder: str):
        super().__init__(f"lost the step's lease to {holder}")
        self.holder = holder


def _taken_over(output_path: str, lease: leases.Lease, running: Status) -> str | None:
    """Who took the step over from this launcher (None while it has not): a newer lease, or, once that
    launcher let its lease go, a newer attempt in `step.json` than this launcher's `running` one."""
    holder = lease.taken_over()
    if holder is None:
        latest = read_status(output_path)
        if latest is None or (latest.attempt, latest.started) != (running.attempt, running.started):
            return "a launcher that has since let it go"
    return holder


class ChildStepError(RuntimeError):
    """The step's function raised in its child process; the message is the child's error line."""


class StepPreempted(RuntimeError):
    """The step's process was killed from outside, or stopped making progress and was killed."""


_OUTPUT_NAME = re.compile(r".+-[0-9a-f]{%d}" % HASH_CHARS)


_FS_CLOCK_LAG_NS = 20_000_000
"""File times come from the kernel's coarse clock, up to a tick (4-10 ms) behind `time.time_ns()`."""


@dataclasses.dataclass(frozen=True)
class _Beside:
    """The folder holding a step's output, as the step started: what the step wrote there instead of
    under its output (`{output_path}/../x`) shows up as a new entry that no step owns. Local folders
    only: two stats when nothing changed there, one listing when something did. Steps running
    beside each other in one folder see each other's entries: a `watched` step (`writes.py`) is
    blamed only for those its watch saw it write; another only for those no step was seen writing."""

    folder: str
    mtime_ns: int | None
    started_ns: int
    output: str
    watched: bool

    @classmethod
    def before(cls, output_path: str, watched: bool) -> "_Beside":
        output = storage.split(output_path)[1] if storage.is_local(output_path) else ""
        folder = output.rsplit("/", 1)[0]
        try:
            mtime = os.stat(folder).st_mtime_ns if folder else None
        except FileNotFoundError:
            mtime = 0
        return cls(folder, mtime, time.time_ns() - _FS_CLOCK_LAG_NS, output, watched)

    def written(self, owned: dict[str, set[str]]) -> list[str]:
        """Entries created in the folder since the start that no step owns and this step is blamed for
        (recorded as its own, so that no other step is). Another experiment's steps in the same prefix
        may add entries there at any time: an output (`NAME-HASH`), or the folder above outputs of
        nested names (`ladder` for `train/ladder/rung-HASH`)."""
        try:
            if self.mtime_ns is None or os.stat(self.folder).st_mtime_ns == self.mtime_ns:
                return []
        except FileNotFoundError:  # the folder is gone (deleted by hand meanwhile): nothing to say about it
            return []
        mine = owned.get(self.folder, set())
        found = []
        for entry in os.scandir(self.folder):
            if entry.name in mine or _OUTPUT_NAME.fullmatch(entry.name) or entry.name.startswith(".keel-probe-") or entry.name == KEEL_DIR:
                continue
            if entry.is_dir(follow_symlinks=False) and _holds_outputs(entry.path):
                continue
            writer = writes.writer_of(entry.path, self.started_ns)
            if writer != self.output and (self.watched or writer is not None):
                continue  # another step's, or nobody's its watch saw
            if entry.stat(follow_symlinks=False).st_ctime_ns >= self.started_ns:
                found.append(entry.name)
        writes.wrote_beside((os.path.join(self.folder, name) for name in found), self.output)
        return sorted(found)


def _holds_outputs(folder: str, depth: int = 4) -> bool:
    """Whether `folder` holds steps' outputs (`NAME-HASH` folders), directly or up to `depth` levels down."""
    try:
        entries = list(os.scandir(folder))
    except OSError:  # gone meanwhile, or not readable: not shown to hold any
        return False
    return any(e.is_dir(follow_symlinks=False) and (_OUTPUT_NAME.fullmatch(e.name) or (depth > 1 and _holds_outputs(e.path, depth - 1)))
               for e in entries)


def _signal_quietly(process, signum) -> None:
    try:
        process.send_signal(signum)
    except (ProcessLookupError, OSError):
        pass


def run_steps(steps, prefix: str, *, force: str | None = None, only: str | None = None, max_concurrent: int = 8,
              client=None, cluster=None, lease_timeout: float = leases.DEFAULT_TIMEOUT_S, echo: Callable[[str], None] = print) -> RunReport:
    """Run the graph behind `steps` under `prefix`; the report says what ran, was reused or failed."""
    graph = Graph(list(steps), prefix)
    runner = Runner(graph, client=client, cluster=cluster, max_concurrent=max_concurrent, force=re.compile(force) if force else None,
                    lease_timeout=lease_timeout, echo=echo)
    return runner.run(re.compile(only) if only else None)
