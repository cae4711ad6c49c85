"""Behaviour of the reference features: document isolation, windows, XSA, quantile balancing."""

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_tiny import compiled_init, hero_like, packed_batch

from keel.mesh.mesh import build_mesh, use_mesh
from keel.spec.topology import RackTopology
from keel.model.attention import Attention
from keel.model.loss import TokenBatch, loss_fn
from keel.model.routing import Routes, next_router_bias, quantile_beta, route
from keel.spec.transports import TransportSpec
from keel.spec import GroupedOptimizerConfig, ScheduleConfig, TrainConfig
from keel.train.lm import KeelLM
from keel.train.optimizer import Optimizer


@jax.jit
def _forward(model, ids, seg):
    return model(ids, seg, transport=TransportSpec("local"))[0]


def _logits(model, ids, seg):
    return _forward(model, ids, seg).array


def _randomise(module, pick, key, scale=0.5):
    """`module` with the leaves `pick` returns set to random normals: convs start as identity and
    attention gates at zero, so leakage through them is invisible until they are perturbed."""
    current = pick(module)
    keys = jax.random.split(key, len(current))
    return eqx.tree_at(pick, module, [hax.random.normal(k, x.axes) * scale for k, x in zip(keys, current)])


def _convs_and_gates(model):
    block = model.layers.stacked
    return [block.attn.gate, block.attn.conv_key.kernel, block.conv_attention_output.kernel, block.conv_moe_output.kernel]


@pytest.mark.slow
def test_documents_in_one_row_do_not_see_each_other():
    config = hero_like()
    fresh = compiled_init(config, jax.random.PRNGKey(0))
    model = _randomise(fresh, _convs_and_gates, jax.random.PRNGKey(5))
    ids, seg = packed_batch(config, batch=2)
    assert np.abs(_logits(model, ids, seg) - _logits(fresh, ids, seg)).max() > 1e-2  # the new leaves are in play
    first_doc = np.asarray(seg.array) == 0
    changed = hax.named(jnp.where(first_doc, (ids.array + 7) % config.vocab_size, ids.array), ids.axes)
    before, after = _logits(model, ids, seg), _logits(model, changed, seg)
    np.testing.assert_allclose(after[~first_doc], before[~first_doc], rtol=1e-5, atol=1e-5)
    assert np.abs(after[first_doc] - before[first_doc]).max() > 1e-3


@pytest.mark.parametrize("global_every, reaches", [(None, False), (1, True)])
def test_local_layers_see_only_the_window_global_layers_everything(global_every, reaches):
    config = hero_like(num_layers=1, global_every=global_every, sliding_window=4, conv_sites=())
    model = compiled_init(config, jax.random.PRNGKey(0))
    ids, _ = packed_batch(config, batch=1)
    seg = hax.zeros_like(ids)
    changed = hax.named(ids.array.at[0, 2].set((ids.array[0, 2] + 1) % config.vocab_size), ids.axes)
    delta = np.abs(_logits(model, changed, seg) - _logits(model, ids, seg)).max(axis=-1)[0]
    assert delta[5] > 1e-4  # position 5 attends to 2..5
    assert (delta[6:].max() > 1e-4) == reaches


@pytest.mark.slow
@pytest.mark.parametrize("declared", [dict(global_every=None, num_global_kv_heads=1, conv_kernel=2),
                                      dict(global_every=1, sliding_window=4, rope_fraction=0.5, qk_norm=False, qk_norm_eps=1e-3,
                                           balancing="none", qb_histogram_bins=10)])
def test_fields_the_plan_calls_inert_change_nothing_the_model_computes(declared):
    """`MoELMConfig.inert_fields` is what the model never reads: with them at their defaults, the
    same key initialises the same weights and the same tokens give the same logits, bit for bit."""
    config = hero_like(num_layers=2, conv_sites=(), **declared)
    cleared = config.without_inert_fields()
    assert config.inert_fields() and not cleared.inert_fields()
    ids, seg = packed_batch(config, batch=2)
    models = [compiled_init(c, jax.random.PRNGKey(0)) for c in (config, cleared)]
    np.testing.assert_array_equal(*(_logits(m, ids, seg) for m in models))


