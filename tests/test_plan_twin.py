"""scale_down: the hero's twin keeps the run's shape (features, phases, switch) at CPU size."""

import dataclasses

import pytest

from defaults.hardware import cpu_sim
from defaults.models import tiny_moe
from defaults.optimizers import hero_lr_law
from keel import Step
from keel.spec import PlanError, RackTopology, resolve
from keel.plan import architecture_features, fact_sheet, scale_down
from keel.train.step import train_step
from test_plan_facts import hero_config

CPU = dict(name="hero-tiny", batch_size=16, seq_len=128, num_steps=60, topology=RackTopology(2, 4, expert_parallel=4),
           hardware=cpu_sim)


def hero_step() -> Step:
    return Step("train/hero", train_step, hero_config(), isolated=True)


def test_twin_keeps_the_run_shape_at_scaled_steps():
    hero = hero_config()
    step = scale_down(hero_step(), model=tiny_moe, data="/caches/stdlib", **CPU)
    assert step.name == "train/hero-tiny" and step.isolated and step.fn is train_step
    twin = resolve(step.config).config  # the law's rates, at the twin's size
    assert architecture_features(twin.model) >= architecture_features(hero.model)
    # phases at 60/390,251 of the hero's steps, on blocks of 256 sequences = 16 steps of 16
    assert [p.start_step for p in twin.data.phases] == [0, 16, 48]
    assert twin.data.block_size == 256
    assert [p.weights for p in twin.data.phases] == [p.weights for p in hero.data.phases]
    assert set(twin.data.components.values()) == {"/caches/stdlib"}
    assert twin.data.components.keys() == hero.data.components.keys()
    switch = twin.train.transports[1]
    assert switch.start_step == round(81_716 * 60 / 390_251)
    assert switch.transport == "ring"  # cpu_sim has no ragged all-to-all: the dropless CPU transport stands in
    assert twin.train.transports[0].num_waves == 2  # 3 waves cannot split 2 experts per device; 2 can
    # the kernels are handed the hero's capacity, not tiny_moe's own
    assert tiny_moe.capacity_factor != hero.model.capacity_factor
    assert [t.capacity_factor for t in resolve(step.config).transports] == [hero.model.capacity_factor, None]
    assert twin.train.weight_decay_change.start_step == round(54_000 * 60 / 390_251)
    assert twin.train.schedule == hero.train.schedule and twin.train.z_loss == hero.train.z_loss
    assert twin.train.optimizer.muonh_params == hero.train.optimizer.muonh_params
    assert twin.train.optimizer.muon_lr / twin.train.optimizer.adam_lr == pytest.approx(13 / 3)
    assert twin.train.optimizer.adam_lr == pytest.approx(hero_lr_law.adam_lr(tiny_moe.hidden_dim, 16 * 128 * 60, 16 * 128))
    assert twin.facts is None


def test_twin_passes_plan_on_cpu_hardware():
    sheet = fact_sheet(scale_down(hero_step(), model=tiny_moe, data="/caches/stdlib", **CPU).config, "hero/train-tiny")
    assert sheet["mesh"]["axes"] == {"replica_dcn": 2, "data": 1, "expert": 4, "model": 1}
    assert sheet["training"]["num_steps"] == 60
    assert [t["transport"] for t in sheet["transports"]] == ["fixed_pooled_all_to_all", "ring"]


def test_twin_must_keep_every_feature():
    with pytest.raises(PlanError, match="switches off qk_norm, xsa"):
        scale_down(hero_step(), model=tiny_moe.replace(xsa=False, qk_norm=False), data="/c", **CPU)


def test_a_feature_the_run_declares_but_never_reads_is_not_one_its_twin_must_keep():
    """A window on a run whose every layer is global is 'no effect' in the plan: its twin need not declare it."""
    all_global = dataclasses.replace(hero_config(), model=hero_config().model.replace(global_every=1))
    run = Step("train/hero", train_step, all_global, isolated=True)
    assert all_global.model.inert_fields()
    twin = scale_down(run, model=tiny_moe.replace(global_every=1).without_inert_fields(), data="/c", **CPU)
    assert twin.config.model.sliding_window is None


