"""One step's function running on every replica of a multi-task cluster job (several hosts of a
TPU slice, several GPU hosts): which replica this is, joining the replicas into one
`jax.distributed` world, and waiting for all of them before keel records the outputs.

Outside a multi-task Iris job every replica is 0 and joining is a no-op, so a step function can
call these unconditionally. Iris and jax are imported only inside a multi-task job.
"""

from __future__ import annotations

import os
import sys


def replica_count() -> int:
    return int(os.environ.get("IRIS_NUM_TASKS", "1"))


def replica_index() -> int:
    """This process's task index within a multi-task Iris job; 0 everywhere else."""
    if replica_count() <= 1:
        return 0
    from iris.cluster.client.job_info import get_job_info

    info = get_job_info()
    return info.task_index if info is not None else 0


def join_replicas(coordinator: str | None = None) -> None:
    """Make the replicas of this job the processes of one `jax.distributed` world. Call it first
    thing in a multi-host step, before jax is asked for devices.

    By default replica 0 publishes its advertised address through Iris and the others look it up.
    `coordinator` ("host:port") pins the meeting point instead, e.g. "127.0.0.1:<port>" when every
    replica runs on one machine; replica 0 then serves it on exactly that address.
    """
    if replica_count() <= 1:
        return
    if coordinator is None:
        from iris.jax.init import initialize_jax

        initialize_jax()
        return
    import jax

    jax.distributed.initialize(coordinator, replica_count(), replica_index(), coordinator_bind_address=coordinator)


def wait_for_replicas(label: str) -> None:
    """When the replicas joined through jax.distributed, block until every one has got here."""
    jax = sys.modules.get("jax")
    if jax is None or not jax.distributed.is_initialized():
        return
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(label)
