"""What the dashboard shows, as one JSON document built from the experiment's graph and its prefix.

Nothing here runs a step, talks to wandb or imports jax: every figure is read from what steps
leave under the prefix (`.keel/step.json`, `.keel/status`, `.keel/log.txt`, `metrics.jsonl`,
`checkpoints/`) and from the declaration itself (identity fields, mixture phases, fact sheets),
so the page works offline and on a prefix that another machine is writing.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import time
from typing import Any

from keel.executor import storage
from keel.executor.plan import RUNNING_ELSEWHERE, Graph, StepPlan, plan_graph
from keel.executor.status import keel_path
from keel.executor.step import Step
from keel.spec.metrics import METRICS_FILE, read_metrics, steady_tokens_per_s
from keel.spec.mixture import first_step_reading
from keel.trained import compare, ladder

LOG_TAIL_LINES = 80
LOG_TAIL_BYTES = 64 * 1024  # read from a log's end: a long run's log.txt is not read whole on every poll
MAX_POINTS = 2000
"""Points per series at most in the document: a chart is about 400 pixels wide, and a 390,251-step
run sent whole made a 45 MB document on every poll (`_thinned` keeps each stretch's extremes)."""
CHART_KEYS = re.compile(r"^(train/loss|eval/.*loss|lr/.*|throughput/tokens_per_s|moe/.*)$")
"""The metrics the run charts draw (loss, per-component validation loss, LR per group, speed, MoE health)."""


def build_state(experiment: str, graph: Graph) -> dict[str, Any]:
    """The dashboard's document: the graph's steps, its training runs' series and comparison, the
    fact sheets with a projection from the measured step time, and declared predictions."""
    plans = plan_graph(graph)
    names = {id(p.step): p.name for p in plans}
    runs = [_run(graph, p) for p in plans if _is_training(p.step)]
    finished = {r["name"]: r["output_path"] for r in runs if r["state"] == "cached"}
    predictions = {p.name: ladder.prediction_location(graph, p.step) for p in plans if p.name in finished}
    rows = compare.summarize(finished, predictions=predictions) if finished else []
    return {
        "experiment": experiment,
        "prefix": graph.prefix,
        "generated": time.time(),
        "steps": [_step(graph, p, names) for p in plans],
        "runs": runs,
        "comparison": {"rows": [vars(r) for r in rows], "table": compare.render_table(rows) if rows else "",
                       "columns": compare.COLUMNS},
        "fact_sheets": _fact_sheets(graph, {r["name"]: r for r in runs}),
    }


def _is_training(step) -> bool:
    from keel.spec.train import TrainStepConfig

    return isinstance(step, Step) and isinstance(step.config, TrainStepConfig)


def _step(graph: Graph, plan: StepPlan, names: dict[int, str]) -> dict[str, Any]:
    status = plan.status
    config = {}
    if isinstance(plan.step, Step):  # identity fields only: execution-only ones never change what a step computes
        config = compare.identity_fields(graph.identities.payload(plan.step))
    return {
        "name": plan.name,
        "state": plan.state,
        "reason": plan.reason,
        "output_path": plan.output_path,
        "deps": [names[id(d)] for d in plan.step.deps if id(d) in names],
        "description": getattr(plan.step, "description", None),
        "attempt": status.attempt if status else None,
        "started": status.started if status else None,
        "finished": status.finished if status else None,
        "duration_s": status.duration if status else None,
        "config": {k: v for k, v in config.items() if not k.endswith("__class__")},
        "log_tail": _log_tail(plan.output_path) if isinstance(plan.step, Step) else "",
    }


def _log_tail(path: str) -> str:
    """The log's last lines, read from its last `LOG_TAIL_BYTES`; a byte that is no UTF-8 (a
    character cut by the read, or written so) shows as \ufffd rather than failing the page."""
    fs, log = storage.split(keel_path(path, "log.txt"))
    try:
        size = fs.size(log)
        data = fs.cat_file(log, start=max(0, size - LOG_TAIL_BYTES))
    except (FileNotFoundError, NotADirectoryError):
        return ""
    lines = data.decode(errors="replace").replace("\r", "\n").splitlines()
    return "\n".join(lines[1 if size > LOG_TAIL_BYTES else 0:][-LOG_TAIL_LINES:])  # the first line read may be cut


def _run(graph: Graph, plan: StepPlan) -> dict[str, Any]:
    """One training step's curves and marks, read from its metrics (empty before its first step)."""
    config = plan.step.config
    try:
        records = read_metrics(storage.join(plan.output_path, METRICS_FILE))
    except (FileNotFoundError, OSError):
        records = []
    series: dict[str, dict[int, float]] = {}
    transports: dict[int, str] = {}
    rollbacks: set[tuple[int, int | None]] = set()  # (step, skipped batch): a step may roll back twice
    for record in records:  # the last record of a step wins (a resumed run rewrites its tail)
        for key, value in record.items():
            if CHART_KEYS.match(key) and isinstance(value, (int, float)):
                series.setdefault(key, {})[record["step"]] = value
        if isinstance(record.get("transport"), str):
            transports[record["step"]] = record["transport"]
        if "spike/rollback_from" in record:  # keel.train.spike_guard
            rollbacks.add((record["step"], record.get("spike/skipped_batch")))
    prediction = ladder.read_prediction(ladder.prediction_location(graph, plan.step))
    evals = series.get("eval/loss", {})
    final = evals[max(evals)] if evals else None
    return {
        "name": plan.name,
        "state": plan.state,
        "output_path": plan.output_path,
        "num_steps": config.train.num_steps,
        "tokens_per_step": config.train.tokens_per_step,
        "series": {k: _thinned(sorted(v.items())) for k, v in sorted(series.items())},
        "marks": _marks(plan.output_path, transports, config, {batch for _, batch in rollbacks if batch is not None}) + [
            {"step": step, "kind": "rollback", "label": f"rollback: skipped batch {batch}"} for step, batch in sorted(rollbacks)],
        "rollbacks": len(rollbacks),
        "prediction": prediction,
        "verdict": ladder.judge(final, prediction) if evals and max(evals) == config.train.num_steps else None,
        "tokens_per_s": steady_tokens_per_s(records),
    }


def _thinned(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """At most about `MAX_POINTS` of a series sorted by step: its first and last, and the lowest and
    highest finite value of each of `MAX_POINTS / 2` equal stretches between, so a spike stays drawn."""
    if len(points) <= MAX_POINTS:
        return points
    per = math.ceil(len(points) / (MAX_POINTS // 2))
    kept = {points[0], points[-1]}
    for i in range(0, len(points), per):
        stretch = [p for p in points[i:i + per] if math.isfinite(p[1])]
        if stretch:
            kept.update((min(stretch, key=lambda p: p[1]), max(stretch, key=lambda p: p[1])))
    return sorted(kept)


def _marks(path: str, transports: dict[int, str], config, skipped: set[int]) -> list[dict[str, Any]]:
    """Checkpoints kept, transport switches and mixture phase starts, by step: a phase starts at a
    batch, read by an earlier step for each batch the spike guard skipped before it (`skipped`)."""
    from keel.spec.checks import mixture_phases

    marks = [{"step": int(m.group(1)), "kind": "checkpoint", "label": f"checkpoint {m.group(1)}"}
             for name in storage.list_names(storage.join(path, "checkpoints")) if (m := re.fullmatch(r"step-(\d+)", name))]
    previous = None
    for step, transport in sorted(transports.items()):
        if previous is not None and transport != previous:
            marks.append({"step": step, "kind": "transport", "label": f"-> {transport}"})
        previous = transport
    marks += [{"step": first_step_reading(start, skipped), "kind": "phase", "label": f"phase {i}"}
              for i, (start, _) in enumerate(mixture_phases(config.data)) if start]
    return sorted(marks, key=lambda m: m["step"])


def _fact_sheets(graph: Graph, runs: dict[str, dict]) -> list[dict[str, Any]]:
    """Each training step's fact sheet text, with its end projected from the measured step time."""
    from keel.plan import fact_sheets_for
    from keel.spec import PlanError

    try:
        sheets = fact_sheets_for(graph)
    except PlanError as exc:
        return [{"step": "", "text": f"fact sheets unavailable: {exc}", "measured": None}]
    out = []
    for sheet in sheets:
        run = runs.get(sheet["step"])
        out.append({"step": sheet["step"], "text": sheet["text"], "measured": _measured(run) if run else None})
    return out


def _measured(run: dict) -> dict[str, Any] | None:
    """Seconds per training step (the mean of the latest transport's steps that did not compile:
    `steady_tokens_per_s`), steps done, and the end projected from them: now + the steps to go
    while the step runs, when it finished once it has; a step that is not running (interrupted,
    failed, not started again) projects no end."""
    if not run["tokens_per_s"]:
        return None
    step_s = run["tokens_per_step"] / run["tokens_per_s"]
    done = max((s for s, _ in run["series"].get("train/loss", [])), default=-1) + 1
    remaining = max(0, run["num_steps"] - done)
    if run["state"] == "cached":
        from keel.executor.status import read_status

        status = read_status(run["output_path"])
        end = status.finished if status and status.finished else time.time()
    elif run["state"] == RUNNING_ELSEWHERE:
        end = time.time() + remaining * step_s
    else:
        end = None
    return {"step_seconds": step_s, "steps_done": done, "num_steps": run["num_steps"], "remaining_s": remaining * step_s,
            "projected_end": None if end is None else dt.datetime.fromtimestamp(end, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "finished": run["state"] == "cached", "state": run["state"]}
