"""A declaration that would run another run than the one declared, or fail only inside the running
step, is refused where it is declared (or by `keel plan`), naming the field and the fix."""

import dataclasses

import pytest

from defaults import default_train
from defaults.hardware import cpu_sim
from defaults.models import tiny_moe
from keel import External
from keel.spec import (
    AdamWConfig,
    EvalConfig,
    GroupedOptimizerConfig,
    HostOffload,
    LaunchPlan,
    LrScalingLaw,
    PlanError,
    RackTopology,
    TrainConfig,
    TrainedModel,
    TrainTokenizerConfig,
    TransportPhase,
    WeightDecayChange,
)
from keel.spec.checks import check_train_step

TRAIN = dict(batch_size=16, seq_len=128, num_steps=300, optimizer=AdamWConfig(lr=1e-3))
RACKS = RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4)
OPTIMIZER = dict(muon_lr=1e-2, adam_lr=1e-3)


@pytest.mark.parametrize("declare, message", [
    # a count that is not a whole number: 300.5 steps train 301 and never write the final checkpoint
    (lambda: TrainConfig(**{**TRAIN, "num_steps": 300.5}), r"TrainConfig.num_steps=300.5 must be a whole number"),
    (lambda: TrainConfig(**{**TRAIN, "batch_size": 16.0}), r"TrainConfig.batch_size=16.0 must be a whole number"),
    (lambda: tiny_moe.replace(experts_per_token=2.5), r"MoELMConfig.experts_per_token=2.5 must be a whole number"),
    (lambda: TransportPhase(0.5, "ring"), r"TransportPhase.start_step=0.5 must be a whole number"),
    # a seed a PRNG key cannot hold
    (lambda: TrainConfig(**TRAIN, seed=-1), r"TrainConfig.seed=-1 must lie in \[0, 2\*\*32\)"),
    (lambda: TrainConfig(**TRAIN, seed=2**32 + 5), r"TrainConfig.seed=4294967301 must lie in \[0, 2\*\*32\)"),
    (lambda: HostOffload(master_weights_until_step=-5), r"HostOffload.master_weights_until_step=-5 must be >= 0"),
    (lambda: LrScalingLaw(coefficient=-1.0, tokens_exponent=-0.3, width_exponent=-0.5, muon_to_adam=4.0),
     r"LrScalingLaw.coefficient=-1.0 must be positive"),
    # knobs a transport does not read
    (lambda: TransportPhase(0, "ring", num_waves=2), r"TransportPhase.num_waves=2 on 'ring', which does not send in "
                                                     r"waves \(only 'fixed_pooled_all_to_all' does\)"),
    (lambda: TransportPhase(0, "ring", capacity_factor=1.5), r"TransportPhase.capacity_factor=1.5 on 'ring', which has "
                                                             r"no capacity"),
    (lambda: tiny_moe.replace(routing="softmax_topk", balancing="none"),
     r"routing_renorm_sum=2.5 is only used with routing='sigmoid_topk_threshold'"),
    # regexes that do not compile fail at declaration, not in the running step's optimizer
    (lambda: GroupedOptimizerConfig(**OPTIMIZER, muonh_params=("(",)),
     r"GroupedOptimizerConfig.muonh_params: '\(' is not a regular expression"),
    (lambda: WeightDecayChange(start_step=1, peak=0.1, groups=("(",)),
     r"WeightDecayChange.groups: '\(' is not a regular expression"),
    # an axis no parameter uses; figures a plan divides by
    (lambda: RackTopology(racks=2, gpus_per_rack=4, expert_parallel=2, model_parallel=2),
     r"RackTopology.model_parallel=2: no parameter is split over the `model` axis"),
    (lambda: RackTopology(racks=2, gpus_per_rack=4, hbm_per_gpu_gb=0), r"RackTopology.hbm_per_gpu_gb=0 must be positive"),
    (lambda: dataclasses.replace(cpu_sim, peak_flops_per_device=0.0), r"Hardware.peak_flops_per_device=0.0 must be positive"),
    (lambda: LaunchPlan(store_gb_per_s=-1.0), r"LaunchPlan.store_gb_per_s=-1.0 must be positive"),
    (lambda: TrainTokenizerConfig(documents="/docs", min_frequency=-1), r"TrainTokenizerConfig.min_frequency=-1 must be >= 0"),
    (lambda: TrainTokenizerConfig(documents="/docs", max_training_bytes=-5),
     r"TrainTokenizerConfig.max_training_bytes=-5 must be positive"),
])
def test_a_declaration_that_would_run_otherwise_than_declared_is_refused_naming_the_field(declare, message):
    with pytest.raises(ValueError, match=message):
        declare()


