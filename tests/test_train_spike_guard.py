"""The spike guard (`TrainConfig.spike_guard`) through the real training loop, on the micro MoE and
8 simulated devices, with batches poisoned by the loop's fault injection (`KEEL_POISON_BATCHES`):
batch 17 marked all padding (a NaN gradient), batch 23's tokens replaced by random ids (a finite
loss spike).

- without the guard the NaN fails the run naming step 17, and the noise batch alone spikes the loss
  and leaves the run worse;
- with it the run rolls back twice (at step 17, and at step 22, which reads batch 23 once batch 17
  is skipped), skips exactly batches 17 and 23, makes its 30 updates and ends within 0.05 of the
  clean run's validation loss; the console, metrics.jsonl, spike_guard.json and the closing line
  say so;
- with max_rollbacks=1 it gives up at step 22 naming steps 17 and 22; raised to 2 (execution-only:
  the same run), it resumes from its step-15 checkpoint, skips batch 17 by the record without
  spiking again, rolls back at 22 and ends with the uninterrupted guarded run's very losses.

The runs share the session's persistent compilation cache (`conftest.py`), so only the first
compiles the step (about a minute on 2 cores); the rest take about 10 s each.
"""

import contextlib
import io
import json
import os

import pytest

from keel.spec import AdamWConfig, SpikeGuardConfig, TrainConfig
from keel.spec.metrics import METRICS_FILE, latest_by_step, read_metrics

pytestmark = pytest.mark.slow

POISON = "17:padding,23:noise"
BASE = dict(num_steps=30, batch_size=16, seq_len=64, eval_every=100, eval_batches=1, z_loss=1e-4,
            rolling_checkpoint_minutes=None, permanent_checkpoint_every=15, optimizer=AdamWConfig(lr=1e-2))
PHASES = {0: "first", 25: "second"}  # a mixture phase starting at batch 25: read by step 23, after two skipped batches
GUARD = SpikeGuardConfig(window=16, min_history=8, snapshot_every=5, max_rollbacks=2)


def _train(out, monkeypatch, poison=POISON, phase_starts=None, **changes):
    import dataclasses

    from train_standin import loop_inputs

    from keel.train.loop import train

    if poison:
        monkeypatch.setenv("KEEL_POISON_BATCHES", poison)
    else:
        monkeypatch.delenv("KEEL_POISON_BATCHES", raising=False)
    config = TrainConfig(**{**BASE, **changes})
    inputs = loop_inputs(config, use_wandb=False)
    return train(config, dataclasses.replace(inputs, phase_starts=phase_starts or {}), str(out))


def _records(out):
    return read_metrics(os.path.join(out, METRICS_FILE))


def _final_eval(out):
    evals = latest_by_step(_records(out), "eval/loss")
    assert max(evals) == BASE["num_steps"]
    return evals[BASE["num_steps"]]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "clean-0123abcd89"
    with pytest.MonkeyPatch.context() as mp:
        _train(out, mp, poison=None)
    return out


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """(output path, what the run printed)."""
    out = tmp_path_factory.mktemp("runs") / "guarded-0123abcd89"
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        _train(out, mp, spike_guard=GUARD, phase_starts=PHASES)
    return out, printed.getvalue()


def test_without_the_guard_the_poisoned_batches_fail_or_damage_the_run(clean, tmp_path, monkeypatch):
    from keel.train.loop import NonFiniteTraining

    with pytest.raises(NonFiniteTraining, match=r"training diverged at step 17: train/grad_norm = nan"):
        _train(tmp_path / "nan-0123abcd89", monkeypatch)

    noisy = tmp_path / "noise-0123abcd89"
    _train(noisy, monkeypatch, poison="23:noise")
    losses, clean_losses = latest_by_step(_records(noisy), "train/loss"), latest_by_step(_records(clean), "train/loss")
    assert losses[23] > 2 * losses[22], "the noise batch is a loss spike"
    assert all(losses[s] > clean_losses[s] for s in range(24, 30)), "the loss stays above the clean run's"
    print(f"final validation loss: clean {_final_eval(clean):.4f}, trained on the noise batch {_final_eval(noisy):.4f}")
    assert _final_eval(noisy) > _final_eval(clean) + 0.03, "trained on, it leaves the run worse"


