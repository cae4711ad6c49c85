"""What a step asks of the machine that runs it, never part of the step's identity; and what this
machine offers (`machine_cores`)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

CPU_QUOTA = "/sys/fs/cgroup/cpu.max"
"""A cgroup v2 container's CPU quota: `<quota> <period>` in microseconds, or `max <period>`."""


def machine_cores() -> int:
    """The cores this process may run on: how many steps the executor runs in processes of their own
    at once (`keel.executor.run`), and how many threads the tokenize step encodes on.

    A training or evaluation step keeps every core busy by itself in its compiles and its steps,
    so more of them at once only take turns on the same cores. The scaling-ladder tutorial's four
    rungs on 2 cores, started together, took 126-137 s of wall time and 234-253 CPU s; two at a
    time, 115-119 s and 207-217 CPU s; one at a time, 137 s and 217 CPU s. In a container whose CPU
    quota (cgroup v2 `cpu.max`) is less than the cores it sees, the quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        with open(CPU_QUOTA) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):  # no cgroup v2 quota here
        pass
    return cores


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
