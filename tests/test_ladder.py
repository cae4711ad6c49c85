"""Loss prediction from a scaling ladder: the fit recovers a known law with a band that holds it, the
declaration (rungs, cached fit, a prediction only for the run it was made for, execution-only on
the target), and the prediction carried through `keel plan`, `status`, `compare` and the dashboard,
with a run that leaves the band flagged. The rungs and the target are stand-ins that write the
validation loss a known law gives, so this runs in seconds; the real ladder is the tutorial's."""

import dataclasses
import glob
import json
import os
import textwrap

import pytest

from keel.cli import console_main, load_experiment
from keel.executor.plan import Graph
from keel.trained.ladder import LadderConfig, fit_power_law, judge, training_compute


def law(compute: float) -> float:
    return 2.0 + 3.0 * (compute / 1e10) ** -0.3


def test_the_fit_recovers_a_known_law_and_its_band_holds_the_truth():
    compute = [1e10, 2e10, 4e10, 8e10, 1.6e11]
    wiggle = [0.004, -0.003, 0.002, -0.004, 0.003]  # measurement noise
    fit = fit_power_law(compute, [law(c) + w for c, w in zip(compute, wiggle)])
    assert fit.E == pytest.approx(2.0, abs=0.3) and fit.alpha == pytest.approx(0.3, abs=0.08)
    low, high, method = fit.band(4e11)
    assert method == "jackknife over 5 rungs" and low < law(4e11) < high and high - low < 0.2
    assert low < fit.loss(4e11) < high
    # Without noise every leave-one-out fit finds the law again: the band closes on the truth.
    exact = fit_power_law(compute[:4], [law(c) for c in compute[:4]])
    low, high, _ = exact.band(4e11)
    assert low == pytest.approx(law(4e11), abs=1e-3) and high == pytest.approx(law(4e11), abs=1e-3)
    with pytest.raises(ValueError, match="4 or more"):
        fit_power_law(compute[:3], [law(c) for c in compute[:3]])


def test_a_ladder_needs_four_distinct_rungs_and_judges_a_loss_against_the_band():
    with pytest.raises(ValueError, match="give 4 or more"):
        LadderConfig(runs={"a": "x", "b": "y", "c": "z"}, compute={"a": 1.0, "b": 2.0, "c": 3.0}, target="t", target_compute=9.0)
    with pytest.raises(ValueError, match="same compute"):
        LadderConfig(runs=dict.fromkeys("abcd", "x"), compute=dict.fromkeys("abcd", 1.0), target="t", target_compute=9.0)
    band = {"low": 3.0, "high": 3.2}
    assert [judge(v, band) for v in (2.9, 3.1, 3.3, None)] == ["below", "within", "above", None]
    # a loss that is no number lies in no band (NaN compares neither above nor below: it read as within)
    assert [judge(v, band) for v in (float("nan"), float("inf"))] == ["not finite", "not finite"]


def test_a_rung_that_ended_on_a_loss_that_is_no_number_is_named(tmp_path):
    """scipy refused the fit with "array must not contain infs or NaNs", naming no rung."""
    from keel.trained.ladder import ladder_step

    runs, compute = {}, {}
    for i, loss in enumerate((5.0, 4.5, float("nan"), 4.0)):
        run = tmp_path / f"rung{i}"
        run.mkdir()
        (run / "metrics.jsonl").write_text(json.dumps({"step": 10, "eval/loss": loss}) + "\n")
        runs[f"rung{i}"], compute[f"rung{i}"] = str(run), 1e10 * 2**i
    config = LadderConfig(runs=runs, compute=compute, target="t", target_compute=1e12, output_path=str(tmp_path / "fit"))
    with pytest.raises(ValueError, match=r"ladder run rung2 \(.*rung2\) ended with validation loss nan at step 10: a power "
                                         "law cannot be fitted"):
        ladder_step(config)


