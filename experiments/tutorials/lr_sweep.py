"""Sweep, compare, evaluate, sample: the tiny MoE at three learning-rate scales.

    uv run keel run experiments/tutorials/lr_sweep.py       # 3 short runs, then the steps below
    uv run keel compare experiments/tutorials/lr_sweep.py   # the table of finished runs; runs nothing

The data chain is tiny_moe.py's (`defaults.stdlib_tokens()`: the same three steps, hence the same
identities), so after either tutorial the other finds its corpus, tokenizer and token cache cached. Each point scales
the scaling-law learning rates (MuonH's and Adam's together) and trains for STEPS steps (30: a
quick look that CI can afford; raise it for a real sweep, every step below follows). Then:

- `compare/lr_sweep` writes comparison.md / .json (final and best validation loss, tokens/s, wall
  time, the config fields that differ) and comparison.png (every loss curve in one plot);
- `eval/lr_sweep/lr1.0` evaluates the scaling-law point's final checkpoint on the validation
  cache (loss, perplexity, bits per byte) -> eval.json;
- `sample/lr_sweep/lr1.0` completes two prompts with it -> samples.jsonl (and the log).
"""

from defaults import default_compare, default_eval, default_sample, default_train, stdlib_tokens
from defaults.hardware import cpu_sim
from defaults.models import tiny_moe
from defaults.optimizers import hero_lr_law
from keel import main
from keel.spec import RackTopology, ScheduleConfig, TrainConfig, TransportPhase

STEPS, SCALES = 30, (0.5, 1.0, 2.0)
tokens = stdlib_tokens()

def point(scale: float):
    """The tiny MoE trained at `scale` x the scaling-law learning rates."""
    train = TrainConfig(
        batch_size=16,
        num_steps=STEPS,
        optimizer=hero_lr_law.optimizer(scale=scale),
        schedule=ScheduleConfig(warmup_fraction=0.1, decay_to_fraction=0.05),
        z_loss=1e-4,
        evaluations=3,
        eval_batches=4,
        rolling_checkpoint_minutes=None,
        transports=(TransportPhase(0, "fixed_all_to_all"),),
        compute_dtype="float32",  # bf16 is emulated on CPUs (defaults.hardware.cpu_sim)
    )
    return default_train(f"lr_sweep/lr{scale}", data=tokens, model=tiny_moe, train=train,
                         topology=RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4), hardware=cpu_sim,
                         description=f"tiny MoE at {scale}x the scaling-law learning rates")


runs = {scale: point(scale) for scale in SCALES}
comparison = default_compare("lr_sweep", runs=list(runs.values()))
evaluation = default_eval("lr_sweep/lr1.0", run=runs[1.0], data={"stdlib": tokens})
samples = default_sample("lr_sweep/lr1.0", run=runs[1.0], prompts=("def ", "import os\n"), max_tokens=48,
                         temperature=0.8, seed=0)

if __name__ == "__main__":
    main([comparison, evaluation, samples])
