"""Memory verdicts at the step's peak: the state, the offloaded state copied in and one layer's
transient buffers; a plan that does not fit exits non-zero and `keel run` refuses it."""

import dataclasses

import pytest

from defaults.hardware import gb200_nvl72
from keel.plan import check_fits, fact_sheet, render_fact_sheet
from keel.plan.peak import layer_activations_per_token
from keel.spec.resolved import resolve
from keel.spec import PlanError
from test_plan_facts import hero_config
from test_plan_hero import HERO, _keel


@pytest.fixture(scope="module")
def hero():
    return fact_sheet(hero_config(), "hero")


def test_the_hero_peak_is_its_state_plus_named_transients_and_fits_with_headroom(hero):
    m = hero["memory"]
    (pooled, *_), launch = hero["all_to_all"], m["phases"][0]
    t = launch["transient_gb"]
    assert t["all_to_all_buffers"] == pytest.approx(2 * pooled["buffer_gb_per_layer"])  # send and receive
    rows = 16 * 4096 * 8 * 1.15  # the receive buffer: capacity x the even share of a GPU's assignments
    assert pooled["buffer_gb_per_layer"] == pytest.approx(rows * 3072 * 2 / 1e9)
    # the backward computes the layer's forward again: all of it is live, but the received rows are the buffer
    whole_layer = 16 * 4096 * sum(layer_activations_per_token(hero_config().model, 1.15).values()) * 2 / 1e9
    assert t["layer_activations"] == pytest.approx(whole_layer - pooled["buffer_gb_per_layer"])
    assert t["layer_activations"] > 3 * rows * 3072 * 2 / 1e9 + 10  # far beyond the experts' gate, up and product
    assert t["gathered_weights"] == pytest.approx(3 * 6144 * 128_256 * 2 / 1e9)  # lm_head: the largest FSDP leaf
    elements = resolve(hero_config()).newton_schulz_elements_per_device()
    # the embedding's Adam update, its moments split over the rack, gathered whole into the replicated fp32 weight
    assert launch["update_gb"] == {"newton_schulz_loop": pytest.approx(elements * (4 * 2 + 2 * 4) / 1e9),
                                   "gathered_updates": pytest.approx(128_256 * 6144 * 4 / 1e9)}
    for phase in m["phases"]:
        assert phase["backward_peak_gb"] == pytest.approx(phase["step_peak_gb"] + sum(phase["transient_gb"].values()))
        assert phase["update_peak_gb"] == pytest.approx(
            phase["step_peak_gb"] - phase["saved_residuals_gb"] + sum(phase["update_gb"].values()))
        assert phase["peak_in"] == "backward" and phase["peak_gb"] == phase["backward_peak_gb"] > phase["update_peak_gb"]
        assert phase["fits"] and phase["headroom_gb"] == pytest.approx(192 - phase["peak_gb"])
        assert phase["host_fits"] and phase["host_per_host_gb"] == pytest.approx(4 * phase["host_gb"])
    assert hero["verdict"] == {"fits": True, "problems": [], "enforced": True}
    check_fits([hero])
    assert "GB headroom" in render_fact_sheet(hero)


def test_fits_is_judged_at_the_peak_not_between_steps():
    sheet = fact_sheet(hero_config(batch=2 * 11_264), "hero/2x")
    launch = sheet["memory"]["phases"][0]
    assert launch["device_gb"] < 192 < launch["peak_gb"]  # fits between steps, not at the peak
    assert launch["fits"] is False and sheet["verdict"]["fits"] is False
    assert "DOES NOT FIT 192.0 GB HBM" in render_fact_sheet(sheet)
    with pytest.raises(PlanError, match=r"hero/2x: from step 0 the peak is .* over the 192 GB HBM.*--set hero/2x:train\.refuse_unfit=false"):
        check_fits([sheet])
    allowed = fact_sheet(hero_config(batch=2 * 11_264, refuse_unfit=False))
    check_fits([allowed])  # told otherwise: the verdict stands, nothing is refused


def test_host_ram_per_host_is_checked_against_what_offload_puts_there():
    config = dataclasses.replace(hero_config(), hardware=dataclasses.replace(gb200_nvl72, host_ram_per_host_gb=200.0))
    sheet = fact_sheet(config, "hero/small-host")
    launch, later = sheet["memory"]["phases"]
    assert launch["host_fits"] is False and later["host_fits"] is True  # master weights + moments vs moments alone
    with pytest.raises(PlanError, match=r"from step 0 the offloaded state is .* GB per host, over its 200 GB RAM"):
        check_fits([sheet])


