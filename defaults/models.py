"""Model presets: the 535B-A23B hero architecture, its tiny CPU-sized twin, a small one for
speed measurements where matmuls, not per-feature overheads, dominate, and `dense_baseline`: the
dense model a MoE is compared with at equal active parameters."""

from collections.abc import Callable

from keel.spec import AttentionBackend, Balancing, ConvSite, MoELMConfig, Routing

ALL_CONV_SITES = (ConvSite.KEY, ConvSite.ATTENTION_OUTPUT, ConvSite.MOE_OUTPUT)

hero_535b = MoELMConfig(
    hidden_dim=6144,
    num_layers=48,
    vocab_size=128_256,
    max_seq_len=4096,
    tie_embeddings=False,
    embed_norm=True,
    num_heads=48,
    head_dim=128,
    num_kv_heads=12,
    num_global_kv_heads=6,
    global_every=4,
    sliding_window=2048,
    attention_backend=AttentionBackend.JAX_FLASH,  # GPUs' default, NVTE, cannot apply the window
    rope_theta=10_000.0,
    rope_fraction=0.5,
    qk_norm=True,
    qk_mult=1.3,
    xsa=True,
    attention_gate=True,
    conv_kernel=4,
    conv_sites=ALL_CONV_SITES,
    gated_norm_rank=128,
    num_experts=384,
    experts_per_token=8,
    latent_dim=3072,
    expert_dim=3072,
    num_shared_experts=2,
    shared_expert_dim=3072,
    routing=Routing.SIGMOID_TOPK_THRESHOLD,
    routing_renorm_sum=2.5,
    balancing=Balancing.QUANTILE,
    qb_histogram_bins=10_000,
    capacity_factor=1.15,
)
"""The hero: 535,477,106,688 parameters, 22,762,487,808 active per token."""

tiny_moe = MoELMConfig(
    hidden_dim=64,
    num_layers=4,
    vocab_size=1024,
    max_seq_len=128,
    embed_norm=True,
    num_heads=4,
    head_dim=16,
    num_kv_heads=2,
    num_global_kv_heads=1,
    global_every=4,
    sliding_window=64,
    rope_fraction=0.5,
    qk_norm=True,
    qk_mult=1.3,
    xsa=True,
    attention_gate=True,
    conv_kernel=4,
    conv_sites=ALL_CONV_SITES,
    gated_norm_rank=16,
    num_experts=8,
    experts_per_token=2,
    latent_dim=32,
    expert_dim=32,
    num_shared_experts=2,
    shared_expert_dim=32,
    routing=Routing.SIGMOID_TOPK_THRESHOLD,
    routing_renorm_sum=2.5,
    balancing=Balancing.QUANTILE,
    qb_histogram_bins=1000,
    capacity_factor=1.25,
)
"""Every hero feature switched on at CPU size: 4 layers (layer 3 global), 8 experts top-2 on a
32-wide latent, 2 shared experts, quantile balancing, a 1024-token vocabulary."""

small_moe = tiny_moe.replace(
    hidden_dim=256,
    num_heads=8,
    head_dim=32,
    num_kv_heads=4,
    num_global_kv_heads=2,
    gated_norm_rank=32,
    num_experts=16,
    experts_per_token=4,
    latent_dim=128,
    expert_dim=256,
    shared_expert_dim=256,
)
"""Every hero feature at hidden 256: 4 layers, 16 experts top-4 on a 128-wide latent, 2 shared
experts; sized so that benchmarks on 8 simulated CPU devices measure matmuls, not overheads."""


def dense_baseline(model: MoELMConfig, match: Callable[[MoELMConfig], float] | None = None) -> MoELMConfig:
    """The dense model to compare `model` with: no routed experts (so no router, no balancing, no
    MoE metrics, and the routing fields at their defaults), its shared MLP widened until `match` (default: active parameters per token)
    equals the MoE's. Everything else (attention, norms, vocabulary) is the same. A dense model has
    no experts to split: train it on a topology with `expert_parallel=1`.

        base = default_train("dense", model=dense_baseline(tiny_moe), ..., topology=RackTopology(2, 4))
        flops = dense_baseline(small_moe, match=lambda m: m.flops_per_token(seq_len))  # same FLOPs instead
    """
    match = match or (lambda m: m.param_counts()["active"])
    shared = max(model.num_shared_experts, 1)

    def dense(width: int) -> MoELMConfig:
        return model.replace(num_experts=0, experts_per_token=0, latent_dim=None, balancing=Balancing.NONE,
                             num_shared_experts=shared, shared_expert_dim=width).without_inert_fields()

    # the matched figure grows linearly with the MLP's width: solve for it, then take the nearest width
    base, slope = match(dense(1)), match(dense(2)) - match(dense(1))
    guess = max(1, round(1 + (match(model) - base) / slope))
    return min((dense(w) for w in range(max(1, guess - 2), guess + 3)), key=lambda m: abs(match(m) - match(model)))