def test_the_guard_skips_exactly_the_poisoned_batches_and_ends_like_the_clean_run(clean, guarded):
    guarded, _ = guarded
    records = _records(guarded)
    spikes = [r for r in records if "spike/rollback_from" in r]
    assert [(r["step"], r["spike/rollback_to"], r["spike/skipped_batch"], r["spike/rollbacks"]) for r in spikes] == [
        (17, 15, 17, 1), (22, 20, 23, 2)]
    assert spikes[1]["spike/loss"] > spikes[1]["spike/threshold"]
    trained = [r["step"] for r in records if "train/loss" in r]
    assert trained == list(range(30)), "every step trained (on the next batch), one row each"
    with open(os.path.join(guarded, "spike_guard.json")) as f:
        rollbacks = json.load(f)["rollbacks"]
    assert [(r["spike_step"], r["rolled_back_to"], r["skipped_batch"]) for r in rollbacks] == [(17, 15, 17), (22, 20, 23)]
    assert rollbacks[0]["why"] == "train/grad_norm = nan is not finite" and "is above" in rollbacks[1]["why"]

    clean_loss, guarded_loss = _final_eval(clean), _final_eval(guarded)
    print(f"final validation loss: clean {clean_loss:.4f}, guarded {guarded_loss:.4f}")
    assert abs(guarded_loss - clean_loss) < 0.05
    # Steps before the first spike trained exactly as the clean run did.
    clean_losses, guarded_losses = latest_by_step(_records(clean), "train/loss"), latest_by_step(records, "train/loss")
    assert all(guarded_losses[s] == clean_losses[s] for s in range(17))


def test_the_rollbacks_are_on_the_console_and_in_the_closing_line(guarded):
    _, printed = guarded
    lines = [line for line in printed.splitlines() if line.startswith("[train] guarded: ")]
    text = "\n".join(lines)
    assert ("step 17: LOSS SPIKE: train/grad_norm = nan is not finite. Rolled back to step 15, replaying steps 15-16 "
            "and skipping batch 17 (rollback 1 of at most 2)") in text
    assert "step 22: LOSS SPIKE: train/loss = " in text
    assert "Rolled back to step 20, replaying steps 20-21 and skipping batch 23 (rollback 2 of at most 2)" in text
    assert "batch 17 skipped" in text and "batch 23 skipped" in text
    # the mixture phase starts at its batch, which step 23 reads (step 25 reads batch 27): said there, once
    assert "step 23: mixture second starts (batch 25)" in text and text.count("mixture second starts") == 1
    assert lines[-1].split("; outputs in")[0].endswith("; with 2 rollbacks (skipped batch 17 at step 17, batch 23 at step 22)")


def test_giving_up_names_the_spikes_and_a_raised_budget_resumes_to_the_same_run(guarded, tmp_path, monkeypatch):
    from keel.train.spike_guard import SpikeGuardGaveUp

    guarded, _ = guarded

    out = tmp_path / "gave_up-0123abcd89"
    with pytest.raises(SpikeGuardGaveUp, match=r"loss spike at step 22 after 1 rollback \(SpikeGuardConfig.max_rollbacks=1\)"
                       r".*Spikes at steps 17, 22"):
        _train(out, monkeypatch, spike_guard=SpikeGuardConfig(window=16, min_history=8, snapshot_every=5, max_rollbacks=1))
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["step-15"]

    # The budget is execution-only: the same run resumes at step 15, skips batch 17 by its record
    # (no second rollback there) and rolls back at 22, as the uninterrupted run did.
    _train(out, monkeypatch, spike_guard=GUARD)
    with open(os.path.join(out, "spike_guard.json")) as f:
        assert [(r["spike_step"], r["skipped_batch"]) for r in json.load(f)["rollbacks"]] == [(17, 17), (22, 23)]
    records = _records(out)
    assert [r["step"] for r in records if "spike/rollback_from" in r] == [17, 22]
    assert latest_by_step(records, "train/loss") == latest_by_step(_records(guarded), "train/loss")
    assert _final_eval(out) == _final_eval(guarded)

    # Run once more: it is trained to the end already, and still says it rolled back twice.
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        _train(out, monkeypatch, spike_guard=GUARD)
    done = [line for line in printed.getvalue().splitlines() if ": done: steps 30->30" in line]
    assert done and "; with 2 rollbacks (skipped batch 17 at step 17, batch 23 at step 22)" in done[0], printed.getvalue()


