"""`keel plan experiments/hero_535b.py`: the declared hero graph derives the reference's figures."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from keel.cli import load_experiment
from keel.plan import fact_sheets_for

ROOT = Path(__file__).resolve().parents[1]
HERO = str(ROOT / "experiments" / "hero_535b.py")


def _keel(*args, env=None):
    keel = Path(sys.executable).parent / "keel"  # the console script of this environment
    return subprocess.run([str(keel), *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def sheet():
    (only,) = fact_sheets_for(load_experiment(HERO))
    return only


def test_hero_file_derives_the_reference(sheet):
    assert sheet["step"] == "train/hero_535b"
    assert (sheet["parameters"]["total"], sheet["parameters"]["active"]) == (535_477_106_688, 22_762_487_808)
    assert sheet["mesh"]["axes"]["replica_dcn"] == 11 and sheet["mesh"]["axes"]["expert"] == 64
    assert (sheet["mesh"]["experts_per_gpu"], sheet["mesh"]["sequences_per_gpu"]) == (6, 16)
    t = sheet["training"]
    assert (t["tokens_per_step"], t["num_steps"], t["total_tokens"]) == (46_137_344, 390_251, 18_005_144_633_344)
    assert [p["start_step"] for p in sheet["mixture"]] == [0, 108_000, 312_192]
    assert [(x["transport"], x["start_step"]) for x in sheet["transports"]] == [
        ("fixed_pooled_all_to_all", 0), ("ragged_all_to_all", 81_716)]
    assert sheet["time"]["projected_end_date"] == "2026-11-18"
    assert round(sheet["optimizer"]["adam_lr"], 6) == 0.000759
    claims = {c["claim"]: c for c in sheet["claims"]}
    assert round(claims["trains in 60 days"]["value"]) == 89 and not claims["trains in 60 days"]["holds"]
    assert claims["about 3 months"]["holds"]
    assert round(claims["the 46M-token batch is 92 MB"]["value"] / 1e6) == 185
    two_years = claims["2 years on one rack -> 60 days on 11"]
    assert two_years["value"] == pytest.approx(11 * claims["trains in 60 days"]["value"]) and not two_years["holds"]
    # "567 GB per layer" is one bf16 D-wide tensor over the batch, said as such; a layer keeps far more
    per_layer = claims["activations are 567 GB per layer"]
    assert "566.9 GB is one bf16 6144-wide tensor" in per_layer["finding"] and not per_layer["holds"]
    assert per_layer["value"] > 10 * 567e9
    all_layers = claims["27 TB of activations for 48 layers without checkpointing"]
    assert all_layers["value"] == pytest.approx(48 * per_layer["value"]) and not all_layers["holds"]
    assert [s["step_seconds"] for s in sheet["time"]["speeds"]] == [19.8, 16.8]


def test_keel_plan_prints_the_fact_sheet_without_jax():
    """How fast it is: benchmarks/plan_latency.py."""
    out = _keel("plan", HERO, "--json", "--prefix", "/tmp/keel-hero-plan")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    (sheet,) = plan["fact_sheets"]
    assert "2026-11-18" in sheet["text"]
    probe = (
        "import sys\nfrom keel.cli import load_experiment\nfrom keel.plan import fact_sheets_for\n"
        f"fact_sheets_for(load_experiment({HERO!r}))\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('jax', 'levanter', 'haliax', 'equinox')]\n"
        "assert not heavy, heavy\n"
    )
    probed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert probed.returncode == 0, probed.stderr


def test_a_broken_hero_variant_fails_in_plan_naming_the_field():
    out = _keel("plan", HERO, "--prefix", "/tmp/keel-hero-plan", "--set", "train/hero_535b.topology.racks=10")
    assert out.returncode == 2  # the step's resources still start 704 GPUs
    assert ("--set train/hero_535b.topology.racks=10: resources ask for 4 GPUs x 176 replicas = 704, but the topology "
            "lays out 10 racks x 64 = 640") in out.stderr
    out = _keel("plan", HERO, "--prefix", "/tmp/keel-hero-plan", "--set", "train/hero_535b:train.batch_size=11000")
    assert out.returncode == 2
    assert "TrainConfig.batch_size=11000 is not divisible by the 704 batch shards" in out.stderr


def test_the_twin_plans_on_cpu_hardware():
    out = _keel("plan", HERO, "--json", "--prefix", "/tmp/keel-hero-plan", "--scale", "tiny")
    assert out.returncode == 0, out.stderr
    (sheet,) = json.loads(out.stdout)["fact_sheets"]
    assert sheet["mesh"]["axes"] == {"replica_dcn": 2, "data": 1, "expert": 4, "model": 1}
    assert [x["transport"] for x in sheet["transports"]] == ["fixed_pooled_all_to_all", "ring"]
    assert len(sheet["mixture"]) == 3


def test_an_override_the_config_refuses_is_a_clear_error():
    out = _keel("plan", HERO, "--prefix", "/tmp/keel-hero-plan", "--set", "train/hero_535b.train.num_steps=50000")
    assert out.returncode == 2
    assert "TrainConfig.transports: a phase starts at step 81716, at or after num_steps=50000" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_longer_run_by_set_warns_that_its_positions_stay_at_their_steps():
    """The hero's positions are shares of its length, resolved when the file loads; a `--set` of the
    length keeps their steps, so the cooldown's last 20% would become 38% of the run: said, with the fix."""
    longer = _keel("plan", HERO, "--prefix", "/tmp/keel-hero-plan", "--set", "train/hero_535b:train.num_steps=500000")
    assert longer.returncode == 0, longer.stderr
    (warning,) = [line for line in longer.stderr.splitlines() if line.startswith("keel: warning:")]
    assert warning.startswith("keel: warning: --set train/hero_535b:train.num_steps=500000: train.num_steps 390,251 -> "
                              "500,000 keeps the steps its positions are declared at")
    for position in ("mixture phase 2 at step 312,192 (80.0% -> 62.4%)", "transport 1 (ragged_all_to_all) at step 81,716 "
                     "(20.9% -> 16.3%)", "weight decay change at step 54,000 (13.8% -> 10.8%)"):
        assert position in warning
    moved = _keel("plan", HERO, "--prefix", "/tmp/keel-hero-plan", "--set", "train/hero_535b:train.num_steps=500000",
                  "--set", "train/hero_535b:train.weight_decay_change.start_step=69180")
    (warning,) = [line for line in moved.stderr.splitlines() if line.startswith("keel: warning:")]
    assert "mixture phase 2 at step 312,192" in warning and "weight decay" not in warning  # the one moved with it
    assert "change the length where the experiment declares it" in warning
    assert "mixture      steps 312,192-499,999" in longer.stdout  # what the warning is about, as planned
    # a wider batch keeps every position's share, but not the run's tokens: the file derives its steps from them
    wider = _keel("plan", HERO, "--prefix", "/tmp/keel-hero-plan", "--set", "train/hero_535b:train.batch_size=22528")
    (warning,) = [line for line in wider.stderr.splitlines() if line.startswith("keel: warning:")]
    assert warning == ("keel: warning: --set train/hero_535b:train.batch_size=22528: tokens per step 46,137,344 -> "
                       "92,274,688 (batch_size x seq_len) keeps train.num_steps at 390,251, so the run reads "
                       f"{92_274_688 * 390_251:,} tokens instead of {46_137_344 * 390_251:,} (2x, every phase alike). To "
                       "keep the tokens, change the batch where the experiment declares it, with a length derived from "
                       "it, or --set train.num_steps too"), warning
    both = _keel("plan", HERO, "--prefix", "/tmp/keel-hero-plan", "--set", "train/hero_535b:train.batch_size=22528",
                 "--set", "train/hero_535b:train.num_steps=195125")
    assert "tokens per step" not in both.stderr  # the length was set with it: the positions' warning is the one