def test_the_stand_ins_name_every_model_field_the_twin_changes_and_the_waves():
    hero = hero_config()
    step = scale_down(hero_step(), model=tiny_moe, data="/caches/stdlib", **CPU)
    model_line, = (line for line in step.config.stand_ins if line.startswith("model "))
    changed = {f.name for f in dataclasses.fields(hero.model) if getattr(tiny_moe, f.name) != getattr(hero.model, f.name)}
    assert {"vocab_size", "experts_per_token", "qb_histogram_bins"} <= changed  # e.g. the 1k BPE plays the 128k vocabulary
    named = {part.split(" ")[0] for part in model_line.split(": ", 1)[1].split(", ")}
    assert named == changed - {"capacity_factor"}  # the capacity is the run's (kept, not swapped)
    assert "vocab_size 1024 (128256)" in model_line
    pooled, = (line for line in step.config.stand_ins if "waves" in line)
    assert pooled == ("transport from step 0: fixed_pooled_all_to_all in 2 waves plays 3, which do not split the "
                      "twin's 2 experts per device")


def test_the_plan_says_how_far_the_twins_small_blocks_draw_a_weight_from_its_declaration():
    from keel.plan import render_fact_sheet

    step = scale_down(hero_step(), model=tiny_moe, data="/caches/stdlib", **CPU)
    sheet = fact_sheet(step.config, "hero/train-tiny")
    first = sheet["mixture"][0]
    counts = step.config.data.block_counts()[0]
    assert first["block_size"] == 256 and sum(counts.values()) == 256
    assert first["drawn"] == {name: counts[name] / 256 for name in first["weights"]}
    misses = {name: abs(first["drawn"][name] - w) / w for name, w in first["weights"].items()}
    worst = max(misses, key=misses.get)
    assert misses[worst] > 0.2  # a 1.1% weight is 2.8 sequences of a block: 2 are drawn
    assert (f"blocks of 256 sequences draw {worst} at {first['drawn'][worst]:.2%} for its {first['weights'][worst]:.2%}"
            in render_fact_sheet(sheet))
    hero = fact_sheet(hero_config(), "hero")
    assert "draw" not in "\n".join(line for line in render_fact_sheet(hero).splitlines() if line.startswith("mixture"))


def test_a_stand_in_without_a_capacity_drops_the_phases_capacity_and_a_block_too_small_names_mixture_block():
    hero = hero_config()
    ragged = dataclasses.replace(hero.train.transports[1], capacity_factor=1.3)  # valid on the run's GPUs
    run = Step("train/hero", train_step, dataclasses.replace(
        hero, train=dataclasses.replace(hero.train, transports=(hero.train.transports[0], ragged))), isolated=True)
    twin = scale_down(run, model=tiny_moe, data="/caches/stdlib", **CPU).config
    assert (twin.train.transports[1].transport, twin.train.transports[1].capacity_factor) == ("ring", None)  # dropless
    with pytest.raises(PlanError, match=r"scale_down\(mixture_block=64\): .*less than one sequence of a block of 64"):
        scale_down(hero_step(), model=tiny_moe, data="/caches/stdlib", mixture_block=64, **CPU)


def test_twin_phase_starts_move_down_to_a_block_so_a_short_twin_still_plans():
    """Phase starts move down to a block of 16 steps (rounded to the nearest, a 30-step twin's cooldown
    at step 24 went to 32, past its end)."""
    step = scale_down(hero_step(), model=tiny_moe, data="/caches/stdlib", **{**CPU, "num_steps": 60})
    assert [p.start_step for p in step.config.data.phases] == [0, 16, 48]  # blocks of 16 steps
    fact_sheet(step.config, "hero/train-tiny")  # the plan accepts it


@pytest.mark.parametrize("num_steps", [15, 30])
def test_a_twin_too_short_to_keep_every_phase_apart_is_refused(num_steps):
    """At 30 steps the run's first two mixture phases (steps 0 and 108,000 of 390,251) both start at
    the twin's block 0: the twin would never train the first, and it says so instead."""
    with pytest.raises(PlanError, match=rf"scale_down\(num_steps={num_steps}, mixture_block=256\) \(phases start on "
                                        r"blocks of 16 steps\): the run's mixture phases 0 and 1 both start at step 0 "
                                        r"of the twin, which would never train phase 0: train the twin longer"):
        scale_down(hero_step(), model=tiny_moe, data="/caches/stdlib", **{**CPU, "num_steps": num_steps})


def test_the_stand_ins_name_every_training_field_the_twin_swaps_with_the_runs_value():
    hero = hero_config()
    step = scale_down(hero_step(), model=tiny_moe, data="/caches/stdlib", evaluations=6, eval_batches=1, **CPU)
    train_line, = (line for line in step.config.stand_ins if line.startswith("train "))
    twin = step.config.train
    for name in ("batch_size", "seq_len", "num_steps", "eval_every", "evaluations", "eval_batches",
                 "permanent_checkpoint_every"):
        assert f"{name} {getattr(twin, name)} ({getattr(hero.train, name)})" in train_line
    assert "mixture block_size 256 (49152)" in train_line
    assert "z_loss" not in train_line  # kept, so not named
