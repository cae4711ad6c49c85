"""Optimizer groups, the learning-rate schedule and the scheduled weight-decay change."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from defaults.models import tiny_moe
from keel.train import GroupedOptimizerConfig, ScheduleConfig, TrainConfig, WeightDecayChange
from keel.train.optimizer import build_optimizer, label_params, lr_schedule, param_paths

HERO_GROUPS = {  # the model's leaf paths (Stacked layers under `layers.stacked`)
    "layers.stacked.attn.q": "muonh", "layers.stacked.attn.o": "muonh", "layers.stacked.moe.experts.gate": "muonh",
    "layers.stacked.moe.experts.down": "muonh", "layers.stacked.shared.up": "muonh",
    "layers.stacked.moe.latent_down": "muonh", "layers.stacked.moe.latent_up": "muonh",
    "layers.stacked.attn_norm.gated.down": "muonh", "final_norm.gated.up": "muonh", "embed_norm.gated.down": "muonh",
    "lm_head": "adamh",
    "embedding": "adam", "layers.stacked.moe.router": "adam", "layers.stacked.attn.gate": "adam",
    "final_norm.norm.weight": "adam", "layers.stacked.attn.conv_key.kernel": "adam",
    "layers.stacked.conv_moe_output.kernel": "adam", "layers.stacked.moe.latent_norm.weight": "adam",
    "layers.stacked.moe.router_bias": "frozen",
}


def test_hero_groups_put_every_model_parameter_where_the_hero_trains_it():
    from keel.model.transformer import init_model
    from keel.train.optimizer import FROZEN_PARAMS

    config = GroupedOptimizerConfig(muon_lr=1e-2, adam_lr=1e-3)
    params = jax.eval_shape(lambda: init_model(tiny_moe, jax.random.PRNGKey(0)))
    rules = ([(p, "frozen") for p in FROZEN_PARAMS] + [(p, "muonh") for p in config.muonh_params]
             + [(p, "adamh") for p in config.adamh_params])
    labels = dict(zip(jax.tree.leaves(param_paths(params)), jax.tree.leaves(label_params(params, rules, "adam"))))
    assert len(labels) == len(tiny_moe.parameter_shapes())
    for path, group in HERO_GROUPS.items():
        assert labels[path] == group, path
    muonh = {p for p, g in labels.items() if g == "muonh"}
    assert len(muonh) == 4 + 3 + 3 + 2 + 2 * 4  # q/k/v/o, experts, shared, latent projections, 4 GatedNorms


def test_schedule_warms_up_then_decays_linearly_to_its_fraction():
    lr = lr_schedule(2.0, 100, warmup_fraction=0.1, min_lr_ratio=0.05)
    assert float(lr(0)) == 0.0
    assert float(lr(10)) == pytest.approx(2.0)
    assert float(lr(55)) == pytest.approx((2.0 + 0.1) / 2, rel=1e-5)
    assert float(lr(100)) == pytest.approx(0.1)


def test_weight_decay_change_hits_named_groups_from_its_step_and_the_router_bias_never_moves():
    params = {
        "layers": {"attn": {"gate": jnp.ones((4, 2)), "q": jnp.ones((4, 4))},
                   "moe": {"router": jnp.ones((4, 3)), "router_bias": jnp.ones((3,))}},
        "embedding": jnp.ones((5, 4)),
    }
    train = TrainConfig(batch_size=1, seq_len=1, num_steps=10, schedule=ScheduleConfig(0.0, 1.0),
                        optimizer=GroupedOptimizerConfig(muon_lr=0.1, adam_lr=0.5),
                        weight_decay_change=WeightDecayChange(start_step=2, peak=0.4))
    tx, _ = build_optimizer(train, params)
    state = tx.init(params)
    zero = jax.tree.map(jnp.zeros_like, params)
    history = []
    for _ in range(4):
        updates, state = tx.update(zero, state, params)
        params = optax.apply_updates(params, updates)
        history.append(jax.tree.map(lambda x: float(x.ravel()[0]), params))
    gate = [h["layers"]["attn"]["gate"] for h in history]
    assert gate[:2] == [1.0, 1.0]  # steps 0 and 1: no decay yet
    assert gate[2] == pytest.approx(1.0 - 0.5 * 0.4 * (1 - 2 / 10))  # adam lr x peak x (1 - step / steps)
    assert gate[3] == pytest.approx(gate[2] * (1.0 - 0.5 * 0.4 * (1 - 3 / 10)))
    assert [h["layers"]["moe"]["router"] for h in history] == gate
    for untouched in (("layers", "attn", "q"), ("embedding",), ("layers", "moe", "router_bias")):
        value = history[-1]
        for key in untouched:
            value = value[key]
        assert value == 1.0, untouched

    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.3), params)
    updates, _ = tx.update(grads, state, params)
    assert np.all(np.asarray(updates["layers"]["moe"]["router_bias"]) == 0)
