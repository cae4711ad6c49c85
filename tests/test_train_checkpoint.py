"""Checkpoint retention under a step's output path follows the declaration: rolling checkpoints
(by time or every N steps) keep the newest N, permanent ones every N steps stay. A damaged
checkpoint falls back to an older one; a storage error stops the run."""

import os
from types import SimpleNamespace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from keel.train.checkpoint import TrainCheckpoints, restore_like


def _save_steps(checkpoints: TrainCheckpoints, steps) -> list[str]:
    for step in steps:
        checkpoints.on_step({"w": jnp.full((4,), float(step))}, step)
        checkpoints.wait()
    return sorted(os.listdir(checkpoints.root), key=lambda n: int(n.split("-")[1]))


def test_rolling_by_time_keeps_only_the_newest_and_permanent_ones_stay(tmp_path):
    checkpoints = TrainCheckpoints(str(tmp_path), permanent=lambda step: step % 3 == 0, rolling_minutes=1e-6)  # roll after every step
    saved = _save_steps(checkpoints, range(1, 6))
    assert saved == ["step-3", "step-5"], saved  # step 3 is permanent; 1, 2 and 4 were rolled away
    latest = checkpoints.latest()
    assert latest.endswith("step-5")
    restored = restore_like({"w": jnp.zeros((4,))}, latest)
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.full((4,), 5.0))


def test_rolling_every_n_steps_keeps_the_declared_number(tmp_path):
    checkpoints = TrainCheckpoints(str(tmp_path), permanent=lambda step: False, rolling_every=2, keep_rolling=2)
    assert _save_steps(checkpoints, range(1, 12)) == ["step-8", "step-10"]  # 2, 4, 6 pruned; odd steps never saved


def test_permanent_cadence_is_kept_and_supersedes_rolling_ones(tmp_path):
    checkpoints = TrainCheckpoints(str(tmp_path), permanent=lambda step: step % 10 == 0, rolling_every=3, keep_rolling=3)
    # 3, 6, 9 rolling; 10 permanent (rolling ones before it are superseded); 12, 15, 18, 21 rolling (keep 3); 20 permanent
    assert _save_steps(checkpoints, range(1, 23)) == ["step-10", "step-20", "step-21"]


def test_a_truncated_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, capsys):
    checkpoints = TrainCheckpoints(str(tmp_path), permanent=lambda step: True)
    assert _save_steps(checkpoints, (1, 2)) == ["step-1", "step-2"]
    newest = checkpoints.latest()
    for chunk in (Path(newest) / "d").iterdir():  # tensorstore's OCDBT data files
        chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])  # truncated, as a full disk or a killed copy leaves it
    restored = checkpoints.restore({"w": jnp.zeros((4,))}, newest)
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.full((4,), 1.0))
    out = capsys.readouterr().out
    assert f"skipping checkpoint {newest}: it cannot be read" in out and "step-1 instead" in out, out


def test_a_damaged_rolling_checkpoint_is_set_aside_so_the_new_rolling_ones_are_kept(tmp_path, capsys):
    """Left in place, a damaged rolling checkpoint at step 12 stayed the newest rolling one: a rerun
    resuming from step 10 had each new rolling save (step 11 here; on SIGTERM, the one the
    interruption said it saved) deleted as soon as it was written."""
    first = TrainCheckpoints(str(tmp_path), permanent=lambda step: step % 10 == 0, rolling_every=1, keep_rolling=1)
    assert _save_steps(first, range(1, 13)) == ["step-10", "step-12"]
    for chunk in (tmp_path / "checkpoints" / "step-12" / "d").iterdir():
        chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
    rerun = TrainCheckpoints(str(tmp_path), permanent=lambda step: step % 10 == 0, rolling_every=1, keep_rolling=1)
    restored = rerun.restore({"w": jnp.zeros((4,))}, rerun.latest())
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.full((4,), 10.0))
    aside = tmp_path / "checkpoints-damaged" / "step-12"
    assert f"moved the damaged checkpoint {tmp_path / 'checkpoints' / 'step-12'} to {aside}" in capsys.readouterr().out
    assert (aside / "metadata.json").exists(), "kept to be looked at"
    assert _save_steps(rerun, (11,)) == ["step-10", "step-11"]
    assert rerun.latest().endswith("step-11")


def _abstract_w() -> dict:
    """The saved tree as the loop restores it on a resume: shapes and shardings, no arrays."""
    return {"w": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))}


