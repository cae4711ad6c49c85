"""Launch figures (checkpoints, GPU-hours and cost, tokens read per component), positions that
follow the run, and `keel plan A.py B.py`'s table of variants."""

import dataclasses
import datetime
import math
from pathlib import Path

import pytest

from keel.plan import fact_sheet, render_fact_sheet
from keel.spec import LaunchPlan, PlanError
from keel.plan.positions import steps_at
from keel.spec.train import MOMENTS
from test_plan_facts import hero_config
from test_plan_hero import HERO, _keel


def test_checkpoints_hold_master_weights_and_optimizer_state_and_the_cadence_keeps_them():
    config = dataclasses.replace(hero_config(), launch=LaunchPlan(store_gb_per_s=100.0, gpu_hour_price=2.0))
    sheet = fact_sheet(config)
    ckpt = sheet["launch"]["checkpoint"]
    entries = sum(math.prod(r["axes"].values()) * (4 + 4 * MOMENTS[r["group"]]) for r in sheet["parameter_table"])
    assert ckpt["gb"] == pytest.approx(entries / 1e9)
    # every 6,000 steps below the end, the final one and the switch at 81,716; one rolling kept
    assert ckpt["permanent"] == 390_251 // 6000 + 1 + 1 and ckpt["rolling_kept"] == 1
    assert ckpt["retained_gb"] == pytest.approx(ckpt["gb"] * (ckpt["permanent"] + 1))
    assert ckpt["write_seconds"] == pytest.approx(ckpt["gb"] / 100.0)
    hours = sheet["launch"]["gpu_hours"]
    assert hours["hours"] == pytest.approx(sheet["time"]["projected_days"] * 24 * 704)  # start to the projected end
    assert hours["cost"] == pytest.approx(2.0 * hours["hours"])
    text = render_fact_sheet(sheet)
    assert "written in" in text and "GPU-hours" in text
    # the variants table's length is one figure: the days at full goodput from its start to the end it shows
    from keel.plan import variant_row

    row = variant_row("hero", sheet)
    start = datetime.date.fromisoformat(sheet["time"]["start_date"])
    assert start + datetime.timedelta(days=row["days"]) == datetime.date.fromisoformat(row["end_date"])


def test_a_checkpoint_holds_the_state_the_state_table_lays_out_in_any_master_dtype():
    from keel.spec.dtypes import DTYPE_BYTES
    from keel.spec.resolved import resolve

    for master in ("float32", "bfloat16"):
        config = dataclasses.replace(hero_config(), train=dataclasses.replace(hero_config().train, master_dtype=master))
        state = resolve(config).state_at(0)  # what the trainer holds: moments in the master dtype too
        held = sum(math.prod(leaf.shape) * DTYPE_BYTES[leaf.dtype] for leaf in state if leaf.path != "step")
        assert fact_sheet(config)["launch"]["checkpoint"]["gb"] == pytest.approx(held / 1e9), master


def test_tokens_read_per_component_against_what_its_cache_holds():
    config = dataclasses.replace(hero_config(), launch=LaunchPlan(cache_tokens=(("math", 0.2e12), ("law", 1e12))))
    sheet = fact_sheet(config)
    read = {r["component"]: r for r in sheet["launch"]["components"]}
    assert sum(r["tokens_read"] for r in read.values()) == pytest.approx(18_005_144_633_344)
    assert read["math"]["epochs"] == pytest.approx(read["math"]["tokens_read"] / 0.2e12) and read["math"]["epochs"] > 1
    assert read["law"]["epochs"] < 1 and read["finance"]["epochs"] is None
    assert "REPEATS" in render_fact_sheet(sheet)
    with pytest.raises(PlanError, match=r"launch.cache_tokens names maths, which the mixture does not have"):
        fact_sheet(dataclasses.replace(config, launch=LaunchPlan(cache_tokens=(("maths", 1e12),))))
    with pytest.raises(ValueError, match=r"LaunchPlan.cache_tokens names 'math' more than once"):
        LaunchPlan(cache_tokens=(("math", 1e11), ("law", 1e12), ("math", 1e13)))  # which would the sheet read?
    # one token cache (`Mixture.single`, the component "data") reads every token from it
    from keel.spec import Mixture

    single = dataclasses.replace(config, data=Mixture.single(config.data.components["math"]),
                                 launch=LaunchPlan(cache_tokens=(("data", 6e12),)))
    (only,) = fact_sheet(single)["launch"]["components"]
    assert only["component"] == "data" and only["tokens_read"] == 18_005_144_633_344
    assert only["epochs"] == pytest.approx(18_005_144_633_344 / 6e12)
    assert "data 18.01T of 6.00T (3.00 epochs, REPEATS)" in render_fact_sheet(fact_sheet(single))


