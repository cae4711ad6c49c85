"""Test-session environment: 8 simulated CPU devices (2 racks x 4), offline hubs and trackers,
and one JAX compilation cache for the session.

Set before anything imports jax, so every test sees the same simulated machine. Many tests train
the same small models (in this process, in pytest-xdist's other worker, in `keel run` children):
a program compiles once per session and later tests load it (`JAX_COMPILATION_CACHE_DIR`, which
keel's training step honours). Tests of what a user runs (`test_step_isolation.user_env`) leave it
out, as they leave out `XLA_FLAGS`.
"""

import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
_MAKES_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ  # pytest-xdist's workers inherit the controller's
if _MAKES_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="keel-test-jax-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def pytest_sessionfinish(session):
    """The process that made the session's compilation cache removes it."""
    if _MAKES_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
