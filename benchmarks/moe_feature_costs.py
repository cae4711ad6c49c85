"""What each hero feature of a keel MoE costs: compile time, program size, step time and FLOPs.

    uv run python benchmarks/moe_feature_costs.py [--model tiny|small] [--steps 6] [--only xsa,convs]

Baseline, in the same run: the model with every feature on (`defaults.models.tiny_moe` or
`small_moe`), trained by keel's loop on 8 simulated CPU devices (2 racks x 4, experts split 4
ways, fixed-capacity all-to-all). Each other row is that model with one feature off. For each:

- compile: the training step's XLA compile (seconds, from the loop's compile-ahead), and the size
  of the optimised program (HLO instructions of one device's module);
- step: median wall time of the steps after the first;
- FLOPs: XLA's own count for the compiled step (`cost_analysis`), every op, not only matmuls.

A feature's share of the step time against its share of the FLOPs says whether it costs more than
its arithmetic (ratio > 1: memory traffic, small ops or gathers dominate it). The ratios come last.
On 2 shared CPU cores one step's time varies by 10-20%, more than most features cost: read the
FLOP and HLO columns as exact, and the time columns over several runs (`--steps 12`).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from planned import planned  # noqa: E402

from defaults.models import small_moe, tiny_moe  # noqa: E402
from keel.spec import (
    BATCH_AXES,
    AdamWConfig,
    Balancing,
    MoELMConfig,
    RackTopology,
    Routing,
    TrainConfig,
    TransportPhase,
)

BATCH, SEQ = 16, 128
RACKS = RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4)

WITHOUT = {
    "xsa": dict(xsa=False),
    "attention gate": dict(attention_gate=False),
    "convs": dict(conv_sites=()),
    "gated norms": dict(gated_norm_rank=0),
    "latent experts": dict(latent_dim=None),
    "shared experts": dict(num_shared_experts=0, shared_expert_dim=0),
    "quantile balancing": dict(balancing=Balancing.NONE),
    "threshold routing + QB": dict(routing=Routing.SOFTMAX_TOPK, routing_renorm_sum=1.0, balancing=Balancing.NONE),
    "local/global attention": dict(global_every=None, sliding_window=None, num_global_kv_heads=None),
    "qk norm + mult": dict(qk_norm=False, qk_mult=1.0),
    "embed norm": dict(embed_norm=False),
    "partial rope": dict(rope_fraction=1.0),
}
"""Each feature, as the fields that turn it off."""


@dataclasses.dataclass
class Cost:
    compile_s: float
    instructions: int
    step_s: float
    flops: float


def measure(model: MoELMConfig, steps: int) -> Cost:
    import jax

    from keel.mesh.mesh import build_mesh
    from keel.train.batches import batch_sharding
    from keel.train.lm import KeelLM
    from keel.train.loop import LoopInputs, _Run

    mesh = build_mesh(RACKS)
    phase = TransportPhase(0, "fixed_all_to_all")
    config = TrainConfig(batch_size=BATCH, seq_len=SEQ, num_steps=steps, optimizer=AdamWConfig(lr=3e-3),
                         eval_batches=0, rolling_checkpoint_minutes=None, compute_dtype="bfloat16",
                         compilation_cache=False, transports=(phase,))
    inputs = LoopInputs(lm=KeelLM(model, mesh), mesh=mesh, batch_axes=BATCH_AXES, train_data=None, val_data={},
                        plan=planned(model, config, RACKS), use_wandb=False)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as out, jax.set_mesh(mesh):
        run = _Run(config, inputs, out)
        pending = run._step_fns[run._program_key(phase, run.layout)]
        step = pending.get()
        sharding = batch_sharding(mesh, BATCH_AXES)
        batch = {"input_ids": jax.device_put(rng.integers(0, model.vocab_size, (BATCH, SEQ), dtype=np.int32), sharding),
                 "segment_ids": jax.device_put(np.zeros((BATCH, SEQ), np.int32), sharding)}
        state, times = run.state_arrays, []
        for _ in range(steps):
            t0 = time.perf_counter()
            state, metrics = step(state, batch, run._rates(0))
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t0)
        analysis = step.cost_analysis()
        analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
        instructions = sum(1 for line in step.as_text().splitlines() if " = " in line)
    return Cost(pending.seconds, instructions, statistics.median(times[1:]), float(analysis.get("flops", 0.0)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "small"), default="tiny")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--only", default=None, help="comma-separated feature names (default: all)")
    args = parser.parse_args()
    model = {"tiny": tiny_moe, "small": small_moe}[args.model]
    names = [n.strip() for n in args.only.split(",")] if args.only else list(WITHOUT)

    full = measure(model, args.steps)
    print(f"{args.model}_moe, every feature on (the baseline): compile {full.compile_s:.1f}s, {full.instructions:,} HLO "
          f"instructions, step {full.step_s * 1e3:.0f} ms, {full.flops / 1e9:.2f} GFLOP per device step", flush=True)
    print(f"{'without':<24} {'compile':>8} {'HLO instr':>10} {'step':>8} {'GFLOP':>7}  {'time share':>10} "
          f"{'FLOP share':>10}", flush=True)
    rows = {}
    for name in names:
        cost = measure(model.replace(**WITHOUT[name]), args.steps)
        time_share = 1 - cost.step_s / full.step_s
        flop_share = 1 - cost.flops / full.flops
        rows[name] = (cost, time_share, flop_share)
        print(f"{name:<24} {cost.compile_s:7.1f}s {cost.instructions:10,} {cost.step_s * 1e3:6.0f}ms "
              f"{cost.flops / 1e9:7.2f}  {time_share:10.1%} {flop_share:10.1%}", flush=True)
    print("\nper feature, against the full model (baseline) in this run:")
    for name, (cost, time_share, flop_share) in rows.items():
        # a share below 0 is a feature whose removal adds FLOPs (the latent experts: full width instead)
        ratio = f"{time_share / flop_share:5.2f}x" if abs(flop_share) > 0.005 else "  n/a (no FLOPs to speak of)"
        print(f"  {name:<24} compile {1 - cost.compile_s / full.compile_s:6.1%}, HLO {1 - cost.instructions / full.instructions:6.1%}"
              f", step time share / FLOP share = {ratio}")


if __name__ == "__main__":
    main()
