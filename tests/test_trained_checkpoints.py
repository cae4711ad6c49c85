"""The eval step on checkpoints of the runs that stretch it: the hero's CPU twin (every hero feature,
a mixture, the pooled -> ring transport switch, host-offloaded optimizer state) and the tiny
experiment trained as 2 processes x 4 devices on a local Iris cluster, restored in one process of
8 devices. On the run's validation cache the eval gives the run's last validation loss."""

import dataclasses
import json
import os
from pathlib import Path

import pytest

from defaults import default_eval
from iris_local import free_port, local_iris_client
from keel import Resources, Step
from keel.cli import load_experiment
from keel.executor.plan import Graph
from keel.executor.run import run_steps
from keel.executor.status import keel_path
from keel.spec import TransportPhase
from keel.spec.metrics import latest_by_step, METRICS_FILE, read_metrics

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent


def _eval_reproduces_the_last_validation_loss(prefix: str, evaluation: Step) -> dict:
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
    result = _eval_reproduces_the_last_validation_loss(shared_prefix, evaluation)
    last = train.config.train.num_steps - 1
    assert result["transport"] == train.config.train.transport_at(last).transport == "ring"  # after the switch
    assert set(result["datasets"]) == set(components)
    assert all(0 < r["bits_per_byte"] < r["loss"] for r in result["datasets"].values())


@pytest.fixture(scope="module")
def iris(tmp_path_factory):
    with local_iris_client(tmp_path_factory.mktemp("iris")) as (_, client):
        yield client



@pytest.mark.timeout(900)
def test_a_checkpoint_of_2_processes_x_4_devices_evaluates_in_one_process_of_8(tmp_path, iris):
    step = next(s for s in load_experiment(str(REPO / "experiments/tutorials/tiny_moe.py")) if s.name == "train/tiny_moe")
    train = dataclasses.replace(step.config.train, num_steps=3, eval_every=3, eval_batches=1, weight_decay_change=None,
                                permanent_checkpoint_every=None, rolling_checkpoint_minutes=None,
                                compute_dtype="float32", transports=(TransportPhase(0, "fixed_all_to_all"),))
    config = dataclasses.replace(step.config, train=train, coordinator=f"127.0.0.1:{free_port()}")
    multi = Step(step.name, step.fn, config, resources=Resources(cpu=1, replicas=2), isolated=True)
    evaluation = default_eval("tiny_moe-2x4", run=multi)  # on the run's own data
    report = run_steps([evaluation], str(tmp_path), cluster=iris, echo=lambda _: None)
    assert report.ok, report.failures
    run = Graph([evaluation], str(tmp_path)).path(multi)
    assert "Traceback" not in Path(keel_path(run, "log.replica1.txt")).read_text()  # two processes trained
    _eval_reproduces_the_last_validation_loss(str(tmp_path), evaluation)
