"""Marin's StepRunner on the DAG of `executor_overhead.py` (a layered DAG of trivial steps; each step
of layer d reads two parents of layer d-1): prints the cold run's seconds, then the warm rerun's.

Needs `marin-core` (PyPI), never a dependency of this project: run it with an interpreter that
has it, e.g. `python -m venv /tmp/marin && /tmp/marin/bin/pip install marin-core`, then
`/tmp/marin/bin/python benchmarks/marin_step_runner_dag.py --width 20 --depth 10`, or pass that
interpreter to `executor_overhead.py --marin-python /tmp/marin/bin/python`.
"""

import argparse
import functools
import logging
import tempfile
import time


def touch(output_path: str, layer: int, index: int) -> None:
    import os

    os.makedirs(output_path, exist_ok=True)
    with open(f"{output_path}/done", "w") as f:
        f.write(f"{layer}.{index}")


def layered_dag(width: int, depth: int, prefix: str) -> list:
    from marin.execution.step_spec import StepSpec

    layers: list[list] = []
    for d in range(depth):
        row = []
        for w in range(width):
            deps = [] if d == 0 else [layers[-1][w], layers[-1][(w + 1) % width]]
            row.append(StepSpec(name=f"bench/l{d:03d}/s{w:03d}", output_path_prefix=prefix, deps=deps,
                                hash_attrs={"layer": d, "index": w}, fn=functools.partial(touch, layer=d, index=w)))
        layers.append(row)
    return [s for row in layers for s in row]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=20)
    parser.add_argument("--depth", type=int, default=10)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)  # StepRunner logs each step at INFO otherwise
    from marin.execution.step_runner import StepRunner

    with tempfile.TemporaryDirectory() as tmp:
        steps = layered_dag(args.width, args.depth, tmp)
        t0 = time.perf_counter()
        StepRunner().run(steps)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        StepRunner().run(layered_dag(args.width, args.depth, tmp))
        warm = time.perf_counter() - t0
    print(f"{cold:.4f} {warm:.4f}")


if __name__ == "__main__":
    main()
