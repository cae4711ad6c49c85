"""The scaling-ladder tutorial as the README runs it: four tiny MoE rungs, the fit, the larger target
trained after its prediction, and the prediction error printed and kept; `keel compare` sets the
target's loss against the band."""

import json
from pathlib import Path

import pytest

from keel.cli import load_experiment
from keel.spec.metrics import METRICS_FILE, latest_by_step, read_metrics
from test_step_isolation import graph_as_run, keel

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
TUTORIAL = "experiments/tutorials/scaling_ladder.py"


@pytest.mark.timeout(2400)
def test_the_ladder_fits_four_sizes_and_reports_its_error_on_the_fifth(shared_prefix):
    # the session's prefix: the tutorial's data chain is tiny_moe's, which other tests' runs there share
    done = keel("run", TUTORIAL, "--prefix", shared_prefix, timeout=2300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "fit L(C) = " in done.stdout and "prediction error on hidden 128, 64 steps: actual val loss" in done.stdout
    graph = graph_as_run(load_experiment(str(REPO / TUTORIAL)), shared_prefix)
    steps = {s.name: s for s in graph.steps()}
    fit = json.loads((Path(graph.path(steps["ladder/tiny"])) / "fit.json").read_text())
    assert len(fit["rungs"]) == 4 and fit["prediction"]["compute"] > max(r["compute"] for r in fit["rungs"])
    prediction = fit["prediction"]
    assert prediction["low"] <= prediction["loss"] <= prediction["high"]
    check = json.loads((Path(graph.path(steps["ladder/tiny/check"])) / "check.json").read_text())
    target = steps["train/ladder/tiny/target"]
    evals = latest_by_step(read_metrics(str(Path(graph.path(target)) / METRICS_FILE)), "eval/loss")
    assert check["step"] == max(evals) == 64 and check["actual"] == evals[64]  # the target's own final validation loss
    assert check["error"] == pytest.approx(check["actual"] - prediction["loss"])
    table = keel("compare", TUTORIAL, "--prefix", shared_prefix, "--only", "target", timeout=120)
    assert table.returncode == 0 and "| predicted |" in table.stdout.splitlines()[0], table.stdout + table.stderr
