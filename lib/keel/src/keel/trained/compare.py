"""Compare finished training runs, of one experiment or several: a table whose every column is
defined under it, and one overlaid loss plot, from what the runs recorded.

Everything comes from files a training step leaves (no jax): `metrics.jsonl` (losses, each step's
throughput, the transport), `.keel/status` (wall time), `.keel/step.json` (identity fields, of
which the table shows those that differ between the runs; the driver's host), `.keel/host` (the
host a job away from the driver ran on) and `.keel/log.txt` (the loop's summary line: how long it
waited for compiles). Two things make a throughput figure
untrustworthy, and the table deals with both: steps that compiled or evaluated are left out of
it, and a run that overlapped on its host with other steps is marked, since sharing the CPU or
GPU slows it (two concurrent runs made an MoE look 27% slower than a dense model it matched alone).
`keel compare A.py [B.py ...]` prints the table for the cached training steps of the experiments;
the compare step (`compare_step`) writes it as comparison.md, comparison.json and comparison.png.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from keel.executor import storage
from keel.executor.job import ran_on
from keel.executor.lease import current_lease
from keel.executor.status import KEEL_DIR, RECORD, keel_path, read_record, read_status
from keel.executor.plan import CACHED, plan_graph
from keel.executor.step import Step
from keel.spec.metrics import (COMPILE_WAIT, finite_json, latest_by_step, METRICS_FILE, read_metrics,
                               steady_tokens_per_s)
from keel.trained import ladder
from keel.spec.trained import CompareConfig
from keel.spec.train import TrainStepConfig

TABLE_FILE, JSON_FILE, PLOT_FILE = "comparison.md", "comparison.json", "comparison.png"
SHARED_MARK = "*"

COLUMNS = {
    "experiment": "the experiment file that declares the run",
    "run": "the training step's name",
    "steps": "optimizer steps the run recorded",
    "final val loss": "eval/loss (mean over the validation sets) at the last evaluated step",
    "best val loss (step)": "the lowest eval/loss and the step it was measured at",
    "tokens/s": "tokens per second of training steps alone, in the run's last transport phase: their tokens over their "
                "own times (batch fetch and update), leaving out steps that compiled and every evaluation; "
                f"{SHARED_MARK} when the run shared its host with other steps (slower than alone)",
    "wall time": "the step's last attempt, start to end (.keel/status)",
    "compile": "of the wall time, how long the loop stood waiting for its step and evaluation functions to compile",
    "training": "of the wall time, the training steps' own measured times summed (batch fetch and update), less "
                "their compile wait",
    "eval+ckpt": "of the wall time, the rest of the training loop: validation passes and checkpoint writes",
    "setup": "the rest of the wall time, before the loop's first step: process start, imports, state initialisation, "
             "opening the data",
    "predicted": "the declared predicted_loss (a scaling-ladder fit) with its 95% band; OUTSIDE when the final val "
                 "loss leaves the band",
}


@dataclass(frozen=True)
class RunSummary:
    """One row of the table (every figure is defined in `COLUMNS`)."""

    run: str
    experiment: str | None
    steps: int
    final_loss: float | None
    final_step: int | None
    best_loss: float | None
    best_step: int | None
    tokens_per_s: float | None
    wall_s: float | None
    compile_s: float | None
    train_s: float | None
    eval_s: float | None
    setup_s: float | None
    shared: dict | None
    """{"steps": names of the steps that ran on the host meanwhile, "fraction": of the wall time}, or None."""
    prediction: dict | None
    verdict: str | None
    """'within', 'above' or 'below' the prediction's band, or 'not finite' (a NaN or infinite loss)."""
    fields: dict[str, Any]
    """Identity fields that differ between the compared runs (dotted paths into the config)."""
    rollbacks: tuple[int, ...] = ()
    """The step of each rollback the spike guard took (`keel.train.spike_guard`; twice where one step rolled
    back twice): its curve is not a plain run's."""


