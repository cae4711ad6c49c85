"""Executor overhead on a layered DAG of trivial steps: cold run, warm re-run, and plan of 10,000.

Each step of layer d reads two parents of layer d-1. Baseline in the same run: the same DAG
executed by a bare loop that calls each step function directly in topological order (no
identities, statuses, leases or manifests), so the ratio is keel's bookkeeping cost per step.

    uv run python benchmarks/executor_overhead.py [--width 20 --depth 10 --plan-width 100 --plan-depth 100]

Reference figures for Marin's executor on this machine (from the issue): cold 200 steps 3.6-18 s,
warm 0.07-0.2 s, dry-run of 10,000 steps 0.5-0.8 s. Targets: cold < 0.4 s, warm < 0.2 s,
plan of 10,000 with cache state < 0.5 s.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from keel import Step, output_of, this_output
from keel.executor.plan import Graph, plan_graph
from keel.executor.run import run_steps


@dataclass(frozen=True)
class NodeConfig:
    layer: int
    index: int
    parents: tuple = ()
    output_path: str = this_output()


def touch(config: NodeConfig) -> None:
    with open(f"{config.output_path}/done", "w") as f:
        f.write(f"{config.layer}.{config.index}")


def layered_dag(width: int, depth: int) -> list[Step]:
    layers: list[list[Step]] = []
    for d in range(depth):
        row = []
        for w in range(width):
            parents = () if d == 0 else (output_of(layers[-1][w]), output_of(layers[-1][(w + 1) % width]))
            row.append(Step(f"bench/l{d:03d}/s{w:03d}", touch, NodeConfig(d, w, parents)))
        layers.append(row)
    return [s for row in layers for s in row]


def bare_loop(steps: list[Step], root: str) -> None:
    """The baseline: create each output folder and call the function, nothing else."""
    for i, step in enumerate(steps):
        out = f"{root}/{i}"
        os.makedirs(out, exist_ok=True)
        touch(NodeConfig(step.config.layer, step.config.index, output_path=out))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=20)
    parser.add_argument("--depth", type=int, default=10)
    parser.add_argument("--plan-width", type=int, default=100)
    parser.add_argument("--plan-depth", type=int, default=100)
    args = parser.parse_args()
    quiet = lambda _: None  # noqa: E731

    with tempfile.TemporaryDirectory() as tmp:
        steps = layered_dag(args.width, args.depth)
        n = len(steps)
        t0 = time.perf_counter()
        bare_loop(steps, f"{tmp}/bare")
        bare = time.perf_counter() - t0

        t0 = time.perf_counter()
        report = run_steps(steps, f"{tmp}/keel", echo=quiet)
        cold = time.perf_counter() - t0
        assert report.ok and len(report.ran) == n

        t0 = time.perf_counter()
        report = run_steps(steps, f"{tmp}/keel", echo=quiet)
        warm = time.perf_counter() - t0
        assert not report.ran

        big = layered_dag(args.plan_width, args.plan_depth)
        t0 = time.perf_counter()
        plans = plan_graph(Graph(big, f"{tmp}/plan"))
        plan_s = time.perf_counter() - t0
        assert len(plans) == len(big)

        hello = os.path.join(os.path.dirname(__file__), "..", "experiments", "tutorials", "hello_world.py")
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "keel.cli_entry", "plan", hello, "--prefix", f"{tmp}/hello"], check=True, capture_output=True)
        plan_cli = time.perf_counter() - t0

    print(f"cold run   {n:>6} steps: {cold:7.3f} s  ({cold / n * 1e3:.2f} ms/step; target < 0.4 s for 200)")
    print(f"warm rerun {n:>6} steps: {warm:7.3f} s  ({warm / n * 1e3:.2f} ms/step; target < 0.2 s)")
    print(f"plan       {len(big):>6} steps: {plan_s:7.3f} s  ({plan_s / len(big) * 1e6:.0f} us/step; target < 0.5 s)")
    print(f"`keel plan hello_world.py`, whole process: {plan_cli:.3f} s (target < 1 s)")
    print(f"bare loop  {n:>6} steps: {bare:7.3f} s  (baseline: direct calls, no bookkeeping)")
    print(f"ratio cold keel / bare loop: {cold / bare:.1f}x; per-step keel overhead {(cold - bare) / n * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
