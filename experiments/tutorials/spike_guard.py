"""A spike guard: the tiny MoE rolls back past a loss spike and skips the batch that caused it.

    uv run keel run experiments/tutorials/spike_guard.py        # a clean run: the guard only watches
    KEEL_POISON_BATCHES=65 uv run keel run experiments/tutorials/spike_guard.py --force spike_guard

The second command spoils batch 65 (random tokens: a loss spike; `65:padding` gives a NaN
gradient instead), the fault injection `keel.train.spike_guard` documents. At step 65 the guard
sees the loss jump far above the median of the last 50 steps, goes back to its snapshot of step 60
(it keeps one in host memory every 10 steps), replays steps 60-64, skips batch 65 and trains on.
The console says so, `metrics.jsonl` has a `spike/rollback_from` row, `spike_guard.json` records
the skipped batch (a resumed run skips it too), the dashboard marks it on the loss chart, and
`keel run` / `keel status` report the step as SUCCESS with a warning naming the rollback, never as
a plain success. Without a guard the NaN would fail the run and the noise would stay in the
weights (tests/test_train_spike_guard.py measures both).

The data chain is tiny_moe.py's (`defaults.stdlib_tokens()`, so either tutorial finds it cached). The
guard's detection settings count toward the run's identity (they decide which batches are
skipped); its snapshot cadence and rollback budget are execution-only.
"""

from defaults import default_train, stdlib_tokens
from defaults.hardware import cpu_sim
from defaults.models import tiny_moe
from defaults.optimizers import hero_lr_law
from keel import main
from keel.spec import RackTopology, ScheduleConfig, SpikeGuardConfig, TrainConfig, TransportPhase

train = TrainConfig(
    batch_size=16,
    num_steps=100,
    optimizer=hero_lr_law.optimizer(),
    schedule=ScheduleConfig(warmup_fraction=0.05, decay_to_fraction=0.05),
    z_loss=1e-4,
    spike_guard=SpikeGuardConfig(
        threshold=6.0,  # a spike: this many robust deviations (one step's noise) above the median ...
        window=50,  # ... of the last 50 good steps,
        min_rise=0.05,  # and at least 5% above that median; a NaN or infinity always is one
        min_history=20,  # judged once 20 steps are known
        snapshot_every=10,  # execution-only: a host-memory copy of the train state every 10 steps
        max_rollbacks=3,  # execution-only: the 4th spike fails the step, naming every spike
    ),
    eval_every=25,
    eval_batches=4,
    rolling_checkpoint_minutes=2.0,
    transports=(TransportPhase(0, "fixed_all_to_all"),),
    compute_dtype="float32",  # bf16 is emulated on CPUs (defaults.hardware.cpu_sim)
)

model = default_train(
    "spike_guard",
    data=stdlib_tokens(),
    model=tiny_moe,
    train=train,
    topology=RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4),
    hardware=cpu_sim,
    description="tiny MoE with a spike guard, 2 simulated racks x 4 CPU devices",
)

if __name__ == "__main__":
    main([model])