def test_the_history_starts_again_where_the_data_changes_phase_after_skipped_batches(tmp_path):
    """Phases are fixed by batch: with batches 3 and 5 skipped, steps 8 and 9 read the batches 10
    and 11 of a phase starting at batch 10, so a jump there is the new data, not a spike."""
    import jax.numpy as jnp

    from keel.train.spike_guard import SpikeGuard

    guard = SpikeGuard(SpikeGuardConfig(window=16, min_history=4), str(tmp_path), start=0, state={"w": jnp.zeros(2)},
                       layout=None, event=print, write_row=lambda *_: None, writer=False, restarts=(10,))
    guard.skipped = {3, 5}
    guard.losses = [(s, 2.0 - 0.01 * s + 0.002 * (s % 3)) for s in range(8)]
    assert guard.batch_index(8) == 10
    assert guard._judge(8, {"train/loss": 3.0, "train/grad_norm": 1.0}) is None
    guard.skipped = set()  # the same jump inside a phase is a spike
    assert guard._judge(8, {"train/loss": 3.0, "train/grad_norm": 1.0}) is not None


def test_an_update_that_is_not_finite_from_a_finite_gradient_is_this_steps_spike(tmp_path):
    """The weights a step leaves are judged with it: a non-finite update (a zero-norm projection, an
    optimizer overflow) on a finite loss and gradient passed, and the next step's spike was blamed
    on its innocent batch, again after every rollback to the snapshot holding those weights."""
    import jax.numpy as jnp

    from keel.train.spike_guard import NonFiniteTraining, SpikeGuard, check_finite

    update_inf = {"train/loss": 2.0, "train/grad_norm": 1.0, "train/update_norm": float("inf")}
    with pytest.raises(NonFiniteTraining, match=r"diverged at step 99: train/update_norm = inf; nothing from this"):
        check_finite(99, update_inf)
    guard = SpikeGuard(SpikeGuardConfig(window=16, min_history=4), str(tmp_path), start=0, state={"w": jnp.zeros(2)},
                       layout=None, event=print, write_row=lambda *_: None, writer=False, restarts=())
    assert guard._judge(3, update_inf) == ("train/update_norm = inf is not finite", None)
    # a gradient that is not finite is named alone: the update follows from it
    nan_gradient = {"train/loss": 2.0, "train/grad_norm": float("nan"), "train/update_norm": float("nan")}
    assert guard._judge(3, nan_gradient) == ("train/grad_norm = nan is not finite", None)
    assert guard._judge(3, {**update_inf, "train/update_norm": 0.5}) is None


def test_a_resume_without_the_earlier_losses_says_it_judges_without_them(tmp_path):
    import jax.numpy as jnp

    from keel.train.spike_guard import SpikeGuard

    said = []
    guard = SpikeGuard(SpikeGuardConfig(window=16, min_history=4), str(tmp_path), start=10, state={"w": jnp.zeros(2)},
                       layout=None, event=said.append, write_row=lambda *_: None, writer=False, restarts=())
    assert guard.losses == []
    assert any(line.startswith("spike guard: resuming at step 10 without the losses before it") and
               "may skip other batches" in line for line in said), said
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "train/loss": 2.0}) + "\n" for s in range(10)))
    said.clear()
    guard = SpikeGuard(SpikeGuardConfig(window=16, min_history=4), str(tmp_path), start=10, state={"w": jnp.zeros(2)},
                       layout=None, event=said.append, write_row=lambda *_: None, writer=False, restarts=())
    assert len(guard.losses) == 10 and not said


