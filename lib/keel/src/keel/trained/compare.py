"""Compare finished training runs: a table and one overlaid loss plot, from what the runs recorded.

Everything comes from files a training step leaves (no jax): `metrics.jsonl` (losses, tokens/s),
`.keel/status` (wall time) and `.keel/step.json` (the identity fields, of which the table shows
those that differ between the runs). `keel compare EXP.py` prints the same table for the cached
training steps of an experiment; the compare step (`compare_step`) writes it under its output as
comparison.md, comparison.json and comparison.png.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from dataclasses import asdict, dataclass
from typing import Any

from keel.executor import storage
from keel.executor.status import keel_path, read_status
from keel.executor.step import Step
from keel.train.tracking import METRICS_FILE, latest_by_step, read_metrics
from keel.trained.config import CompareConfig

TABLE_FILE, JSON_FILE, PLOT_FILE = "comparison.md", "comparison.json", "comparison.png"


@dataclass(frozen=True)
class RunSummary:
    """One row of the table."""

    run: str
    steps: int
    final_loss: float | None
    """The last validation loss (`eval/loss` at the highest step evaluated)."""
    final_step: int | None
    best_loss: float | None
    best_step: int | None
    tokens_per_s: float | None
    """Median training throughput over the logged steps after the first (which compiles)."""
    wall_s: float | None
    """Duration of the step's last attempt."""
    fields: dict[str, Any]
    """Identity fields that differ between the compared runs (dotted paths into the config)."""


def summarize(runs: dict[str, str]) -> list[RunSummary]:
    """One summary per run (label -> a finished training step's output directory), in label order."""
    identities = {label: _identity_fields(path) for label, path in runs.items()}
    differing = _differing(list(identities.values()))
    rows = []
    for label, path in runs.items():
        records = read_metrics(storage.join(path, METRICS_FILE))
        evals = latest_by_step(records, "eval/loss")
        throughput = latest_by_step(records, "throughput/tokens_per_s")
        train_steps = latest_by_step(records, "train/loss")
        steady = [v for s, v in throughput.items() if s > min(throughput)] if len(throughput) > 1 else list(throughput.values())
        best_step = min(evals, key=evals.get) if evals else None
        status = read_status(path)
        rows.append(RunSummary(
            run=label,
            steps=max(train_steps) + 1 if train_steps else 0,
            final_loss=evals[max(evals)] if evals else None,
            final_step=max(evals) if evals else None,
            best_loss=evals[best_step] if evals else None,
            best_step=best_step,
            tokens_per_s=statistics.median(steady) if steady else None,
            wall_s=status.duration if status is not None else None,
            fields={name: identities[label].get(name) for name in differing},
        ))
    return rows


def _identity_fields(path: str) -> dict[str, Any]:
    """The run's identity config as {dotted path: plain value} (from its `.keel/step.json`)."""
    record = storage.read_json(keel_path(path, "step.json"))
    if record is None:
        raise FileNotFoundError(f"{path} has no .keel/step.json: is it a keel step's output?")
    flat: dict[str, Any] = {}
    _flatten(record["identity"]["config"], "", flat)
    return flat


def _flatten(value: Any, where: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and "__float__" in value:
        out[where] = float(value["__float__"])
    elif isinstance(value, dict) and "__output_of__" in value:
        out[where] = f"output of {value['__output_of__']}" + (f"/{value['subpath']}" if value.get("subpath") else "")
    elif isinstance(value, dict) and "__enum__" in value:
        out[where] = value["__enum__"]
    elif isinstance(value, dict) and "__this_output__" in value:
        return  # the run's own output path: not a setting
    elif isinstance(value, dict):
        for key, item in value.items():
            _flatten(item, f"{where}.{key}" if where else key, out)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _flatten(item, f"{where}[{i}]", out)
    else:
        out[where] = value


def _differing(identities: list[dict[str, Any]]) -> list[str]:
    """Field paths whose values are not the same in every run (a field some runs lack counts)."""
    names = sorted({name for fields in identities for name in fields})
    return [n for n in names if len({repr(fields.get(n)) for fields in identities}) > 1]


def render_table(rows: list[RunSummary]) -> str:
    """The rows as a Markdown table, one line per run."""
    differing = list(rows[0].fields) if rows else []
    header = ["run", "steps", "final val loss", "best val loss (step)", "tokens/s", "wall time", *differing]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        best = f"{r.best_loss:.4f} ({r.best_step})" if r.best_loss is not None else "-"
        cells = [r.run, str(r.steps), _number(r.final_loss, ".4f"), best, _number(r.tokens_per_s, ",.0f"),
                 f"{r.wall_s:.1f}s" if r.wall_s is not None else "-", *(_value(r.fields[n]) for n in differing)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def plot_losses(runs: dict[str, str], png_path: str) -> None:
    """Every run's train loss (thin) and validation loss (dots) against step, in one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (label, path) in enumerate(runs.items()):
        records = read_metrics(storage.join(path, METRICS_FILE))
        color = f"C{i % 10}"
        train, val = latest_by_step(records, "train/loss"), latest_by_step(records, "eval/loss")
        ax.plot(list(train), list(train.values()), color=color, linewidth=0.8, alpha=0.5)
        ax.plot(list(val), list(val.values()), "o-", color=color, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (validation: dots; train: thin)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fs, path = storage.split(png_path)
    with fs.open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


def compare_step(config: CompareConfig) -> None:
    """Step function: comparison.md / .json / .png under the output path; prints the table."""
    rows = summarize(config.runs)
    table = render_table(rows)
    print(table)
    storage.write_atomic(storage.join(config.output_path, TABLE_FILE), table + "\n")
    storage.write_json(storage.join(config.output_path, JSON_FILE),
                       {"runs": [asdict(r) for r in rows], "paths": dict(config.runs)})
    plot_losses(config.runs, storage.join(config.output_path, PLOT_FILE))


def compare_finished(graph, only: re.Pattern | None = None, as_json: bool = False) -> int:
    """`keel compare EXP.py [--only REGEX] [--json]`: print the table (or its rows as JSON) of the
    graph's cached training steps whose names match `only`; runs nothing. Exit code 1 when no such
    step has finished."""
    from keel.executor.plan import CACHED, plan_graph
    from keel.train.config import TrainStepConfig

    plans = [p for p in plan_graph(graph) if isinstance(p.step, Step) and isinstance(p.step.config, TrainStepConfig)
             and (only is None or only.search(p.name))]
    finished = {p.name: p.output_path for p in plans if p.state == CACHED}
    waiting = [f"{p.name} ({p.state})" for p in plans if p.state != CACHED]
    if not finished:
        print(f"keel: no finished training steps to compare{' matching ' + only.pattern if only else ''}"
              + (f"; not finished: {', '.join(waiting)}" if waiting else ""), file=sys.stderr)
        return 1
    rows = summarize(finished)
    if as_json:
        print(json.dumps({"runs": [asdict(r) for r in rows], "not_finished": waiting}, indent=1))
        return 0
    print(render_table(rows))
    if waiting:
        print(f"-- not finished: {', '.join(waiting)}")
    return 0
