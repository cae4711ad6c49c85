"""An in-process Iris cluster for tests, on 127.0.0.1 only (see fixtures/iris_local.yaml), and a
fray client of it whose jobs see this repository.

The cluster writes credentials under HOME and scratch under TMPDIR, so both point into a scratch
folder while it is up; the tests' own ledgers stay in pytest's temp folder, which is then no longer
the temp dir, so steps may write there (KEEL_WRITABLE, see keel.executor.writes). It is always stopped: a process that exits with the cluster up hangs.
"""

import contextlib
import os
import socket
import tempfile
from pathlib import Path

CONFIG = Path(__file__).parent / "fixtures" / "iris_local.yaml"


@contextlib.contextmanager
def local_iris_cluster(scratch: Path):
    """Start the cluster; yield its controller URL; stop it and restore HOME and TMPDIR."""
    saved = {key: os.environ.get(key) for key in ("HOME", "TMPDIR", "KEEL_WRITABLE")}
    for key in ("HOME", "TMPDIR"):
        (scratch / key.lower()).mkdir(parents=True, exist_ok=True)
        os.environ[key] = str(scratch / key.lower())
    os.environ["KEEL_WRITABLE"] = str(scratch.parent)
    tempfile.tempdir = None  # tempfile caches its folder: make it read TMPDIR again
    from iris.cluster.config import load_config, make_local_config
    from iris.cluster.local_cluster import LocalCluster

    cluster = LocalCluster(make_local_config(load_config(CONFIG)))
    try:
        yield cluster.start()
    finally:
        cluster.close()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        tempfile.tempdir = None


@contextlib.contextmanager
def local_iris_client(scratch: Path):
    """(controller URL, fray client) of a local cluster whose jobs run this repository's code."""
    from keel.executor.cluster import cluster_client, workspace_root

    with local_iris_cluster(scratch) as url:
        client = cluster_client(url, workspace=workspace_root(Path(__file__).parent))
        try:
            yield url, client
        finally:
            client.shutdown(wait=False)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a coordinator the replicas meet at)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