def summarize(runs: dict[str, str], experiments: dict[str, str] | None = None,
              predictions: dict[str, str | None] | None = None) -> list[RunSummary]:
    """One summary per run (label -> a finished training step's output directory), in label order;
    `experiments` maps labels to the experiment file that declares them, `predictions` to where the
    prediction each declares is written (`ladder.prediction_location`: found through the graph, since
    `predicted_loss` is no part of the run's identity and the path its step.json froze can be stale)."""
    records = {label: _record(path) for label, path in runs.items()}
    identities = {label: identity_fields(record["identity"]) for label, record in records.items()}
    differing = _differing(list(identities.values()))
    neighbours = _attempts_near(runs.values())
    rows = []
    for label, path in runs.items():
        metrics = read_metrics(storage.join(path, METRICS_FILE))
        evals = latest_by_step(metrics, "eval/loss")
        train_steps = latest_by_step(metrics, "train/loss")
        finite = {step: loss for step, loss in evals.items() if math.isfinite(loss)}
        best_step = min(finite, key=finite.get) if finite else None
        status = read_status(path)
        wall = status.duration if status is not None else None
        tokens_per_step = identities[label].get("train.batch_size", 0) * identities[label].get("train.seq_len", 0)
        split = wall_split(storage.read_text(keel_path(path, "log.txt")) or "", metrics, tokens_per_step, wall)
        final = evals[max(evals)] if evals else None
        prediction = ladder.read_prediction((predictions or {}).get(label))
        rows.append(RunSummary(
            run=label,
            experiment=(experiments or {}).get(label),
            steps=max(train_steps) + 1 if train_steps else 0,
            final_loss=final,
            final_step=max(evals) if evals else None,
            best_loss=evals[best_step] if finite else None,
            best_step=best_step,
            tokens_per_s=steady_tokens_per_s(metrics),
            wall_s=wall,
            **split,
            shared=_shared(path, records[label], status, neighbours),
            prediction=prediction,
            verdict=ladder.judge(final, prediction),
            fields={name: identities[label].get(name) for name in differing},
            rollbacks=_rollback_steps(metrics),
        ))
    return rows


def _rollback_steps(metrics: list[dict]) -> tuple[int, ...]:
    """The step of each spike-guard rollback a run took: one per skipped batch, so a step that rolled
    back twice (its next batch spiked too) is there twice."""
    rows = {(int(r["spike/rollback_from"]), r.get("spike/skipped_batch")) for r in metrics if "spike/rollback_from" in r}
    return tuple(step for step, _ in sorted(rows, key=lambda row: (row[0], row[1] is None, row[1] or 0)))


_DONE = re.compile(r"done: steps (\d+)->\d+ in ([\d.]+)s \(compiling [\d.]+s, waited for ([\d.]+)s, ([\d.]+)s of it "
                   r"by training steps\)")  # the loop's own summary of its attempt (`keel.train.loop`)


def wall_split(log: str, metrics: list[dict], tokens_per_step: int, wall: float | None) -> dict[str, float | None]:
    """The wall time as compile / training / eval+ckpt / setup seconds (see `COLUMNS`), from the
    loop's summary of its last attempt (its own time, what it waited for compiles, and how much of
    that its training steps waited) and the measured time of that attempt's steps: a row of
    `metrics.jsonl` times its own step and stands for the steps since the row before it
    (`log_every`) at that time less the compile wait it names (`COMPILE_WAIT`: a step that waited
    has a row of its own). Rows that name no wait (written before the loop named them) had every
    wait the summary counts subtracted, which is right only where each step has a row. None where
    the log lacks the loop's summary line."""
    done = _DONE.findall(log)
    start = int(done[-1][0]) if done else 0
    rows = {s: v for s, v in latest_by_step(metrics, "throughput/tokens_per_s").items() if s >= start and v}
    if wall is None or not done or not rows or not tokens_per_step:
        return {"compile_s": None, "train_s": None, "eval_s": None, "setup_s": None}
    loop_s, compile_s, step_waits = (float(x) for x in done[-1][1:])
    waits = latest_by_step(metrics, COMPILE_WAIT)
    steps = sorted(rows)
    steps_s = sum((s - before) * (tokens_per_step / rows[s] - waits.get(s, 0.0)) for before, s in zip([start - 1] + steps, steps))
    train_s = max(0.0, steps_s - (0.0 if any(s in waits for s in steps) else step_waits))
    eval_s = max(0.0, loop_s - train_s - compile_s)
    return {"compile_s": compile_s, "train_s": train_s, "eval_s": eval_s, "setup_s": max(0.0, wall - loop_s)}


