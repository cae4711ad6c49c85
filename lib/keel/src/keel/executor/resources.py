"""What a step asks of the machine that runs it, never part of the step's identity; and what this
machine offers (`machine_cores`)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import NamedTuple

PROC_SELF = "/proc/self"
"""Where this process's cgroup (`cgroup`) and the mounted cgroup hierarchies (`mountinfo`) are read."""
PROC_VMSTAT = "/proc/vmstat"
"""The kernel's event counts for the whole machine, `oom_kill` among them (Linux 4.13 and later)."""


def machine_cores() -> int:
    """The cores this process may run on: how many steps the executor runs in processes of their own
    at once (`keel.executor.run`), and how many threads the tokenize step encodes on.

    A training or evaluation step keeps every core busy by itself in its compiles and its steps,
    so more of them at once only take turns on the same cores. The scaling-ladder tutorial's four
    rungs on 2 cores, started together, took 126-137 s of wall time and 234-253 CPU s; two at a
    time, 115-119 s and 207-217 CPU s; one at a time, 137 s and 217 CPU s. In a container whose CPU
    quota is less than the cores it sees (a Kubernetes CPU limit, `docker --cpus`), the quota,
    rounded up (`cpu_quota`)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cpu_quota()
    return cores if quota is None else min(cores, max(1, math.ceil(quota)))


def cpu_quota() -> float | None:
    """The least CPU quota, in cores, of this process's cgroup and its ancestors (a limit set on a
    parent binds its children), in cgroup v2 (`cpu.max`: `<quota> <period>` or `max <period>`) or
    v1 (`cpu.cfs_quota_us`, -1 for none, over `cpu.cfs_period_us`); None where none is set or the
    cgroups cannot be read (not Linux)."""
    quotas = []
    for directory, mountpoint, version in _cgroups("cpu"):
        while True:
            try:
                if version == 2:
                    with open(os.path.join(directory, "cpu.max")) as f:
                        quota, period = f.read().split()[:2]
                else:
                    with open(os.path.join(directory, "cpu.cfs_quota_us")) as f:
                        quota = f.read().strip()
                    with open(os.path.join(directory, "cpu.cfs_period_us")) as f:
                        period = f.read().strip()
                if quota not in ("max", "-1") and int(period) > 0:
                    quotas.append(int(quota) / int(period))
            except (OSError, ValueError):  # no limit file here (a hierarchy's root has none)
                pass
            if directory == mountpoint or not directory.startswith(mountpoint):
                break
            directory = os.path.dirname(directory)
    return min(quotas) if quotas else None


class OomKills(NamedTuple):
    """A count of the kernel's out-of-memory kills, and whether it is the whole machine's."""

    count: int
    whole_machine: bool


def oom_kills() -> OomKills | None:
    """How many processes the kernel's out-of-memory killer has killed in this process's memory
    cgroup (and the cgroups below it, where its steps' processes run): cgroup v2's `memory.events`
    or v1's `memory.oom_control`, else the whole machine's count (`/proc/vmstat`, where another
    process's kill counts too); None where none can be read. A step's process killed with SIGKILL
    while it rose was killed for its memory."""
    counts = []
    for directory, _, version in _cgroups("memory"):
        try:
            with open(os.path.join(directory, "memory.events" if version == 2 else "memory.oom_control")) as f:
                counts += [int(line.split()[1]) for line in f if line.startswith("oom_kill ")]
        except (OSError, ValueError, IndexError):  # a v2 hierarchy without the memory controller
            pass
    if counts:
        return OomKills(sum(counts), whole_machine=False)
    try:
        with open(PROC_VMSTAT) as f:
            count = next((int(line.split()[1]) for line in f if line.startswith("oom_kill ")), None)
    except (OSError, ValueError, IndexError):
        return None
    return None if count is None else OomKills(count, whole_machine=True)


def _cgroups(controller: str) -> list[tuple[str, str, int]]:
    """(this process's cgroup directory, its hierarchy's mount point, cgroup version) for each
    mounted hierarchy that may hold `controller` ("cpu", "memory"): the unified (v2) one and a v1
    one holding it; a hybrid host has both. A container sees its own cgroup as its hierarchy's
    root (mountinfo's root field), so the path below that root is what names its directory."""
    try:
        with open(os.path.join(PROC_SELF, "cgroup")) as f:
            paths = {}  # controller ("" for v2) -> the process's cgroup path
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for name in controllers.split(",") if controllers else [""]:
                    paths[name] = path
        with open(os.path.join(PROC_SELF, "mountinfo")) as f:
            mounts = f.read().splitlines()
    except (OSError, ValueError):
        return []
    found = []
    for line in mounts:
        fields, _, after = line.partition(" - ")
        fields, after = fields.split(), after.split()
        if len(fields) < 5 or len(after) < 3:
            continue
        root, mountpoint, fstype, options = fields[3], fields[4], after[0], after[2].split(",")
        if fstype == "cgroup2" and "" in paths:
            path, version = paths[""], 2
        elif fstype == "cgroup" and controller in options and controller in paths:
            path, version = paths[controller], 1
        else:
            continue
        below = os.path.relpath(path, root) if path == root or path.startswith(root.rstrip("/") + "/") else "."
        found.append((os.path.normpath(os.path.join(mountpoint, below)), mountpoint, version))
    return found


@dataclass(frozen=True)
class Resources:
    """Plain description of a step's hardware, turned into a fray `ResourceConfig` at dispatch.

    Kept free of fray imports so that declaring and planning stay instant.
    """

    cpu: int = 1
    memory: str | None = None
    gpu_type: str | None = None
    gpu_count: int = 0
    tpu_type: str | None = None
    tpu_slices: int = 0
    replicas: int = 1

    @staticmethod
    def with_cpu(cpu: int = 1, memory: str | None = None) -> "Resources":
        return Resources(cpu=cpu, memory=memory)

    @staticmethod
    def with_gpu(gpu_type: str, count: int = 1, *, replicas: int = 1, cpu: int = 1) -> "Resources":
        return Resources(cpu=cpu, gpu_type=gpu_type, gpu_count=count, replicas=replicas)

    @staticmethod
    def with_tpu(tpu_type: str, *, slices: int = 1) -> "Resources":
        return Resources(tpu_type=tpu_type, tpu_slices=slices)

    def describe(self) -> str:
        if self.tpu_type:
            return f"tpu {self.tpu_type} x{self.tpu_slices}"
        parts = [f"cpu {self.cpu}"]
        if self.gpu_type:
            parts.append(f"gpu {self.gpu_type} x{self.gpu_count}")
        if self.replicas > 1:
            parts.append(f"replicas {self.replicas}")
        return ", ".join(parts)

    def to_fray(self):
        from fray.types import ResourceConfig

        if self.tpu_type:
            return ResourceConfig.with_tpu(self.tpu_type, slice_count=self.tpu_slices)
        extra = {"replicas": self.replicas} if self.replicas > 1 else {}
        if self.memory:
            extra["ram"] = self.memory
        if self.gpu_type:
            return ResourceConfig.with_gpu(self.gpu_type, count=self.gpu_count, cpu=self.cpu, **extra)
        return ResourceConfig.with_cpu(cpu=self.cpu, **extra)
