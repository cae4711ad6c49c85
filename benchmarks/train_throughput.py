"""Training tokens/s of a keel MoE against two baselines, under one trainer, mesh and data.

    uv run python benchmarks/train_throughput.py [--model tiny|small] [--steps 12]

`--model small` (defaults.models.small_moe: hidden 256, 16 experts, every hero feature) is the
size where matmuls dominate; `tiny` (hidden 64) mostly measures per-feature overheads.

Every model trains with keel's loop (same optimizer, batches, 8 simulated CPU devices as 2 racks
x 4) on the same synthetic token stream:

- the keel model, experts split 4 ways over `expert`, with each CPU-capable transport
  (fixed-capacity all-to-all, dropless ring);
- Levanter's own Qwen3-MoE at the same widths: it has no expert parallelism, so it trains
  data-parallel with every expert on every device;
- the same keel model with the hero's extra features off (diagnostic: architecture vs framework);
- a dense keel model (no routed experts; shared SwiGLU experts widened) with the same training
  FLOPs per token as `tiny_moe` (`MoELMConfig.flops_per_token`).

Reported: the first step's time (compilation) apart, then median tokens/s over the steps after the
first two; achieved training FLOP/s against a calibrated `jnp.dot` of this CPU in the same run (a
CPU "MFU"). The ratios come last.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402

import numpy as np  # noqa: E402
from planned import planned  # noqa: E402

from defaults.models import dense_baseline, small_moe, tiny_moe  # noqa: E402
from keel.spec import BATCH_AXES, AdamWConfig, Balancing, MoELMConfig, RackTopology, TrainConfig, TransportPhase

BATCH, SEQ = 16, 128
RACKS = RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4)
DENSE_RACKS = RackTopology(racks=2, gpus_per_rack=4, expert_parallel=1)
"""The same 8 devices for the dense twin, which has no experts to split: its rack axis is `data`."""


def token_stream(n: int, seed: int = 0):
    """Random token sequences, one document each: the same stream for every model."""
    from levanter.data.dataset import ListAsyncDataset

    ids = np.random.default_rng(seed).integers(0, tiny_moe.vocab_size, (n, SEQ), dtype=np.int32)  # one vocab for both
    return ListAsyncDataset([{"input_ids": row, "segment_ids": np.zeros(SEQ, np.int32)} for row in ids])


def plain_twin(model: MoELMConfig) -> MoELMConfig:
    """`model` with the hero's extra features off: the architecture Levanter's Qwen3-MoE has."""
    return model.replace(embed_norm=False, global_every=None, sliding_window=None, rope_fraction=1.0, qk_mult=1.0,
                         xsa=False, attention_gate=False, conv_sites=(), gated_norm_rank=0, latent_dim=None,
                         num_shared_experts=0, shared_expert_dim=0, routing="softmax_topk", routing_renorm_sum=1.0,
                         balancing=Balancing.NONE)


def dense_twin(model: MoELMConfig) -> MoELMConfig:
    """No routed experts; the shared MLP widened until training FLOPs per token match `model`'s."""
    return dense_baseline(model, match=lambda m: m.flops_per_token(SEQ))


