"""A user's two-point sweep: one data chain, the tiny MoE at 1.0x and 0.5x the scaling-law LR.

Both training steps run at once under default options (each in its own process); nothing here sets
XLA flags: the declared hardware decides each step's devices.
"""

import os

from defaults import default_tokenize, default_tokenizer, default_train, stdlib_corpus
from defaults.hardware import cpu_sim
from defaults.models import tiny_moe
from defaults.optimizers import hero_lr_law
from keel import main
from keel.spec import RackTopology, TrainConfig

BATCH, SEQ = 16, 64
STEPS = int(os.environ.get("SWEEP_STEPS", "6"))

corpus = stdlib_corpus(max_bytes=400_000)
tokenizer = default_tokenizer("stdlib-bpe-1k", corpus, vocab_size=tiny_moe.vocab_size)
tokens = default_tokenize("stdlib-bpe-1k-64", corpus, tokenizer, seq_len=SEQ)
def point(scale: float):
    optimizer = hero_lr_law.optimizer(scale=scale)
    train = TrainConfig(batch_size=BATCH, seq_len=SEQ, num_steps=STEPS, optimizer=optimizer, eval_every=STEPS,
                        eval_batches=0, rolling_checkpoint_minutes=None,  # 400 KB of stdlib: no validation split
                        compute_dtype="float32")
    return default_train(f"sweep/lr{scale}", data=tokens, model=tiny_moe, train=train,
                         topology=RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4), hardware=cpu_sim)


if __name__ == "__main__":
    main([point(1.0), point(0.5)])
