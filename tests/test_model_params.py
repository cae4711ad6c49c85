"""The Haliax model's array leaves add up to exactly what MoELMConfig.param_counts() promises."""

import random

import jax
import pytest
from model_tiny import compiled_init, hero_like, leaf_size

from keel.spec.model import Balancing, ConvSite, MoELMConfig, Routing
from keel.model.transformer import init_model


def _shapes(config: MoELMConfig):
    """The model's array shapes without allocating them."""
    return jax.eval_shape(lambda key: init_model(config, key), jax.random.PRNGKey(0))


def _random_config(rng: random.Random) -> MoELMConfig:
    num_heads = rng.choice([2, 4, 6])
    kv = rng.choice([d for d in (1, 2, 3, 6) if num_heads % d == 0])
    num_experts = rng.choice([0, 4, 6, 8])
    quantile = num_experts and rng.random() < 0.5
    return MoELMConfig(
        hidden_dim=rng.choice([8, 12, 24]),
        num_layers=rng.randint(1, 5),
        vocab_size=rng.randint(5, 40),
        max_seq_len=32,
        tie_embeddings=rng.random() < 0.3,
        embed_norm=rng.random() < 0.5,
        num_heads=num_heads,
        head_dim=rng.choice([2, 4, 8]),
        num_kv_heads=kv,
        num_global_kv_heads=rng.choice([None, 1]),
        global_every=rng.choice([None, 1, 2, 3]),
        sliding_window=rng.choice([None, 4]),
        attention_gate=rng.random() < 0.5,
        conv_kernel=rng.randint(1, 4),
        conv_sites=tuple(s for s in ConvSite if rng.random() < 0.5),
        gated_norm_rank=rng.choice([0, 2, 3]),
        num_experts=num_experts,
        experts_per_token=rng.randint(2, num_experts - 1) if num_experts else 0,
        latent_dim=rng.choice([None, 6]) if num_experts else None,
        expert_dim=rng.choice([4, 10]),
        num_shared_experts=rng.choice([0, 1, 2]) if num_experts else rng.choice([1, 2]),
        shared_expert_dim=7,
        routing=Routing.SIGMOID_TOPK_THRESHOLD if quantile else rng.choice(list(Routing)),
        balancing=Balancing.QUANTILE if quantile else Balancing.NONE,
    )


@pytest.mark.parametrize("seed", range(8))
def test_leaf_count_equals_param_counts_for_random_configs(seed):
    config = _random_config(random.Random(seed))
    assert leaf_size(_shapes(config)) == config.param_counts()["total"], config


def test_initialised_tiny_model_counts_exactly():
    config = hero_like()
    model = compiled_init(config, jax.random.PRNGKey(0))
    assert leaf_size(model) == config.param_counts()["total"]


def test_hero_model_shapes_count_535b():
    from defaults.models import hero_535b

    assert leaf_size(_shapes(hero_535b)) == hero_535b.param_counts()["total"] == 535_477_106_688