def test_positions_are_fractions_of_the_run_resolved_to_steps():
    assert steps_at({"a": 0.25, "b": 0.5}, 1000, field="x") == {"a": 250, "b": 500}
    with pytest.raises(PlanError, match=r"phases: a at step 500 \(0.5\), b at step 250 \(0.25\): each must land"):
        steps_at({"a": 0.5, "b": 0.25}, 1000, field="phases", ordered=True)
    with pytest.raises(PlanError, match=r"x\['a'\]=1.2 is not a fraction of the run"):
        steps_at({"a": 1.2}, 1000, field="x")


def _hero_copy(tmp_path: Path, old: str, new: str) -> str:
    text = Path(HERO).read_text()
    assert old in text
    path = tmp_path / "hero_variant.py"
    path.write_text(text.replace(old, new))
    return str(path)


@pytest.mark.parametrize("per_rack", [2048, 3072])
def test_a_hero_copy_with_a_larger_batch_moves_its_positions_with_its_tokens(tmp_path, per_rack):
    import json

    path = _hero_copy(tmp_path, "BATCH_SIZE = 1024 * RACKS", f"BATCH_SIZE = {per_rack} * RACKS")
    out = _keel("plan", path, "--json", "--prefix", str(tmp_path / "out"))
    assert out.returncode == 2 and "does not fit" in out.stderr  # planned; its peak is over the HBM
    (sheet,) = json.loads(out.stdout[out.stdout.index("{"):])["fact_sheets"]
    hero_tokens_per_step = 11_264 * 4096
    steps, tokens_per_step = sheet["training"]["num_steps"], sheet["training"]["tokens_per_step"]
    main, switch = sheet["mixture"][1]["start_step"], sheet["transports"][1]["start_step"]
    block_steps = 49_152 // math.gcd(49_152, sheet["training"]["batch_size"])  # phases start on a mixture block
    assert 0 <= 108_000 / 390_251 * steps - main < block_steps  # the hero's share of the tokens
    assert abs(main * tokens_per_step - 108_000 * hero_tokens_per_step) <= block_steps * tokens_per_step
    assert switch == round(81_716 / 390_251 * steps)
    assert sheet["optimizer"]["weight_decay_change"]["start_step"] == round(54_000 / 390_251 * steps)


