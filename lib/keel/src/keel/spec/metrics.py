"""The record a training step keeps of itself: `metrics.jsonl` under its output, one JSON object
per line (`step`, `train/loss`, `eval/loss`, ...). The trainer writes it (`keel.train.tracking`);
`keel status`, `keel compare`, the dashboard and the scaling ladder read it with these functions."""

from __future__ import annotations

import json
from typing import Any

import fsspec

METRICS_FILE = "metrics.jsonl"


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
