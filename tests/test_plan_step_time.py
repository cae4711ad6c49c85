"""The step-time model: calibrated once on the hero's two observed steps, it predicts any variant
term by term, pricing each kind of traffic on the link it crosses."""

import dataclasses

import pytest

from defaults.hardware import gb200_nvl72, h100_sxm
from keel.spec import RackTopology
from keel.plan import fact_sheet, render_fact_sheet
from keel.plan.step_time import speed_key
from test_plan_facts import hero_config

OBSERVED = {0: 19.8, 81_716: 16.8}  # the reference's pooled and ragged step times


def keyed(config):
    """The config with its observations keyed to its own layout, as the hero file declares them."""
    return dataclasses.replace(config, facts=dataclasses.replace(config.facts, measured_on=speed_key(config)))


HERO = keyed(hero_config())


def variant(**changes):
    """A variant of the hero that keeps the hero's (keyed) observations."""
    return dataclasses.replace(HERO, **changes)


@pytest.fixture(scope="module")
def hero():
    return fact_sheet(HERO, "hero")


@pytest.fixture(scope="module")
def predicted_hero():
    """The hero predicted from its declaration and the GB200 preset alone."""
    return fact_sheet(dataclasses.replace(hero_config(), facts=None), "hero")


def test_calibrated_on_the_hero_it_reproduces_both_observations_and_says_what_binds(hero):
    s = hero["step_time"]
    assert s["observations"] == "own" and s["calibration"]["source"] == "this run's observations"
    for row in s["stretches"]:
        assert row["observed_seconds"] == OBSERVED[row["from_step"]]
        assert row["step_seconds"] == pytest.approx(row["observed_seconds"], rel=0.10)
        assert row["binds"] in row["terms"]
        exposed = sum(t["exposed_seconds"] for t in row["terms"].values())
        assert row["step_seconds"] == pytest.approx(exposed)
    pooled, ragged = s["stretches"]
    assert pooled["collectives"] == 3 * ragged["collectives"]  # three waves per exchange
    # the preset carries the constants this fit finds
    c = gb200_nvl72.calibration
    assert s["calibration"]["compute_efficiency"] == pytest.approx(c.compute_efficiency, rel=1e-3)
    assert s["calibration"]["collective_sync_s"] == pytest.approx(c.collective_sync_s, rel=1e-3)


def test_the_preset_alone_predicts_the_hero_within_ten_percent(predicted_hero):
    s = predicted_hero["step_time"]
    assert s["observations"] is None and s["calibration"]["source"] == "the GB200 NVL72 preset"
    assert predicted_hero["time"] is None
    for row in s["stretches"]:
        assert row["step_seconds"] == pytest.approx(OBSERVED[row["from_step"]], rel=0.10)
        assert 0 < row["mfu"] < 1
    text = render_fact_sheet(predicted_hero)
    assert "step time    predicted" in text and "binds: compute" in text