class LevanterQwen3Moe:
    """Levanter's Qwen3-MoE as a keel `TrainableLM` (data parallel: its experts cannot be split)."""

    def __init__(self, model: MoELMConfig, mesh):
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P
        from levanter.models.qwen3_moe import Qwen3MoeConfig

        self.mesh, self.replicated = mesh, NamedSharding(mesh, P())
        self.config = Qwen3MoeConfig(
            max_seq_len=SEQ,
            hidden_dim=model.hidden_dim,
            intermediate_dim=model.expert_dim,
            moe_intermediate_dim=model.expert_dim,
            num_layers=model.num_layers,
            num_heads=model.num_heads,
            head_dim=model.head_dim,
            num_kv_heads=model.num_kv_heads,
            num_experts=model.num_experts,
            num_experts_per_tok=model.experts_per_token,
            router_aux_loss_coef=None,
            gradient_checkpointing=True,
            reference_checkpoint=None,
            tokenizer=None,
        )
        self.vocab_size = model.vocab_size

    def init(self, key):
        import haliax as hax
        import jax
        from levanter.models.qwen3_moe import Qwen3MoeLMHeadModel

        Vocab = hax.Axis("vocab", self.vocab_size)
        return jax.jit(lambda k: Qwen3MoeLMHeadModel.init(Vocab, self.config, key=k), out_shardings=self.replicated)(key)

    def loss(self, model, batch, *, transport, z_loss, compute_dtype):
        import haliax as hax
        import jax
        import jax.numpy as jnp
        from levanter.layers.attention import AttentionMask
        from levanter.models.loss import maybe_fused_next_token_loss

        del transport
        model = jax.tree.map(lambda x: x.astype(compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, model)
        Pos = self.config.max_Pos.resize(SEQ)
        with hax.axis_mapping({"batch": BATCH_AXES, "token": BATCH_AXES, "token_repeat": BATCH_AXES}):
            ids = hax.named(batch["input_ids"], ("batch", Pos.name))
            h, _ = model.activations(ids, attn_mask=AttentionMask.causal())
            weight = hax.named(jnp.ones(ids.array.shape, jnp.float32).at[:, -1].set(0.0), ids.axes)
            loss = maybe_fused_next_token_loss(
                Pos, self.config.Embed, model.Vocab, h, model.get_lm_head(), ids,
                loss_weight=weight, reduction=hax.mean, logsumexp_weight=z_loss or None,
            )
        return loss.array, {}

    def apply_router_update(self, model, aux):
        return model


def matmul_peak() -> float:
    """FLOP/s of a large bf16 `jnp.dot` on this machine: its practical matmul peak."""
    import time

    import jax
    import jax.numpy as jnp

    n = 1024
    a = jnp.ones((n, n), jnp.bfloat16)
    dot = jax.jit(lambda x: x @ x)
    dot(a).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(5):
        dot(a).block_until_ready()
    return 5 * 2 * n**3 / (time.perf_counter() - t0)


def tokens_per_second(name: str, lm, mesh, steps: int, transport: TransportPhase, data,
                      topology: RackTopology = RACKS) -> float:
    """Train `lm` for `steps` steps; a keel model trains its resolved run (the loop checks the live
    layout against the plan before the first step and stops on any difference) and the layout it
    trained is shown; Levanter's model has no plan and trains replicated."""
    import json

    from keel.train.layout import LAYOUT_FILE
    from keel.train.lm import KeelLM
    from keel.train.loop import LoopInputs, train
    from keel.spec.metrics import METRICS_FILE, read_metrics

    config = TrainConfig(batch_size=BATCH, seq_len=SEQ, num_steps=steps, optimizer=AdamWConfig(lr=3e-3),
                         eval_batches=0, eval_every=steps, rolling_checkpoint_minutes=None, compute_dtype="bfloat16",
                         transports=(transport,))
    plan = planned(lm.config, config, topology) if isinstance(lm, KeelLM) else None
    inputs = LoopInputs(lm=lm, mesh=mesh, batch_axes=BATCH_AXES, train_data=data, val_data={}, plan=plan,
                        default_transport=transport, use_wandb=False)
    with tempfile.TemporaryDirectory() as out:
        train(config, inputs, out)
        all_rates = [r["throughput/tokens_per_s"] for r in read_metrics(os.path.join(out, METRICS_FILE))
                     if "throughput/tokens_per_s" in r]
        if plan is not None:
            with open(os.path.join(out, ".keel", LAYOUT_FILE)) as f:
                leaves = json.load(f)["records"][0]["leaves"]
            mine, whole = sum(x["bytes_per_device"] for x in leaves), _whole_bytes(leaves, topology.axis_sizes)
            print(f"{'':<52} layout as planned (checked by the loop): one device holds {mine / whole:.1%} of the "
                  "train state", flush=True)
    rates = all_rates[2:]
    rate = statistics.median(rates)
    first = BATCH * SEQ / all_rates[0]
    print(f"{name:<52} {rate:10.0f} tokens/s  (median of {len(rates)} steps; first step {first:.1f}s with compiling)",
          flush=True)
    return rate


def _whole_bytes(leaves: list[dict], axis_sizes: dict[str, int]) -> int:
    """The train state's bytes on one device if nothing were split."""
    total = 0
    for leaf in leaves:
        pieces = 1
        for entry in leaf["spec"]:
            for axis in [entry] if isinstance(entry, str) else entry or []:
                pieces *= axis_sizes[axis]
        total += leaf["bytes_per_device"] * pieces
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--model", choices=("tiny", "small"), default="small")
    args = parser.parse_args()
    model = {"tiny": tiny_moe, "small": small_moe}[args.model]
    label = f"{args.model}_moe"

    from jax.sharding import AxisType, Mesh

    from keel.mesh.mesh import build_mesh
    from keel.train.lm import KeelLM

    mesh = build_mesh(RACKS)
    data = token_stream(BATCH * args.steps)
    dense = dense_twin(model)
    print(f"{label}: {model.flops_per_token(SEQ):.3g} training FLOPs/token; dense twin (shared experts "
          f"{dense.num_shared_experts} x {dense.shared_expert_dim}): {dense.flops_per_token(SEQ):.3g}")

    keel = {
        t: tokens_per_second(f"keel {label}, EP 4, {t}", KeelLM(model, mesh), mesh, args.steps, TransportPhase(0, t), data)
        for t in ("fixed_all_to_all", "ring")
    }
    fastest = max(keel, key=keel.get)
    # Levanter's Haliax MoE cannot trace under explicit mesh axes (ragged_dot has no explicit-sharding
    # rule): the same devices in the same layout, with automatic axes.
    auto_mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    qwen = tokens_per_second("Levanter Qwen3-MoE, same dims, data parallel", LevanterQwen3Moe(model, auto_mesh),
                             auto_mesh, args.steps, TransportPhase(0, "local"), data)
    plain = tokens_per_second("keel plain MoE (hero features off), EP 4, " + fastest,
                              KeelLM(plain_twin(model), mesh), mesh, args.steps, TransportPhase(0, fastest), data)
    dense_mesh = build_mesh(DENSE_RACKS)
    dense_rate = tokens_per_second("keel dense twin, same FLOPs/token", KeelLM(dense, dense_mesh), dense_mesh,
                                   args.steps, TransportPhase(0, "local"), data, DENSE_RACKS)
    peak = matmul_peak()  # the simulated devices share this machine's cores, which one large dot already uses
    achieved = keel[fastest] * model.flops_per_token(SEQ)
    print(f"CPU 'MFU': {achieved / 1e9:.2f} GFLOP/s of training against {peak / 1e9:.1f} GFLOP/s of one large bf16 "
          f"jnp.dot on this machine = {achieved / peak:.1%}")
    print(f"keel ({fastest}) / Levanter Qwen3-MoE: {keel[fastest] / qwen:.2f}x  (target >= 1.0x)")
    print(f"keel plain MoE / Levanter Qwen3-MoE:   {plain / qwen:.2f}x  (same architecture: framework vs framework)")
    print(f"keel ({fastest}) / same-FLOP dense:    {keel[fastest] / dense_rate:.2f}x  (target >= 0.9x)")


if __name__ == "__main__":
    main()
