"""Step time of the tiny keel MoE with host offload against the same run without it.

    uv run python benchmarks/host_offload.py [--steps 12] [--repeats 2]

Every run trains keel `tiny_moe` with keel's loop (AdamW, bf16 compute, fp32 master weights) on 8
simulated CPU devices as 2 racks x 4, experts split 4 ways, fixed-capacity all-to-all, on the same
synthetic token stream. Only `TrainConfig.host_offload` differs:

- baseline: `HostOffload()`, the whole train state in device memory;
- optimizer state in `pinned_host` (`HostOffload(optimizer_state=True)`), copied in and out by
  every step;
- master weights and optimizer state in `pinned_host` for the whole run (the hero's layout
  before its `master_weights_until_step`).

Reported: median seconds per step over the steps after the first two of every run (compilation
and warm-up excluded), the variants run in turn `--repeats` times so that a shared machine's load
falls on all of them alike; the ratios to the baseline come last. On CPU "host" and "device" memory are the same
RAM, so the ratio is the cost of the extra copies and of the executable's layout, not of a PCIe
link: read it as an upper bound on the loop's overhead, not as a GPU figure.
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

from defaults.models import tiny_moe  # noqa: E402
from keel.spec import BATCH_AXES, AdamWConfig, HostOffload, RackTopology, TrainConfig, TransportPhase

BATCH, SEQ = 16, 128
RACKS = RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4)
BASELINE = "baseline: all state on device"


def token_stream(n: int, seed: int = 0):
    from levanter.data.dataset import ListAsyncDataset

    ids = np.random.default_rng(seed).integers(0, tiny_moe.vocab_size, (n, SEQ), dtype=np.int32)
    return ListAsyncDataset([{"input_ids": row, "segment_ids": np.zeros(SEQ, np.int32)} for row in ids])


def step_times(host_offload: HostOffload, mesh, steps: int, data) -> list[float]:
    """Seconds per step of one fresh run, its first two steps dropped."""
    from keel.train.lm import KeelLM
    from keel.train.loop import LoopInputs, train
    from keel.spec.metrics import METRICS_FILE, read_metrics

    config = TrainConfig(batch_size=BATCH, seq_len=SEQ, num_steps=steps, optimizer=AdamWConfig(lr=3e-3),
                         eval_batches=0, eval_every=steps, rolling_checkpoint_minutes=None, compute_dtype="bfloat16",
                         host_offload=host_offload, transports=(TransportPhase(0, "fixed_all_to_all"),))
    inputs = LoopInputs(lm=KeelLM(tiny_moe, mesh), mesh=mesh, batch_axes=BATCH_AXES, train_data=data, val_data={},
                        plan=planned(tiny_moe, config, RACKS), use_wandb=False)
    with tempfile.TemporaryDirectory() as out:
        train(config, inputs, out)
        return [config.tokens_per_step / r["throughput/tokens_per_s"]
                for r in read_metrics(os.path.join(out, METRICS_FILE)) if "throughput/tokens_per_s" in r][2:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    from keel.mesh.mesh import build_mesh
    from keel.train import offload

    mesh = build_mesh(RACKS)
    data = token_stream(BATCH * args.steps)
    variants = {
        BASELINE: HostOffload(),
        "optimizer state on host": HostOffload(optimizer_state=True),
        "master weights + optimizer state on host": HostOffload(master_weights_until_step=args.steps,
                                                                optimizer_state=True),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(args.repeats):
        for name, host_offload in variants.items():
            run = step_times(host_offload, mesh, args.steps, data)
            times[name] += run
            print(f"run {repeat + 1}: {name:<42} {statistics.median(run) * 1e3:8.1f} ms/step", flush=True)
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, host_offload in variants.items():
        print(f"{name:<46} {medians[name] * 1e3:8.1f} ms/step  (median of {len(times[name])} steps; "
              f"{offload.layout_at(host_offload, 0)})")
    for name in variants:
        if name != BASELINE:
            print(f"step time, {name} / baseline: {medians[name] / medians[BASELINE]:.2f}x")


if __name__ == "__main__":
    main()