def _record(path: str) -> dict:
    record = read_record(path)
    if record is None:
        raise FileNotFoundError(f"{path} has no readable .keel/step.json: is it a keel step's output?")
    return record


def _attempts_near(paths) -> list[tuple[str, str, str | None, float, float]]:
    """(output path, name, host, start, end) of every step attempt under the prefixes of `paths`
    (a step's output is {prefix}/{name}-{hash}, its name one to four segments deep). One with no
    end on record ends now while its lease is live, else at its lease's last heartbeat (a launcher
    killed or crashed mid-step); one that left neither is not counted. The host is the one the step
    ran on (`job.ran_on`): a step sent to a cluster ran on a worker, not on the driver."""
    roots = set()
    for path in paths:
        record = _record(path)
        roots.add(path.rstrip("/")[: -len(f"/{record['name']}-{record['hash']}")])
    found = []
    for root in roots:
        fs, plain = storage.split(root)
        for depth in range(1, 5):
            for record_path in fs.glob(f"{plain}/{'/'.join(['*'] * depth)}/{KEEL_DIR}/{RECORD}"):
                step = root + record_path.rsplit(f"/{KEEL_DIR}/", 1)[0][len(plain):]
                record, status = read_record(step), read_status(step)
                if record is None or status is None:
                    continue
                end = status.finished
                if end is None:
                    holder = current_lease(step)
                    end = None if holder is None else time.time() if holder.is_live() else holder.heartbeat
                if end is not None:
                    found.append((step, record.get("name", step), ran_on(step, record), status.started, end))
    return found


def _shared(path: str, record: dict, status, attempts) -> dict | None:
    """The other steps whose attempts overlapped this run's on the host it ran on, and for what share
    of its wall time. Told apart by output path, not name: two experiments (or two `--set` variants)
    may each have a step of this name. None where no host is known (`job.ran_on`)."""
    host = ran_on(path, record)
    if status is None or status.finished is None or host is None:
        return None
    start, end, mine = status.started, status.finished, path.rstrip("/")
    spans = sorted((max(s, start), min(e, end), name) for step, name, h, s, e in attempts
                   if h == host and step != mine and s < end and e > start)
    if not spans:
        return None
    covered, reach = 0.0, start
    for s, e, _ in spans:  # the union of the overlaps
        if e > reach:
            covered += e - max(s, reach)
            reach = e
    return {"steps": sorted({name for _, _, name in spans}), "fraction": covered / max(end - start, 1e-9)}


def identity_fields(identity: dict) -> dict[str, Any]:
    """A step's identity as {dotted path: plain value}: its config's fields and, under `derived.`,
    what its config derives into it (`DerivesIdentity`: the drops a layout decides), so two runs
    that differ only there are told apart."""
    fields: dict[str, Any] = {}
    _flatten(identity["config"], "", fields)  # placeholders (outputs of other steps, enums) as words
    _flatten(identity.get("derived", {}), "derived", fields)
    return fields


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
    """The rows as a Markdown table, one line per run, then the definition of every column shown."""
    differing = list(rows[0].fields) if rows else []
    several = len({r.experiment for r in rows}) > 1
    predicted = any(r.prediction for r in rows)
    header = [*(["experiment"] if several else []), "run", "steps", "final val loss", "best val loss (step)", "tokens/s",
              "wall time", "compile", "training", "eval+ckpt", "setup", *(["predicted"] if predicted else []), *differing]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        best = f"{r.best_loss:.4f} ({r.best_step})" if r.best_loss is not None else "-"
        speed = _number(r.tokens_per_s, ",.0f") + (f" {SHARED_MARK}" if r.shared and r.tokens_per_s is not None else "")
        cells = [*([r.experiment or "-"] if several else []), r.run, str(r.steps), _number(r.final_loss, ".4f"), best,
                 speed, _seconds(r.wall_s), _seconds(r.compile_s), _seconds(r.train_s), _seconds(r.eval_s), _seconds(r.setup_s),
                 *([_predicted(r)] if predicted else []), *(_value(r.fields[n]) for n in differing)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"- {name}: {COLUMNS[name]}" for name in header if name in COLUMNS]
    lines += [f"- {name}: an identity field (in the step's config) that differs between these runs" for name in differing]
    for r in rows:
        if r.shared:
            lines.append(f"- {SHARED_MARK} {r.run} shared its host for {r.shared['fraction']:.0%} of its wall time with "
                         f"{_names(r.shared['steps'])}")
        if r.rollbacks:
            lines.append(f"- {r.run} rolled back past {len(r.rollbacks)} loss spike(s), skipping the batch at step(s) "
                         f"{', '.join(map(str, r.rollbacks))} (its spike_guard.json): not a plain run's curve")
    return "\n".join(lines)