def test_a_capacity_below_one_is_planned_with_the_share_it_drops_however_balanced():
    """Below 1 the experts hold fewer rows than the routed assignments even when every expert gets its
    even share: the plan took capacity_factor=0.5 without a word."""
    out = _keel("plan", HERO, "--prefix", "/tmp/keel-hero-plan", "--set", "train/hero_535b:model.capacity_factor=0.5")
    lines = [line for line in out.stdout.splitlines() if line.startswith("transport")]
    assert len(lines) == 2 and all("(capacity 0.5" in line and "DROPS at least 50% of the routed assignments" in line
                                   for line in lines), lines
    hero = _keel("plan", HERO, "--prefix", "/tmp/keel-hero-plan")
    assert "DROPS" not in hero.stdout and "(capacity 1.15, 3 waves)" in hero.stdout


def test_the_hero_file_keys_its_speeds_to_its_own_layout(sheet):
    s = sheet["step_time"]
    assert s["observations"] == "own" and s["calibration"]["source"] == "this run's observations"
    assert [round(r["step_seconds"], 1) for r in s["stretches"]] == [19.8, 16.8]
    assert all(m["fits"] for m in sheet["memory"]["phases"]) and sheet["verdict"]["fits"]


def test_a_hardware_variant_by_set_is_predicted_and_judged_at_its_hbm():
    out = _keel("plan", HERO, "--prefix", "/tmp/keel-hero-plan", "--set",
                "train/hero_535b.hardware.name=H100 SXM (HGX, InfiniBand)", "--set",
                "train/hero_535b.hardware.hbm_per_device_gb=80")
    assert out.returncode == 2 and "does not fit" in out.stderr
    assert "measured on another layout (GB200 NVL72 -> H100 SXM (HGX, InfiniBand)): not used" in out.stdout
    assert "DOES NOT FIT 80.0 GB HBM" in out.stdout


