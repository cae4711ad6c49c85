"""MoELMConfig: the hero's exact counts, accounting of every switchable feature, FLOPs, validation."""

import dataclasses
import math
import random

import pytest

from defaults.models import hero_535b, tiny_moe
from keel.spec import AttentionBackend, Balancing, ConvSite, MoELMConfig, Routing
from keel.spec.model import select_attention_backend


def test_hero_counts_match_the_reference_exactly():
    counts = hero_535b.param_counts()
    assert counts["total"] == 535_477_106_688
    assert counts["active"] == 22_762_487_808
    assert counts["components"]["routed_experts"] == 48 * 384 * 3 * 3072 * 3072
    assert counts["active_components"]["routed_experts"] == 48 * 8 * 3 * 3072 * 3072
    assert counts["components"]["router_bias"] == 48 * 384
    assert sum(counts["components"].values()) == counts["total"]
    assert sum(counts["active_components"].values()) == counts["active"]


def test_hero_layer_schedule():
    assert hero_535b.global_layers == tuple(range(3, 48, 4))
    assert len(hero_535b.global_layers) == 12
    assert hero_535b.rotary_dim == 64


@pytest.mark.parametrize(
    "layers, every, expected",
    [(6, 4, (3, 5)), (4, 4, (3,)), (5, 1, (0, 1, 2, 3, 4)), (3, None, ())],
)
def test_global_layers_include_the_last(layers, every, expected):
    config = tiny_moe.replace(num_layers=layers, global_every=every)
    assert config.global_layers == expected
    with pytest.raises(IndexError):
        config.is_global_layer(layers)


def _size(config, *names):
    shapes = config.parameter_shapes()
    return sum(math.prod(shapes[n]) for n in names)


@pytest.mark.parametrize(
    "off, removed",
    [
        (dict(attention_gate=False), ["layers.stacked.attn.gate"]),
        (dict(conv_sites=()), ["layers.stacked.attn.conv_key.kernel", "layers.stacked.conv_attention_output.kernel",
                               "layers.stacked.conv_moe_output.kernel"]),
        (dict(gated_norm_rank=0), [f"{p}.gated.{m}" for p in ("embed_norm", "final_norm", "layers.stacked.attn_norm",
                                                              "layers.stacked.mlp_norm") for m in ("down", "up")]),
        (dict(latent_dim=None, expert_dim=32), ["layers.stacked.moe.latent_down", "layers.stacked.moe.latent_up",
                                                 "layers.stacked.moe.latent_norm.weight"]),
        (dict(num_shared_experts=0), ["layers.stacked.shared.gate", "layers.stacked.shared.up", "layers.stacked.shared.down"]),
        (dict(balancing=Balancing.NONE), ["layers.stacked.moe.router_bias"]),
        (dict(tie_embeddings=True), ["lm_head"]),
    ],
)
def test_switching_a_feature_off_removes_exactly_its_parameters(off, removed):
    """Each feature's parameters disappear from the count, and nothing else changes (tiny_moe's
    latent and expert widths are both 32 and its hidden is 64, so dropping the latent changes the
    experts' input width: that case compares the experts separately)."""
    plain = tiny_moe.replace(**off)
    before, after = tiny_moe.param_counts()["total"], plain.param_counts()["total"]
    lost = _size(tiny_moe, *removed)
    assert lost > 0
    if "latent_dim" in off:
        expert_growth = _size(plain, "layers.stacked.moe.experts.gate", "layers.stacked.moe.experts.up", "layers.stacked.moe.experts.down") - _size(
            tiny_moe, "layers.stacked.moe.experts.gate", "layers.stacked.moe.experts.up", "layers.stacked.moe.experts.down"
        )
        assert after == before - lost + expert_growth
    else:
        assert after == before - lost
    for name in removed:
        assert name not in plain.parameter_shapes()


def test_a_plain_moe_with_every_feature_off_is_valid():
    plain = MoELMConfig(hidden_dim=32, num_layers=2, vocab_size=100, max_seq_len=16, num_heads=2, head_dim=16,
                        num_kv_heads=2, num_experts=4, experts_per_token=2, expert_dim=16)
    assert not plain.qk_norm and not plain.xsa and not plain.conv_sites and plain.latent_dim is None
    assert plain.balancing is Balancing.NONE and plain.global_layers == ()
    shapes = plain.parameter_shapes()
    assert shapes["layers.stacked.moe.experts.gate"] == (2, 4, 32, 16)


