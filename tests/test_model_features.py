"""Behaviour of the reference features: document isolation, windows, XSA, quantile balancing."""

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_tiny import hero_like, packed_batch

from keel.mesh.mesh import build_mesh, use_mesh
from keel.mesh.topology import RackTopology
from keel.model.routing import Routes, next_router_bias, quantile_beta, route
from keel.model.transformer import init_model
from keel.model.transport_spec import TransportSpec


def _logits(model, ids, seg):
    return jax.jit(lambda m, i, s: m(i, s, transport=TransportSpec("local"))[0])(model, ids, seg).array


def test_documents_in_one_row_do_not_see_each_other():
    config = hero_like()
    model = init_model(config, jax.random.PRNGKey(0))
    ids, seg = packed_batch(config, batch=2)
    first_doc = np.asarray(seg.array) == 0
    changed = hax.named(jnp.where(first_doc, (ids.array + 7) % config.vocab_size, ids.array), ids.axes)
    before, after = _logits(model, ids, seg), _logits(model, changed, seg)
    np.testing.assert_allclose(after[~first_doc], before[~first_doc], rtol=1e-5, atol=1e-5)
    assert np.abs(after[first_doc] - before[first_doc]).max() > 1e-3


@pytest.mark.parametrize("global_every, reaches", [(None, False), (1, True)])
def test_local_layers_see_only_the_window_global_layers_everything(global_every, reaches):
    config = hero_like(num_layers=1, global_every=global_every, sliding_window=4, conv_sites=())
    model = init_model(config, jax.random.PRNGKey(0))
    ids, _ = packed_batch(config, batch=1)
    seg = hax.zeros_like(ids)
    changed = hax.named(ids.array.at[0, 2].set((ids.array[0, 2] + 1) % config.vocab_size), ids.axes)
    delta = np.abs(_logits(model, changed, seg) - _logits(model, ids, seg)).max(axis=-1)[0]
    assert delta[5] > 1e-4  # position 5 attends to 2..5
    assert (delta[6:].max() > 1e-4) == reaches


def test_xsa_output_is_orthogonal_to_the_own_value():
    config = hero_like()
    attn = init_model(config, jax.random.PRNGKey(0)).layers.get_layer(0).attn
    B, P = hax.Axis("batch", 2), hax.Axis("position", 8)
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(3), 3)
    q = hax.random.normal(kq, (B, P, attn.q.axes[1], attn.q.axes[2]))
    k = hax.random.normal(kk, (B, P, attn.k.axes[1], attn.k.axes[2]))
    v = hax.random.normal(kv, (B, P, attn.v.axes[1], attn.v.axes[2]))
    y = attn._attend(q, k, v, hax.zeros((B, P), dtype=jnp.int32), P, config.num_kv_heads, None)
    own_v = v.array.repeat(config.num_heads // config.num_kv_heads, axis=2)
    component = (y.array * own_v).sum(-1) / np.linalg.norm(own_v, axis=-1)  # y's length along its own v
    assert np.abs(component).max() < 1e-4
    assert np.linalg.norm(y.array, axis=-1)[:, 1:].min() > 1e-2  # while y itself is not small


def test_quantile_beta_is_the_global_quantile_on_a_rack_mesh():
    config = hero_like(qb_histogram_bins=4000)
    Token, Experts = hax.Axis("token", 512), hax.Axis("experts", config.num_experts)
    logits = hax.random.normal(jax.random.PRNGKey(0), (Token, Experts)) * 2
    threshold = hax.random.normal(jax.random.PRNGKey(1), (Token,))
    valid = hax.named(jnp.arange(512) % 5 != 0, Token)
    routes = Routes(selected=None, weights=None, logits=logits, threshold=threshold)
    with use_mesh(build_mesh(RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4))):
        beta = jax.jit(lambda r, v: quantile_beta(r, v, config))(routes, valid).array
    scores = np.asarray(logits.array - threshold.array[:, None])[np.asarray(valid.array)]
    keep = int(len(scores) * config.experts_per_token / config.num_experts)
    exact = -np.sort(-scores, axis=0)[keep - 1]
    bin_width = (scores.max(0) - scores.min(0)) / config.qb_histogram_bins
    assert np.all(np.abs(beta - exact) <= 2 * bin_width + 1e-6)
    above = (scores > beta[None, :]).sum(0)
    assert np.all(np.abs(above - keep) <= 2)


def test_next_router_bias_is_minus_beta_centred():
    betas = hax.named(jnp.array([[1.0, 2.0, 3.0], [0.0, 0.0, 3.0]]), (hax.Axis("layers", 2), hax.Axis("experts", 3)))
    bias = next_router_bias(betas).array
    np.testing.assert_allclose(bias, [[1.0, 0.0, -1.0], [1.0, 1.0, -2.0]])


def test_forward_reports_per_layer_balance_stats():
    config = hero_like()
    model = init_model(config, jax.random.PRNGKey(0))
    ids, seg = packed_batch(config)
    _, aux = jax.jit(lambda m, i, s: m(i, s, transport=TransportSpec("local")))(model, ids, seg)
    L, E = config.num_layers, config.num_experts
    assert aux["qb_beta"].array.shape == (L, E)
    counts = np.asarray(aux["routing_counts"].array)
    assert counts.shape == (L, E)
    assert np.all(counts.sum(1) == ids.array.size * config.experts_per_token)
    assert np.all(np.asarray(aux["dropped_fraction"].array) == 0)


def test_router_bias_steers_selection_but_not_the_combine_weights_and_gets_no_gradient():
    config = hero_like()
    moe = init_model(config, jax.random.PRNGKey(0)).layers.get_layer(0).moe
    Token = hax.Axis("token", 32)
    u = hax.random.normal(jax.random.PRNGKey(1), (Token, moe.router.axes[0]))
    bias = hax.named(jnp.zeros(config.num_experts).at[3].set(100.0), moe.router.axes[1])
    plain, steered = route(u, moe.router, None, config), route(u, moe.router, bias, config)
    assert np.all(np.any(np.asarray(steered.selected.array) == 3, axis=1))
    np.testing.assert_allclose(np.asarray(steered.weights.array).sum(1), config.routing_renorm_sum, rtol=1e-5)
    assert not np.array_equal(plain.selected.array, steered.selected.array)

    def routed_weight_sum(bias):
        return hax.sum(route(u, moe.router, bias, config).weights).array

    assert np.all(np.asarray(jax.grad(lambda b: routed_weight_sum(b))(bias).array) == 0)


def test_softmax_routing_with_auxiliary_loss():
    config = hero_like(routing="softmax_topk", balancing="aux_loss", aux_loss_coef=0.01, routing_renorm_sum=1.0)
    model = init_model(config, jax.random.PRNGKey(0))
    router = model.layers.get_layer(0).moe.router
    routes = route(hax.random.normal(jax.random.PRNGKey(1), (hax.Axis("token", 16), router.axes[0])), router, None, config)
    np.testing.assert_allclose(np.asarray(routes.weights.array).sum(1), 1.0, rtol=1e-5)
    assert routes.threshold is None
    ids, seg = packed_batch(config)

    def aux_loss(model):
        return model(ids, seg, transport=TransportSpec("local"))[1]["aux_loss"]

    value, grads = jax.jit(jax.value_and_grad(aux_loss))(model)
    assert float(value) == pytest.approx(0.01 * config.num_layers, rel=0.5)  # about 1 per layer when balanced
    assert float(np.abs(np.asarray(grads.layers.stacked.moe.router.array)).max()) > 0
