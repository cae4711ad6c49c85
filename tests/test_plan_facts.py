"""The fact sheet derives the hero run's figures from its declaration; broken declarations fail in plan."""

import dataclasses
import math
import subprocess
import sys

import pytest

from defaults.hardware import cpu_sim, gb200_nvl72
from defaults.models import hero_535b, tiny_moe
from defaults.optimizers import hero_lr_law
from keel import External, Step
from keel.spec import (
    Claim,
    HostOffload,
    Mixture,
    MixturePhase,
    PlanError,
    RackTopology,
    RunFacts,
    ScheduleConfig,
    SpeedObservation,
    steps_for_tokens_per_param,
    TrainConfig,
    TrainStepConfig,
    TransportPhase,
    WeightDecayChange,
)
from keel.plan import fact_sheet, fact_sheets_for, render_fact_sheet

TOPICS = {  # public topic shares per phase (initial, main, cooldown); the rest of each phase is "other"
    "perf-logs-low-level-code": (9.0, 10.6, 11.4),
    "software-infra-security": (9.3, 8.3, 8.0),
    "cli-agent-transcripts": (1.3, 6.0, 6.6),
    "general-software-web": (7.9, 4.5, 3.1),
    "natural-science": (8.8, 6.9, 11.3),
    "history-literature": (6.9, 3.7, 3.7),
    "finance": (5.6, 2.4, 2.8),
    "math": (4.3, 1.8, 1.4),
    "law": (1.1, 3.6, 2.9),
    "world-news": (0.8, 2.7, 1.8),
}


def _never_run(config):
    raise AssertionError("planning must not run a step")


def hero_config(racks: int = 11, batch: int = 11_264, **train_changes) -> TrainStepConfig:
    """The hero declaration as the reference states it; derived numbers are computed."""
    seq = 4096
    steps = steps_for_tokens_per_param(hero_535b, batch, seq, 791)
    block = 49_152
    align = block // math.gcd(block, batch)
    cooldown = math.floor(steps * 15 / 18.75 / align) * align
    names = [*TOPICS, "other"]
    phases = []
    for i, start in enumerate((0, 108_000, cooldown)):
        weights = {topic: shares[i] / 100 for topic, shares in TOPICS.items()}
        weights["other"] = 1 - sum(weights.values())
        phases.append(MixturePhase(start, weights))
    components = {n: External(f"hero/data/{n}", f"gs://hero-data/cache/{n}", version="v1") for n in names}
    data = Mixture(components, tuple(phases), block_size=block, normalize=True)
    train = TrainConfig(
        batch_size=batch,
        seq_len=seq,
        num_steps=steps,
        optimizer=hero_lr_law.optimizer(),
        schedule=ScheduleConfig(warmup_fraction=0.01, decay_to_fraction=0.05),
        z_loss=1e-4,
        weight_decay_change=WeightDecayChange(start_step=54_000, peak=0.02),
        eval_every=3000,
        permanent_checkpoint_every=6000,
        rolling_checkpoint_minutes=60,
        transports=(TransportPhase(0, "fixed_pooled_all_to_all", num_waves=3), TransportPhase(81_716, "ragged_all_to_all")),
        host_offload=HostOffload(master_weights_until_step=81_716, optimizer_state=True),
    )
    train = dataclasses.replace(train, **train_changes)
    facts = RunFacts(
        start_date="2026-08-19",
        observed=(SpeedObservation(0, "2026-08-19", 19.8), SpeedObservation(81_716, "2026-09-09", 16.8)),
        projected_steps_per_day=4400,
        run_id="hero-12d8b6f0-dee637",
        claims=(Claim("trains in 60 days", "run_days", 60), Claim("the batch is 92 MB", "batch_bytes", 92e6),
                Claim("activations are 567 GB per layer", "activation_bytes_per_layer", 567e9),
                Claim("top-8 x 3072 equals a dense 4x MLP in FLOPs", "moe_to_dense_flops", 1.0)),
    )
    return TrainStepConfig(model=hero_535b, data=data, train=train, hardware=gb200_nvl72,
                           topology=RackTopology(racks, gb200_nvl72.gpus_per_rack, expert_parallel=64), facts=facts)


@pytest.fixture(scope="module")
def hero():
    return fact_sheet(hero_config(), "hero/train")


