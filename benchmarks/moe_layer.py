"""One MoE layer, forward + backward, on this CPU: keel's transports and block against baselines.

Two baselines in the same run, each at equal dims:

1. A dense SwiGLU with the same active FLOPs (intermediate = experts_per_token x expert_dim), on
   the same 2 racks x 4 simulated-device mesh with the batch split over every device. Each keel
   transport runs the full keel MoE layer (fp32 router, top-k, balance statistics, dispatch).
   Speed ratio = dense time / MoE time (target: the best CPU transport >= 0.8).
2. Levanter's Haliax Qwen3-MoE sparse block (`levanter.models.qwen3_moe`) against keel's block
   with the `local` transport, both on one device (Levanter's Haliax MoE has no expert
   parallelism to compare against). Speed ratio = Qwen3 time / keel time (target >= 1.2).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 uv run python benchmarks/moe_layer.py

Times are the best of `--repeats` steps after a compile-and-warm-up call, the variants taking turns
(the best, not the median, because other jobs share this machine's two cores); ratios print last.
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import time  # noqa: E402

import equinox as eqx  # noqa: E402
import haliax as hax  # noqa: E402
import haliax.nn as hnn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from keel.mesh.mesh import build_mesh, shard_batch, tree_shardings, use_mesh  # noqa: E402
from keel.spec.topology import MESH_AXES, RackTopology  # noqa: E402
from keel.spec.model import MoELMConfig  # noqa: E402
from keel.model.layout import gathered  # noqa: E402
from keel.model.moe import LatentMoE  # noqa: E402
from keel.spec.transports import TransportSpec  # noqa: E402

TRANSPORTS = {
    "local": TransportSpec("local"),
    "fixed_all_to_all": TransportSpec("fixed_all_to_all"),
    "fixed_pooled_all_to_all": TransportSpec("fixed_pooled_all_to_all"),  # the model's capacity, like fixed_all_to_all
    "ring": TransportSpec("ring"),
}


def time_round_robin(steps: dict, repeats: int) -> dict[str, float]:
    """Best time of each step; the steps take turns, so background load hits them alike."""
    for context, fn, args in steps.values():
        with context():
            jax.block_until_ready(fn(*args))  # compile and warm up
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(repeats):
        for name, (context, fn, args) in steps.items():
            with context():
                start = time.perf_counter()
                jax.block_until_ready(fn(*args))
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def fwd_bwd(apply):
    """jit(grad) of <apply(module, x), cotangent> with respect to the module and x."""

    def objective(module, x, cotangent):
        return hax.sum(apply(module, x) * cotangent).array

    return eqx.filter_jit(eqx.filter_grad(objective))


class DenseSwiGLU(eqx.Module):
    gate: hax.NamedArray
    up: hax.NamedArray
    down: hax.NamedArray

    @staticmethod
    def init(Embed, Mlp, key):
        k1, k2, k3 = jax.random.split(key, 3)
        scale = 0.5 / Embed.size**0.5
        return DenseSwiGLU(
            hax.random.normal(k1, (Embed, Mlp)) * scale,
            hax.random.normal(k2, (Embed, Mlp)) * scale,
            hax.random.normal(k3, (Mlp, Embed)) * scale,
        )

    def __call__(self, x):
        Embed, Mlp = self.gate.axes
        return hax.dot(hnn.silu(hax.dot(x, self.gate, axis=Embed)) * hax.dot(x, self.up, axis=Embed), self.down, axis=Mlp)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--expert-dim", type=int, default=256)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    config = MoELMConfig(
        hidden_dim=args.hidden, num_layers=1, vocab_size=8, max_seq_len=512, num_heads=1, head_dim=8, num_kv_heads=1,
        num_experts=args.experts, experts_per_token=args.topk, expert_dim=args.expert_dim,
        routing="sigmoid_topk_threshold", routing_renorm_sum=float(args.topk), capacity_factor=args.capacity_factor,
    )
    seq = 512
    Batch, Pos = hax.Axis("batch", args.tokens // seq), hax.Axis("position", seq)
    Embed = hax.Axis("embed", args.hidden)
    key_x, key_ct, key_moe, key_dense, key_qwen = jax.random.split(jax.random.PRNGKey(0), 5)
    x = hax.random.normal(key_x, (Batch, Pos, Embed))
    cotangent = hax.random.normal(key_ct, (Batch, Pos, Embed))
    valid = hax.ones((Batch, Pos), dtype=bool)
    moe = LatentMoE.init(config, key=key_moe)
    dense = DenseSwiGLU.init(Embed, hax.Axis("mlp", args.topk * args.expert_dim), key_dense)
    print(f"{args.tokens} tokens, hidden {args.hidden}, {args.experts} experts top-{args.topk}, expert dim "
          f"{args.expert_dim}, capacity factor {args.capacity_factor}; dense SwiGLU intermediate {args.topk * args.expert_dim}")

    mesh = build_mesh(RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4))
    on_racks = lambda: use_mesh(mesh)  # noqa: E731
    one_device = jax.devices()[:1]
    on_one = lambda: use_mesh(build_mesh(RackTopology(racks=1, gpus_per_rack=1), devices=one_device))  # noqa: E731
    # Levanter's block routes inside shard_maps, so it needs a mesh, and one with Auto axes (its
    # ragged_dot has no explicit-sharding rule).
    on_one_auto = lambda: jax.set_mesh(Mesh(np.array(one_device).reshape(1, 1, 1, 1), MESH_AXES))  # noqa: E731

    steps: dict[str, tuple] = {}  # name -> (mesh context, fn, args)
    with on_racks():
        xs, cts, vs = shard_batch(x, mesh), shard_batch(cotangent, mesh), shard_batch(valid, mesh)
        dense_s = jax.device_put(dense, tree_shardings(dense, mesh))
        moe_s = jax.device_put(moe, tree_shardings(moe, mesh))
        steps["dense SwiGLU (2x4 mesh)"] = (on_racks, fwd_bwd(lambda m, x: gathered(m)(x)), (dense_s, xs, cts))
        drops = {}
        for name, spec in TRANSPORTS.items():
            apply = lambda m, x, spec=spec: gathered(m)(x, vs, transport=spec)[0]  # noqa: E731
            steps[f"keel MoE, {name} (2x4 mesh)"] = (on_racks, fwd_bwd(apply), (moe_s, xs, cts))
            _, stats = jax.jit(lambda m, x, spec=spec: gathered(m)(x, vs, transport=spec))(moe_s, xs)
            drops[name] = float(stats["dropped_fraction"].array)
    keel_local = lambda m, x: m(x, valid, transport=TRANSPORTS["local"])[0]  # noqa: E731
    steps["keel MoE, local (1 device)"] = (on_one, fwd_bwd(keel_local), (moe, x, cotangent))
    with on_one_auto():
        qwen_block = _qwen3_block(args, key_qwen)
    steps["Levanter Qwen3-MoE block (1 device)"] = (on_one_auto, fwd_bwd(lambda m, x: m(x)[0]), (qwen_block, x, cotangent))
    results = time_round_robin(steps, repeats=args.repeats)

    print()
    for name, seconds in results.items():
        print(f"{name:42s} {seconds * 1000:9.1f} ms")
    print("dropped assignments: " + ", ".join(f"{k} {v:.2%}" for k, v in drops.items()))
    print()
    dense_time = results["dense SwiGLU (2x4 mesh)"]
    for name in TRANSPORTS:
        t = results[f"keel MoE, {name} (2x4 mesh)"]
        print(f"ratio dense/{name}: {dense_time / t:.2f}x dense speed")
    print(f"ratio Qwen3-MoE/keel block: {results['Levanter Qwen3-MoE block (1 device)'] / results['keel MoE, local (1 device)']:.2f}x")


def _qwen3_block(args, key):
    from levanter.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_dim=args.hidden, moe_intermediate_dim=args.expert_dim, num_experts=args.experts,
        num_experts_per_tok=args.topk, max_seq_len=512, num_heads=1, num_kv_heads=1, head_dim=8,
    )
    return Qwen3MoeSparseMoeBlock.init(config, key=key)


if __name__ == "__main__":
    main()