def _run(model=tiny_moe, hardware=cpu_sim, **train):
    return default_train("t", data=External("tokens", "/caches/tokens", version="1"), model=model,
                         train=TrainConfig(**{**TRAIN, **train}), topology=RACKS, hardware=hardware)


@pytest.mark.parametrize("declare, message", [
    (lambda: _run(weight_decay_change=WeightDecayChange(start_step=200, peak=0.02, groups=("nomatch",))),
     r"train.weight_decay_change.groups=\['nomatch'\] match no parameter, so nothing would be decayed"),
    (lambda: _run(optimizer=GroupedOptimizerConfig(**OPTIMIZER, muonh_params=("norm",))),
     r"train.optimizer.muonh_params puts embed_norm.norm.weight in MuonH, which is no matrix"),
    (lambda: _run(model=tiny_moe.replace(attention_backend="splash")),
     r"model.attention_backend='splash' runs on tpu only, and hardware 'simulated CPU racks' is cpu"),
    (lambda: _run(model=tiny_moe.replace(attention_backend="jax_flash", max_seq_len=2048), seq_len=1500),
     r"train.seq_len=1500 with model.attention_backend='jax_flash': its blocks are 1024 tokens"),
    # the experts expert_parallel splits would be gathered whole on every GPU, uncounted by the plan
    (lambda: _run(transports=(TransportPhase(0, "local"),)),
     r"train.transports\[0\].transport='local' computes every expert on every GPU, so each layer would gather whole "
     r"the experts topology.expert_parallel=4 splits"),
    (lambda: _run(transports=(TransportPhase(0, "fixed_all_to_all"), TransportPhase(100, "dense"))),
     r"train.transports\[1\].transport='dense' computes every expert on every GPU"),
])
def test_keel_plan_refuses_what_would_fail_only_inside_the_running_step(declare, message):
    with pytest.raises(PlanError, match=message):
        check_train_step(declare().config)


def test_the_defaults_and_their_neighbours_pass():
    check_train_step(_run().config)
    check_train_step(_run(optimizer=GroupedOptimizerConfig(**OPTIMIZER), seed=2**32 - 1,
                          weight_decay_change=WeightDecayChange(start_step=200, peak=0.02)).config)
    check_train_step(_run(model=tiny_moe.replace(attention_backend="jax_flash", max_seq_len=2048), seq_len=2048).config)
    # the hero's decay groups on a model without attention gates: the router is still decayed
    check_train_step(_run(model=tiny_moe.replace(attention_gate=False),
                          weight_decay_change=WeightDecayChange(start_step=200, peak=0.02)).config)
    TransportPhase(0, "fixed_pooled_all_to_all", capacity_factor=1.5, num_waves=2)


def test_an_eval_batch_that_does_not_split_over_the_runs_batch_shards_is_refused():
    run = TrainedModel(_run())
    with pytest.raises(ValueError, match=r"EvalConfig.batch_size=3 does not split over the run's 8 batch shards: "
                                         r"give a multiple of 8"):
        EvalConfig(run, data={"v": "/caches/tokens"}, batch_size=3)
    EvalConfig(run, data={"v": "/caches/tokens"}, batch_size=8)