_EXPERIMENT = textwrap.dedent(
    """
    import dataclasses, json, os
    from defaults import default_scaling_ladder, default_train
    from defaults.models import tiny_moe
    from keel import External, Step, main, output_of
    from keel.spec import AdamWConfig, TrainConfig
    from keel.trained.ladder import training_compute

    def pretend_to_train(config):  # the validation losses a known law gives (the target: plus an offset)
        compute = training_compute(config.model, config.train)
        loss = 2.0 + 3.0 * (compute / 1e10) ** -0.3 + float(os.environ.get("TARGET_OFFSET", "0")) * (config.predicted_loss is not None)
        rows = [{"step": 0, "eval/loss": 7.0}, {"step": 0, "train/loss": 7.0, "throughput/tokens_per_s": 100.0},
                {"step": config.train.num_steps, "eval/loss": loss}]
        with open(os.path.join(config.output_path, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\\n" for r in rows)

    data = External("cache", "/nowhere", version="v1")
    train = TrainConfig(batch_size=8, seq_len=128, num_steps=10, optimizer=AdamWConfig(lr=1e-3))
    ladder = default_scaling_ladder("fake", data=data, model=tiny_moe, train=train, sizes=(32, 48, 64, 96),
                                    steps=(20, 30, 40, 60), target=(128, 80))
    rungs = {r.name: Step(r.name, pretend_to_train, r.config) for r in ladder.runs}
    fit = Step(ladder.fit.name, ladder.fit.fn, dataclasses.replace(ladder.fit.config, runs=rungs))
    ladder = dataclasses.replace(ladder, fit=fit, prediction=output_of(fit, "prediction.json"))
    declared = default_train("big", data=data, model=ladder.target_model, train=ladder.target_train,
                             predicted_loss=ladder.prediction)
    target = Step(declared.name, pretend_to_train, declared.config)

    if __name__ == "__main__":
        main([ladder.check(target)])
    """
)


