"""The hero's twin trains end to end on 8 simulated CPU devices: same graph shape, loss falls.
It reads the run of the README's twin command (`readme_twin`, conftest.py)."""

import json
from pathlib import Path

import pytest

from keel.data import iter_documents
from keel.spec.resolved import resolve


@pytest.mark.slow
def test_the_twin_trains_through_its_phases_transport_and_offload_switch_as_planned(readme_twin):
    done, graph = readme_twin  # conftest.py: the README's twin command, run once per session
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    step = next(s for s in graph.steps() if s.name.startswith("train/"))
    config = step.config
    assert config.train.num_steps == 120
    assert [p.start_step for p in config.data.phases] == [0, 32, 96]
    assert [(t.transport, t.start_step) for t in config.train.transports] == [("fixed_pooled_all_to_all", 0), ("ring", 25)]
    assert config.train.host_offload.master_weights_until_step == 25, "the swap step, scaled"
    caches = {name: c.name for name, c in config.data.components.items()}
    assert len(set(caches.values())) == 11, "a cache per topic, and the general stdlib for every phase's 'other'"
    assert {caches[f"other-{p}"] for p in ("initial", "main", "cooldown")} == {"tokenized/hero-twin-general"}
    steps, swap = config.train.num_steps, config.train.host_offload.master_weights_until_step

    run_dir = Path(graph.path(step))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in records if "train/loss" in r}
    assert sorted(train) == list(range(steps))
    assert {train[s]["transport"] for s in range(swap)} == {"fixed_pooled_all_to_all"}
    assert {train[s]["transport"] for s in range(swap, steps)} == {"ring"}
    first, last = train[0]["train/loss"], sum(train[s]["train/loss"] for s in range(steps - 3, steps)) / 3
    assert last < first - 0.3, (first, last)
    # distinct data per topic component: their validation losses differ
    evals = [r for r in records if "eval/loss" in r]
    per_topic = {k: v for k, v in evals[-1].items() if k.startswith("eval/") and k.endswith("/loss")
                 and k != "eval/loss" and not k.startswith("eval/other-")}
    assert len(per_topic) == 10 and len(set(per_topic.values())) == len(per_topic), per_topic  # same data: the same float
    # each topic validates on documents no component trains on (the run's own document sets)
    documents = {name: graph.path(cache.config.documents) for name, cache in config.data.components.items()}
    trained = {d.text for path in set(documents.values()) for d in iter_documents(path, "train")}
    held_out = {name: {d.text for d in iter_documents(path, "validation")} for name, path in documents.items()}
    assert all(texts for name, texts in held_out.items() if not name.startswith("other-")), held_out
    assert {name: texts & trained for name, texts in held_out.items() if texts & trained} == {}

    # the live layout, as the run recorded it: planned at the start and after the swap
    layout = json.loads((run_dir / ".keel" / "layout.json").read_text())["records"]
    assert [(r["step"], r["reason"]) for r in layout] == [(0, "start"), (swap, "phase change")]
    plan = resolve(config)
    for record in layout:
        live = [leaf for leaf in record["leaves"] if not leaf["path"].startswith("opt_state/counter/")]
        assert live == [leaf.record() for leaf in plan.state_at(record["step"])]
    kinds = [{leaf["memory_kind"] for leaf in r["leaves"] if leaf["path"].startswith("model/")} for r in layout]
    assert kinds == [{"pinned_host"}, {"device"}], "master weights on the host until the swap, then on the device"
    # what the step's kernels reported they ran after each phase's first step (the pooled waves' capacity as planned)
    assert layout[0]["transport"] == {"transport": "fixed_pooled_all_to_all",
                                      "capacity_factor": plan.transport_at(0).capacity_factor}
    assert plan.transport_at(0).capacity_factor > 0
    assert layout[1]["transport"] == {"transport": "ring", "capacity_factor": None}
