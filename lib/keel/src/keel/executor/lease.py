"""Leases: at most one launcher runs a step at a time, and a dead launcher's lease is taken over.

A lease is a numbered file `.keel/lease-<epoch>` holding its owner and a heartbeat time. Taking a
lease means creating the next epoch's file with an exclusive create, which exactly one contender
wins on local disks, in-memory stores and object stores with conditional writes. The holder
refreshes its heartbeat from a background thread; a lease whose heartbeat is older than the timeout
belongs to a dead launcher and may be superseded by the next epoch; so does one whose owner ran on
this host under a pid that no longer exists (no need to wait out the timeout). A step that runs in
a process of its own (`child.py`) has that pid recorded too (`Lease.runs_in`): the lease stays live
while either process exists, so a launcher killed with -9 is not taken over while its step's process
still writes the output. Each lease records its own timeout, so every reader judges expiry the same
way. Release marks the holder's own epoch file released (never a newer one, so a slow holder that
was superseded cannot free its successor's lease) rather than deleting it: epochs only ever rise, so
two launchers can never both hold a lease, one numbered after an expired lease and one numbered 0
after that lease's release emptied the folder. The next lease deletes the released one it follows,
so one file at most stays behind. A holder that was suspended (SIGSTOP, a paused VM)
past the timeout may have been superseded: its heartbeat stops renewing once a newer epoch exists,
and `Lease.taken_over` tells the launcher, before it records anything, that the step is no longer
its own. Its isolated step's process, in a session of its own, is not stopped with it: the launcher
taking the lease over on the same host kills it first (`LeaseInfo.stray_step_process`), so two
processes never write one output. A step on a cluster has its job recorded (`Lease.runs_job`): the
launcher taking the lease over adopts that job by submitting under its name (or stops it first, for
a run that starts from an empty output), and a released lease keeps naming a job that may still run
(its launcher gave the step up: refused, interrupted) for the next launcher.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from keel.executor import storage
from keel.executor.status import KEEL_DIR

TIMEOUT_ENV = "KEEL_LEASE_TIMEOUT"
UNSET_TIMEOUT_S = 60.0
SHORTEST_TIMEOUT_S = 1.0
"""A lease lasts at least this long: its holder renews it every quarter of its timeout, and a
shorter one expires between two renewals of a launcher busy starting a step."""


def timeout_problem(text: str | None) -> str | None:
    """What is wrong with `KEEL_LEASE_TIMEOUT`'s value (None: nothing, or it is not set)."""
    if text is None:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not seconds >= SHORTEST_TIMEOUT_S or math.isinf(seconds):
        return (f"{TIMEOUT_ENV}={text!r}: give the seconds a silent launcher keeps its steps' leases, a number of at "
                f"least {SHORTEST_TIMEOUT_S:g} (the default is {UNSET_TIMEOUT_S:g}), or unset it")
    return None


_ENV_TIMEOUT = os.environ.get(TIMEOUT_ENV)
DEFAULT_TIMEOUT_S = UNSET_TIMEOUT_S if _ENV_TIMEOUT is None or timeout_problem(_ENV_TIMEOUT) else float(_ENV_TIMEOUT)
"""The lease timeout of this process's runs: `KEEL_LEASE_TIMEOUT` when it is valid; `keel` refuses
an invalid one before anything runs (`timeout_problem`), and so does `Runner`."""
_PREFIX = "lease-"
EMPTY_LEASE_S = 10.0
"""How long an empty lease file counts as one being written: past that, its writer died between
creating and writing it (a crash), and the lease is taken over."""


CHILD_FOLDER_PREFIX = "keel-step-"
"""How the folder of an isolated step's process is named (`child.start_child`)."""


@dataclass(frozen=True)
class StrayStep:
    """A superseded lease's step process, still running: its pid and its folder (payload, result
    and the step's temporary directory), which its stopped launcher would have removed."""
    pid: int
    workdir: str


@dataclass(frozen=True)
class ClusterJob:
    """The cluster job a step runs in: the name it was submitted under, which a launcher taking the
    lease over submits under too, so that the cluster hands it the job while it runs (and starts it
    again once it has ended), and the id the cluster gave it (None until submitted). The id holds
    the user and parent job, under which the same name is another job."""
    name: str
    id: str | None = None

    def record(self) -> dict:
        return {"name": self.name, **({"id": self.id} if self.id else {})}

    @staticmethod
    def read(record) -> "ClusterJob | None":
        if not isinstance(record, dict) or not isinstance(record.get("name"), str) or not record["name"]:
            return None
        job_id = record.get("id")
        return ClusterJob(record["name"], job_id if isinstance(job_id, str) and job_id else None)