def _random_config(rng: random.Random) -> MoELMConfig:
    kv = rng.choice([1, 2, 4])
    heads = kv * rng.choice([1, 2])
    experts = rng.choice([0, 4, 8])
    seq = rng.choice([16, 32, 64])
    return MoELMConfig(
        hidden_dim=rng.choice([16, 32, 48]),
        num_layers=rng.randint(1, 5),
        vocab_size=rng.randint(50, 300),
        max_seq_len=seq,
        tie_embeddings=rng.random() < 0.3,
        embed_norm=rng.random() < 0.5,
        num_heads=heads,
        head_dim=rng.choice([8, 16]),
        num_kv_heads=kv,
        num_global_kv_heads=rng.choice([None, 1]),
        global_every=rng.choice([None, 1, 2, 3]),
        sliding_window=rng.choice([None, seq // 2]),
        rope_fraction=rng.choice([0.0, 0.5, 1.0]),
        qk_norm=rng.random() < 0.5,
        xsa=rng.random() < 0.5,
        attention_gate=rng.random() < 0.5,
        conv_sites=tuple(s for s in ConvSite if rng.random() < 0.5),
        conv_kernel=rng.randint(1, 4),
        gated_norm_rank=rng.choice([0, 4]),
        num_experts=experts,
        experts_per_token=rng.randint(2, experts - 1) if experts else 0,
        latent_dim=rng.choice([None, 8]) if experts else None,
        expert_dim=rng.choice([8, 24]),
        num_shared_experts=rng.randint(0 if experts else 1, 2),
        shared_expert_dim=16,
        routing=Routing.SIGMOID_TOPK_THRESHOLD if experts else Routing.SOFTMAX_TOPK,
        balancing=rng.choice([Balancing.QUANTILE, Balancing.NONE]) if experts else Balancing.NONE,
    )


@pytest.mark.parametrize("seed", range(8))
def test_random_small_configs_count_every_shape(seed):
    """The shapes a config declares (the built model's leaves match them: test_model_params)."""
    config = _random_config(random.Random(seed))
    counts = config.param_counts()
    shapes = config.parameter_shapes()
    assert 0 < counts["active"] < counts["total"]
    d, L = config.hidden_dim, config.num_layers
    assert shapes["layers.stacked.attn.k"] == (L, d, config.num_kv_heads, config.head_dim)
    if config.num_experts:  # a token uses k of the E experts of each layer: k/E of their weights
        gate = shapes["layers.stacked.moe.experts.gate"]
        assert gate == (L, config.num_experts, config.latent_dim or d, config.expert_dim)
        idle = counts["components"]["routed_experts"] - counts["active_components"]["routed_experts"]
        assert idle == 3 * L * math.prod(gate[2:]) * (config.num_experts - config.experts_per_token)  # gate, up, down
    assert ("layers.stacked.moe.router_bias" in shapes) == (config.balancing is Balancing.QUANTILE)


def _attended_keys_brute_force(config: MoELMConfig, seq: int) -> float:
    total = 0
    for layer in range(config.num_layers):
        window = seq if config.is_global_layer(layer) or config.sliding_window is None else config.sliding_window
        total += sum(min(t + 1, window) for t in range(seq))
    return total / (seq * config.num_layers)


@pytest.mark.parametrize("seq", [16, 64, 128])
def test_flops_count_attention_with_window_and_causality(seq):
    config = tiny_moe
    assert config.attended_keys_per_query(seq) == pytest.approx(_attended_keys_brute_force(config, seq))
    c = config.param_counts()
    matmul = c["active"] + config.hidden_dim * config.vocab_size + c["components"]["attention_gate"] + c["components"]["gated_norms"]
    attention = 12 * config.num_heads * config.head_dim * _attended_keys_brute_force(config, seq) * config.num_layers
    assert config.flops_per_token(seq) == pytest.approx(6 * matmul + attention)


def test_a_sliding_window_saves_attention_flops():
    full = tiny_moe.replace(sliding_window=None)
    assert tiny_moe.flops_per_token(128) < full.flops_per_token(128)
    assert tiny_moe.flops_per_token(32) == pytest.approx(full.flops_per_token(32))  # window 64 > 32 tokens


def test_hero_training_flops_are_about_2_7e24():
    tokens = 390_251 * 11_264 * 4096
    assert 6 * hero_535b.param_counts()["active"] * tokens == pytest.approx(2.46e24, rel=1e-3)
    assert round(hero_535b.flops_per_token(4096) * tokens / 1e24, 1) == 2.7


def test_enum_fields_accept_their_string_values():
    config = tiny_moe.replace(routing="sigmoid_topk_threshold", balancing="quantile", conv_sites=("key",))
    assert config.routing is Routing.SIGMOID_TOPK_THRESHOLD and config.conv_sites == (ConvSite.KEY,)


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(num_kv_heads=3), "num_kv_heads"),
        (dict(num_global_kv_heads=3), "num_global_kv_heads"),
        (dict(experts_per_token=8), "experts_per_token"),
        (dict(experts_per_token=1), "experts_per_token=1 with routing='sigmoid_topk_threshold' renormalises"),
        (dict(experts_per_token=1, routing="softmax_topk", balancing="none"), "experts_per_token=1 with routing='softmax_topk' renormalises"),
        (dict(latent_dim=0), "latent_dim"),
        (dict(expert_dim=-1), "expert_dim"),
        (dict(sliding_window=256), "sliding_window"),
        (dict(rope_fraction=0.3), "rope_fraction"),
        (dict(routing="softmax_topk"), "balancing"),
        (dict(routing="top_k"), "routing"),
        (dict(conv_sites=("key", "key")), "conv_sites"),
        (dict(num_shared_experts=2, shared_expert_dim=0), "shared_expert_dim"),
        (dict(capacity_factor=0.0), "capacity_factor"),
        (dict(hidden_dim=0), "hidden_dim"),
        (dict(qb_histogram_bins=1), "qb_histogram_bins"),
        (dict(balancing="aux_loss"), "aux_loss_coef"),
        (dict(attention_backend="nvte"), "attention_backend"),
        (dict(attention_backend="default"), "attention_backend"),
    ],
)
def test_invalid_configs_name_the_field(change, field):
    with pytest.raises(ValueError, match=rf"MoELMConfig\.{field}\b"):
        dataclasses.replace(tiny_moe, **change)