def test_a_prediction_through_plan_run_status_compare_and_the_dashboard(tmp_path, capsys, monkeypatch):
    from dashboard_browser import browser_page, serving
    from defaults import default_train
    from keel.dashboard import build_state

    experiment = tmp_path / "ladder_exp.py"
    experiment.write_text(_EXPERIMENT)
    prefix = str(tmp_path / "out")
    graph = Graph(load_experiment(str(experiment)), prefix)
    steps = {s.name: s for s in graph.steps()}
    assert sorted(steps) == ["ladder/fake", "ladder/fake/check", "train/big", "train/ladder/fake/h32-s20",
                             "train/ladder/fake/h48-s30", "train/ladder/fake/h64-s40", "train/ladder/fake/h96-s60"]
    target = steps["train/big"]
    assert steps["ladder/fake"] in target.deps  # the target trains after its prediction is made
    unpredicted = default_train("big", data=target.config.data, model=target.config.model, train=target.config.train)
    assert graph.identities.hash(target) == Graph([unpredicted], prefix).identities.hash(unpredicted)  # execution-only
    with pytest.raises(ValueError, match="was made for"):
        default_train("other", data=target.config.data, model=target.config.model,
                      train=dataclasses.replace(target.config.train, num_steps=81),
                      predicted_loss=target.config.predicted_loss)

    # `--set` reaches both sides of the prediction: a rung's compute, which the fit reads, and the target's
    assert console_main(["plan", str(experiment), "--prefix", prefix, "--set", "train/big:train.num_steps=81"]) == 2
    assert "train/big: predicted_loss was made for" in capsys.readouterr().err
    longer = str(tmp_path / "longer")
    assert console_main(["run", str(experiment), "--prefix", longer, "--set", "train/ladder/fake/h32-s20:train.num_steps=25"]) == 0
    rung = {r["run"]: r for r in json.loads(open(glob.glob(f"{longer}/ladder/fake-*/fit.json")[0]).read())["rungs"]}
    retrained = dataclasses.replace(steps["train/ladder/fake/h32-s20"].config.train, num_steps=25)
    assert rung["train/ladder/fake/h32-s20"]["compute"] == training_compute(target.config.model.replace(hidden_dim=32), retrained)
    assert rung["train/ladder/fake/h48-s30"]["compute"] == training_compute(steps["train/ladder/fake/h48-s30"].config.model,
                                                                            steps["train/ladder/fake/h48-s30"].config.train)
    capsys.readouterr()

    assert console_main(["plan", str(experiment), "--prefix", prefix]) == 0
    assert "prediction   not made yet: the ladder's fit writes" in capsys.readouterr().out
    assert console_main(["run", str(experiment), "--prefix", prefix]) == 0
    printed = capsys.readouterr().out
    assert "fit L(C) = " in printed and "prediction error on hidden 128, 80 steps: actual val loss " in printed

    fit = json.loads(open(os.path.join(graph.path(steps["ladder/fake"]), "fit.json")).read())
    assert [r["run"] for r in fit["rungs"]] == sorted(n for n in steps if n.startswith("train/ladder/"))
    assert fit["alpha"] == pytest.approx(0.3, abs=1e-3) and fit["E"] == pytest.approx(2.0, abs=1e-2)
    prediction = fit["prediction"]
    truth = law(prediction["compute"])
    assert prediction["loss"] == pytest.approx(truth, abs=1e-3) and prediction["low"] <= truth <= prediction["high"]
    check = json.loads(open(os.path.join(graph.path(steps["ladder/fake/check"]), "check.json")).read())
    assert check["verdict"] == "within" and abs(check["error"]) < 1e-3

    assert console_main(["plan", str(experiment), "--prefix", prefix]) == 0
    assert f"prediction   predicted val loss {prediction['loss']:.4f} (95% band" in capsys.readouterr().out
    assert console_main(["status", str(experiment), "--prefix", prefix]) == 0
    assert "at step 80: within the band" in capsys.readouterr().out

    # The same run, trained again off the law: every view flags it.
    monkeypatch.setenv("TARGET_OFFSET", "0.5")
    assert console_main(["run", str(experiment), "--prefix", prefix, "--force", "^(train/big|ladder/fake/check)$"]) == 0
    assert "OUTSIDE (above) the 95% band" in capsys.readouterr().out
    assert console_main(["status", str(experiment), "--prefix", prefix]) == 0
    assert "at step 80: OUTSIDE the band (above)" in capsys.readouterr().out
    assert console_main(["compare", str(experiment), "--prefix", prefix, "--only", "big"]) == 0
    table = capsys.readouterr().out
    assert "| predicted |" in table and "OUTSIDE (above)" in table and "- predicted: the declared predicted_loss" in table
    state = build_state(str(experiment), graph)
    run = next(r for r in state["runs"] if r["name"] == "train/big")
    assert run["verdict"] == "above" and run["prediction"]["loss"] == prediction["loss"]
    row = next(r for r in state["comparison"]["rows"] if r["run"] == "train/big")  # the page's comparison table
    assert row["verdict"] == "above" and row["prediction"]["loss"] == prediction["loss"]
    assert "| predicted |" in state["comparison"]["table"]
    with serving(str(experiment), graph) as url, browser_page() as page:  # the page draws the band and flags the run
        page.goto(url)
        drawn = page.locator('.run[data-run="train/big"]')
        assert drawn.locator('svg[data-chart="loss"] rect.band').count() == 1
        assert "OUTSIDE the band (above)" in drawn.locator(".badge.prediction").inner_text()


def test_status_and_compare_find_the_prediction_where_plan_does(tmp_path, capsys):
    """`predicted_loss` is no part of the run's identity, so the path its step.json froze can be stale:
    status and compare find the prediction through the graph, as plan and the dashboard do. A copied
    prefix reads its own prediction (the original is gone), and after the ladder changes the run stays
    cached while every view says its prediction is not made yet."""
    import shutil

    experiment = tmp_path / "ladder_exp.py"
    experiment.write_text(_EXPERIMENT)
    original, copy = str(tmp_path / "out"), str(tmp_path / "copy")
    assert console_main(["run", str(experiment), "--prefix", original]) == 0
    shutil.copytree(original, copy)
    shutil.rmtree(original)
    capsys.readouterr()

    def shown(command: str, *options: str) -> str:
        assert console_main([command, str(experiment), "--prefix", copy, *options]) == 0
        return capsys.readouterr().out

    assert "at step 80: within the band" in shown("status")
    assert "| predicted |" in shown("compare", "--only", "big")
    renamed = ("--set", "ladder/fake:target=renamed")
    assert "prediction   not made yet: the ladder's fit writes" in shown("plan", *renamed)
    status = shown("status", *renamed)
    assert "cached            train/big" in status and "prediction declared, not made yet" in status, status
    assert "| predicted |" not in shown("compare", "--only", "big", *renamed)
