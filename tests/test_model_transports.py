"""Every CPU-capable expert transport computes what the all-experts `dense` reference computes."""

import math

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_tiny import hero_like

from keel.mesh.mesh import build_mesh, shard_batch, tree_shardings, use_mesh
from keel.model.layout import gathered
from keel.spec.topology import RackTopology
from keel.model.moe import LatentMoE
from keel.spec.transports import TRANSPORTS, TransportSpec, check_transport_supported
from keel.model.transports import dispatch

RACKS_2X4 = RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4)
CPU_TRANSPORTS = ["local", "fixed_all_to_all", "ring", "fixed_pooled_all_to_all"]


def _moe_and_inputs(config):
    moe = LatentMoE.init(config, key=jax.random.PRNGKey(0))
    B, P = hax.Axis("batch", 8), hax.Axis("position", 8)
    u = hax.random.normal(jax.random.PRNGKey(1), (B, P, hax.Axis("embed", config.hidden_dim)))
    valid = hax.named(jnp.arange(64).reshape(8, 8) % 7 != 3, (B, P))  # some padding tokens
    cotangent = hax.random.normal(jax.random.PRNGKey(2), u.axes)
    return moe, u, valid, cotangent


def _value_and_grads(moe, u, valid, cotangent, transport):
    def objective(moe, u):
        out, stats = gathered(moe)(u, valid, transport=transport)
        return hax.sum(out * cotangent).array, (out.array, stats["dropped_fraction"].array)

    return eqx.filter_jit(eqx.filter_value_and_grad(objective, has_aux=True))(moe, u)


@pytest.mark.slow
def test_cpu_transports_match_dense_outputs_and_gradients_when_nothing_drops():
    # Capacity for every assignment: capacity factors of E make the fixed transports dropless.
    config = hero_like(capacity_factor=8.0)
    moe, u, valid, cotangent = _moe_and_inputs(config)
    mesh = build_mesh(RACKS_2X4)
    with use_mesh(mesh):
        moe, u = jax.device_put(moe, tree_shardings(moe, mesh)), shard_batch(u, mesh)
        valid, cotangent = shard_batch(valid, mesh), shard_batch(cotangent, mesh)
        (_, (ref_out, _)), ref_grads = _value_and_grads(moe, u, valid, cotangent, TransportSpec("dense"))
        for name in CPU_TRANSPORTS:
            spec = TransportSpec(name, capacity_factor=8.0)
            (_, (out, dropped)), grads = _value_and_grads(moe, u, valid, cotangent, spec)
            assert float(dropped) == 0.0, name
            np.testing.assert_allclose(out, ref_out, rtol=2e-5, atol=2e-5, err_msg=name)
            for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
                np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-5, err_msg=name)


def test_fixed_all_to_all_counts_the_assignments_over_capacity():
    E, K, tokens, width = 8, 2, 64, 4
    rng = np.random.default_rng(0)
    skewed = rng.choice(E, size=(tokens, K), p=np.array([4, 2, 1, 1, 1, 1, 1, 1]) / 12)
    skewed[:, 1] = (skewed[:, 0] + 1 + rng.integers(0, E - 1, tokens)) % E  # two distinct experts per token
    Token, TopK, Latent, Mlp, Experts = (hax.Axis(n, s) for n, s in
                                         [("token", tokens), ("top_k", K), ("latent", width), ("expert_mlp", 4), ("experts", E)])
    x = hax.random.normal(jax.random.PRNGKey(0), (Token, Latent))
    selected = hax.named(jnp.asarray(skewed, jnp.int32), (Token, TopK))
    weights = hax.ones((Token, TopK)) / K
    valid = hax.ones(Token, dtype=bool)
    w = [hax.random.normal(jax.random.PRNGKey(i), axes) for i, axes in
         enumerate([(Experts, Latent, Mlp), (Experts, Latent, Mlp), (Experts, Mlp, Latent)])]
    mesh = build_mesh(RACKS_2X4)
    shards = RACKS_2X4.batch_shards
    per_shard = tokens // shards
    drops = {}
    for factor in (1.0, 2.0):  # the kernel drops what the capacity it is handed leaves out, and says which it was
        with use_mesh(mesh):
            _, dropped, sized = jax.jit(
                lambda *a: dispatch(*a, transport=TransportSpec("fixed_all_to_all"), capacity_factor=factor)
            )(x, selected, weights, valid, *w)
        capacity = math.ceil(per_shard * K / E * factor)
        expected = sum(
            max(int((skewed[s * per_shard:(s + 1) * per_shard] == e).sum()) - capacity, 0)
            for s in range(shards) for e in range(E)
        )
        assert int(dropped) == expected and float(sized) == factor, factor
        drops[factor] = expected
    assert drops[1.0] > drops[2.0] > 0


def test_ragged_all_to_all_is_a_configuration_error_on_cpu():
    with pytest.raises(ValueError, match="GPU or TPU"):
        check_transport_supported("ragged_all_to_all", "cpu")
    check_transport_supported("ragged_all_to_all", "gpu")
    for name in CPU_TRANSPORTS + ["dense"]:
        check_transport_supported(name, "cpu")
    with pytest.raises(ValueError, match="TransportSpec.name"):
        TransportSpec("warp_drive")
    assert set(TRANSPORTS) == {*CPU_TRANSPORTS, "dense", "ragged_all_to_all"}


def test_ragged_all_to_all_fails_before_xla_in_the_model():
    config = hero_like()
    moe, u, valid, _ = _moe_and_inputs(config)
    with pytest.raises(ValueError, match="ragged-all-to-all"):
        moe(u, valid, transport=TransportSpec("ragged_all_to_all"))


def test_tiled_cpu_kernel_is_dropless_under_skewed_routing():
    from keel.model.tiled_experts import tiled_expert_mlp

    tokens, k, width, mlp, E = 40, 2, 6, 5, 4
    rng = np.random.default_rng(1)
    selected = np.stack([np.zeros(tokens, int), rng.integers(1, 3, tokens)], axis=1)  # expert 0 hot, 3 idle
    weights = rng.random((tokens, k)).astype(np.float32)
    valid = np.arange(tokens) % 9 != 4
    x = rng.normal(size=(tokens, width)).astype(np.float32)
    w13 = rng.normal(size=(E, width, 2 * mlp)).astype(np.float32)
    w2 = rng.normal(size=(E, mlp, width)).astype(np.float32)
    out = tiled_expert_mlp(jnp.asarray(x), jnp.asarray(selected), jnp.asarray(weights), jnp.asarray(valid), w13, w2)

    def expert(e, row):
        gate, up = np.split(row @ w13[e], 2)
        return (gate / (1 + np.exp(-gate)) * up) @ w2[e]

    expected = np.array([
        sum(weights[t, j] * expert(selected[t, j], x[t]) for j in range(k)) if valid[t] else np.zeros(width)
        for t in range(tokens)
    ])
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-4, atol=1e-4)
