"""Host offload (`TrainConfig.host_offload`): the live train state sits in the memory kinds the
declaration gives it, before and after the master weights come back to the device; training
computes the very same losses as without offload; a run stopped on either side of the switch
resumes into the right layout and carries on exactly.

The rule itself (`keel.train.offload`) and the checkpoint round trip of host arrays are quick;
the training tests (the micro keel MoE on 8 simulated CPU devices, whose `pinned_host` memory is
real host memory) are slow.
"""

import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from keel.train import offload
from keel.spec.train import GroupedOptimizerConfig, HostOffload, TrainConfig
from keel.spec.metrics import latest_by_step, METRICS_FILE, read_metrics

SWITCH = 10
OFFLOAD = HostOffload(master_weights_until_step=SWITCH, optimizer_state=True)
BASE = dict(batch_size=16, seq_len=64, num_steps=20, eval_every=10, eval_batches=1, z_loss=1e-4,
            rolling_checkpoint_minutes=None, compute_dtype="float32",
            optimizer=GroupedOptimizerConfig(muon_lr=1e-2, adam_lr=1e-3))
"""fp32 compute so that equal means equal; the hero's grouped optimizer (MuonH, AdamH, Adam state)."""

HOST, DEVICE = "pinned_host", "device"


# ---------------------------------------------------------------------------- the rule (quick)
def test_layout_follows_the_declaration_step_by_step():
    assert offload.layout_at(HostOffload(), 0) == offload.Layout(DEVICE, DEVICE)
    assert offload.layout_at(OFFLOAD, 0) == offload.Layout(HOST, HOST)
    assert offload.layout_at(OFFLOAD, SWITCH - 1) == offload.Layout(HOST, HOST)
    assert offload.layout_at(OFFLOAD, SWITCH) == offload.Layout(DEVICE, HOST)
    masters_only = HostOffload(master_weights_until_step=3)
    assert [offload.layout_at(masters_only, s).on_host for s in (0, 2, 3, 9)] == [("master_weights",)] * 2 + [()] * 2
    optimizer_only = HostOffload(optimizer_state=True)
    assert {offload.layout_at(optimizer_only, s).on_host for s in (0, 10**6)} == {("optimizer_state",)}


def _toy_state():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from train_standin import rack_mesh

    mesh = rack_mesh()
    split, replicated = NamedSharding(mesh, P("expert")), NamedSharding(mesh, P())
    return mesh, {
        "step": jax.device_put(jnp.zeros((), jnp.int32), replicated),
        "model": {"w": jax.device_put(jnp.arange(8.0), split), "ids": jax.device_put(jnp.arange(8), split)},
        "opt_state": {"mu": jax.device_put(jnp.ones(8), split), "count": jax.device_put(jnp.zeros((), jnp.int32), replicated)},
    }


def test_shardings_put_float_model_arrays_and_all_optimizer_state_where_the_layout_says():
    _, state = _toy_state()
    placed = jax.device_put(state, offload.shardings(state, offload.Layout(HOST, HOST)))
    assert placed["model"]["w"].sharding.memory_kind == HOST
    assert placed["model"]["w"].sharding.spec == state["model"]["w"].sharding.spec  # only the memory kind moves
    assert placed["model"]["ids"].sharding.memory_kind == DEVICE  # not a float: not a master weight
    assert {placed["opt_state"][k].sharding.memory_kind for k in ("mu", "count")} == {HOST}
    assert placed["step"].sharding.memory_kind == DEVICE
    assert offload.memory_kinds(placed) == {"master_weights": {HOST}, "optimizer_state": {HOST}, "other": {DEVICE}}
    back = jax.device_put(placed, offload.shardings(placed, offload.Layout(DEVICE, HOST)))
    assert offload.memory_kinds(back) == {"master_weights": {DEVICE}, "optimizer_state": {HOST}, "other": {DEVICE}}


def test_a_jitted_step_computes_on_device_copies_and_returns_host_arrays():
    mesh, state = _toy_state()
    shardings = offload.shardings(state, offload.Layout(HOST, HOST))
    placed = jax.device_put(state, shardings)

    def step(s):
        s = offload.to_device(s, shardings)
        mu = s["opt_state"]["mu"] * 0.5 + s["model"]["w"]
        return {"step": s["step"] + 1, "model": {"w": s["model"]["w"] - mu, "ids": s["model"]["ids"]},
                "opt_state": {"mu": mu, "count": s["opt_state"]["count"] + 1}}

    with jax.set_mesh(mesh):
        out = jax.jit(step, in_shardings=(shardings,), out_shardings=shardings, donate_argnums=0)(placed)
    assert offload.memory_kinds(out) == offload.memory_kinds(placed)
    np.testing.assert_array_equal(np.asarray(out["opt_state"]["mu"]), 0.5 + np.arange(8.0))
    np.testing.assert_array_equal(np.asarray(out["model"]["w"]), -0.5 * np.ones(8))


