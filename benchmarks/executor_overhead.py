"""Executor overhead on a layered DAG of trivial steps: cold run, warm re-run, and plan of 10,000.

Each step of layer d reads two parents of layer d-1. Baseline in the same run: the same DAG
executed by a bare loop that calls each step function directly in topological order (no
identities, statuses, leases or manifests), so the ratio is keel's bookkeeping cost per step.

    uv run python benchmarks/executor_overhead.py [--repeat 3] [--marin-python /tmp/marin/bin/python]
        [--width 20 --depth 10 --plan-width 100 --plan-depth 100]

Each figure is the median of `--repeat` runs. The comparison with Marin's StepRunner on the same
DAG (`marin_step_runner_dag.py`) is measured when `marin-core` is importable here or an
interpreter that has it is given (`--marin-python`, or $MARIN_PYTHON; install it into a throwaway
venv, never into this project); otherwise no Marin ratio is printed (one from another run's Marin
would not be a same-run figure), and the last line says how to measure it. Documented: Marin StepRunner
9.9-17.5 s for the 200-step cold run (four runs on this 2-core machine while other work shared
it), against keel 0.17-0.43 s (32x-104x of the Marin run beside it) while the bare loop took
0.01-0.06 s, and 1.1-1.3 s (7.6x-8.9x) in a run where creating a file in /tmp took 0.6-0.8 ms
and the bare loop 0.29 s. Targets: cold 200 steps >= 10x faster than Marin's StepRunner, warm
< 0.2 s, plan of 10,000 with cache state (`keel.main(steps, argv=["plan", "--json", "--prefix",
...])`) <= 0.3 s. The ratios print last.

What a cold step costs beyond the bare loop's folder and file: five more inodes (`.keel/`, the
lease, `step.json`, `status` and its content-index entry `{prefix}/.keel/content/<hash>.json`;
Marin's StepRunner creates four) and 0.4-0.9 ms of Python (measured on /dev/shm, where creating a
file costs nothing, before the index entry was added). When creating a file is slow, the inodes
dominate.
"""

import argparse
import contextlib
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import keel
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


def layered_dag(width: int, depth: int, resources=None) -> list[Step]:
    """`depth` layers of `width` trivial steps, each reading two of the layer before; with `resources`,
    each step declares them (a cluster runs such steps as its jobs)."""
    layers: list[list[Step]] = []
    for d in range(depth):
        row = []
        for w in range(width):
            parents = () if d == 0 else (output_of(layers[-1][w]), output_of(layers[-1][(w + 1) % width]))
            row.append(Step(f"bench/l{d:03d}/s{w:03d}", touch, NodeConfig(d, w, parents), resources=resources))
        layers.append(row)
    return [s for row in layers for s in row]


def bare_loop(steps: list[Step], root: str) -> None:
    """The baseline: create each output folder and call the function, nothing else."""
    for i, step in enumerate(steps):
        out = f"{root}/{i}"
        os.makedirs(out, exist_ok=True)
        touch(NodeConfig(step.config.layer, step.config.index, output_path=out))


def marin_runs(args) -> list[tuple[float, float]] | None:
    """(cold, warm) seconds of Marin's StepRunner on the same DAG, `--repeat` times as keel's, or None
    when marin-core is absent."""
    first = marin_times(args)
    return None if first is None else [first] + [marin_times(args) for _ in range(max(1, args.repeat) - 1)]


def marin_times(args) -> tuple[float, float] | None:
    """(cold, warm) seconds of one run of Marin's StepRunner on the same DAG, or None when marin-core is absent."""
    here = os.path.dirname(os.path.abspath(__file__))
    dag = ["--width", str(args.width), "--depth", str(args.depth)]
    try:
        import marin.execution.step_runner  # noqa: F401
    except ImportError:
        python = args.marin_python or os.environ.get("MARIN_PYTHON")
        if not python:
            return None
        out = subprocess.run([python, os.path.join(here, "marin_step_runner_dag.py"), *dag], capture_output=True, text=True, check=True)
        cold, warm = map(float, out.stdout.split()[-2:])
        return cold, warm
    sys.path.insert(0, here)
    import marin_step_runner_dag

    from marin.execution.step_runner import StepRunner

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        StepRunner().run(marin_step_runner_dag.layered_dag(args.width, args.depth, tmp))
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        StepRunner().run(marin_step_runner_dag.layered_dag(args.width, args.depth, tmp))
        return cold, time.perf_counter() - t0