def test_when_no_checkpoint_reads_restore_says_so_and_returns_none(tmp_path, capsys):
    checkpoints = TrainCheckpoints(str(tmp_path), permanent=lambda step: True)
    assert _save_steps(checkpoints, (1, 2)) == ["step-1", "step-2"]
    for chunk in Path(tmp_path).glob("checkpoints/step-*/d/*"):
        chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
    assert checkpoints.restore(_abstract_w(), checkpoints.latest()) is None  # the loop then starts from its init
    assert "can be read: starting from the initial state" in capsys.readouterr().out


def test_a_checkpoint_restores_into_abstract_arrays(tmp_path):
    checkpoints = TrainCheckpoints(str(tmp_path), permanent=lambda step: True)
    _save_steps(checkpoints, (1,))
    restored = checkpoints.restore(_abstract_w(), checkpoints.latest())
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.full((4,), 1.0))


def test_none_leaves_load_without_a_warning(tmp_path, caplog):
    checkpoints = TrainCheckpoints(str(tmp_path), permanent=lambda step: True)
    checkpoints.on_step({"w": jnp.full((4,), 1.0), "bias": None}, 1)
    checkpoints.wait()
    restored = restore_like({"w": jnp.zeros((4,)), "bias": None}, checkpoints.latest())
    assert restored["bias"] is None
    assert "Unknown leaf type" not in caplog.text, caplog.text


def test_a_storage_error_stops_the_restore_instead_of_falling_back(tmp_path, monkeypatch, capsys):
    """A checkpoint that fails to read for its storage (a 503, a permission) is not damaged: falling
    back to an older one, or to step 0, would throw away the run's progress for a passing outage."""
    import keel.train.checkpoint as checkpoint

    checkpoints = TrainCheckpoints(str(tmp_path), permanent=lambda step: True)
    _save_steps(checkpoints, (1, 2))
    newest = checkpoints.latest()

    def unavailable(exemplar, path):
        raise ValueError(f'UNAVAILABLE: Error reading "{path}/manifest.ocdbt": HTTP response code: 503')

    monkeypatch.setattr(checkpoint, "restore_like", unavailable)
    with pytest.raises(RuntimeError, match=r"step-2 could not be read \(ValueError: UNAVAILABLE: .*503\), and not because "
                                           r"it is damaged: the run stops"):
        checkpoints.restore(_abstract_w(), newest)
    assert "skipping" not in capsys.readouterr().out


def test_a_training_step_under_a_store_tensorstore_cannot_write_is_refused_before_it_compiles(monkeypatch):
    import keel.train.step as step

    monkeypatch.setattr(step, "resolve", lambda config: pytest.fail("the step went on to resolve its run"))
    config = SimpleNamespace(output_path="memory://exp/train-1", coordinator=None)
    with pytest.raises(ValueError, match=r"cannot run under memory:// \(memory://exp/train-1\): .*local path, gs:// or s3://"):
        step.train_step(config)


@pytest.mark.parametrize("elsewhere, raises", [(1, None), (2, "could not be read on another of the run's processes")])
def test_a_checkpoint_another_process_cannot_read_is_skipped_or_fails_here_too(tmp_path, monkeypatch, capsys,
                                                                               elsewhere, raises):
    """Each process of a multi-host run reads its own shards: one that finds the newest checkpoint
    damaged (1) or unreadable (2) decides for all, so none trains on from another step than the
    rest. Here this process reads it whole; the other's outcome comes through the agreement."""
    import keel.train.checkpoint as checkpoint

    checkpoints = TrainCheckpoints(str(tmp_path), permanent=lambda step: True)
    _save_steps(checkpoints, (1, 2))
    newest = checkpoints.latest()
    outcomes = iter([elsewhere])  # the other process's outcome for the newest; the older one reads everywhere
    monkeypatch.setattr(checkpoint, "_worst_of_every_process", lambda mine: max(mine, next(outcomes, mine)))
    if raises:
        with pytest.raises(RuntimeError, match=rf"step-2 {raises} \(that process says why\), and not because it is damaged"):
            checkpoints.restore(_abstract_w(), newest)
        return
    restored = checkpoints.restore(_abstract_w(), newest)
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.full((4,), 1.0))
    out = capsys.readouterr().out
    assert f"skipping checkpoint {newest}: it cannot be read on another of the run's processes (that process says why)" in out
    assert not (tmp_path / "checkpoints" / "step-2").exists()  # set aside, once every process has read it
