"""Runs one micro-model training in its own process (for kill -9 tests): `python train_driver.py OUT CONFIG_JSON`."""

import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("WANDB_MODE", "offline")
sys.path.insert(0, os.path.dirname(__file__))


def main(output_path: str, config_json: str) -> None:
    from train_standin import loop_inputs

    from keel.spec.train import AdamWConfig, TrainConfig
    from keel.train.loop import train

    fields = json.loads(config_json)
    delay = fields.pop("delay_per_item", 0.0)
    config = TrainConfig(optimizer=AdamWConfig(lr=1e-2), **fields)
    train(config, loop_inputs(config, delay_per_item=delay, use_wandb=False), output_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
