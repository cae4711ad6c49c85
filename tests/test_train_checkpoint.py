"""Checkpoint policies under a step's output path: rolling by time (newest kept) and permanent every N."""

import os

import jax.numpy as jnp
import numpy as np

from keel.train.checkpoint import TrainCheckpoints, restore_like


def test_rolling_checkpoints_keep_only_the_newest_and_permanent_ones_stay(tmp_path):
    checkpoints = TrainCheckpoints(str(tmp_path), every_steps=3, rolling_minutes=1e-6)  # roll after every step
    for step in range(1, 6):
        checkpoints.on_step({"w": jnp.full((4,), float(step))}, step)
        checkpoints.wait()
    saved = sorted(os.listdir(tmp_path / "checkpoints"))
    assert saved == ["step-3", "step-5"], saved  # step 3 is permanent; 1, 2 and 4 were rolled away
    latest = checkpoints.latest()
    assert latest.endswith("step-5")
    restored = restore_like({"w": jnp.zeros((4,))}, latest)
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.full((4,), 5.0))