def test_a_float32_variant_without_remat_claims_what_its_memory_line_holds():
    """The claims' "the layers keep at least" is every GPU's "kept for the backward" of the memory
    line, in the compute dtype; the quoted 567 GB stays one bf16 tensor, its per-GPU share / 704."""
    import re

    out = _keel("plan", HERO, "--prefix", "/tmp/keel-hero-plan", "--set", "train/hero_535b:train.compute_dtype=float32",
                "--set", "train/hero_535b:train.remat=false")
    assert out.returncode == 2 and "does not fit" in out.stderr  # planned; it does not fit
    kept_gb = float(re.search(r"kept for the backward without remat: at least ([\d,.]+) GB", out.stdout)[1].replace(",", ""))
    kept_tb = float(re.search(r"the layers keep at least ([\d,]+) TB", out.stdout)[1].replace(",", ""))
    assert kept_tb == pytest.approx(kept_gb * 704 / 1000, abs=1)  # 2,730.9 GB x 704 GPUs = 1,923 TB
    tensor_gb = 46_137_344 * 6144 * 2 / 1e9
    assert f"{tensor_gb:.4g} GB is one bf16 6144-wide tensor" in out.stdout
    assert f"(per GPU {tensor_gb / 704:.3g} GB)" in out.stdout


def test_a_variant_whose_observations_are_rejected_prints_no_observed_switch_date():
    out = _keel("plan", HERO, "--prefix", "/tmp/keel-hero-plan", "--set", "train/hero_535b:train.batch_size=5632")
    assert "measured on another layout (batch 11264x4096 -> batch 5632x4096): not used" in out.stdout
    (switch,) = [line for line in out.stdout.splitlines() if line.startswith("transport") and "ragged_all_to_all" in line]
    assert "2026-09-09" not in switch and "(predicted)" in switch, switch