def test_keel_plan_exits_non_zero_and_keel_run_refuses_a_plan_that_does_not_fit():
    unfit = ("--prefix", "/tmp/keel-hero-plan", "--set", "train/hero_535b.train.remat=false")  # every layer's activations kept
    out = _keel("plan", HERO, *unfit)
    assert out.returncode == 2 and "DOES NOT FIT 192.0 GB HBM" in out.stdout
    assert "keel: error: train/hero_535b: from step 0 the peak is" in out.stderr and "Traceback" not in out.stderr
    run = _keel("run", HERO, *unfit)
    assert run.returncode == 2 and "does not fit" in run.stderr and "ran" not in run.stdout


def test_vanilla_attention_holds_its_fp32_scores_and_probabilities_at_the_peak(hero):
    """16 sequences x 48 heads x 4096^2 in fp32, scores and softmax probabilities: 103 GB per GPU."""
    assert all(phase["transient_gb"]["attention_scores"] == 0 for phase in hero["memory"]["phases"])  # jax_flash
    config = hero_config()
    sheet = fact_sheet(dataclasses.replace(config, model=config.model.replace(attention_backend="vanilla")), "hero/vanilla")
    for phase in sheet["memory"]["phases"]:
        assert phase["transient_gb"]["attention_scores"] == pytest.approx(2 * 16 * 48 * 4096**2 * 4 / 1e9)
        assert phase["fits"] is False
    assert "103.1 GB vanilla attention scores and probabilities" in render_fact_sheet(sheet)
    with pytest.raises(PlanError, match="over the 192 GB HBM"):
        check_fits([sheet])


def test_the_update_is_the_peak_when_newton_schulz_gathers_every_matrix_at_once():
    """The saved residuals are freed once the backward ends; a Newton-Schulz loop allowed to batch
    every MuonH matrix on a device then holds more than any layer's backward does."""
    config = hero_config()
    optimizer = dataclasses.replace(config.train.optimizer, newton_schulz_batch=10**12)
    sheet = fact_sheet(dataclasses.replace(config, train=dataclasses.replace(config.train, optimizer=optimizer)), "hero/ns")
    launch = sheet["memory"]["phases"][0]
    assert launch["peak_in"] == "update" and launch["peak_gb"] == launch["update_peak_gb"] > launch["backward_peak_gb"]
    assert launch["fits"] is False
    text = render_fact_sheet(sheet)
    assert "peak in the update" in text and "(the saved residuals freed) + " in text and "Newton-Schulz loop + 3.2 GB gathered updates: DOES NOT FIT" in text
    with pytest.raises(PlanError, match=r"hero/ns: from step 0 the peak is .* GB per GPU \(in the update\)"):
        check_fits([sheet])


def test_without_remat_the_saved_residuals_hold_the_layer_activations_once():
    config = hero_config()
    sheet = fact_sheet(dataclasses.replace(config, train=dataclasses.replace(config.train, remat=False)))
    assert all(phase["transient_gb"]["layer_activations"] == 0 for phase in sheet["memory"]["phases"])


@pytest.mark.parametrize("transport", ["ring", "fixed_all_to_all"])
def test_without_remat_each_layer_keeps_what_the_remat_backward_computes_again(transport):
    """One figure for a layer's activations, whichever way the backward gets them: kept from the
    forward (no remat) or computed again (remat: all of it live but the received rows, which are the
    all-to-all buffer). The ring's kernel holds expert_parallel times the assignments; counted at
    its declared 1.0, the kept activations came out 31 times too small, and a run that does not fit
    was judged to."""
    from keel.spec import TransportPhase

    config = hero_config()
    ring = dataclasses.replace(config.train, transports=(TransportPhase(0, transport),))
    remat = fact_sheet(dataclasses.replace(config, train=ring))
    kept = fact_sheet(dataclasses.replace(config, train=dataclasses.replace(ring, remat=False)))
    (a2a,) = remat["all_to_all"]
    for again, saved in zip(remat["memory"]["phases"], kept["memory"]["phases"], strict=True):  # split where offload ends
        per_layer = saved["saved_residuals_gb"] / config.model.num_layers
        assert per_layer == pytest.approx(again["transient_gb"]["layer_activations"] + a2a["buffer_gb_per_layer"])
        assert kept["memory"]["parts_gb"]["saved_residuals"] == saved["saved_residuals_gb"]  # the least: one transport