def once(args) -> dict[str, float]:
    """One measurement of every figure (seconds)."""
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

        out = io.StringIO()
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(out):
            code = keel.main(big, argv=["plan", "--json", "--prefix", f"{tmp}/plan"])
        plan_main = time.perf_counter() - t0
        assert code == 0 and out.getvalue().count('"state"') == len(big)

        hello = os.path.join(os.path.dirname(__file__), "..", "experiments", "tutorials", "hello_world.py")
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "keel.cli_entry", "plan", hello, "--prefix", f"{tmp}/hello"], check=True, capture_output=True)
        plan_cli = time.perf_counter() - t0
    return {"n": n, "plan_n": len(big), "cold": cold, "warm": warm, "plan": plan_s, "plan_main": plan_main, "plan_cli": plan_cli, "bare": bare}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=20)
    parser.add_argument("--depth", type=int, default=10)
    parser.add_argument("--plan-width", type=int, default=100)
    parser.add_argument("--plan-depth", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3, help="runs of every figure; the median is printed")
    parser.add_argument("--marin-python", default=None, help="an interpreter with marin-core, for the measured comparison")
    args = parser.parse_args()

    runs = [once(args) for _ in range(max(1, args.repeat))]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    colds = [r["cold"] for r in runs]
    n, big = int(med["n"]), int(med["plan_n"])
    cold, warm, bare = med["cold"], med["warm"], med["bare"]
    print(f"medians of {len(runs)} runs")
    print(f"cold run   {n:>6} steps: {cold:7.3f} s  ({cold / n * 1e3:.2f} ms/step; runs {', '.join(f'{c:.3f}' for c in colds)})")
    print(f"warm rerun {n:>6} steps: {warm:7.3f} s  ({warm / n * 1e3:.2f} ms/step; target < 0.2 s)")
    print(f"plan       {big:>6} steps: {med['plan']:7.3f} s  ({med['plan'] / big * 1e6:.0f} us/step; plan_graph)")
    print(f"plan       {big:>6} steps: {med['plan_main']:7.3f} s  (keel.main(steps, argv=['plan', '--json', ...]); target <= 0.3 s)")
    print(f"`keel plan hello_world.py`, whole process: {med['plan_cli']:.3f} s (target < 1 s)")
    print(f"bare loop  {n:>6} steps: {bare:7.3f} s  (baseline: direct calls, no bookkeeping)")

    marins = marin_runs(args)
    if marins is not None:
        marin = (statistics.median(m[0] for m in marins), statistics.median(m[1] for m in marins))
        print(f"Marin StepRunner {n} steps: cold {marin[0]:.3f} s, warm {marin[1]:.3f} s (medians of {len(marins)} runs, "
              f"measured now; cold runs {', '.join(f'{m[0]:.3f}' for m in marins)})")
    print(f"ratio cold keel / bare loop: {cold / bare:.1f}x; per-step keel overhead {(cold - bare) / n * 1e3:.2f} ms")
    if marins is None:
        print("ratio cold Marin / keel: not measured (marin-core is not importable here): give an interpreter that "
              "has it, --marin-python PATH or $MARIN_PYTHON; target >= 10x")
    else:
        fastest_marin = min(m[0] for m in marins)
        print(f"ratio cold Marin / keel: {marin[0] / cold:.1f}x (medians), {fastest_marin / max(colds):.1f}x (Marin's "
              "fastest run against keel's slowest); target >= 10x")


if __name__ == "__main__":
    main()