@dataclass(frozen=True)
class LeaseInfo:
    epoch: int
    owner: str
    heartbeat: float
    timeout: float
    child: int | None = None
    """The pid of the process the step runs in, when not the owner's (an isolated step's)."""
    job: ClusterJob | None = None
    """The cluster job the step runs in, on a cluster, which a launcher taking the lease over adopts."""

    @property
    def host(self) -> str:
        return self.owner.split(":", 1)[0]

    @property
    def pid(self) -> int | None:
        parts = self.owner.split(":")
        return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None

    def age(self, now: float | None = None) -> float:
        """Seconds since the holder's last heartbeat."""
        return max(0.0, (now or time.time()) - self.heartbeat)

    @property
    def who(self) -> str:
        return f"host {self.host}, pid {self.pid}" if self.pid is not None else f"owner {self.owner}"

    def owner_gone(self) -> bool:
        """The owner ran on this host and neither its process nor its step's process exists."""
        if self.host != socket.gethostname() or self.pid is None or self.pid == os.getpid():
            return False
        return not _exists(self.pid) and (self.child is None or not _exists(self.child))

    def stray_step_process(self) -> StrayStep | None:
        """This (expired) lease's isolated step process when it still runs on this host: its
        launcher is stopped (Ctrl-Z, SIGSTOP) or stuck past the timeout while the step, in a session
        of its own, goes on writing the output. None otherwise, or where the pid now names another
        process: the step's process is `python -m keel.executor.child WORKDIR LAUNCHER_PID`, and its
        launcher is this lease's owner."""
        if self.child is None or self.pid is None or self.host != socket.gethostname():
            return None
        try:
            with open(f"/proc/{self.child}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            return None
        argv = [a for a in argv if a]
        ours = (b"keel.executor.child" in argv and len(argv) >= 2 and argv[-1] == str(self.pid).encode()
                and os.path.basename(argv[-2]).startswith(CHILD_FOLDER_PREFIX.encode()))
        return StrayStep(self.child, os.fsdecode(argv[-2])) if ours else None  # a zombie's cmdline is empty: not ours

    def is_live(self, now: float | None = None) -> bool:
        return self.age(now) < self.timeout and not self.owner_gone()

    def describe(self, now: float | None = None) -> str:
        """Whose lease it is, how old its heartbeat is, and when it may be taken over."""
        age = self.age(now)
        if self.owner_gone():
            return f"{self.who} (that process is gone; taking over now)"
        left = self.timeout - age
        when = f"takeover in {left:.0f}s unless it heartbeats" if left > 0 else "expired; taking over now"
        step = f", its step in pid {self.child}" if self.child is not None else ""
        return f"{self.who}{step}, last heartbeat {age:.0f}s ago ({when})"


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _stat(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command's name: state, ppid, pgrp, ... (OSError or
    IndexError where there is none to read)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def process_lives(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (dead, not yet reaped by its parent)."""
    try:
        return _stat(pid)[0] != "Z"
    except (OSError, IndexError):
        return _exists(pid)


def group_lives(group: int) -> bool:
    """Whether a process of process group `group` lives: not a zombie, which `kill` counts too (an
    orphan waits for init to reap it)."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    try:
        pids = [name for name in os.listdir("/proc") if name.isdigit()]
    except OSError:  # no /proc: what kill says
        return True
    for pid in pids:
        try:
            state, _, pgrp = _stat(pid)[:3]
        except (OSError, IndexError, ValueError):
            continue
        if int(pgrp) == group and state != "Z":
            return True
    return False


def stop_stray_step_process(pid: int, wait_s: float = 10.0) -> bool:
    """Kill the process group of a superseded lease's step process (it leads its own session) and
    wait, at most `wait_s`, until none of its processes lives (a writer it started too, not only
    the step's own process); whether none does."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process: not this launcher's to stop
        return False
    deadline = time.monotonic() + wait_s
    while group_lives(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not group_lives(pid)


def _created(url: str) -> float:
    """When the file at `url` was last written (now, where the storage does not say)."""
    fs, path = storage.split(url)
    try:
        return fs.modified(path).timestamp()
    except (OSError, NotImplementedError, ValueError, AttributeError):
        return time.time()


def _lease_url(output_path: str, epoch: int) -> str:
    return storage.join(output_path, KEEL_DIR, f"{_PREFIX}{epoch:08d}")


def _latest_epoch(output_path: str) -> int | None:
    epochs = [int(n[len(_PREFIX):]) for n in storage.list_names(storage.join(output_path, KEEL_DIR)) if n.startswith(_PREFIX) and n[len(_PREFIX):].isdigit()]
    return max(epochs, default=None)


def current_lease(output_path: str) -> LeaseInfo | None:
    """The newest lease on the output, None when there is none or it was released."""
    epoch = _latest_epoch(output_path)
    return None if epoch is None else _read(output_path, epoch)


def _read(output_path: str, epoch: int) -> LeaseInfo | None:
    text = storage.read_text(_lease_url(output_path, epoch))
    if not text:  # being written right now (created, still empty, or gone): fresh, for a moment
        return LeaseInfo(epoch, "?", _created(_lease_url(output_path, epoch)), EMPTY_LEASE_S)
    try:
        record = json.loads(text)
        if record.get("released") is True:
            return None
        child, job = record.get("child"), record.get("job")
        return LeaseInfo(epoch, str(record["owner"]), float(record["heartbeat"]), float(record["timeout"]),
                         child if isinstance(child, int) and not isinstance(child, bool) else None,
                         ClusterJob.read(job))
    except (ValueError, KeyError, TypeError, AttributeError):  # not a lease keel wrote (torn, or edited): expired, so taken over
        return LeaseInfo(epoch, f"unreadable lease {_lease_url(output_path, epoch)}", 0.0, 0.0)


def _released_job(output_path: str, epoch: int | None) -> ClusterJob | None:
    """The cluster job a released lease left running (its launcher gave the step up before the job
    ended: refused, stopped), else None."""
    if epoch is None:
        return None
    try:
        return ClusterJob.read(json.loads(storage.read_text(_lease_url(output_path, epoch)) or "{}").get("job"))
    except (ValueError, AttributeError):
        return None


class Lease:
    """A lease this process holds on one output path."""

    def __init__(self, output_path: str, epoch: int, owner: str, timeout: float):
        self.output_path = output_path
        self.epoch = epoch
        self.owner = owner
        self.timeout = timeout
        self._lock = threading.Lock()
        self._released = False
        self._superseded = False
        self._child: int | None = None
        self._job: ClusterJob | None = None
        self.adopts: ClusterJob | None = None
        """The cluster job of the expired or released lease this one follows (`LeaseInfo.job`),
        which this launcher's first cluster attempt submits under."""

    def heartbeat(self) -> None:
        """Renew the lease, unless a newer epoch superseded it (this holder was suspended past its
        timeout): then never again, even once that epoch is released."""
        with self._lock:
            if self._released or self._superseded:
                return
            if (_latest_epoch(self.output_path) or 0) > self.epoch:
                self._superseded = True
                _HEARTBEATS.discard(self)
                return
            record = {"owner": self.owner, "heartbeat": time.time(), "timeout": self.timeout,
                      **({"child": self._child} if self._child is not None else {}),
                      **({"job": self._job.record()} if self._job is not None else {})}
            storage.write_atomic(_lease_url(self.output_path, self.epoch), json.dumps(record))

    def runs_in(self, child: int | None) -> None:
        """Record that the step now runs in process `child` too (None: no longer), so the lease
        stays live while that process exists; a write that fails is made by the next heartbeat."""
        self._child = child
        with contextlib.suppress(OSError):
            self.heartbeat()

    def runs_job(self, job: ClusterJob | None) -> None:
        """Record that the step now runs in cluster job `job` (None: no longer), for a launcher that
        takes the lease over to adopt (`LeaseInfo.job`); a write that fails is made by the next
        heartbeat. A release keeps it, for the next launcher."""
        self._job = job
        with contextlib.suppress(OSError):
            self.heartbeat()

    @property
    def job(self) -> ClusterJob | None:
        """The cluster job this lease names (`runs_job`)."""
        return self._job

    def handed_over(self, job_id: str) -> bool:
        """Whether a launcher that took this lease over runs the step in cluster job `job_id` too (it
        adopted it): the job is then its, not this superseded launcher's to stop. Read from the
        store, not from what this one's heartbeat last saw."""
        current = current_lease(self.output_path)
        return (current is not None and current.epoch > self.epoch and current.job is not None
                and current.job.id == job_id)

    @property
    def superseded(self) -> bool:
        """Whether a heartbeat found a newer epoch: what the last one saw, without reading the store
        (`taken_over` reads it)."""
        return self._superseded

    def taken_over(self) -> str | None:
        """Who holds the step's lease now, when it is no longer this one (None while it is): a
        holder that was suspended past its timeout may have been superseded meanwhile."""
        current = current_lease(self.output_path)
        mine = current is not None and (current.epoch, current.owner) == (self.epoch, self.owner)
        if mine and not self._superseded:
            return None
        self._superseded = True
        return current.who if current is not None and not mine else "a launcher that has since let it go"

    def release(self) -> None:
        _HEARTBEATS.discard(self)
        with self._lock:
            self._released = True
            url = _lease_url(self.output_path, self.epoch)
            if (_latest_epoch(self.output_path) or 0) > self.epoch:  # superseded: the newer epoch numbers on
                storage.delete_file(url)
            else:  # a job that may still run is named for the next launcher to adopt
                storage.write_atomic(url, json.dumps({"owner": self.owner, "released": True,
                                                      **({"job": self._job.record()} if self._job else {})}))


def try_acquire(output_path: str, timeout: float = DEFAULT_TIMEOUT_S) -> tuple[Lease | None, LeaseInfo | None]:
    """Take the lease unless another live launcher holds it; returns (lease, holder): the live
    holder when refused, the expired lease it superseded (or None) when taken.

    `timeout` is how long this lease stays valid without a heartbeat if this process dies.
    """
    latest = _latest_epoch(output_path)
    current = None if latest is None else _read(output_path, latest)
    if current is not None and current.is_live():
        return None, current
    epoch = 0 if latest is None else latest + 1
    owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
    lease = Lease(output_path, epoch, owner, timeout)
    adopted = current.job if current is not None else _released_job(output_path, latest)
    lease._job = lease.adopts = adopted  # named from the start: its old launcher leaves it be
    record = json.dumps({"owner": owner, "heartbeat": time.time(), "timeout": timeout,
                         **({"job": adopted.record()} if adopted else {})})
    if not storage.create_exclusive(_lease_url(output_path, epoch), record):
        return None, current_lease(output_path)
    # Epoch files are deleted only once a newer one exists (below; `release`). So an epoch created
    # after its file was deleted, by a launcher whose listing was that old, has a newer one beside it:
    # the holder of that one has the step, and this epoch goes.
    if (_latest_epoch(output_path) or 0) > epoch:
        storage.delete_file(_lease_url(output_path, epoch))
        return None, current_lease(output_path)
    if latest is not None and current is None:  # the released lease this one follows: no longer needed to number on
        storage.delete_file(_lease_url(output_path, latest))
    _HEARTBEATS.add(lease, timeout)
    return lease, current


class _Heartbeats:
    """One daemon thread refreshing every lease this process holds, a few times per timeout."""

    def __init__(self) -> None:
        self._leases: dict[int, Lease] = {}
        self._lock = threading.Lock()
        self._interval = DEFAULT_TIMEOUT_S / 4
        self._shortened = threading.Event()  # wakes the loop's wait when a shorter lease joins
        self._thread: threading.Thread | None = None

    def add(self, lease: Lease, timeout: float) -> None:
        with self._lock:
            self._leases[id(lease)] = lease
            if timeout / 4 < self._interval:
                self._interval = timeout / 4
                self._shortened.set()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="keel-lease-heartbeat", daemon=True)
                self._thread.start()

    def discard(self, lease: Lease) -> None:
        with self._lock:
            self._leases.pop(id(lease), None)

    def _loop(self) -> None:
        while True:
            self._shortened.wait(self._interval)
            self._shortened.clear()
            with self._lock:
                leases = list(self._leases.values())
            for lease in leases:
                try:
                    lease.heartbeat()
                except Exception:  # a failed heartbeat is retried next round; expiry is the backstop
                    pass


_HEARTBEATS = _Heartbeats()
