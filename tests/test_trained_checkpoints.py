"""The eval step on the checkpoint of the run that stretches it most: the hero's CPU twin (every hero
feature, a mixture, the pooled -> ring transport switch, host-offloaded optimizer state). On the
run's validation cache the eval gives the run's last validation loss. (A checkpoint of 2 processes
x 4 devices, evaluated in one process of 8: `test_cluster_training.py`, beside the run it reads.)"""

import json
import os
from pathlib import Path

import pytest

from defaults import default_eval
from keel import Step
from keel.executor.plan import Graph
from keel.executor.run import run_steps
from keel.spec.metrics import latest_by_step, METRICS_FILE, read_metrics

pytestmark = pytest.mark.slow

def eval_reproduces_the_last_validation_loss(prefix: str, evaluation: Step) -> dict:
    graph = Graph([evaluation], prefix)
    run = graph.path(evaluation.deps[0])
    evals = latest_by_step(read_metrics(os.path.join(run, METRICS_FILE)), "eval/loss")
    report = json.loads(Path(graph.path(evaluation), "eval.json").read_text())
    last = max(evals)
    assert report["step"] == last == evaluation.deps[0].config.train.num_steps
    assert abs(report["loss"] - evals[last]) < 1e-4, (report["loss"], evals[last])
    return report


@pytest.mark.timeout(900)
def test_the_hero_twins_final_checkpoint_evaluates_to_its_last_validation_loss(readme_twin, shared_prefix):
    done, graph = readme_twin  # conftest.py: the README's twin command, run once per session
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    train = next(s for s in graph.steps() if s.name.startswith("train/"))
    components = dict(train.config.data.components)  # 10 stdlib families and the whole stdlib, by component
    evaluation = default_eval("hero_535b-tiny", run=train, data=components)
    report = run_steps([evaluation], shared_prefix, echo=lambda _: None)  # the run is found cached
    assert report.ok, report.failures
    result = eval_reproduces_the_last_validation_loss(shared_prefix, evaluation)
    last = train.config.train.num_steps - 1
    assert result["transport"] == train.config.train.transport_at(last).transport == "ring"  # after the switch
    assert set(result["datasets"]) == set(components)
    assert all(0 < r["bits_per_byte"] < r["loss"] for r in result["datasets"].values())
