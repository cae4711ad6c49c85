"""Hello, keel: three steps that show placeholders, an execution-only field and reuse.

    uv run keel run experiments/tutorials/hello_world.py     # runs all three steps
    uv run keel run experiments/tutorials/hello_world.py     # again: everything is cached
    uv run keel plan experiments/tutorials/hello_world.py --set tutorial/numbers:n=200

`numbers` writes n pseudo-random integers, `stats` summarises them, `report` writes a sentence.
Change `n` and all three re-run under new output paths; change `workers` (execution-only) and
nothing re-runs.
"""

import random
from dataclasses import dataclass

from keel import Step, execution_only, main, output_of, this_output
from keel.executor.storage import read_json, write_atomic, write_json  # fsspec paths, written atomically


@dataclass(frozen=True)
class NumbersConfig:
    n: int
    seed: int = 0
    output_path: str = this_output()
    workers: int = execution_only(default=2)  # how to run, not what to compute


def make_numbers(config: NumbersConfig) -> None:
    rng = random.Random(config.seed)
    write_json(f"{config.output_path}/numbers.json", [rng.randint(0, 1000) for _ in range(config.n)])


@dataclass(frozen=True)
class StatsConfig:
    numbers: str  # the path of numbers.json
    output_path: str = this_output()


def compute_stats(config: StatsConfig) -> None:
    numbers = read_json(config.numbers)
    stats = {"count": len(numbers), "mean": sum(numbers) / len(numbers), "min": min(numbers), "max": max(numbers)}
    write_json(f"{config.output_path}/stats.json", stats)
    print(f"mean of {stats['count']} numbers: {stats['mean']:.2f}")


@dataclass(frozen=True)
class ReportConfig:
    stats: str
    output_path: str = this_output("report.txt")


def write_report(config: ReportConfig) -> None:
    stats = read_json(config.stats)
    write_atomic(config.output_path, f"{stats['count']} numbers between {stats['min']} and {stats['max']}, mean {stats['mean']:.2f}\n")


numbers = Step("tutorial/numbers", make_numbers, NumbersConfig(n=100), description="n pseudo-random integers")
stats = Step("tutorial/stats", compute_stats, StatsConfig(numbers=output_of(numbers, "numbers.json")))
report = Step("tutorial/report", write_report, ReportConfig(stats=output_of(stats, "stats.json")))

if __name__ == "__main__":
    main([report])