def test_the_guard_declares_what_counts_toward_identity():
    from keel.executor.step import is_execution_only

    fields = {f.name: is_execution_only(f) for f in __import__("dataclasses").fields(SpikeGuardConfig)}
    assert fields == {"threshold": False, "window": False, "min_history": False, "min_rise": False,
                      "snapshot_every": True, "max_rollbacks": True}
    with pytest.raises(ValueError, match="min_history=20 exceeds window=10"):
        SpikeGuardConfig(window=10)
    for window, min_history in ((1, 1), (5, 1)):  # one loss gives no step-to-step change: the guard would never judge
        with pytest.raises(ValueError, match=f"SpikeGuardConfig.min_history={min_history}: .*set min_history >= 2"):
            SpikeGuardConfig(window=window, min_history=min_history)
    # its history after a resume comes from metrics.jsonl, so every step needs its row there
    with pytest.raises(ValueError, match="TrainConfig.log_every=5 with a spike_guard.*keep log_every=1"):
        TrainConfig(batch_size=8, seq_len=16, num_steps=10, spike_guard=SpikeGuardConfig(), log_every=5)


def test_a_rollback_at_a_phase_start_checks_the_kernels_of_the_step_that_enters_the_phase_again(tmp_path, monkeypatch):
    """A NaN at the ring phase's first step (17): the loop rolls back to its step-15 snapshot in the
    fixed-capacity phase, replays, and enters the ring phase again. The rolled-back step's record
    gets no kernel report, and no replayed step of the earlier phase lends it one: the report the
    record holds is that of the step that entered the phase and stood."""
    from keel.spec import TransportPhase

    out = tmp_path / "guarded_switch-0123abcd89"
    _train(out, monkeypatch, poison="17:padding", spike_guard=GUARD, num_steps=19, compute_dtype="float32",
           transports=(TransportPhase(0, "fixed_all_to_all"), TransportPhase(17, "ring")))
    records = json.loads((out / ".keel" / "layout.json").read_text())["records"]
    fixed, ring = {"transport": "fixed_all_to_all", "capacity_factor": 4.0}, {"transport": "ring", "capacity_factor": None}
    assert [(r["step"], r["reason"], r.get("transport")) for r in records] == [
        (0, "start", fixed), (17, "phase change", None), (17, "phase change", ring)]
    assert [r["spike/rollback_from"] for r in _records(out) if "spike/rollback_from" in r] == [17]


def test_a_ctrl_c_during_the_replay_names_the_checkpoint_a_rerun_resumes_from(guarded, tmp_path, monkeypatch):
    """Snapshots every 10 steps: the spike at 17 rolls back to step 10 and replays steps 10-16, past
    the permanent checkpoint at step 15 saved before the spike. A Ctrl-C at step 12 of the replay
    saves nothing behind that checkpoint (a rolling one there would be deleted at once, or stand
    unused) and names it; the rerun resumes from it and ends as the uninterrupted run did."""
    from keel.executor import interrupt
    from keel.train.spike_guard import SpikeGuard

    guarded, _ = guarded
    replaying = SpikeGuard.replaying

    def ctrl_c_at_step_12_of_the_replay(self, step):
        if step == 12 and replaying(self, step):
            interrupt.request()
        return replaying(self, step)

    out, printed = tmp_path / "stopped-0123abcd89", io.StringIO()
    guard = SpikeGuardConfig(window=16, min_history=8, snapshot_every=10, max_rollbacks=2)
    try:
        with monkeypatch.context() as mp, contextlib.redirect_stdout(printed), \
                pytest.raises(interrupt.StepInterrupted) as stopped:
            mp.setattr(SpikeGuard, "replaying", ctrl_c_at_step_12_of_the_replay)
            _train(out, mp, spike_guard=guard, phase_starts=PHASES)
    finally:
        interrupt.clear()
    assert stopped.value.resume == "its checkpoint at step 15"
    assert ("interrupted: stopped after step 13 of 30, replaying after a rollback; a rerun resumes from the checkpoint "
            "at step 15, saved before the rollback") in printed.getvalue(), printed.getvalue()
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["step-15"]

    _train(out, monkeypatch, spike_guard=guard, phase_starts=PHASES)
    assert latest_by_step(_records(out), "train/loss") == latest_by_step(_records(guarded), "train/loss")
    assert _final_eval(out) == _final_eval(guarded)
