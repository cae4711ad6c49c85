"""Predict a run's loss before training it: a scaling ladder of four tiny MoEs, then the fifth, bigger one.

    uv run keel run experiments/tutorials/scaling_ladder.py       # 4 rungs, the fit, then the target run
    uv run keel compare experiments/tutorials/scaling_ladder.py   # the target's actual loss against its band

The rungs are the tiny MoE at hidden 32, 48, 64 and 96, each trained for more steps than the last
(their compute spans about 4.7x); the fit step `ladder/tiny` fits L(C) = E + A (C/C0)^-alpha to their
final validation losses and predicts hidden 128 trained for 64 steps (about 1.7x the largest rung's
compute). The target declares that prediction (`predicted_loss=`), so it trains after the fit and
`keel plan`, `status`, `compare` and the dashboard show its actual loss against the band; the step
`ladder/tiny/check` prints the prediction error. Learning
rates follow the scaling law at each rung's width and tokens. The data chain is tiny_moe.py's.
"""

from defaults import default_scaling_ladder, default_train, stdlib_tokens
from defaults.hardware import cpu_sim
from defaults.models import tiny_moe
from defaults.optimizers import hero_lr_law
from keel import main
from keel.spec import RackTopology, ScheduleConfig, TrainConfig, TransportPhase

SIZES, STEPS, TARGET = (32, 48, 64, 96), (24, 32, 40, 48), (128, 64)
tokens = stdlib_tokens()

topology = RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4)
train = TrainConfig(
    batch_size=8,
    num_steps=STEPS[0],  # each rung sets its own steps; the law gives each its learning rates
    optimizer=hero_lr_law.optimizer(),
    schedule=ScheduleConfig(warmup_fraction=0.1, decay_to_fraction=0.05),
    z_loss=1e-4,
    eval_batches=8,
    rolling_checkpoint_minutes=None,
    transports=(TransportPhase(0, "fixed_all_to_all"),),
    compute_dtype="float32",  # bf16 is emulated on CPUs (defaults.hardware.cpu_sim)
)
ladder = default_scaling_ladder("tiny", data=tokens, model=tiny_moe, train=train, sizes=SIZES, steps=STEPS,
                                target=TARGET, topology=topology, hardware=cpu_sim)
target = default_train("ladder/tiny/target", data=tokens, model=ladder.target_model, train=ladder.target_train,
                       topology=topology, hardware=cpu_sim, predicted_loss=ladder.prediction,
                       description=f"hidden {TARGET[0]}, {TARGET[1]} steps: the run the ladder predicts")

check = ladder.check(target)  # prints the prediction error once the target has trained

if __name__ == "__main__":
    main([check])
