"""Hello, keel: three steps that show placeholders, an execution-only field and reuse.

    uv run keel run experiments/tutorials/hello_world.py     # runs all three steps
    uv run keel run experiments/tutorials/hello_world.py     # again: everything is cached
    uv run keel plan experiments/tutorials/hello_world.py --set tutorial/numbers:n=200

`numbers` writes n pseudo-random integers, `stats` summarises them, `report` writes a sentence.
Change `n` and all three re-run under new output paths; change `workers` (execution-only) and
nothing re-runs.
"""

import json
import random
from dataclasses import dataclass

import fsspec

from keel import Step, execution_only, main, output_of, this_output


@dataclass(frozen=True)
class NumbersConfig:
    n: int
    seed: int = 0
    output_path: str = this_output()
    workers: int = execution_only(default=2)  # how to run, not what to compute


def make_numbers(config: NumbersConfig) -> None:
    rng = random.Random(config.seed)
    numbers = [rng.randint(0, 1000) for _ in range(config.n)]
    with fsspec.open(f"{config.output_path}/numbers.json", "w") as f:
        json.dump(numbers, f)


@dataclass(frozen=True)
class StatsConfig:
    numbers: str  # the path of numbers.json
    output_path: str = this_output()


def compute_stats(config: StatsConfig) -> None:
    with fsspec.open(config.numbers) as f:
        numbers = json.load(f)
    stats = {"count": len(numbers), "mean": sum(numbers) / len(numbers), "min": min(numbers), "max": max(numbers)}
    with fsspec.open(f"{config.output_path}/stats.json", "w") as f:
        json.dump(stats, f, indent=1)
    print(f"mean of {stats['count']} numbers: {stats['mean']:.2f}")


@dataclass(frozen=True)
class ReportConfig:
    stats: str
    output_path: str = this_output("report.txt")


def write_report(config: ReportConfig) -> None:
    with fsspec.open(config.stats) as f:
        stats = json.load(f)
    with fsspec.open(config.output_path, "w") as f:
        f.write(f"{stats['count']} numbers between {stats['min']} and {stats['max']}, mean {stats['mean']:.2f}\n")


numbers = Step("tutorial/numbers", make_numbers, NumbersConfig(n=100), description="n pseudo-random integers")
stats = Step("tutorial/stats", compute_stats, StatsConfig(numbers=output_of(numbers, "numbers.json")))
report = Step("tutorial/report", write_report, ReportConfig(stats=output_of(stats, "stats.json")))

if __name__ == "__main__":
    main([report])