@pytest.mark.parametrize("backend", ["vanilla", "jax_flash"])
def test_the_declared_backend_applies_the_window(backend):
    """A local layer's output at a position does not move when an input more than `window` back
    changes, and does move within the window. 2,048 positions: jax_flash runs its blockwise kernel
    only from its 1,024-token block up (shorter sequences take the vanilla path)."""
    window, seq, at = 64, 2048, 1000
    config = hero_like(num_layers=1, global_every=None, sliding_window=window, max_seq_len=seq, conv_sites=(),
                       attention_backend=backend)
    attn = _randomise(Attention.init(config, key=jax.random.PRNGKey(0)), lambda a: [a.gate], jax.random.PRNGKey(1))
    B, P, Embed = hax.Axis("batch", 1), hax.Axis("position", seq), attn.q.axes[0]
    x = hax.random.normal(jax.random.PRNGKey(2), (B, P, Embed))
    moved = hax.named(x.array.at[:, at].add(10.0), x.axes)
    seg = hax.zeros((B, P), dtype=jnp.int32)
    run = jax.jit(lambda a, x: a(x, seg, False, P).rearrange((B, P, Embed)).array)
    delta = np.abs(np.asarray(run(attn, moved) - run(attn, x)))[0].max(axis=-1)
    assert delta[:at].max() == 0  # causal
    assert delta[at + window :].max() == 0  # beyond the window: masked keys contribute exactly nothing
    assert delta[at : at + window].min() > 1e-3  # while every position whose window holds `at` moves


@pytest.mark.slow
def test_xsa_output_is_orthogonal_to_the_own_value():
    config = hero_like()
    attn = compiled_init(config, jax.random.PRNGKey(0)).layers.get_layer(0).attn
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


@pytest.mark.slow
def test_forward_reports_per_layer_balance_stats():
    config = hero_like()
    model = compiled_init(config, jax.random.PRNGKey(0))
    ids, seg = packed_batch(config)
    _, aux = jax.jit(lambda m, i, s: m(i, s, transport=TransportSpec("local")))(model, ids, seg)
    L, E = config.num_layers, config.num_experts
    assert aux["qb_beta"].array.shape == (L, E)
    counts = np.asarray(aux["routing_counts"].array)
    assert counts.shape == (L, E)
    assert np.all(counts.sum(1) == ids.array.size * config.experts_per_token)
    assert np.all(np.asarray(aux["dropped_fraction"].array) == 0)


def test_router_bias_steers_selection_but_not_the_combine_weights():
    config = hero_like()
    moe = compiled_init(config, jax.random.PRNGKey(0)).layers.get_layer(0).moe
    Token = hax.Axis("token", 32)
    u = hax.random.normal(jax.random.PRNGKey(1), (Token, moe.router.axes[0]))
    bias = hax.named(jnp.zeros(config.num_experts).at[3].set(100.0), moe.router.axes[1])
    plain, steered = route(u, moe.router, None, config), route(u, moe.router, bias, config)
    assert np.all(np.any(np.asarray(steered.selected.array) == 3, axis=1))
    np.testing.assert_allclose(np.asarray(steered.weights.array).sum(1), config.routing_renorm_sum, rtol=1e-5)
    assert not np.array_equal(plain.selected.array, steered.selected.array)

    # The threshold is a biased logit, the one value of `route` the bias moves continuously: the
    # stop-gradient keeps it from carrying a gradient back to the bias.
    def threshold_sum(bias):
        return hax.sum(route(u, moe.router, bias, config).threshold).array

    assert np.all(np.asarray(jax.grad(threshold_sum)(bias).array) == 0)