def test_observed_speeds_are_not_applied_to_another_layout(hero):
    # half the batch over the same steps (twice would read one component past Levanter's int32 count)
    halved = fact_sheet(variant(train=dataclasses.replace(HERO.train, batch_size=11_264 // 2)))
    assert halved["time"] is None  # the hero's 19.8 s belong to the hero
    s = halved["step_time"]
    assert s["observations"] == "other layout"
    assert s["differs"] == ["batch 11264x4096 -> batch 5632x4096"]
    for mine, heros in zip(s["stretches"], hero["step_time"]["stretches"]):
        assert mine["step_seconds"] < heros["step_seconds"]  # half the tokens per GPU take less
        assert mine["mfu"] > heros["mfu"] / 1.5  # not half the MFU at the hero's step time
    assert "measured on another layout (batch 11264x4096 -> batch 5632x4096): not used" in render_fact_sheet(halved)
    # the model's own capacity pads the pooled phase's rows (more FLOPs, bigger buffers): another layout too
    padded = fact_sheet(variant(model=HERO.model.replace(capacity_factor=2.0)))
    assert padded["time"] is None and padded["step_time"]["observations"] == "other layout"
    assert [d.split(" -> ")[1].split("+")[0] for d in padded["step_time"]["differs"] if "pooled" in d] == [
        "fixed_pooled_all_to_all@0/3w/cf2"]


def test_h100_hosts_as_a_64_gpu_rack_price_the_expert_axis_on_infiniband(predicted_hero):
    h100 = dataclasses.replace(h100_sxm, gpus_per_rack=64, physical_gpus_per_rack=None)
    sheet = fact_sheet(variant(hardware=h100))
    for mine, gb200 in zip(sheet["step_time"]["stretches"], predicted_hero["step_time"]["stretches"]):
        a2a = mine["terms"]["all_to_all"]
        assert a2a["off_domain"] == pytest.approx((64 - 8) / 63)  # 8 GPUs share an NVLink domain
        assert gb200["terms"]["all_to_all"]["off_domain"] == 0
        assert a2a["seconds"] > 3 * gb200["terms"]["all_to_all"]["seconds"]
        assert mine["terms"]["host"]["seconds"] == pytest.approx(
            gb200["terms"]["host"]["seconds"] * gb200_nvl72.host_link_gb_per_s / h100.host_link_gb_per_s)
        assert mine["step_seconds"] > 2 * gb200["step_seconds"]
        assert mine["mfu"] < 0.3
    assert sheet["verdict"]["fits"] is False  # 80 GB cannot hold the hero's per-GPU share


def test_ep32_gathers_expert_weights_over_data_and_sends_fewer_rows_off_gpu(predicted_hero):
    sheet = fact_sheet(variant(topology=RackTopology(11, 64, expert_parallel=32)))
    assert sheet["mesh"]["axes"]["data"] == 2
    experts_bf16 = 48 * 384 * 3 * 3072 * 3072 * 2 / 1e9 / 64  # a GPU's routed-expert shard
    for mine, ep64 in zip(sheet["step_time"]["stretches"], predicted_hero["step_time"]["stretches"]):
        fsdp, fsdp64 = mine["terms"]["fsdp"], ep64["terms"]["fsdp"]
        assert fsdp["gb"] - fsdp64["gb"] == pytest.approx(experts_bf16 * 4)  # 3 gathers + 1 reduce-scatter
        assert mine["terms"]["all_to_all"]["gb"] / ep64["terms"]["all_to_all"]["gb"] == pytest.approx((31 / 32) / (63 / 64))
        assert mine["step_seconds"] != ep64["step_seconds"]


def test_hardware_without_its_links_names_what_is_missing():
    bare = dataclasses.replace(gb200_nvl72, link_gb_per_s=None, host_link_gb_per_s=None)
    sheet = fact_sheet(variant(hardware=bare))
    assert sheet["step_time"] == {"missing": ["hardware.link_gb_per_s", "hardware.host_link_gb_per_s"]}
    assert "not predicted: declare hardware.link_gb_per_s, hardware.host_link_gb_per_s" in render_fact_sheet(sheet)


def test_the_ring_prices_the_other_gpus_rows_it_gathers_once():
    """The ring all-gathers the other ep - 1 GPUs' tokens and reduce-scatters their outputs: every
    row it counts comes from or goes to another GPU, so all of it leaves the GPU, and the step-time
    model prices the all-to-all line's bytes as they are (not another (ep - 1) / ep of them)."""
    from keel.spec import TransportPhase

    sheet = fact_sheet(variant(train=dataclasses.replace(HERO.train, transports=(TransportPhase(0, "ring"),))))
    (ring,) = sheet["all_to_all"]
    tokens, ep, width, layers = 16 * 4096, 64, 3072, 48
    exchanges = 2 * 3  # a gather and a scatter in the forward, the backward and remat's second forward
    gb = tokens * (ep - 1) * width * 2 * exchanges * layers / 1e9  # bf16 rows of the other GPUs' tokens
    assert ring["kind"] == "all_gather" and ring["gb_per_step_per_gpu"] == pytest.approx(gb)
    assert ring["off_gpu_fraction"] == 1.0
    for row in sheet["step_time"]["stretches"]:
        assert row["terms"]["all_to_all"]["gb"] == pytest.approx(gb)
    text = render_fact_sheet(sheet)
    assert f"{gb:,.1f} GB per step per GPU (100% leaves the GPU)" in text
    assert f"all-to-all {sheet['step_time']['stretches'][0]['terms']['all_to_all']['seconds']:.2f} s ({gb:,.0f} GB)" in text


def test_a_variant_whose_observations_are_rejected_dates_its_switch_by_the_modelled_step_times(hero):
    """The observed run switched on 2026-09-09; a variant the sheet predicts (its observations
    belong to the hero's layout) reaches the switch when its own modelled steps take it there."""
    import datetime

    halved = fact_sheet(variant(train=dataclasses.replace(HERO.train, batch_size=11_264 // 2)))
    assert halved["step_time"]["observations"] == "other layout"
    start = datetime.datetime.fromisoformat(HERO.facts.start_date)
    for phase in halved["transports"]:
        seconds = sum((min(r["to_step"] + 1, phase["start_step"]) - r["from_step"]) * r["step_seconds"]
                      for r in halved["step_time"]["stretches"] if r["from_step"] < phase["start_step"])
        assert phase["date"] == (start + datetime.timedelta(seconds=seconds)).date().isoformat()
    switch = halved["transports"][1]
    assert switch["start_step"] == 81_716 and switch["date"] != "2026-09-09"  # faster steps than the hero's
    text = render_fact_sheet(halved)
    assert "from 2026-09-09" not in text
    assert f"ragged_all_to_all (capacity 1.15), from {switch['date']} (predicted)" in text
    # the hero's own observations date its switches as they happened
    assert [p["date"] for p in hero["transports"]] == ["2026-08-19", "2026-09-09"]
    assert "(predicted)" not in "\n".join(line for line in render_fact_sheet(hero).splitlines() if line.startswith("transport"))


def test_a_float32_variant_is_not_timed_at_the_bfloat16_peak():
    """The hardware's peak and its preset calibration are bf16 matmul rates: a float32 variant's
    compute time is not predicted from them (it printed the bf16 run's 15.30 s)."""
    sheet = fact_sheet(variant(train=dataclasses.replace(HERO.train, compute_dtype="float32")))
    assert sheet["step_time"]["missing"][0].startswith("train.compute_dtype='bfloat16'")
    assert "step time    not predicted: declare train.compute_dtype='bfloat16'" in render_fact_sheet(sheet)
    assert "stretches" in fact_sheet(variant())["step_time"]  # the bf16 run is
    # its claims on the run's length are listed unchecked, not an error that stops the plan
    claims = {c["claim"]: c for c in fact_sheet(variant(train=dataclasses.replace(HERO.train, compute_dtype="float32")))["claims"]}
    assert claims["trains in 60 days"]["holds"] is None and claims["trains in 60 days"]["finding"].startswith("not checked")


def test_the_attention_kernel_is_part_of_the_speed_key():
    """The hero's speeds were measured with jax_flash: the vanilla kernel is another layout."""
    vanilla = variant(model=HERO.model.replace(attention_backend="vanilla"))
    assert "attention jax_flash" in speed_key(HERO) and "attention vanilla" in speed_key(vanilla)
    out = render_fact_sheet(fact_sheet(vanilla, "hero/vanilla"))
    assert "measured on another layout (attention jax_flash -> attention vanilla): not used" in out


def test_the_hero_files_observations_are_keyed_to_its_own_layout():
    from keel.cli import load_experiment

    (hero,) = [s for s in load_experiment("experiments/hero_535b.py") if s.name == "train/hero_535b"]
    assert hero.config.facts.measured_on == speed_key(hero.config)


def test_a_run_still_in_its_first_phase_dates_the_next_one_by_the_modelled_step_times():
    """Its own observations reach only its first steps: the switch it has not reached is predicted."""
    first_only = dataclasses.replace(HERO.facts, observed=HERO.facts.observed[:1], projected_steps_per_day=None)
    sheet = fact_sheet(dataclasses.replace(HERO, facts=first_only))
    assert sheet["step_time"]["observations"] != "other layout"
    start, switch = sheet["transports"]
    assert (start["date"], start["date_basis"]) == ("2026-08-19", "observed")
    assert switch["date_basis"] == "predicted" and switch["date"] > "2026-08-19"
    assert f"from {switch['date']} (predicted)" in render_fact_sheet(sheet)


def test_a_switch_not_yet_reached_is_dated_from_the_latest_observation_before_it_and_never_before_it():
    """A run observed at step 40,000 on 2026-09-25 (slower than full goodput) reaches its 81,716
    switch after that date, at the modelled steps from there: counted from the start it came out
    2026-09-06, before a step it had already passed."""
    import datetime

    from keel.spec import SpeedObservation

    observed = (HERO.facts.observed[0], SpeedObservation(step=40_000, date="2026-09-25", step_seconds=19.8))
    sheet = fact_sheet(dataclasses.replace(HERO, facts=dataclasses.replace(HERO.facts, observed=observed,
                                                                            projected_steps_per_day=3000)))
    switch = sheet["transports"][1]
    pooled = sheet["step_time"]["stretches"][0]["step_seconds"]
    expected = datetime.date(2026, 9, 25) + datetime.timedelta(seconds=(81_716 - 40_000) * pooled)
    assert (switch["date"], switch["date_basis"]) == (expected.isoformat(), "predicted") and switch["date"] > "2026-09-25"
    # observed a few steps after it, the switch is dated between the two observations, by the modelled step times
    late = (HERO.facts.observed[0], SpeedObservation(step=81_800, date="2026-09-10", step_seconds=16.8))
    sheet = fact_sheet(dataclasses.replace(HERO, facts=dataclasses.replace(HERO.facts, observed=late)))
    switch = sheet["transports"][1]
    assert switch["date_basis"] == "predicted" and "2026-09-08" <= switch["date"] <= "2026-09-10"


def test_a_variants_days_at_full_goodput_do_not_check_a_claim_in_calendar_days(hero):
    """The hero's "trains in 60 days" is calendar days on its schedule (4,400 steps a day, 85.6% of
    its measured rate); a variant's predicted days are at full goodput: 58 "held" for a variant that
    would take 68 at the hero's goodput, so the claim is listed unchecked, saying why."""
    sheet = fact_sheet(variant(train=dataclasses.replace(HERO.train, remat=False)))
    days = sheet["step_time"]["run_days"]  # predicted, at full goodput: within the 5% a claim may be off
    assert not sheet.get("time") and abs(days / 60 - 1) <= 0.05
    on_days = [c for c in sheet["claims"] if c["figure"] in ("run_days", "one_rack_days")]
    assert any(c["claim"] == "trains in 60 days" for c in on_days)
    for claim in on_days:
        assert claim["holds"] is None and "predicted at full goodput" in claim["finding"], claim
    assert {c["claim"]: c for c in hero["claims"]}["trains in 60 days"]["holds"] is False  # the hero's own: its schedule


def test_a_date_that_is_no_iso_date_is_refused_where_it_is_declared():
    """Before any plan: the step-time model parsed the start date itself, so `keel plan`, variants
    and the dashboard died on a bare ValueError traceback (`--set ...:facts.start_date=2026-13-01`)."""
    _, second = HERO.facts.observed
    with pytest.raises(ValueError, match=r"SpeedObservation\.date='2026-09-31' is not an ISO date: write it as 'yyyy-mm-dd'"):
        dataclasses.replace(second, date="2026-09-31")
    for bad in ("2026-13-01", "2026/08/19", None):
        with pytest.raises(ValueError, match=rf"RunFacts\.start_date={bad!r} is not an ISO date"):
            dataclasses.replace(HERO.facts, start_date=bad)


def test_plan_names_a_start_date_set_wrong_and_how_to_write_it(capsys):
    from keel.cli import console_main

    assert console_main(["plan", "experiments/hero_535b.py", "--set", "train/hero_535b:facts.start_date=2026-13-01"]) == 2
    assert capsys.readouterr().err.strip() == ("keel: error: --set train/hero_535b:facts.start_date=2026-13-01: "
                                               "RunFacts.start_date='2026-13-01' is not an ISO date: write it as 'yyyy-mm-dd'")


def test_an_observation_at_a_step_the_run_never_takes_is_refused_naming_it():
    """Steps run 0 .. num_steps - 1: one observed at num_steps lay in no stretch and was left out of
    the fit without a word."""
    from keel.spec import PlanError, SpeedObservation
    from keel.spec.resolved import resolve

    last = HERO.train.num_steps
    observed = (HERO.facts.observed[0], SpeedObservation(step=last, date="2026-11-20", step_seconds=16.8))
    with pytest.raises(PlanError, match=rf"facts.observed\[1\]: step {last} must lie in \[0, train.num_steps={last}\)"):
        resolve(dataclasses.replace(HERO, facts=dataclasses.replace(HERO.facts, observed=observed)))
    resolve(dataclasses.replace(HERO, facts=dataclasses.replace(HERO.facts, observed=(
        HERO.facts.observed[0], SpeedObservation(step=last - 1, date="2026-11-20", step_seconds=16.8)))))


def test_the_update_moves_the_memory_sheets_master_weights_gradients_and_moments():
    """The update's HBM bytes are the memory sheet's own parts: master weights and moments read and
    written, gradients (typed like the master weights) read. It counted the gradients in the compute
    dtype and a compute-dtype weight copy the step never keeps: right for bf16/fp32 by coincidence
    (2x4 + 2x2 = 2x4 + 4 bytes a parameter), 2 bytes a trained parameter too many with bf16 masters
    (2x2 + 2x2 against 2x2 + 2)."""
    def hbm_and_parts(config):
        sheet = fact_sheet(config)
        parts = sheet["memory"]["parts_gb"]
        first = sheet["step_time"]["stretches"][0]["terms"]["hbm"]["gb"]
        return first, 2 * parts["master_weights"] + parts["gradients"] + 2 * parts["optimizer_state"]

    fp32_hbm, fp32_update = hbm_and_parts(HERO)
    bf16_hbm, bf16_update = hbm_and_parts(variant(train=dataclasses.replace(HERO.train, master_dtype="bfloat16")))
    assert bf16_update < fp32_update
    # the weights read each pass (compute dtype) and the saved residuals are the same in both
    assert bf16_hbm - fp32_hbm == pytest.approx(bf16_update - fp32_update, rel=1e-9)
