"""A tiny mixture-of-experts LM trained end to end on your laptop, with every hero feature on.

    uv run keel run experiments/tutorials/tiny_moe.py      # a few minutes on 2 CPU cores
    uv run keel run experiments/tutorials/tiny_moe.py      # again: everything cached, seconds

The chain: the running Python's standard library -> a 1,024-token byte-level BPE -> packed
128-token sequences -> `tiny_moe` (4 layers with layer 3 global, 8 experts top-2 with threshold
routing, a 32-wide latent, 2 shared experts, quantile balancing, GatedNorms, convolutions, XSA,
attention gates) trained with the hero's grouped MuonH/AdamH/Adam optimizer on 8 simulated
devices laid out as 2 racks x 4, experts split 4 ways inside a rack. Half-way it switches expert
transport from the fixed-capacity all-to-all to the dropless ring, as the hero run did (pooled ->
ragged) at step 81,716. Results (metrics.jsonl, loss.png, checkpoints, an offline wandb run) land
under the training step's output directory. The training step runs in its own process, which
sees the 8 devices that `cpu_sim` with this topology declares; nothing here sets XLA flags.

It computes in float32 where the hero computes in bf16: a CPU without AVX512-BF16 or AMX has no
bf16 arithmetic (XLA:CPU converts around every bf16 op). On 2 cores these 300 steps trained in
117 s instead of 167 s, to the same validation loss (4.301 against 4.305 when measured). The twin
keeps bf16.
"""

from defaults import default_train, stdlib_tokens
from defaults.hardware import cpu_sim
from defaults.models import tiny_moe
from defaults.optimizers import hero_lr_law
from keel import main
from keel.spec import RackTopology, ScheduleConfig, TrainConfig, TransportPhase, WeightDecayChange

STEPS = 300

train = TrainConfig(
    batch_size=16,
    num_steps=STEPS,
    optimizer=hero_lr_law.optimizer(),
    schedule=ScheduleConfig(warmup_fraction=0.01, decay_to_fraction=0.05),
    z_loss=1e-4,
    weight_decay_change=WeightDecayChange(start_step=200, peak=0.02),
    eval_every=50,
    eval_batches=4,
    permanent_checkpoint_every=100,
    rolling_checkpoint_minutes=2.0,
    transports=(TransportPhase(0, "fixed_all_to_all"), TransportPhase(STEPS // 2, "ring")),
    compute_dtype="float32",  # bf16 is emulated on CPUs (see above)
)

model = default_train(
    "tiny_moe",
    data=stdlib_tokens(),  # 4 MB of stdlib -> a 1,024-token BPE -> 128-token sequences
    model=tiny_moe,
    train=train,
    topology=RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4),
    hardware=cpu_sim,
    description="tiny MoE, every hero feature, 2 simulated racks x 4 CPU devices",
)

if __name__ == "__main__":
    main([model])
