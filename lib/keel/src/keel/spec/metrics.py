"""The record a training step keeps of itself: `metrics.jsonl` under its output, one JSON object
per line (`step`, `train/loss`, `eval/loss`, ...). The trainer writes it (`keel.train.tracking`);
`keel status`, `keel compare`, the dashboard and the scaling ladder read it with these functions."""

from __future__ import annotations

import itertools
import json
import math
from typing import Any

import fsspec

METRICS_FILE = "metrics.jsonl"


def finite_json(value: Any) -> Any:
    """`value` with NaN and infinities as None, for documents others parse: JSON has neither, and
    Python's `json.dumps` writes bare `NaN` tokens that `JSON.parse` and strict parsers refuse
    (a diverged run's losses are NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def read_metrics(path: str) -> list[dict[str, Any]]:
    """All records of a metrics file, in the order written (a torn last line is skipped)."""
    records = []
    with fsspec.open(path, "r") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def latest_by_step(records: list[dict[str, Any]], key: str) -> dict[int, float]:
    """`{step: value}` of `key`, the last record written for each step winning (resumed runs)."""
    out: dict[int, float] = {}
    for record in records:
        if key in record:
            out[record["step"]] = record[key]
    return dict(sorted(out.items()))


COMPILE_WAIT = "compile/waited_s"
"""In the row of a step that was the first to use a compiled program (an attempt's first step, a
transport phase's or a new layout's): the seconds it stood waiting for that program. The loop
writes such a row whatever its `log_every`, so every compile wait a step stood is in its own row."""


def steady_tokens_per_s(records: list[dict[str, Any]]) -> float | None:
    """The speed the run trains at now, for `keel status`, `keel compare` and the dashboard alike:
    the tokens per second of the latest transport phase's logged steps that did not compile, as
    their tokens over their summed times. A projection multiplies the mean step time by the steps to
    go, and a mean of rates weights the fast steps more; an earlier transport ran at another speed.
    A row compiled where it names a wait (`COMPILE_WAIT`), and the phase's first row (rows written
    before the loop named waits); when every row of the phase compiled, they count. None: no rows."""
    speeds = {s: v for s, v in latest_by_step(records, "throughput/tokens_per_s").items() if v}
    if not speeds:
        return None
    transports, waits = latest_by_step(records, "transport"), latest_by_step(records, COMPILE_WAIT)
    newest_first = sorted(speeds, reverse=True)
    phase = list(itertools.takewhile(lambda s: transports.get(s) == transports.get(newest_first[0]), newest_first))
    steady = [s for s in phase[:-1] if s not in waits] or phase
    return len(steady) / sum(1 / speeds[s] for s in steady)