def test_phases_declared_out_of_order_are_a_keel_error(tmp_path):
    path = _hero_copy(tmp_path, '"main": 108_000 / REAL_RUN_STEPS', '"main": 0.9')
    out = _keel("plan", path, "--prefix", str(tmp_path / "out"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "keel: error: hero mixture phases: initial at step 0 (0), main at step" in out.stderr


def test_keel_plan_of_two_files_prints_one_table_of_variants(tmp_path):
    doubled = _hero_copy(tmp_path, "BATCH_SIZE = 1024 * RACKS", "BATCH_SIZE = 2048 * RACKS")
    out = _keel("plan", HERO, doubled, "--prefix", str(tmp_path / "out"))
    header, rule, hero_row, doubled_row = out.stdout.strip().splitlines()
    assert header.startswith("| variant | hardware | steps | tokens | s/step | MFU |")
    assert "hero_535b.py: train/hero_535b" in hero_row and "19.8 / 16.8 (observed)" in hero_row
    assert "| fits |" in hero_row
    # both rows' days and GPU-hours at full goodput, from the step times they show: the hero's own
    # projection (91 days, its declared 4,400 steps a day) beside a variant's 100% made it look slower
    days = 81_716 * 19.8 / 86_400 + (390_251 - 81_716) * 16.8 / 86_400
    assert f"| {days:.0f} (2026-11-05) |" in hero_row and f"| {days * 24 * 704:,.0f} |" in hero_row, hero_row
    assert "days at full goodput (end)" in header and "GPU-hours at full goodput" in header
    assert "(predicted)" in doubled_row and "DOES NOT FIT" in doubled_row and "195,125" in doubled_row
    assert out.returncode == 2  # the doubled batch does not fit
    narrowed = _keel("plan", HERO, doubled, "--prefix", str(tmp_path / "out"), "--only", "hero")
    assert narrowed.returncode == 2 and narrowed.stderr.startswith("keel: error: --only does nothing when `keel plan` "
                                                                   "compares several experiments"), narrowed.stderr


def test_a_variants_row_shows_each_stretchs_own_basis_and_a_measured_layout_without_a_model_its_speeds():
    from keel.plan import variant_row
    from keel.spec import SpeedObservation

    config = hero_config()
    only_pooled = dataclasses.replace(config.facts, observed=(config.facts.observed[0],
                                                              SpeedObservation(step=40_000, date="2026-09-25", step_seconds=19.8)))
    row = variant_row("hero", fact_sheet(dataclasses.replace(config, facts=only_pooled)))
    assert row["basis"] == ["observed", "predicted"] and row["step_seconds"][0] == 19.8
    # hardware with no peak FLOP rate has no step-time model: the row shows what the run measured
    bare = dataclasses.replace(config.hardware, peak_flops_per_device=None)
    row = variant_row("hero", fact_sheet(dataclasses.replace(config, hardware=bare)))
    assert row["step_seconds"] == [19.8, 16.8] and row["basis"] == ["observed", "observed"] and row["days"] is None


def _drawn_tokens(config, component: str) -> float:
    """Tokens a component is read for over the run, as the mixture blocks draw it: in every block of
    `block_size` sequences floor(share x block) of them (the component is not any phase's largest,
    which takes the rest), over each phase's steps."""
    data, train = config.data, config.train
    starts = [p.start_step for p in data.phases] + [train.num_steps]
    read = 0.0
    for phase, end in zip(data.phases, starts[1:]):
        share = phase.weights[component] / sum(phase.weights.values())
        read += math.floor(share * data.block_size) / data.block_size * (end - phase.start_step) * train.tokens_per_step
    return read


def test_tokens_read_per_component_are_what_its_blocks_draw_not_the_declared_weight():
    config = dataclasses.replace(hero_config(), launch=LaunchPlan(cache_tokens=(("world-news", 0.3e12),)))
    read = {r["component"]: r for r in fact_sheet(config)["launch"]["components"]}
    drawn = _drawn_tokens(config, "world-news")  # 393 of 49,152 sequences for its 0.8% in the first phase, ...
    assert read["world-news"]["tokens_read"] == pytest.approx(drawn, rel=1e-12)
    assert read["world-news"]["epochs"] == pytest.approx(drawn / 0.3e12, rel=1e-12)


def test_the_twin_prints_the_tokens_its_blocks_draw_per_component():
    from keel.cli import load_experiment
    from keel.spec import TrainStepConfig

    (twin,) = [s.config for s in load_experiment(HERO, "tiny") if isinstance(s.config, TrainStepConfig)]
    drawn = _drawn_tokens(twin, "world-news")
    assert drawn == 4352  # 2, 6 and 4 of 256 sequences over 32, 64 and 24 steps of 2,048 tokens
    out = _keel("plan", HERO, "--scale", "tiny", "--prefix", "/tmp/keel-hero-plan")
    assert out.returncode == 0, out.stderr
    (line,) = [line for line in out.stdout.splitlines() if "tokens read per component" in line]
    assert f"world-news {drawn:,.0f}" in line, line


def test_variants_of_files_sharing_a_name_are_told_apart_and_small_runs_keep_their_figures(tmp_path):
    sweep = Path("experiments/tutorials/lr_sweep.py").read_text()
    assert "STEPS, SCALES = 30," in sweep
    for folder, steps in (("v1", 30), ("v2", 20)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "lr_sweep.py").write_text(sweep.replace("STEPS, SCALES = 30,", f"STEPS, SCALES = {steps},"))
    out = _keel("plan", str(tmp_path / "v1" / "lr_sweep.py"), str(tmp_path / "v2" / "lr_sweep.py"), "--prefix",
                str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    rows = [line.split(" | ") for line in out.stdout.strip().splitlines()[2:]]
    assert [r[0].removeprefix("| ") for r in rows] == [f"{v}/lr_sweep.py: train/lr_sweep/lr{s}" for v in ("v1", "v2")
                                                       for s in ("0.5", "1.0", "2.0")]
    tokens = {r[0]: r[3] for r in rows}
    assert tokens["| v1/lr_sweep.py: train/lr_sweep/lr1.0"] == f"{30 * 16 * 128:,}"  # 61,440, not 0.00T
    assert all(" MB of 2.0 GB" in r[7] for r in rows), rows  # a small run's peak in MB, not "0.0 of 2 GB"


def test_a_set_in_a_plan_of_several_files_goes_to_the_files_that_have_its_step(capsys):
    """Each file took every `--set`, so one naming a step of the hero file failed in the tutorial's,
    with that file's steps and a wrong "closest"; now it reaches the hero only, and one that names
    no step of either is refused listing both files' steps."""
    from keel.cli import console_main

    files = (HERO, "experiments/tutorials/tiny_moe.py")
    assert console_main(["plan", *files, "--set", "train/hero_535b:train.batch_size=5632"]) == 0  # half the hero's
    out, err = capsys.readouterr()
    hero_row, tiny_row = [line for line in out.splitlines() if "train/" in line]
    assert "hero_535b.py: train/hero_535b" in hero_row and "| 9.00T |" in hero_row, hero_row
    assert "tiny_moe.py: train/tiny_moe" in tiny_row and "| 300 |" in tiny_row and "no step named" not in err, err
    assert console_main(["plan", *files, "--set", "train/tiny:train.num_steps=10"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("keel: error: --set 'train/tiny:train.num_steps=10': no step of the 2 experiment files is named "
                          "so; their steps: ") and "train/hero_535b" in err and "train/tiny_moe" in err, err
