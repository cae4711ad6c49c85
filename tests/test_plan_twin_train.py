"""The hero's twin trains end to end on 8 simulated CPU devices: same graph shape, loss falls."""

import dataclasses
import json
import runpy
from pathlib import Path

import pytest

from keel.executor.run import run_steps

HERO = Path(__file__).resolve().parents[1] / "experiments" / "hero_535b.py"


@pytest.mark.slow
def test_the_twin_trains_through_its_phases_and_transport_switch(tmp_path):
    hero = runpy.run_path(str(HERO), run_name="hero_535b")
    (step,) = hero["twin"](num_steps=12, corpus_bytes=600_000, mixture_block=16)
    config = step.config
    assert [p.start_step for p in config.data.phases] == [0, 3, 10]
    assert [(t.transport, t.start_step) for t in config.train.transports] == [("fixed_pooled_all_to_all", 0), ("ring", 3)]
    # 600 KB of stdlib holds no validation document: no evaluation to declare
    step = step.with_config(dataclasses.replace(config, train=dataclasses.replace(config.train, eval_every=12, eval_batches=0)))

    report = run_steps([step], str(tmp_path), echo=lambda line: None)
    assert not report.failures, report.failures

    (run_dir,) = (tmp_path / "train").iterdir()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in records if "train/loss" in r}
    assert sorted(train) == list(range(12))
    assert {train[s]["transport"] for s in range(3)} == {"fixed_pooled_all_to_all"}
    assert {train[s]["transport"] for s in range(3, 12)} == {"ring"}
    first, last = train[0]["train/loss"], sum(train[s]["train/loss"] for s in (9, 10, 11)) / 3
    assert last < first - 0.3, (first, last)
