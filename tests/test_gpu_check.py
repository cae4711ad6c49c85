"""benchmarks/gpu_check.py runs on CPU at small size, from a clean environment, and every check passes."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_passes_at_small_size_on_cpu():
    # The conftest's XLA_FLAGS / JAX_PLATFORMS are removed: the script must set up its own simulated
    # devices before importing jax when no accelerator is present.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--size", "small"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"gpu_check failed (rc {proc.returncode}):\n{out}\n{proc.stderr[-4000:]}"
    assert "platform cpu, 8 devices" in out  # the simulated racks, set up by the script itself
    rows = dict(re.findall(r"^(transport \S+|mfu \S.*?|window \(\S+\))\s+(PASS|FAIL|SKIP)\s", out, re.M))
    transports = {"local", "fixed_all_to_all", "ring", "fixed_pooled_all_to_all"}
    assert {f"transport {t}" for t in transports} <= {k for k, v in rows.items() if v == "PASS"}, out
    assert rows["transport ragged_all_to_all"] == "SKIP", out  # XLA:CPU has no ragged-all-to-all
    assert rows["mfu hero MoE layer"] == "PASS", out
    assert rows["window (jax_flash)"] == "PASS", out  # the hero's declared backend
    assert "FAIL" not in rows.values(), out
    last = out.strip().splitlines()[-1]
    assert re.match(r"achieved [\d.]+ GFLOP/s = [\d.]+x the calibrated jnp\.dot", last), last