@pytest.mark.parametrize("backend", [b for b in AttentionBackend if b is not AttentionBackend.NVTE])
def test_backends_that_apply_the_window_are_used_as_declared(backend):
    assert select_attention_backend(backend, 64) is backend
    assert select_attention_backend(backend, None) is backend


def test_nvte_is_refused_for_windowed_layers_naming_the_field_the_layers_and_the_fix():
    assert select_attention_backend(AttentionBackend.NVTE, None) is AttentionBackend.NVTE  # full causal: fine
    with pytest.raises(ValueError) as refused:
        select_attention_backend(AttentionBackend.NVTE, 64)
    message = str(refused.value)
    assert message.startswith("MoELMConfig.attention_backend='nvte' cannot apply sliding_window=64 of the local layers")
    assert "attention_backend='jax_flash'" in message and "sliding_window=None" in message
    with pytest.raises(ValueError, match=r"MoELMConfig\.attention_backend='nvte' cannot apply sliding_window=64"):
        tiny_moe.replace(attention_backend="nvte")  # refused when declared, before any jax
    # No windowed layer, no refusal: no window, or every layer global.
    assert tiny_moe.replace(attention_backend="nvte", sliding_window=None).attention_backend is AttentionBackend.NVTE
    assert tiny_moe.replace(attention_backend="nvte", global_every=1).global_layers == (0, 1, 2, 3)


def test_the_attention_backend_is_execution_only():
    from keel.executor.encoding import encode

    assert encode(tiny_moe, "model", None) == encode(tiny_moe.replace(attention_backend="jax_flash"), "model", None)
    assert encode(tiny_moe, "model", None) != encode(tiny_moe.replace(sliding_window=32), "model", None)
