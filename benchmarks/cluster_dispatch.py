"""Per-step dispatch overhead: a local Iris cluster against the in-process client.

The DAG is the executor benchmark's layered DAG of trivial steps (`executor_overhead.layered_dag`:
each step of layer d reads two parents of layer d-1). Baseline in the same run: the same DAG run
cold by keel with fray's in-process `LocalClient`. Then the same DAG, each step declaring
`Resources(cpu=1)`, run cold by keel with a cluster (`run_steps(cluster=...)`, what `keel run
--cluster URL` does): every step is a job on an in-process Iris cluster on 127.0.0.1
(tests/fixtures/iris_local.yaml), a fresh Python process, waited on by keel's own state poll. Both use the same concurrency (`--max-concurrent`), so
the per-step figure is throughput; a 1-wide chain (`--chain`, default 5 steps) run on both also
gives the latency of one step, start to finish, when nothing overlaps it.

    uv run python benchmarks/cluster_dispatch.py [--width 20 --depth 10 --max-concurrent 8]

The default is the executor benchmark's 200 steps; a smaller DAG (e.g. --width 8 --depth 3) gives
the per-step figure in well under a minute.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import cloudpickle

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the local cluster harness the tests use

import executor_overhead  # noqa: E402
from iris_local import local_iris_cluster  # noqa: E402

from keel import Resources  # noqa: E402
from keel.executor.cluster import cluster_client  # noqa: E402
from keel.executor.run import run_steps  # noqa: E402


def timed_cold_run(steps, prefix: str, cluster, max_concurrent: int) -> float:
    started = time.perf_counter()
    report = run_steps(steps, prefix, cluster=cluster, max_concurrent=max_concurrent, echo=lambda _: None)
    elapsed = time.perf_counter() - started
    assert report.ok and len(report.ran) == len(steps), report.failures[:1]
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=20)
    parser.add_argument("--depth", type=int, default=10)
    parser.add_argument("--max-concurrent", type=int, default=8)
    parser.add_argument("--chain", type=int, default=5, help="length of the sequential chain (latency)")
    args = parser.parse_args()
    cloudpickle.register_pickle_by_value(executor_overhead)  # cluster tasks cannot import benchmarks/

    steps = executor_overhead.layered_dag(args.width, args.depth)
    chain = executor_overhead.layered_dag(1, args.chain)
    jobs = executor_overhead.layered_dag(args.width, args.depth, resources=Resources(cpu=1))
    job_chain = executor_overhead.layered_dag(1, args.chain, resources=Resources(cpu=1))
    n = len(steps)
    with tempfile.TemporaryDirectory() as tmp:
        local = timed_cold_run(steps, f"{tmp}/local", None, args.max_concurrent)
        local_chain = timed_cold_run(chain, f"{tmp}/local-chain", None, 1)
        started = time.perf_counter()
        with local_iris_cluster(Path(tmp, "iris")) as url:
            client = cluster_client(url, workspace=ROOT)
            try:
                startup = time.perf_counter() - started
                iris = timed_cold_run(jobs, f"{tmp}/iris", client, args.max_concurrent)
                iris_chain = timed_cold_run(job_chain, f"{tmp}/iris-chain", client, 1)
            finally:
                client.shutdown(wait=False)

    print(f"DAG: {n} steps ({args.width} wide x {args.depth} deep), {args.max_concurrent} at a time")
    print(f"cluster start (controller + log server, in-process): {startup:.1f} s (not counted below)")
    print(f"in-process LocalClient  cold {n} steps: {local:8.3f} s  ({local / n * 1e3:8.2f} ms/step)")
    print(f"local Iris cluster      cold {n} steps: {iris:8.3f} s  ({iris / n * 1e3:8.2f} ms/step)")
    print(f"one step at a time ({args.chain}-step chain): in-process {local_chain / args.chain * 1e3:.2f} ms/step, "
          f"Iris {iris_chain / args.chain * 1e3:.0f} ms/step")
    print(f"ratio Iris / in-process per step: {iris / local:.0f}x")


if __name__ == "__main__":
    main()