def _predicted(r: RunSummary) -> str:
    p = r.prediction
    if p is None:
        return "-"
    shown = f"{p['loss']:.4f} [{p['low']:.4f}, {p['high']:.4f}]"
    return shown + (f" OUTSIDE ({r.verdict})" if r.verdict not in (None, "within") else "")


def _names(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"


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
    """Step function: comparison.md / .json / .png under the output path; prints the table. It has
    no predicted column: a step sees run paths, not the graph that says where predictions are."""
    rows = summarize(config.runs)
    table = render_table(rows)
    print(table)
    storage.write_atomic(storage.join(config.output_path, TABLE_FILE), table + "\n")
    storage.write_json(storage.join(config.output_path, JSON_FILE),
                       finite_json({"runs": [asdict(r) for r in rows], "paths": dict(config.runs), "columns": COLUMNS}))
    plot_losses(config.runs, storage.join(config.output_path, PLOT_FILE))


def training_plans(experiments: list[tuple[str | None, Any]], only: re.Pattern | None = None) -> list[tuple[str | None, Any, Any]]:
    """(experiment, graph, plan) of every training step of the (experiment file, graph) pairs whose
    name matches `only`, each output once (a step two experiments share is listed under the first)."""
    seen, out = set(), []
    for source, graph in experiments:
        for plan in plan_graph(graph):
            if (isinstance(plan.step, Step) and isinstance(plan.step.config, TrainStepConfig)
                    and (only is None or only.search(plan.name)) and plan.output_path not in seen):
                seen.add(plan.output_path)
                out.append((source, graph, plan))
    return out


def short_names(sources: list[str | None]) -> dict[str | None, str]:
    """Each experiment file by the fewest trailing parts of its path that tell it from the others:
    its basename, unless two files share it (sweeps/v1/exp.py and sweeps/v2/exp.py: v1/exp.py). A
    file given twice under two spellings (exp.py, ./exp.py) is one file: nothing tells it from itself."""
    parts = {s: os.path.abspath(s).split(os.sep) for s in dict.fromkeys(sources) if s}
    short = {}
    for source, mine in parts.items():
        n = next(n for n in range(1, len(mine) + 1)
                 if all(theirs[-n:] != mine[-n:] for theirs in parts.values() if theirs != mine))
        short[source] = "/".join(mine[-n:])
    return short


def compare_finished(experiments: list[tuple[str | None, Any]], only: re.Pattern | None = None, as_json: bool = False) -> int:
    """`keel compare A.py [B.py ...] [--only REGEX] [--json]`: print the table (or its rows as JSON)
    of the cached training steps of the (experiment file, graph) pairs whose names match `only`;
    runs nothing. A step name two experiments declare differently is labelled `file:name`. Exit
    code 1 when no such step has finished."""
    plans = training_plans(experiments, only)
    names = [p.name for _, _, p in plans]
    short = short_names([source for source, _ in experiments])
    runs, files, predictions = {}, {}, {}
    for source, graph, plan in plans:
        if plan.state == CACHED:
            file = short.get(source)
            label = plan.name if names.count(plan.name) == 1 else f"{file}:{plan.name}"
            runs[label], files[label] = plan.output_path, file
            predictions[label] = ladder.prediction_location(graph, plan.step)
    waiting = [f"{p.name} ({p.state})" for _, _, p in plans if p.state != CACHED]
    if not runs:
        print(f"keel: no finished training steps to compare{' matching ' + only.pattern if only else ''}"
              + (f"; not finished: {', '.join(waiting)}" if waiting else ""), file=sys.stderr)
        return 1
    rows = summarize(runs, files if len(experiments) > 1 else None, predictions)
    if as_json:
        print(json.dumps(finite_json({"runs": [asdict(r) for r in rows], "not_finished": waiting, "columns": COLUMNS}),
                         indent=1))
        return 0
    print(render_table(rows))
    if waiting:
        print(f"-- not finished: {', '.join(waiting)}")
    return 0
