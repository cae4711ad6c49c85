"""The speed a run is shown at, and where its time went: `keel status`, the dashboard's projected
end and `keel compare` give one figure (`keel.spec.metrics.steady_tokens_per_s`), and a step that
waited for its program has a metrics row naming that wait whatever `log_every` is. Metrics are
written by hand (no training), so this runs in seconds."""

import json
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

from keel.cli import console_main, load_experiment
from keel.executor.plan import Graph
from keel.spec.metrics import COMPILE_WAIT, METRICS_FILE

TOKENS_PER_STEP = 16  # batch_size 2 x seq_len 8
NUM_STEPS = 6040

_EXPERIMENT = textwrap.dedent(
    f"""
    from defaults import default_train
    from defaults.models import tiny_moe
    from keel import External, main
    from keel.spec import AdamWConfig, TrainConfig

    train = TrainConfig(batch_size=2, seq_len=8, num_steps={NUM_STEPS}, optimizer=AdamWConfig(lr=0.5))
    run = default_train("speed", data=External("cache", "/nowhere", version="v1"), model=tiny_moe, train=train)
    if __name__ == "__main__":
        main([run])
    """
)


def _rows() -> list[dict]:
    """40 steps: pooled at 1,000 tokens/s (step 0 compiled), then ring from step 20 (which compiled)
    alternating 1,000 and 4,000 tokens/s, i.e. 0.01 s a step on average (1,600 tokens/s: the mean of
    the rates, 2,500, would put the end 36% early). An attempt resumed at step 31 waited 0.3 s there."""
    rows = []
    for s in range(40):
        speed = (10.0 if s == 0 else 1000.0) if s < 20 else 20.0 if s == 20 else 1000.0 if s % 2 else 4000.0
        rows.append({"step": s, "train/loss": 6.0 - s / 100, "throughput/tokens_per_s": speed,
                     "transport": "fixed_pooled_all_to_all" if s < 20 else "ring"})
    rows[31].update({"throughput/tokens_per_s": TOKENS_PER_STEP / 0.31, COMPILE_WAIT: 0.3})
    return rows


def _prefix(tmp_path) -> tuple[str, Graph, Path]:
    """The experiment, and its training step's output holding the rows above and the record of a
    second attempt whose launcher died (step.json, no status, no lease)."""
    experiment = tmp_path / "speed_exp.py"
    experiment.write_text(_EXPERIMENT)
    graph = Graph(load_experiment(str(experiment)), str(tmp_path / "out"))
    output = Path(graph.path(next(s for s in graph.steps() if s.name == "train/speed")))
    (output / ".keel").mkdir(parents=True)
    (output / ".keel" / "step.json").write_text(json.dumps({"name": "train/speed", "attempt": 2, "started": time.time() - 60}))
    (output / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    return str(experiment), graph, output


def test_status_and_the_dashboard_project_from_the_latest_transports_steady_step_time(tmp_path, capsys):
    from keel.dashboard import build_state

    experiment, graph, _ = _prefix(tmp_path)
    sheet = next(s for s in build_state(experiment, graph)["fact_sheets"] if s["step"] == "train/speed")
    assert round(sheet["measured"]["step_seconds"], 6) == 0.01, sheet["measured"]  # ring's, compiled steps left out
    assert console_main(["status", experiment, "--prefix", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "attempt 2 died while RUNNING" in out
    # the launcher died: how far it got, at the dashboard's speed, and not running (no time to go)
    assert f"training: step 40/{NUM_STEPS}, loss 5.6100, 1,600 tokens/s; not running" in out, out


def test_a_step_that_waited_for_its_program_gets_a_row_naming_the_wait_whatever_log_every():
    """The loop's `_report` on a stand-in run: with log_every=10, step 14 (off the cadence) first
    used a program and waited 2.5 s for it, so it has a row with that wait; step 15 waited for
    nothing and has none."""
    import numpy as np

    from keel.train.loop import StepDone, _Run

    logged = []
    run = SimpleNamespace(config=SimpleNamespace(tokens_per_step=TOKENS_PER_STEP, log_every=10, num_steps=100),
                          progress=SimpleNamespace(step=lambda *a, **k: None), _mixture_phase=lambda step: None,
                          _log=lambda step, values: logged.append((step, values)))
    phase = SimpleNamespace(transport="ring")
    for step, waited in ((14, 2.5), (15, None)):
        done = StepDone(step, phase, {"train/loss": np.float32(6.0)}, time.perf_counter() - 3.0, compile_waited=waited)
        _Run._report(run, done)
    assert [(step, values.get(COMPILE_WAIT)) for step, values in logged] == [(14, 2.5)], logged
