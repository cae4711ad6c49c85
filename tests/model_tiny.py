"""Tiny keel models and packed batches shared by the model and mesh tests."""

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np

from keel.spec.model import MoELMConfig

BATCH, POS = "batch", "position"


def compiled_init(config: MoELMConfig, key):
    """keel.model's `init_model`, compiled as one program with the options the training loop
    compiles its initial state with (`run_once_options`). Run eagerly, each of its ~90 random-number
    ops compiles alone: hero_like's init took 16 s on 2 cores, this 5 s."""
    import equinox as eqx

    from keel.model import transformer
    from keel.train.compile_ahead import run_once_options

    static = eqx.filter(eqx.filter_eval_shape(transformer.init_model, config, key), eqx.is_array, inverse=True)
    init = jax.jit(lambda k: eqx.filter(transformer.init_model(config, k), eqx.is_array))
    return eqx.combine(init.lower(key).compile(run_once_options())(key), static)


def hero_like(**changes) -> MoELMConfig:
    """Every hero feature on, at a size that compiles in seconds."""
    base = dict(
        hidden_dim=32, num_layers=3, vocab_size=64, max_seq_len=16, embed_norm=True,
        num_heads=4, head_dim=8, num_kv_heads=2, num_global_kv_heads=1, global_every=2, sliding_window=4,
        rope_fraction=0.5, qk_norm=True, qk_mult=1.3, xsa=True, attention_gate=True,
        conv_sites=("key", "attention_output", "moe_output"), gated_norm_rank=4,
        num_experts=8, experts_per_token=2, latent_dim=16, expert_dim=16, num_shared_experts=2, shared_expert_dim=16,
        routing="sigmoid_topk_threshold", routing_renorm_sum=2.5, balancing="quantile", qb_histogram_bins=1000,
        capacity_factor=1.25,
    )
    base.update(changes)
    return MoELMConfig(**base)


def packed_batch(config: MoELMConfig, batch: int = 8, seq: int = 16, seed: int = 1):
    """(input_ids, segment_ids) [Batch, Pos]: each row holds two documents split at a random point."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, config.vocab_size, size=(batch, seq))
    cuts = rng.integers(2, seq - 2, size=batch)
    segments = (np.arange(seq)[None, :] >= cuts[:, None]).astype(np.int32)
    axes = (hax.Axis(BATCH, batch), hax.Axis(POS, seq))
    return hax.named(jnp.asarray(ids, jnp.int32), axes), hax.named(jnp.asarray(segments), axes)


def leaf_size(tree) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(tree))