def test_a_checkpoint_of_host_arrays_restores_into_the_exemplars_memory_kinds(tmp_path):
    from keel.train.checkpoint import TrainCheckpoints

    _, state = _toy_state()
    host = offload.shardings(state, offload.Layout(HOST, HOST))
    checkpoints = TrainCheckpoints(str(tmp_path), permanent=lambda step: step == 3)
    checkpoints.on_step(jax.device_put(state, host), 3)
    checkpoints.wait()
    latest = checkpoints.latest()
    assert checkpoints.step_of(latest) == 3
    for layout in (offload.Layout(HOST, HOST), offload.Layout(DEVICE, HOST), offload.Layout(DEVICE, DEVICE)):
        exemplar = jax.device_put(jax.tree.map(jnp.zeros_like, state), offload.shardings(state, layout))
        restored = checkpoints.restore(exemplar, latest)
        assert offload.memory_kinds(restored) == offload.memory_kinds(exemplar), layout
        np.testing.assert_array_equal(np.asarray(restored["model"]["w"]), np.arange(8.0))


# ---------------------------------------------------------------------------- training (slow)
@contextlib.contextmanager
def watching_steps(stop_after: int | None = None):
    """Record, for every training step, its step number and the memory kinds of the state going in
    and coming out; ask the loop to stop (as Ctrl-C does) once step `stop_after` has run."""
    from keel.executor import interrupt
    from keel.train import loop

    records = []
    original = loop._Run._step_fn

    class Watched:
        """The loop's compiled step (a `compile_ahead.Pending`), whose executable records each call."""

        def __init__(self, pending):
            self.pending = pending

        def __getattr__(self, name):
            return getattr(self.pending, name)

        def get(self):
            compiled = self.pending.get()

            def watched(arrays, batch, rates):
                step, before = int(arrays["step"]), offload.memory_kinds(arrays)
                new, metrics = compiled(arrays, batch, rates)
                records.append((step, before, offload.memory_kinds(new)))
                if step == stop_after:
                    interrupt.request()
                return new, metrics

            return watched

    def step_fn(self, phase, step):
        return Watched(original(self, phase, step))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop._Run, "_step_fn", step_fn)
        try:
            yield records
        finally:
            interrupt.clear()


def _train(out, host_offload, stop_after=None, records=None):
    """Train (or resume) under `out`; the steps' records are appended to `records` (and returned)."""
    from train_standin import loop_inputs

    from keel.train.loop import train

    config = TrainConfig(host_offload=host_offload, **BASE)
    records = [] if records is None else records
    with watching_steps(stop_after) as seen:
        try:
            train(config, loop_inputs(config, use_wandb=False), str(out))
        finally:
            records.extend(seen)
    return records


def _expected_kinds(step: int) -> dict[str, set[str]]:
    return {"master_weights": {HOST if step < SWITCH else DEVICE}, "optimizer_state": {HOST}, "other": {DEVICE}}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "no_offload"
    return out, _train(out, HostOffload())


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "offload"
    return out, _train(out, OFFLOAD)


def _metric(out, key):
    return latest_by_step(read_metrics(os.path.join(out, METRICS_FILE)), key)


@pytest.mark.slow
def test_the_live_state_sits_in_the_declared_memory_kinds_before_and_after_the_switch(reference, offloaded):
    _, records = offloaded
    assert [step for step, _, _ in records] == list(range(20))
    for step, before, after in records:
        assert before == _expected_kinds(step), step  # what the step was handed
        assert after == _expected_kinds(step), step  # what it handed back (its pinned out shardings)
    assert records[SWITCH - 1][2]["master_weights"] == {HOST} and records[SWITCH][1]["master_weights"] == {DEVICE}
    all_device = {"master_weights": {DEVICE}, "optimizer_state": {DEVICE}, "other": {DEVICE}}
    assert all(before == after == all_device for _, before, after in reference[1])


@pytest.mark.slow
def test_offload_changes_no_loss(reference, offloaded):
    for key in ("train/loss", "eval/loss"):
        expected, got = _metric(reference[0], key), _metric(offloaded[0], key)
        assert sorted(got) == sorted(expected) and len(got) >= 3, key
        for step in expected:
            assert got[step] == pytest.approx(expected[step], abs=1e-6), (key, step)
    assert sorted(_metric(offloaded[0], "train/loss")) == list(range(20))


@pytest.mark.slow
def test_runs_stopped_before_and_after_the_switch_resume_into_the_right_layout_and_match(tmp_path, offloaded):
    from keel.executor import interrupt

    out = tmp_path / "offload_stopped"
    segments = []
    for stop_after in (5, 13):  # after step 5 (masters on host), after step 13 (masters back on device)
        segments.append([])
        with pytest.raises(interrupt.StepInterrupted, match=f"after step {stop_after + 1} of 20"):
            _train(out, OFFLOAD, stop_after=stop_after, records=segments[-1])
    segments.append(_train(out, OFFLOAD))
    assert [[r[0] for r in s] for s in segments] == [list(range(6)), list(range(6, 14)), list(range(14, 20))]
    for records in segments:
        for step, before, after in records:
            assert before == after == _expected_kinds(step), step
    records = read_metrics(os.path.join(out, METRICS_FILE))
    assert [r["step"] for r in records if "train/loss" in r] == list(range(20))
    expected, got = _metric(offloaded[0], "train/loss"), _metric(out, "train/loss")
    for step in range(20):
        assert got[step] == pytest.approx(expected[step], abs=1e-6), step