def test_hero_parameters_and_mesh(hero):
    assert hero["parameters"]["total"] == 535_477_106_688
    assert hero["parameters"]["active"] == 22_762_487_808
    mesh = hero["mesh"]
    assert mesh["axes"] == {"replica_dcn": 11, "data": 1, "expert": 64, "model": 1}
    assert mesh["gpus"] == 704
    assert mesh["experts_per_gpu"] == 6
    assert mesh["sequences_per_gpu"] == 16
    assert mesh["tokens_per_gpu"] == 16 * 4096


def test_hero_tokens_steps_flops_and_learning_rates(hero):
    t = hero["training"]
    assert t["tokens_per_step"] == 46_137_344
    assert t["num_steps"] == 390_251
    assert t["total_tokens"] == 18_005_144_633_344
    assert t["flops_6nt"] == pytest.approx(2.46e24, rel=2e-3)
    assert round(t["flops_with_attention"] / 1e24, 1) == 2.7
    o = hero["optimizer"]
    assert round(o["adam_lr"], 6) == 0.000759
    assert o["muon_lr"] == pytest.approx(0.003291, abs=1e-6)
    assert o["muon_lr"] / o["adam_lr"] == pytest.approx(13 / 3)
    assert o["warmup_steps"] == 3902


def test_hero_mixture_phases_and_transport_timeline(hero):
    phases = hero["mixture"]
    assert [(p["start_step"], p["end_step"]) for p in phases] == [(0, 107_999), (108_000, 312_191), (312_192, 390_250)]
    assert sum(p["tokens"] for p in phases) == 18_005_144_633_344
    assert phases[2]["weights"]["natural-science"] == pytest.approx(0.113)
    assert sum(phases[1]["weights"].values()) == pytest.approx(1.0)
    switch = hero["transports"][1]
    assert (switch["transport"], switch["start_step"]) == ("ragged_all_to_all", 81_716)
    assert switch["tokens_before"] == 81_716 * 11_264 * 4096 and round(switch["tokens_before"] / 1e12, 2) == 3.77


def test_hero_memory_fits_and_rack_hbm(hero):
    m = hero["memory"]
    assert round(m["hbm_per_rack_gb"] / 1000, 1) == 12.3
    assert [p["from_step"] for p in m["phases"]] == [0, 81_716]
    launch, later = m["phases"]
    assert launch["on_host"] == ["master_weights", "optimizer_state"]
    assert later["on_host"] == ["optimizer_state"]
    assert later["device_gb"] - launch["device_gb"] == pytest.approx(m["parts_gb"]["master_weights"])
    assert launch["fits"] and later["fits"]
    # the trainer copies host-resident state in for the step: at its peak the device holds it all
    everything = sum(m["parts_gb"][k] for k in ("master_weights", "gradients", "optimizer_state", "saved_residuals"))
    assert launch["step_peak_gb"] == pytest.approx(everything) and later["step_peak_gb"] == pytest.approx(everything)
    # one bf16 residual of 16 x 4096 tokens x 6144 per layer and GPU
    assert m["parts_gb"]["residual_per_layer"] == pytest.approx(16 * 4096 * 6144 * 2 / 1e9)


def test_hero_all_to_all_scales_with_capacity_factor(hero):
    pooled, ragged = hero["all_to_all"]
    assert ragged["capacity_factor"] == 1.0  # the ragged transport pads nothing, whatever it declares
    assert pooled["width"] == 3072
    assert pooled["buffer_gb_per_layer"] == pytest.approx(65_536 * 8 * 1.15 * 3072 * 2 / 1e9)
    assert pooled["gb_per_step_per_gpu"] / ragged["gb_per_step_per_gpu"] == pytest.approx(1.15)


def test_hero_cross_rack_traffic(hero):
    c = hero["cross_rack"]
    ring = 2 * 10 / 11
    assert c["gradient_all_reduce_gb"] == pytest.approx(ring * hero["memory"]["parts_gb"]["gradients"])
    assert c["router_histogram_gb"] == pytest.approx(ring * 48 * 384 * 10_000 * 4 / 1e9)


