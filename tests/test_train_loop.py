"""The training loop on 8 simulated devices (2 racks x 4, expert parallel 4) with a micro keel MoE.

Exact resume after kill -9, the transport switch, the quantile-balancing bias carried from one
step to the next and through checkpoints, metrics / PNG / wandb outputs.
"""

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from keel.spec.transports import TransportSpec
from keel.spec.train import AdamWConfig, TrainConfig, TransportPhase
from keel.train.tracking import open_wandb, run_id_for
from keel.spec.metrics import latest_by_step, METRICS_FILE, read_metrics
from keel.train.tracking import main as plot_main

HERE = os.path.dirname(__file__)
BASE = dict(batch_size=16, seq_len=64, eval_every=4, eval_batches=1, z_loss=1e-4, rolling_checkpoint_minutes=None)

pytestmark = pytest.mark.slow


def _losses(output_path):
    return latest_by_step(read_metrics(os.path.join(output_path, METRICS_FILE)), "train/loss")


def _driver(output_path, **fields):
    cmd = [sys.executable, os.path.join(HERE, "train_driver.py"), str(output_path), json.dumps({**BASE, **fields})]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc, timeout=300) -> str:
    """The run's printed lines, once it ended well."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return out


def test_resume_after_kill_9_gives_the_uninterrupted_losses(tmp_path):
    fields = dict(num_steps=14, permanent_checkpoint_every=4, delay_per_item=0.02)
    reference, crashed = tmp_path / "ref-0000000000", tmp_path / "crash-0000000000"
    _finish(_driver(reference, **fields))

    proc = _driver(crashed, **fields)
    deadline = time.time() + 300
    while time.time() < deadline and max(_safe_losses(crashed), default=-1) < 9:
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    seen_before_kill = max(_safe_losses(crashed))
    assert 9 <= seen_before_kill < 13, "the run must die mid-way, after its step-8 checkpoint"

    printed = _finish(_driver(crashed, **fields))
    # the resume evaluates first at step 12: its evaluation compiled in the background, not while training waited there
    assert re.search(r"(compiled|loaded) the \S+ evaluation( from the compilation cache)? in [\d.]+s, ahead \(", printed), printed
    expected, got = _losses(reference), _losses(crashed)
    assert sorted(got) == list(range(14))
    records = read_metrics(os.path.join(crashed, METRICS_FILE))
    steps_logged = [r["step"] for r in records if "train/loss" in r]
    assert steps_logged == list(range(14)), "one row per step: rows past the step-8 checkpoint were dropped on resume"
    assert [r["step"] for r in records if "eval/loss" in r] == [0, 4, 8, 12, 14]
    assert got == expected, {s: (got[s], expected[s]) for s in got if got[s] != expected[s]}


def _safe_losses(output_path):
    try:
        return _losses(output_path)
    except FileNotFoundError:
        return {}


@pytest.fixture(scope="module")
def switch_run(tmp_path_factory):
    """8 steps, fixed-capacity all-to-all until step 4 then the dropless ring; checkpoint every step.

    fp32 compute, so that two transports summing in different orders agree to ~1e-6.
    """
    from train_standin import loop_inputs

    from keel.train import loop

    out = str(tmp_path_factory.mktemp("runs") / "tiny_switch-0123abcd89")
    transports = (TransportPhase(0, "fixed_all_to_all"), TransportPhase(4, "ring"))
    config = TrainConfig(num_steps=8, permanent_checkpoint_every=1, optimizer=AdamWConfig(lr=1e-2), transports=transports,
                         compute_dtype="float32", **BASE)
    sent = []  # what the loop's wandb run was sent, as (thread, record)

    def recorded_wandb(*args, **kwargs):
        tracker = open_wandb(*args, **kwargs)
        send = tracker.log

        def log(metrics, *, step, commit=None):
            sent.append((threading.current_thread().name, {"step": step, **metrics}))
            send(metrics, step=step, commit=commit)
        tracker.log = log
        return tracker

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "open_wandb", recorded_wandb)
        loop.train(config, loop_inputs(config), out)
    return out, config, sent


@pytest.fixture(scope="module")
def fixed_run(tmp_path_factory):
    from train_standin import loop_inputs

    from keel.train.loop import train

    out = str(tmp_path_factory.mktemp("runs") / "tiny_fixed-0123abcd89")
    config = TrainConfig(num_steps=8, optimizer=AdamWConfig(lr=1e-2), compute_dtype="float32", **BASE)
    train(config, loop_inputs(config, use_wandb=False), out)
    return out


def test_transport_switch_checkpoints_at_the_switch_and_keeps_the_loss_continuous(switch_run, fixed_run):
    out, _, _ = switch_run
    records = [r for r in read_metrics(os.path.join(out, METRICS_FILE)) if "train/loss" in r]
    assert [r["transport"] for r in records] == ["fixed_all_to_all"] * 4 + ["ring"] * 4
    assert os.path.exists(os.path.join(out, "checkpoints", "step-4", "metadata.json"))
    assert all(r["moe/dropped_fraction"] == 0.0 for r in records)
    # what the step's MoE kernels reported they ran after each phase's first step, as the run recorded it
    with open(os.path.join(out, ".keel", "layout.json")) as f:
        layout = json.load(f)["records"]
    assert [(r["step"], r["reason"], r["transport"]) for r in layout] == [
        (0, "start", {"transport": "fixed_all_to_all", "capacity_factor": 4.0}),
        (4, "phase change", {"transport": "ring", "capacity_factor": None})]
    switched, unswitched = _losses(out), _losses(fixed_run)
    # Nothing is dropped, so the dropless transport computes the same function: the loss curve
    # carries on as if no switch happened.
    for step in range(8):
        assert switched[step] == pytest.approx(unswitched[step], abs=2e-5), step
    assert switched[7] < switched[0]


def test_a_phase_returning_to_an_earlier_transport_runs_the_program_compiled_for_it(tmp_path, monkeypatch):
    """fixed, ring, fixed again, then fixed at another capacity: three step programs and three
    evaluations, each compiled once (a phase that differed only in its start step compiled the same
    program a second time), and the last compiled ahead while the one returned to runs (it was
    compiled at its step, as only a program's first use looked ahead)."""
    from train_standin import loop_inputs

    from keel.train import compile_ahead
    from keel.train.loop import train

    compiled = []
    for name in ("ahead", "now"):
        original = getattr(compile_ahead.Compiler, name)

        def counted(self, what, *args, _original=original, _name=name):
            compiled.append((what, _name))
            return _original(self, what, *args)

        monkeypatch.setattr(compile_ahead.Compiler, name, counted)
    transports = (TransportPhase(0, "fixed_all_to_all"), TransportPhase(2, "ring"),
                  TransportPhase(4, "fixed_all_to_all"), TransportPhase(6, "fixed_all_to_all", capacity_factor=8.0))
    config = TrainConfig(num_steps=8, optimizer=AdamWConfig(lr=1e-2), transports=transports, compute_dtype="float32",
                         **{**BASE, "eval_every": 2})
    out = str(tmp_path / "tiny_back-0123abcd89")
    train(config, loop_inputs(config, use_wandb=False), out)
    programs = ["the fixed_all_to_all training step", "the fixed_all_to_all evaluation", "the ring training step",
                "the ring evaluation"]
    assert sorted(what for what, _ in compiled) == sorted(programs + programs[:2]), compiled  # fixed at capacity 4 and 8
    assert compiled[-2:] == [("the fixed_all_to_all training step", "ahead"),
                             ("the fixed_all_to_all evaluation", "ahead")]
    records = [r for r in read_metrics(os.path.join(out, METRICS_FILE)) if "train/loss" in r]
    assert [r["transport"] for r in records] == ["fixed_all_to_all"] * 2 + ["ring"] * 2 + ["fixed_all_to_all"] * 4
    # the checkpoints the finished run holds are the ones its config says it keeps (an eval is held to that rule)
    kept = sorted(os.listdir(os.path.join(out, "checkpoints")), key=lambda name: int(name.split("-")[1]))
    assert kept == [f"step-{s}" for s in range(1, 9) if config.keeps_checkpoint(s)] == ["step-2", "step-4", "step-6", "step-8"]


def test_router_bias_of_step_t_plus_1_comes_from_step_t_and_survives_checkpoints(switch_run):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from train_standin import BATCH_AXES, loop_inputs, micro_lm, rack_mesh

    from keel.train.batches import batch_loader
    from keel.train.checkpoint import restore_like

    out, config, _ = switch_run
    mesh = rack_mesh()
    lm = micro_lm(mesh)
    with jax.set_mesh(mesh):
        exemplar = lm.init(jax.random.PRNGKey(0))
        before = restore_like({"model": exemplar}, os.path.join(out, "checkpoints", "step-6"))["model"]
        after = restore_like({"model": exemplar}, os.path.join(out, "checkpoints", "step-7"))["model"]
    batches = batch_loader(loop_inputs(config).train_data, batch_size=16, mesh=mesh, batch_axes=BATCH_AXES).iter_from_step(6)
    batch = next(batches)
    batches.close()
    ring = TransportSpec("ring")
    with jax.set_mesh(mesh):
        _, aux = jax.jit(lambda m, b: lm.loss(m, b, transport=ring, z_loss=1e-4, compute_dtype=jnp.float32))(
            before, batch
        )
        expected = lm.apply_router_update(before, aux)

    def bias(model):
        return np.asarray(model.layers.stacked.moe.router_bias.array)

    assert np.abs(bias(after)).max() > 0, "quantile balancing moved the bias"
    np.testing.assert_allclose(bias(after), bias(expected), atol=1e-6)
    assert not np.allclose(bias(after), bias(before))


def test_metrics_lines_and_loss_plot_are_written(switch_run):
    out, _, _ = switch_run
    records = read_metrics(os.path.join(out, METRICS_FILE))
    train_keys = set().union(*(r for r in records if "train/loss" in r))
    for key in ("train/loss", "lr/adamw", "throughput/tokens_per_s", "moe/dropped_fraction", "moe/router_balance",
                "train/grad_norm", "train/update_norm"):
        assert key in train_keys, key
    assert all(math.isfinite(r["train/update_norm"]) and r["train/update_norm"] > 0 for r in records if "train/loss" in r)
    evals = latest_by_step(records, "eval/loss")
    assert sorted(evals) == [0, 4, 8]
    png = os.path.join(out, "loss.png")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    os.remove(png)
    plot_main([out])  # on demand, e.g. mid-run
    assert os.path.getsize(png) > 1000


def test_wandb_offline_run_is_named_by_the_step_identity(switch_run):
    out, _, _ = switch_run
    run_id = run_id_for(out)
    assert run_id == "tiny_switch-0123abcd89"
    runs = os.listdir(os.path.join(out, "wandb_files", "wandb"))
    assert any(name.startswith("offline-run-") and name.endswith(f"-{run_id}") for name in runs), runs


def test_wandb_is_sent_every_metrics_record_in_order_though_it_opens_after_the_first_step(switch_run):
    """The loop opens wandb on a thread of its own after its first step (`tracking.OpenedLater`):
    the validation at step 0 and the first step's row are queued meanwhile and sent first."""
    out, _, sent = switch_run
    assert [record for _, record in sent] == read_metrics(os.path.join(out, METRICS_FILE))
    assert sent[0][0] == "keel-open-wandb" and sent[0][1]["step"] == 0 and "eval/loss" in sent[0][1]


def test_an_interruption_stops_at_a_step_boundary_with_a_checkpoint_and_resumes_exactly(tmp_path, fixed_run, monkeypatch):
    from train_standin import loop_inputs

    from keel.executor import interrupt
    from keel.train import compile_ahead
    from keel.train.checkpoint import TrainCheckpoints
    from keel.train.loop import train

    out = str(tmp_path / "tiny_stop-0123abcd89")
    config = TrainConfig(num_steps=8, optimizer=AdamWConfig(lr=1e-2), compute_dtype="float32", **BASE)

    def interrupt_after_step_2():
        deadline = time.time() + 300
        while time.time() < deadline and max(_safe_losses(out), default=-1) < 2:
            time.sleep(0.02)
        interrupt.request()

    threading.Thread(target=interrupt_after_step_2, daemon=True).start()
    from keel.train import loop

    votes = []  # the loop stops on the decision every process shares (`stop_requested_anywhere`), asked each step
    monkeypatch.setattr(loop, "stop_requested_anywhere", lambda: votes.append(interrupt.requested()) or votes[-1])
    try:
        with pytest.raises(interrupt.StepInterrupted, match="training stopped after step") as stopped:
            train(config, loop_inputs(config, use_wandb=False, delay_per_item=0.02), out)
    finally:
        interrupt.clear()
    done = int(str(stopped.value).split("after step ")[1].split()[0])
    assert 3 <= done < 8 and len(votes) == done and votes[-1] and not any(votes[:-1])
    assert os.path.exists(os.path.join(out, "checkpoints", f"step-{done}", "metadata.json"))

    # the resume reads its checkpoint once the first step's program is lowered (on XLA:CPU: beside the
    # executable's load, not beside the trace, `_Run._after_lowering_on_cpu`)
    pending, lowered_at_restore = [], []
    ahead, restore = compile_ahead.Compiler.ahead, TrainCheckpoints.restore
    monkeypatch.setattr(compile_ahead.Compiler, "ahead", lambda self, *job: pending.append(ahead(self, *job)) or pending[-1])
    monkeypatch.setattr(TrainCheckpoints, "restore", lambda self, *args: lowered_at_restore.append(
        [p.lowered.is_set() for p in pending]) or restore(self, *args))
    train(config, loop_inputs(config, use_wandb=False), out)
    assert lowered_at_restore == [[True]]
    records = read_metrics(os.path.join(out, METRICS_FILE))
    assert [r["step"] for r in records if "train/loss" in r] == list(range(8))
    got, expected = _losses(out), _losses(fixed_run)
    for step in range(8):
        assert got[step] == pytest.approx(expected[step], abs=1e-6), step


STOP_VOTE = """
import sys
from keel.executor import interrupt
from keel.train.loop import stop_requested_anywhere
import jax

jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]), coordinator_bind_address=sys.argv[1])
before = stop_requested_anywhere()
if jax.process_index() == 1:
    interrupt.request()  # a signal only this process got
print("votes", jax.process_count(), before, stop_requested_anywhere())
"""


def test_a_signal_to_one_process_of_a_run_stops_every_process_after_the_same_step():
    """The loop's stop decision in a real 2-process jax world: process 1 alone is asked to stop, and
    both decide to (process 0 writes the checkpoint, and neither waits in a collective for the other)."""
    from iris_local import free_port

    coordinator = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    procs = [subprocess.Popen([sys.executable, "-c", STOP_VOTE, coordinator, str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    votes = [next((line.split()[1:] for line in out.splitlines() if line.startswith("votes")), out) for out in outs]
    assert votes == [["2", "False", "True"]] * 2, outs


@pytest.mark.parametrize("lr, diverged", [
    # the first update leaves weights of ~1e15: finite, with a finite norm; the next forward overflows
    (1e15, r"training diverged at step 1: (\S+ = nan, )*train/loss = nan"),
    # weights of ~1e30: the first update's norm is no finite number, judged before any loss sees it
    (1e30, r"training diverged at step 0: train/update_norm = inf"),
])
def test_a_non_finite_loss_or_update_fails_the_run_naming_the_step(tmp_path, lr, diverged):
    from train_standin import loop_inputs

    from keel.train.loop import NonFiniteTraining, train

    config = TrainConfig(num_steps=6, optimizer=AdamWConfig(lr=lr), compute_dtype="float32", **BASE)
    with pytest.raises(NonFiniteTraining, match=diverged):
        train(config, loop_inputs(config, use_wandb=False), str(tmp_path / "tiny_nan-0123abcd89"))


def test_a_tracker_that_cannot_open_does_not_hide_why_the_run_stopped(tmp_path, monkeypatch, caplog):
    """wandb opens after the first step; failing to open in a run that then stops is logged, and
    the run's own error is the one raised."""
    from train_standin import loop_inputs

    from keel.train import loop

    release = threading.Event()

    def no_wandb(*args, **kwargs):
        release.wait(60)
        raise PermissionError("wandb: invalid API key")

    def report_fails_at_step_2(self, done):
        if done.step == 2:
            release.set()  # wandb fails to open while the run stops for a reason of its own
            raise ValueError("step 2's report failed")
        return report(self, done)

    report = loop._Run._report
    monkeypatch.setattr(loop, "open_wandb", no_wandb)
    monkeypatch.setattr(loop._Run, "_report", report_fails_at_step_2)
    config = TrainConfig(num_steps=6, optimizer=AdamWConfig(lr=1e-2), compute_dtype="float32", **BASE)
    with pytest.raises(ValueError, match="step 2's report failed"):
        loop.train(config, loop_inputs(config), str(tmp_path / "tiny_stop-0123abcd89"))
    assert "the wandb tracker did not finish after the run stopped" in caplog.text
    assert "wandb: invalid API key" in caplog.text


def test_a_run_that_stops_before_its_first_step_does_not_open_wandb(tmp_path, monkeypatch, caplog):
    """Opening wandb could hold the stop for minutes (`OpenedLater` waits up to 300 s for its
    service); the run says where its records are instead."""
    from train_standin import loop_inputs

    from keel.train import loop

    opened = []

    def unreadable_validation(self, step, phase):
        raise ValueError("validation split unreadable")

    monkeypatch.setattr(loop, "open_wandb", lambda *args, **kwargs: opened.append(args))
    monkeypatch.setattr(loop._Run, "_evaluate", unreadable_validation)  # step 0's, before the first step
    config = TrainConfig(num_steps=6, optimizer=AdamWConfig(lr=1e-2), compute_dtype="float32", **BASE)
    out = str(tmp_path / "tiny_stop-0123abcd89")
    with pytest.raises(ValueError, match="validation split unreadable"):
        loop.train(config, loop_inputs(config), out)
    assert opened == []
    assert f"wandb was not opened: the run stopped before its first step; its records are in {out}/{METRICS_FILE}" in caplog.text


def test_a_kernel_that_runs_another_capacity_than_planned_stops_the_run_after_its_first_step(tmp_path):
    """The check reads what the compiled step's kernels report, not what the loop meant to hand them:
    here the model doubles the capacity on its way to the kernel."""
    import dataclasses

    from train_standin import loop_inputs

    from keel.train.layout import LayoutMismatch
    from keel.train.lm import KeelLM
    from keel.train.loop import train

    class DoublesCapacity(KeelLM):
        def loss(self, model, batch, *, transport, **kwargs):
            doubled = dataclasses.replace(transport, capacity_factor=2 * transport.capacity_factor)
            return super().loss(model, batch, transport=doubled, **kwargs)

    config = TrainConfig(num_steps=3, optimizer=AdamWConfig(lr=1e-2), transports=(TransportPhase(0, "fixed_all_to_all"),),
                         compute_dtype="float32", **{**BASE, "eval_batches": 0})
    # doubled, its step is the phase-returning test's last program (fp32, capacity 8): loaded, not compiled
    inputs = loop_inputs(config, use_wandb=False)
    inputs.lm = DoublesCapacity(inputs.lm.config, inputs.mesh)
    out = tmp_path / "doubled-0123abcd89"
    with pytest.raises(LayoutMismatch, match="step 0: layer 0's MoE kernel ran 'fixed_all_to_all' with capacity "
                                             "factor 8.0, but the resolved run's phase is 'fixed_all_to_all' with 4.0"):
        train(config, inputs, str(out))
    records = json.loads((out / ".keel" / "layout.json").read_text())["records"]
    assert records[-1]["transport"] == {"transport": "fixed_all_to_all", "capacity_factor": 8.0}
    rows = read_metrics(str(out / METRICS_FILE)) if (out / METRICS_FILE).exists() else []
    assert not [r for r in rows if "train/loss" in r], "the step is not reported"
    assert not (out / "checkpoints").exists() or not os.listdir(out / "checkpoints"), "nor checkpointed"


def test_a_dense_baseline_trains_on_the_plan_and_logs_no_moe_metrics(tmp_path):
    """`defaults.models.dense_baseline`: the MoE's active parameters in a dense MLP, no router to report on."""
    from train_standin import MICRO, loop_inputs

    from defaults.models import dense_baseline
    from keel.train.loop import train

    dense = dense_baseline(MICRO)
    assert dense.num_experts == 0 and dense.param_counts()["active"] == pytest.approx(MICRO.param_counts()["active"],
                                                                                     rel=0.01)
    config = TrainConfig(num_steps=3, optimizer=AdamWConfig(lr=1e-2), **BASE)
    out = tmp_path / "dense-0123abcd89"
    train(config, loop_inputs(config, use_wandb=False, model=dense, expert_parallel=1), str(out))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert len(steps) == 3 and all(math.isfinite(r["train/loss"]) for r in steps)
    assert not [k for r in rows for k in r if k.startswith("moe/")]


def test_progress_lines_name_compiles_validation_checkpoints_and_the_switch(tmp_path, capsys):
    """Not a terminal (as in CI and log.txt): plain lines, no carriage returns."""
    from train_standin import loop_inputs

    from keel.train.loop import train

    out = str(tmp_path / "tiny_talk-0123abcd89")
    transports = (TransportPhase(0, "fixed_all_to_all"), TransportPhase(3, "ring"))
    config = TrainConfig(num_steps=6, optimizer=AdamWConfig(lr=1e-2), transports=transports, **BASE)
    train(config, loop_inputs(config, use_wandb=False), out)
    printed = capsys.readouterr().out
    assert "\r" not in printed
    lines = [line for line in printed.splitlines() if line.startswith("[train] tiny_talk: ")]
    text = "\n".join(lines)
    for what in ("fixed_all_to_all evaluation", "fixed_all_to_all training step", "ring training step"):
        # compiled here, or loaded from the session's compilation cache when another test compiled it
        assert re.search(rf"(compiled the {what}|loaded the {what} from the compilation cache) in", text), (what, text)
    for expected in ("compiling the fixed_all_to_all training step ahead, while the run sets up",
                     "compiling the ring training step for step 3 ahead, in the background",
                     ", ahead (step 3 waited",
                     "step 0: validation loss", "step 4: validation loss", "step 3: switching transport fixed_all_to_all -> ring",
                     "step 3: checkpoint saved", "step 6/6, loss", "done: steps 0->6 in"):
        assert expected in text, (expected, text)
    assert "final validation loss" in lines[-1] and out in lines[-1]
    # the summary's share of the compile waits that training steps stood through (keel compare's
    # split) is what the compile lines say each training step waited, evaluations left out
    waits = [float(m[1] or m[0]) for what, *m in re.findall(
        r"(?:compiled|loaded) the (.+?)(?: from the compilation cache)? in ([\d.]+)s.*?, (?:on first use|ahead \(.*? waited ([\d.]+)s)",
        text) if "evaluation" not in what]
    by_steps = float(re.search(r"([\d.]+)s of it by training steps", lines[-1])[1])
    assert len(waits) == 2 and by_steps == pytest.approx(sum(waits), abs=0.1 * len(waits)), (waits, lines[-1])


def test_the_loss_plot_says_what_it_shows(switch_run):
    from keel.train.tracking import plot_loss_curves

    out, config, _ = switch_run
    drawn = plot_loss_curves(os.path.join(out, METRICS_FILE), os.path.join(out, "again.png"),
                             title="tiny_switch: lr 0.01", marks={4: "-> ring"})
    assert drawn["title"] == "tiny_switch: lr 0.01" and drawn["marks"] == {4: "-> ring"}
    loss_panel, health_panel, speed_panel = drawn["panels"]
    assert loss_panel == ["train", "validation"]
    assert health_panel == ["dropped_fraction", "router_balance"] and speed_panel == ["tokens/s"]


def test_status_reads_a_running_steps_progress_from_its_metrics(tmp_path):
    from keel import External
    from keel.spec.train import TrainStepConfig
    from keel.train.tracking import MetricsLog
    from train_standin import MICRO

    config = TrainStepConfig(model=MICRO, data=External("x/cache", "/nowhere"),
                             train=TrainConfig(num_steps=100, optimizer=AdamWConfig(lr=1e-2), **BASE))
    assert config.progress(str(tmp_path)) is None  # nothing written yet
    log = MetricsLog(str(tmp_path / METRICS_FILE))
    for step in range(10):
        log.log({"train/loss": 5.0 - step / 10, "throughput/tokens_per_s": 1024.0}, step=step)
    log.finish()
    line = config.progress(str(tmp_path))
    assert line.startswith("training: step 10/100, loss 4.1000, 1,024 tokens/s")
    assert "about 1.5 min to go" in line  # 90 steps x 1,024 tokens at 1,024 tokens/s
    stopped = config.progress(str(tmp_path), running=False)  # interrupted or failed: no time to go
    assert stopped.endswith("1,024 tokens/s; not running") and "to go" not in stopped
