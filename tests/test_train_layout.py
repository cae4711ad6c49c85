"""The running step is the plan: the train state the loop builds is laid out, typed and scheduled
exactly as the resolved run says, and the loop refuses to train when it is not.

Each case builds the loop's own state in a fresh process with a clean environment (the devices
are the ones the declared hardware gives a training step) through `layout_driver.py`, which runs
the loop's own check and leaves `.keel/layout.json`; the tests read that record, the state the
loop trains, and compare it with `keel plan --json` and the resolved run.
"""

import json
import os
import subprocess
import sys

import pytest

from keel.spec.resolved import resolve

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}


def _drive(tmp_path, which: str, *extra: str) -> subprocess.CompletedProcess:
    out = tmp_path / f"layout_{which}-0123abcd89"
    return subprocess.run([sys.executable, os.path.join(HERE, "layout_driver.py"), str(out), which, *extra],
                          cwd=ROOT, env=CLEAN_ENV, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    """`record(which)`: the loop's layout record of a case, built once per module."""
    made: dict[str, dict] = {}

    def get(which: str) -> dict:
        if which not in made:
            tmp_path = tmp_path_factory.mktemp(which)
            done = _drive(tmp_path, which)
            assert done.returncode == 0, done.stderr[-3000:]
            with open(tmp_path / f"layout_{which}-0123abcd89" / ".keel" / "layout.json") as f:
                records = json.load(f)["records"]
            assert len(records) == 1 and records[0]["reason"] == "start"
            made[which] = records[0]
        return made[which]

    return get


def _planned_json(experiment: str, *args: str) -> list[dict]:
    """The state layout `keel plan --json` prints for the experiment's training step, at step 0."""
    done = subprocess.run([sys.executable, "-m", "keel.cli_entry", "plan", experiment, "--json", *args], cwd=ROOT,
                          env=CLEAN_ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    sheet = next(s for s in json.loads(done.stdout)["fact_sheets"] if s.get("state_layout"))
    return sheet["state_layout"][0]["leaves"]


def _arrays(record: dict) -> list[dict]:
    return [leaf for leaf in record["leaves"] if not leaf["path"].startswith("opt_state/counter/")]


@pytest.mark.slow
@pytest.mark.parametrize("which,experiment,args", [("tiny_moe", "experiments/tutorials/tiny_moe.py", ()),
                                                   ("twin", "experiments/hero_535b.py", ("--scale", "tiny"))])
def test_the_live_layout_of_a_tutorial_and_the_twin_is_keel_plan_json_leaf_by_leaf(record, which, experiment, args):
    live = _arrays(record(which))
    planned = _planned_json(experiment, *args)
    assert [leaf["path"] for leaf in live] == [leaf["path"] for leaf in planned]
    for got, want in zip(live, planned):
        assert got == want, got["path"]
    by_path = {leaf["path"]: leaf for leaf in live}
    experts = by_path["model/layers.stacked.moe.experts.gate"]
    assert experts["spec"][1] == "expert", "routed experts split over the rack's expert axis"
    assert by_path["model/layers.stacked.attn.q"]["spec"][1] == ["data", "expert"], "the rest FSDP over the rack"
    assert by_path["opt_state/layers.stacked.attn.q/0"]["spec"] == by_path["model/layers.stacked.attn.q"]["spec"]
    assert by_path["model/embedding"]["spec"] == [None, None], "the token embedding replicated (a lookup gathers it)"
    for moment in ("opt_state/embedding/0", "opt_state/embedding/1"):
        assert by_path[moment]["spec"] == [None, ["data", "expert"]], "its Adam moments FSDP over data and expert"
    total = sum(leaf["bytes_per_device"] * _shards(leaf["spec"]) for leaf in live)
    assert sum(leaf["bytes_per_device"] for leaf in live) < total / 2, "no device holds the whole state"


@pytest.mark.slow
@pytest.mark.parametrize("which,experiment,args", [("tiny_moe", "experiments/tutorials/tiny_moe.py", ()),
                                                   ("twin", "experiments/hero_535b.py", ("--scale", "tiny"))])
def test_the_fact_sheets_bytes_per_device_are_the_live_states_to_the_byte(record, which, experiment, args):
    done = subprocess.run([sys.executable, "-m", "keel.cli_entry", "plan", experiment, "--json", *args], cwd=ROOT,
                          env=CLEAN_ENV, capture_output=True, text=True, timeout=300)
    sheet = next(s for s in json.loads(done.stdout)["fact_sheets"] if s.get("state_layout"))
    parts = sheet["memory"]["parts_gb"]
    live = _arrays(record(which))
    trained = {f"model/{p['path']}" for p in sheet["parameter_table"] if p["trained"]}

    def live_bytes(keep) -> int:
        return sum(leaf["bytes_per_device"] for leaf in live if keep(leaf["path"]))

    assert round(parts["master_weights"] * 1e9) == live_bytes(lambda p: p.startswith("model/"))
    assert round(parts["gradients"] * 1e9) == live_bytes(lambda p: p in trained)
    assert round(parts["optimizer_state"] * 1e9) == live_bytes(lambda p: p.startswith("opt_state/"))
    first = sheet["memory"]["phases"][0]
    on_host = [leaf for leaf in live if leaf["memory_kind"] == "pinned_host"]
    assert round(first["host_gb"] * 1e9) == sum(leaf["bytes_per_device"] for leaf in on_host)


def _shards(spec) -> int:
    sizes = {"replica_dcn": 2, "data": 1, "expert": 4, "model": 1}
    out = 1
    for entry in spec:
        for axis in [entry] if isinstance(entry, str) else entry or []:
            out *= sizes[axis]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("which", ["random0", "random1", "random2"])
def test_the_live_layout_of_random_models_is_the_resolved_runs(record, which):
    sys.path.insert(0, HERE)
    from layout_driver import step_config

    live = record(which)
    plan = resolve(step_config(which))
    assert _arrays(live) == [leaf.record() for leaf in plan.state_at(0)]
    assert "transport" not in live, "what the kernels ran is added by the step that runs them, never from the plan"


@pytest.mark.slow
def test_adamh_steps_at_the_muonh_learning_rate_in_the_running_loop(record):
    peaks = record("tiny_moe")["peak_learning_rates"]
    assert peaks["adamh"] == pytest.approx(peaks["muonh"], rel=1e-6)
    assert peaks["adam"] < peaks["muonh"] / 2, "Adam keeps its own, lower rate"


@pytest.mark.slow
def test_a_wrong_placement_stops_the_step_naming_the_leaf(tmp_path):
    done = _drive(tmp_path, "random1", "--misplace", "model/layers.stacked.attn.q")
    assert done.returncode != 0
    assert "LayoutMismatch" in done.stderr and "model/layers.stacked.attn.q.spec" in done.stderr, done.stderr[-2000:]


def test_what_the_kernels_ran_is_held_to_the_plans_phase_layer_by_layer():
    """The loop's check of the MoE kernels' own report (`kernel/` outputs of the step that ran)."""
    import numpy as np

    sys.path.insert(0, HERE)
    from train_standin import micro_plan

    from keel.spec.train import AdamWConfig, TrainConfig, TransportPhase
    from keel.spec.transports import TransportName
    from keel.train.layout import LayoutMismatch, check_kernel, kernel_report

    config = TrainConfig(batch_size=16, seq_len=64, num_steps=8, optimizer=AdamWConfig(lr=1e-2),
                         transports=(TransportPhase(0, "fixed_all_to_all"), TransportPhase(4, "ring")))
    plan = micro_plan(config)  # MICRO: capacity factor 4.0, 2 layers
    fixed, ring = TransportName.FIXED_ALL_TO_ALL.code, TransportName.RING.code

    def ran(codes, factors):
        return kernel_report({"kernel/transport": np.array(codes, np.int32),
                              "kernel/capacity_factor": np.array(factors, np.float32), "train/loss": 3.0})

    assert ran([fixed, fixed], [4.0, 4.0]) == {"transport": "fixed_all_to_all", "capacity_factor": 4.0}
    check_kernel(ran([fixed, fixed], [4.0, 4.0]), 3, plan)
    check_kernel(ran([ring, ring], [0.0, 0.0]), 4, plan)  # the ring can drop nothing: no capacity
    with pytest.raises(LayoutMismatch, match="step 4: layer 0's MoE kernel ran 'fixed_all_to_all' with capacity factor "
                                             "4.0, but the resolved run's phase is 'ring' with None"):
        check_kernel(ran([fixed, fixed], [4.0, 4.0]), 4, plan)
    mixed = ran([fixed, fixed], [4.0, 2.0])
    assert mixed == [{"transport": "fixed_all_to_all", "capacity_factor": 4.0},
                     {"transport": "fixed_all_to_all", "capacity_factor": 2.0}]
    with pytest.raises(LayoutMismatch, match="layer 1's MoE kernel ran 'fixed_all_to_all' with capacity factor 2.0"):
        check_kernel(mixed, 0, plan)
    assert kernel_report({"train/loss": 3.0}) is None, "a model without routed experts reports no kernel"


def test_a_step_of_a_model_with_routed_experts_that_reports_no_kernel_stops_the_run():
    """Without the report the kernel check had nothing to compare and passed: a model whose loss
    leaves the `kernel/` metrics out would train unchecked."""
    import types

    sys.path.insert(0, HERE)
    from train_standin import micro_plan

    from keel.spec.train import AdamWConfig, TrainConfig, TransportPhase
    from keel.train.layout import LayoutMismatch
    from keel.train.loop import StepDone, _Run

    plan = micro_plan(TrainConfig(batch_size=16, seq_len=64, num_steps=8, optimizer=AdamWConfig(lr=1e-2),
                                  transports=(TransportPhase(0, "fixed_all_to_all"),)))
    run = types.SimpleNamespace(plan=plan, _kernel_pending=0, output_path="/nowhere")
    done = StepDone(0, plan.transport_at(0).phase, {"train/loss": 3.0}, 0.0)
    with pytest.raises(LayoutMismatch, match="step 0: the model has routed experts, but its step reported no MoE kernel"):
        _Run._check_kernel(run, done)


@pytest.mark.parametrize("warmup, decay_to", [(0.01, 0.05), (0.1, 0.0), (0.01, 0.0)])
def test_the_loops_float32_rates_pass_the_check_at_every_step_and_a_step_off_does_not(warmup, decay_to):
    """The loop checks its rates (XLA's float32 schedule) against the resolved run's (float64) at every
    resume and switch: early in the warmup and near a decay to zero they differ by more than 1e-6 of the
    rate itself, which refused resumes at such steps; a schedule one step off is still refused."""
    import jax.numpy as jnp

    sys.path.insert(0, HERE)
    from train_standin import micro_plan

    from keel.spec.train import AdamWConfig, ScheduleConfig, TrainConfig
    from keel.train.layout import LayoutMismatch, check_rates
    from keel.train.optimizer import Optimizer

    steps = 100_000
    config = TrainConfig(batch_size=16, seq_len=64, num_steps=steps, optimizer=AdamWConfig(lr=1e-3),
                         schedule=ScheduleConfig(warmup_fraction=warmup, decay_to_fraction=decay_to))
    plan = micro_plan(config)
    optimizer = Optimizer(config, {"w": jnp.zeros((2,))})

    def live(step: int, schedule_step: int) -> dict:
        rate = lambda at: {"adamw": float(optimizer.rates_at(at)["lr/adamw"])}
        return {"step": step, "learning_rates": rate(schedule_step), "peak_learning_rates": rate(plan.warmup_steps)}

    checked = [*range(0, 2_048), *range(steps - 2_048, steps)]  # the warmup's start and the decay's end
    for step in checked:
        check_rates(live(step, step), plan)
    for step in (5, plan.warmup_steps - 1, plan.warmup_steps + 5, steps - 3):
        with pytest.raises(LayoutMismatch, match=f"step {step}: the adamw learning rate at step {step} is"):
            check_rates(live(step, step + 1), plan)