def test_hero_time_mfu_per_measured_phase_goodput_and_completion_date(hero):
    t = hero["time"]
    assert t["projected_end_date"] == "2026-11-18"
    pooled, ragged = t["speeds"]
    assert ragged["mfu"] == pytest.approx(pooled["mfu"] * 19.8 / 16.8)  # same FLOPs per step, faster step
    assert 0 < pooled["mfu"] < ragged["mfu"] < 1
    assert pooled["steps_per_day"] == pytest.approx(86_400 / 19.8)  # the reference's "about 4,364 steps/day"
    p = t["projection"]
    assert p["step_seconds"] == pytest.approx(86_400 / 4400)
    assert p["goodput"] == pytest.approx(4400 / (86_400 / 16.8))


def test_a_projection_made_before_a_faster_phase_is_judged_against_the_rest_of_the_run():
    """Before its switch the hero had measured only its pooled 19.8 s steps (4,364 a day) and
    projected 4,400 a day, counting on the ragged phase ahead: a projection is held to the rate the
    rest of the run can go at full goodput, not to the last phase measured (which refused it)."""
    config = hero_config()
    before_switch = dataclasses.replace(config.facts, observed=config.facts.observed[:1])
    sheet = fact_sheet(dataclasses.replace(config, facts=before_switch))
    p, (pooled, ragged) = sheet["time"]["projection"], sheet["step_time"]["stretches"]
    # the measured 19.8 s to the switch, then the modelled ragged steps
    ahead = 81_716 * 19.8 + (390_251 - 81_716) * ragged["step_seconds"]
    assert p["steps_per_day"] == 4400 and p["goodput"] == pytest.approx(4400 / (390_251 * 86_400 / ahead))
    assert 4400 / (86_400 / 19.8) > 1 > p["goodput"]
    assert p["goodput_of"] == "the measured rate to step 81,715, the modelled step times after it"
    with pytest.raises(PlanError, match=r"projected_steps_per_day=6000 is faster than the rest of the run at full "
                                        r"goodput \(\d+ steps a day, the measured rate to step 81,715, the modelled step "
                                        r"times after it\)"):
        fact_sheet(dataclasses.replace(config, facts=dataclasses.replace(before_switch, projected_steps_per_day=6000)))


def test_hero_claims_are_declared_and_recomputed(hero):
    claims = {c["figure"]: c for c in hero["claims"]}
    assert [c["claim"] for c in hero["claims"]] == [
        "trains in 60 days", "the batch is 92 MB", "activations are 567 GB per layer",
        "top-8 x 3072 equals a dense 4x MLP in FLOPs"]
    assert round(claims["run_days"]["value"]) == 89 and not claims["run_days"]["holds"]
    assert round(claims["batch_bytes"]["value"] / 1e6) == 185 and not claims["batch_bytes"]["holds"]
    per_layer = claims["activation_bytes_per_layer"]  # the quoted 567 GB is one D-wide tensor, not a layer's
    assert "566.9 GB is one bf16 6144-wide tensor" in per_layer["finding"] and per_layer["value"] > 10 * 567e9
    assert not per_layer["holds"]
    assert claims["moe_to_dense_flops"]["value"] == pytest.approx(0.5) and not claims["moe_to_dense_flops"]["holds"]


def test_the_activation_bound_counts_the_rows_of_the_run_s_own_transports():
    """A layer's activations hold each token's expert rows as its transports pad them: the hero's
    pooled and ragged phases at 1.15, a dropless ring run at 1.0, whatever the model's own factor."""
    from keel.spec import TransportPhase

    config = hero_config()
    ring = dataclasses.replace(config, train=dataclasses.replace(config.train, transports=(TransportPhase(0, "ring"),)))
    padded, dropless = (fact_sheet(c)["claims"] for c in (config, ring))
    value = {name: {c["figure"]: c["value"] for c in claims}["activation_bytes_per_layer"]
             for name, claims in (("padded", padded), ("dropless", dropless))}
    model, tokens = config.model, config.train.tokens_per_step
    rows_gone = model.experts_per_token * (1.15 - 1.0) * tokens  # rows a dropless transport never holds
    assert value["padded"] - value["dropless"] == pytest.approx(
        rows_gone * (3 * model.expert_dim + model.expert_input_dim) * 2, rel=1e-9)


