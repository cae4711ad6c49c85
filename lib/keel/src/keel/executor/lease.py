"""Leases: at most one launcher runs a step at a time, and a dead launcher's lease is taken over.

A lease is a numbered file `.keel/lease-<epoch>` holding its owner and a heartbeat time. Taking a
lease means creating the next epoch's file with an exclusive create, which exactly one contender
wins on local disks, in-memory stores and object stores with conditional writes. The holder
refreshes its heartbeat from a background thread; a lease whose heartbeat is older than the timeout
belongs to a dead launcher and may be superseded by the next epoch. Each lease records its own
timeout, so every reader judges expiry the same way. Release deletes the holder's own epoch file
(never a newer one, so a slow holder that was superseded cannot free its successor's lease).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from keel.executor import storage
from keel.executor.status import KEEL_DIR

DEFAULT_TIMEOUT_S = float(os.environ.get("KEEL_LEASE_TIMEOUT", "60"))
_PREFIX = "lease-"


@dataclass(frozen=True)
class LeaseInfo:
    epoch: int
    owner: str
    heartbeat: float
    timeout: float

    def is_live(self, now: float | None = None) -> bool:
        return ((now or time.time()) - self.heartbeat) < self.timeout


def _lease_url(output_path: str, epoch: int) -> str:
    return storage.join(output_path, KEEL_DIR, f"{_PREFIX}{epoch:08d}")


def current_lease(output_path: str) -> LeaseInfo | None:
    epochs = [int(n[len(_PREFIX):]) for n in storage.list_names(storage.join(output_path, KEEL_DIR)) if n.startswith(_PREFIX) and n[len(_PREFIX):].isdigit()]
    if not epochs:
        return None
    epoch = max(epochs)
    text = storage.read_text(_lease_url(output_path, epoch))
    if not text:  # being written right now (created, still empty, or gone): treat as fresh
        return LeaseInfo(epoch, "?", time.time(), DEFAULT_TIMEOUT_S)
    record = json.loads(text)
    return LeaseInfo(epoch, record["owner"], record["heartbeat"], record["timeout"])


class Lease:
    """A lease this process holds on one output path."""

    def __init__(self, output_path: str, epoch: int, owner: str, timeout: float):
        self.output_path = output_path
        self.epoch = epoch
        self.owner = owner
        self.timeout = timeout
        self._lock = threading.Lock()
        self._released = False

    def heartbeat(self) -> None:
        with self._lock:
            if not self._released:
                record = {"owner": self.owner, "heartbeat": time.time(), "timeout": self.timeout}
                storage.write_atomic(_lease_url(self.output_path, self.epoch), json.dumps(record))

    def release(self) -> None:
        _HEARTBEATS.discard(self)
        with self._lock:
            self._released = True
            storage.delete_file(_lease_url(self.output_path, self.epoch))


def try_acquire(output_path: str, timeout: float = DEFAULT_TIMEOUT_S) -> tuple[Lease | None, LeaseInfo | None]:
    """Take the lease unless another live launcher holds it; returns (lease, holder-if-any).

    `timeout` is how long this lease stays valid without a heartbeat if this process dies.
    """
    current = current_lease(output_path)
    if current is not None and current.is_live():
        return None, current
    epoch = 0 if current is None else current.epoch + 1
    owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
    lease = Lease(output_path, epoch, owner, timeout)
    record = json.dumps({"owner": owner, "heartbeat": time.time(), "timeout": timeout})
    if not storage.create_exclusive(_lease_url(output_path, epoch), record):
        return None, current_lease(output_path)
    _HEARTBEATS.add(lease, timeout)
    return lease, None


class _Heartbeats:
    """One daemon thread refreshing every lease this process holds, a few times per timeout."""

    def __init__(self) -> None:
        self._leases: dict[int, Lease] = {}
        self._lock = threading.Lock()
        self._interval = DEFAULT_TIMEOUT_S / 4
        self._thread: threading.Thread | None = None

    def add(self, lease: Lease, timeout: float) -> None:
        with self._lock:
            self._leases[id(lease)] = lease
            self._interval = min(self._interval, timeout / 4)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="keel-lease-heartbeat", daemon=True)
                self._thread.start()

    def discard(self, lease: Lease) -> None:
        with self._lock:
            self._leases.pop(id(lease), None)

    def _loop(self) -> None:
        while True:
            time.sleep(self._interval)
            with self._lock:
                leases = list(self._leases.values())
            for lease in leases:
                try:
                    lease.heartbeat()
                except Exception:  # a failed heartbeat is retried next round; expiry is the backstop
                    pass


_HEARTBEATS = _Heartbeats()