@pytest.mark.slow
def test_router_bias_moves_only_by_quantile_balancing_under_the_grouped_optimizer():
    """Two real steps in the loop's order (optimizer update, then `apply_router_update`): the
    optimizer's update for the bias is exactly zero and the bias ends as -beta (centred).

    The loss has no gradient path to the bias (it only steers selection), so with its true zero
    gradient even an optimizer that trained it would leave it still; the bias's gradient is set to
    ones (a leak) so that training it would show."""
    config = hero_like()
    model = compiled_init(config, jax.random.PRNGKey(0))
    ids, seg = packed_batch(config)
    batch = TokenBatch(input_ids=ids, segment_ids=seg)
    train = TrainConfig(batch_size=8, seq_len=16, num_steps=4, schedule=ScheduleConfig(0.0, 1.0),
                        optimizer=GroupedOptimizerConfig(muon_lr=1e-2, adam_lr=1e-2))
    tx = Optimizer(train, eqx.filter(model, eqx.is_inexact_array)).transform()
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    update = eqx.filter_jit(tx.update)
    lm = KeelLM(config, mesh=None)

    def bias_of(tree):
        return tree.layers.stacked.moe.router_bias

    def loss(model):
        return loss_fn(model, batch, transport=TransportSpec("local"))

    grads_and_aux = eqx.filter_jit(eqx.filter_grad(loss, has_aux=True))

    for _ in range(2):
        grads, aux = grads_and_aux(model)
        leaked = eqx.tree_at(bias_of, grads, hax.ones_like(bias_of(grads)))
        updates, opt_state = update(leaked, opt_state, eqx.filter(model, eqx.is_inexact_array))
        assert np.all(np.asarray(bias_of(updates).array) == 0)
        assert np.abs(np.asarray(updates.layers.stacked.moe.router.array)).max() > 0  # a real step
        before = np.asarray(bias_of(model).array)
        model = lm.apply_router_update(eqx.apply_updates(model, updates), aux)
        expected = np.asarray(next_router_bias(aux["qb_beta"]).array)
        np.testing.assert_array_equal(np.asarray(bias_of(model).array), expected)
        assert np.abs(expected - before).max() > 0  # quantile balancing did move it


@pytest.mark.slow
def test_softmax_routing_with_auxiliary_loss():
    config = hero_like(routing="softmax_topk", balancing="aux_loss", aux_loss_coef=0.01, routing_renorm_sum=1.0)
    model = compiled_init(config, jax.random.PRNGKey(0))
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


def test_the_router_computes_its_logits_in_full_fp32_in_the_bf16_training_forward():
    """The reference's router is fp32: its dot must ask for HIGHEST, or XLA runs an fp32 dot in TF32 on
    GPUs (bf16 passes on TPUs). Read from the program the loss compiles, the model's own forward."""
    config = hero_like()
    model = compiled_init(config, jax.random.PRNGKey(0))
    ids, seg = packed_batch(config)
    program = jax.make_jaxpr(lambda m: loss_fn(m, TokenBatch(ids, seg), transport=TransportSpec("local"),
                                               compute_dtype=jnp.bfloat16)[0])(model)

    def dots(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                yield eqn
            for value in eqn.params.values():
                for inner in value if isinstance(value, (list, tuple)) else (value,):
                    inner = getattr(inner, "jaxpr", inner)
                    if isinstance(inner, jax.extend.core.Jaxpr):
                        yield from dots(inner)

    router = (config.hidden_dim, config.num_experts)  # the router weight [Embed, Experts], one layer's
    routers = [eqn for eqn in dots(program.jaxpr) if eqn.invars[1].aval.shape == router]
    assert routers and all(eqn.outvars[0].aval.dtype == jnp.float32 for eqn in routers)
    highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    assert all(eqn.params["precision"] == highest for eqn in routers), [eqn.params["precision"] for eqn in routers]


def test_a_fixed_capacity_transport_without_an_expert_axis_reports_no_capacity():
    """Without an expert axis of 2 or more, grug runs its dropless local kernel whatever transport it
    is asked for: the kernel's report (what the loop checks against the plan) says no capacity."""
    config = hero_like()
    model = compiled_init(config, jax.random.PRNGKey(0))
    ids, seg = packed_batch(config)
    _, aux = jax.jit(lambda m, i, s: m(i, s, transport=TransportSpec("fixed_all_to_all")))(model, ids, seg)
    assert np.all(np.asarray(aux["kernel_capacity_factor"].array) == 0.0)
    assert np.all(np.asarray(aux["dropped_fraction"].array) == 0)