def test_without_remat_the_memory_holds_every_layers_activations_and_the_run_does_not_fit():
    """The bound the claims print for one layer's activations, per GPU, for every layer, is what the
    memory counts without remat: the hero then does not fit, and `keel plan` refuses it."""
    import json

    config = hero_config(remat=False)
    sheet = fact_sheet(config)
    per_layer = {c["figure"]: c["value"] for c in sheet["claims"]}["activation_bytes_per_layer"]  # the whole batch
    devices = config.topology.num_devices
    assert sheet["memory"]["parts_gb"]["saved_residuals"] == pytest.approx(per_layer / devices * config.model.num_layers / 1e9)
    assert sheet["verdict"]["fits"] is False and len(sheet["verdict"]["problems"]) == 2
    assert "kept for the backward without remat: at least 1,365.5 GB" in render_fact_sheet(sheet)
    json.loads(json.dumps(sheet, allow_nan=False))


def test_the_ring_holds_expert_rows_for_every_gathered_assignment():
    """The ring gathers the tokens of its expert_parallel shards and its kernel sizes each device's
    buffers to all of their assignments (`kernel_capacity_factor`): expert_parallel times the rows
    of a transport at capacity 1.0."""
    def layer(phase):  # one layer's activations at the backward's peak, the received rows (the buffer) included
        sheet = fact_sheet(hero_config(transports=(phase,)))
        return sheet["memory"]["phases"][0]["transient_gb"]["layer_activations"] + sheet["all_to_all"][0]["buffer_gb_per_layer"]

    ring, even = layer(TransportPhase(0, "ring")), layer(TransportPhase(0, "fixed_all_to_all", capacity_factor=1.0))
    model, ep = hero_config().model, hero_config().topology.expert_parallel
    expert_rows = 16 * 4096 * model.experts_per_token * (3 * model.expert_dim + model.expert_input_dim) * 2 / 1e9  # at 1.0
    assert ring - even == pytest.approx((ep - 1) * expert_rows)


def test_a_run_that_declares_no_claims_prints_none(hero):
    config = hero_config()
    config = dataclasses.replace(config, facts=dataclasses.replace(config.facts, claims=()))
    sheet = fact_sheet(config)
    assert sheet["claims"] == [] and "claims checked" not in render_fact_sheet(sheet)
    assert "60 days" not in render_fact_sheet(sheet)


def test_hero_text_names_the_figures(hero):
    text = render_fact_sheet(hero)
    for figure in ("535,477,106,688", "22,762,487,808", "replica_dcn 11 x expert 64", "46,137,344 per step",
                   "390,251 steps", "18,005,144,633,344", "2026-11-18", "about 89 days", "184.5 MB", "566.9 GB"):
        assert figure in text, figure
    assert "DOES NOT FIT" not in text


def test_ten_racks_with_the_hero_batch_fail_naming_the_field():
    with pytest.raises(PlanError, match=r"hero/train: topology: TrainConfig.batch_size=11264 .* 640 batch shards"):
        fact_sheet(hero_config(racks=10), "hero/train")


def test_a_phase_after_the_last_step_fails():
    with pytest.raises(PlanError, match=r"data.phases\[2\].start_step=312192 is at or after the last step"):
        fact_sheet(hero_config(num_steps=300_000, transports=()))


def test_ragged_all_to_all_on_cpu_hardware_fails():
    config = hero_config()
    config = dataclasses.replace(config, hardware=dataclasses.replace(cpu_sim, gpus_per_rack=64))
    with pytest.raises(PlanError, match=r"train.transports\[1\].transport='ragged_all_to_all' is not supported"):
        fact_sheet(config)


def test_mixture_phase_off_a_block_boundary_fails():
    config = hero_config()
    phases = list(config.data.phases)
    phases[1] = MixturePhase(108_001, phases[1].weights)  # 108,001 x 11,264 is not a multiple of 49,152
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, phases=tuple(phases)))
    with pytest.raises(PlanError, match=r"data.block_size / train.batch_size: Mixture phase 1 starts at step 108001"):
        fact_sheet(config)


def test_memory_that_does_not_fit_is_flagged():
    # the whole global batch on one rack: 176 sequences per GPU
    sheet = fact_sheet(hero_config(racks=1))
    assert not sheet["memory"]["phases"][0]["fits"]
    assert "DOES NOT FIT 192.0 GB HBM" in render_fact_sheet(sheet)


def test_fact_sheets_only_for_training_steps():
    tiny = TrainStepConfig(model=tiny_moe, data="/tmp/tokens", train=TrainConfig(batch_size=16, seq_len=128, num_steps=10),
                           topology=RackTopology(2, 4, expert_parallel=4), hardware=cpu_sim)
    other = Step("prep/thing", _never_run, dataclasses.replace(ScheduleConfig()))
    steps = [other, Step("tiny/train", _never_run, tiny), Step("hero/train", _never_run, hero_config())]
    sheets = fact_sheets_for(steps)
    assert [s["step"] for s in sheets] == ["tiny/train", "hero/train"]
    assert sheets[0]["mesh"]["experts_per_gpu"] == 2 and sheets[0]["time"] is None
    assert sheets[1]["text"].startswith("== fact sheet: hero/train")


def test_a_run_without_hardware_is_planned_without_a_memory_verdict():
    """The memory is figured without HBM to hold it to; rendering once failed on the missing headroom."""
    tiny = TrainStepConfig(model=tiny_moe, data="/tmp/tokens", train=TrainConfig(batch_size=16, seq_len=128, num_steps=10),
                           topology=RackTopology(2, 4, expert_parallel=4))
    sheet = fact_sheet(tiny)
    assert [phase["fits"] for phase in sheet["memory"]["phases"]] == [None]
    (peak,) = [line for line in render_fact_sheet(sheet).splitlines() if line.startswith("    peak ")]
    assert peak.endswith(" (ring): no hardware declared to fit it in"), peak


def test_model_fields_the_model_never_reads_are_named_in_the_plan():
    """A declared value the model never reads still changes the step's identity (two runs of one
    model); the plan names it and why, and `without_inert_fields` gives the model that trains."""
    from defaults.models import dense_baseline, small_moe
    from model_tiny import hero_like

    assert [m.inert_fields() for m in (hero_535b, small_moe, tiny_moe, hero_like())] == [[], [], [], []]
    local_only = hero_like(global_every=None)  # hero_like declares num_global_kv_heads=1
    all_global = hero_like(global_every=1, qk_norm=False, qk_norm_eps=1e-3)
    assert local_only.inert_fields() == ["num_global_kv_heads=1: no layer is global (global_every=None)"]
    assert all_global.inert_fields() == ["sliding_window=4, rope_fraction=0.5: every layer is global (global_every=1 of "
                                         "3 layers)", "qk_norm_eps=0.001: qk_norm=False"]
    cleared = all_global.without_inert_fields()
    assert cleared.inert_fields() == [] and (cleared.sliding_window, cleared.rope_fraction, cleared.qk_norm_eps) == (
        None, 1.0, 1e-6)
    assert cleared.param_counts() == all_global.param_counts()
    assert dense_baseline(tiny_moe).inert_fields() == []  # the routing knobs of the MoE it replaces are cleared
    # RoPE's evenness is asked of local layers only, so an all-global model can take the defaults
    assert hero_like(global_every=1, head_dim=15, rope_fraction=0.4).without_inert_fields().rope_fraction == 1.0
    with pytest.raises(ValueError, match=r"rope_fraction=1.0 x head_dim=15 must be an even integer"):
        hero_like(head_dim=15, rope_fraction=1.0)
    step = TrainStepConfig(model=local_only, data="/tmp/tokens", train=TrainConfig(batch_size=16, seq_len=16, num_steps=10),
                           topology=RackTopology(2, 4, expert_parallel=4), hardware=cpu_sim)
    text = render_fact_sheet(fact_sheet(step))
    assert "  no effect: model num_global_kv_heads=1: no layer is global (global_every=None)\n" in text
    assert "no effect" not in render_fact_sheet(fact_sheet(dataclasses.replace(step, model=local_only.without_inert_fields())))


def test_planning_the_hero_imports_no_jax():
    """How fast it is: benchmarks/plan_latency.py."""
    code = (
        "import sys; sys.path[:0] = ['.', 'tests']\n"
        "from test_plan_facts import hero_config\n"
        "from keel.plan import fact_sheet, render_fact_sheet\n"
        "render_fact_sheet(fact_sheet(hero_config()))\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('jax', 'levanter', 'haliax', 'equinox', 'optax')]\n"
        "assert not heavy, heavy\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_pooled_waves_must_divide_the_experts_per_gpu():
    waves = (TransportPhase(0, "fixed_pooled_all_to_all", num_waves=4), TransportPhase(81_716, "ragged_all_to_all"))
    with pytest.raises(PlanError, match=r"train.transports\[0\].num_waves=4 must divide the 6 experts per GPU"):
        fact_sheet(hero_config(transports=waves))


def test_activation_claims_count_the_compute_dtype_and_quote_the_bf16_tensor_per_gpu_as_its_share():
    """What the layers keep is in the compute dtype (4 bytes in float32), as the memory line counts
    it; the quoted "567 GB" stays one bf16 tensor of the whole batch, and its per-GPU share is that
    tensor over the GPUs, whatever the run computes in."""
    def with_all_layers_claim(config):
        claim = Claim("27 TB of activations for 48 layers without checkpointing", "activation_bytes_all_layers", 27e12)
        return dataclasses.replace(config, facts=dataclasses.replace(config.facts, claims=config.facts.claims + (claim,)))

    fp32 = fact_sheet(with_all_layers_claim(hero_config(compute_dtype="float32", remat=False)))
    bf16 = fact_sheet(with_all_layers_claim(hero_config(remat=False)))
    claims = {c["figure"]: c for c in fp32["claims"]}
    devices, layers = 11 * 64, 48
    kept_gb = fp32["memory"]["parts_gb"]["saved_residuals"] * devices  # every GPU's layers, as the memory line counts them
    all_layers, per_layer = claims["activation_bytes_all_layers"], claims["activation_bytes_per_layer"]
    assert all_layers["value"] == pytest.approx(kept_gb * 1e9, rel=1e-9)
    assert f"the layers keep at least {kept_gb / 1000:,.0f} TB" in all_layers["finding"]
    assert per_layer["value"] == pytest.approx(kept_gb * 1e9 / layers, rel=1e-9)
    assert f"a layer's forward leaves at least {kept_gb / layers:,.0f} GB" in per_layer["finding"]
    for figure in ("activation_bytes_all_layers", "activation_bytes_per_layer"):  # 4-byte values, twice bf16's
        assert claims[figure]["value"] == pytest.approx(2 * {c["figure"]: c for c in bf16["claims"]}[figure]["value"])
    tensor_gb = 46_137_344 * 6144 * 2 / 1e9  # the quoted figure: one bf16 6144-wide tensor over the batch
    assert f"{tensor_gb:.4g} GB is one bf16 6144-wide tensor" in per_layer["finding"]
    assert f"(per GPU {tensor_gb / devices:.3g} GB)" in per_layer["finding"]  # 0.805, not 1.61
    assert f"{tensor_gb * layers / 1000:.3g} TB is one bf16 6144-wide tensor per layer" in all_layers["finding"]


@pytest.mark.parametrize("change, said", [
    (lambda f: {"observed": (f.observed[0], dataclasses.replace(f.observed[1], date="2026-08-01"))},
     r"facts.observed\[1\].date=2026-08-01 is before facts.start_date=2026-08-19"),
    (lambda f: {"observed": (dataclasses.replace(f.observed[0], date="2026-09-30"), f.observed[1])},
     r"facts.observed\[1\] reaches step 81,716 on 2026-09-09, before facts.observed\[0\] reached step 0 \(2026-09-30\)"),
    (lambda f: {"projected_steps_per_day": 20_000},
     r"facts.projected_steps_per_day=20000 is faster than the rest of the run at full goodput \(5143 steps a day, the "
     r"last measured rate, at step 81,716\)"),
], ids=["before the start", "out of order", "goodput above 1"])
def test_facts_that_would_move_the_projected_end_silently_are_refused(change, said):
    """Each was accepted and moved the end date (an observation before the start put the hero's end
    on 2026-10-10, 52 days), or printed a goodput of 3.89 and an MFU of 0.899."""
    config = hero_config()
    facts = dataclasses.replace(config.facts, **change(config.facts))
    with pytest.raises(PlanError, match=said):
        fact_sheet(dataclasses.replace(config, facts=facts))
