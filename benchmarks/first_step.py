"""Time to first step: how long a training step's process takes to finish its first step, cold and
on a resume with the step's compilation cache, for the README's main job and the hero twin.

Each experiment runs through `keel run` as a user runs it (no XLA_FLAGS, a fresh prefix). The
training step prints "first step done Ns after the process started" (`keel.train.progress`); once
it has, the benchmark stops keel with Ctrl-C (SIGINT: the step checkpoints and is INTERRUPTED),
runs the same command again, which resumes from that checkpoint with the programs the first
process left in the compilation cache (the machine's, here a fresh one under the benchmark's
folder for each experiment: `XDG_CACHE_HOME`, so the twin's cold run loads no program tiny_moe
compiled), and reads the line again. The twin runs after tiny_moe in the same prefix, so it reuses
tiny_moe's token cache and the data steps cost neither anything.

Baseline in the same run: a fresh interpreter that imports what a training step imports
(`keel.train.step`: jax, Levanter, Haliax, optax, wandb) and lists its 8 simulated devices, the
floor no training step goes under. Targets (issue 22, a quiet 2-core machine): tiny_moe 15 s,
twin 25 s, a resume with the cache 5 s. The machine's load is printed first; the ratios last.

    uv run python benchmarks/first_step.py [--only tiny_moe|twin]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = {
    "tiny_moe": ["experiments/tutorials/tiny_moe.py"],
    "twin": ["experiments/hero_535b.py", "--scale", "tiny"],
}
TARGETS = {"tiny_moe": 15.0, "twin": 25.0}
CACHED_TARGET = 5.0
FIRST_STEP = re.compile(r"first step done ([0-9.]+)s after the process started")
TRAIN_START = re.compile(r"start (train/\S+) -> (\S+)")


def user_env(cache_home: str | None = None) -> dict[str, str]:
    """The user's environment: no simulated devices or compilation cache set from outside; with
    `cache_home`, a machine whose caches start empty there (keel's own cache folder too, which
    `$KEEL_CACHE_DIR` would otherwise put elsewhere)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_PLATFORMS") and not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT"))}
    if not cache_home:
        return env
    env.pop("KEEL_CACHE_DIR", None)
    return {**env, "XDG_CACHE_HOME": cache_home}


def keel_command() -> list[str]:
    uv = shutil.which("uv")
    return [uv, "run", "--locked", "keel"] if uv else [sys.executable, "-m", "keel.cli_entry"]


def first_step(args: list[str], prefix: str, cache_home: str, timeout: float, earlier: int) -> float:
    """Run `keel run ARGS` on a machine whose caches are under `cache_home`, read its training step's
    first-step time (the log, which every attempt appends to, already holds `earlier` such lines),
    then stop it with Ctrl-C."""
    console = Path(prefix) / f"console-{time.monotonic_ns()}.txt"
    with open(console, "w") as out:
        proc = subprocess.Popen([*keel_command(), "run", *args, "--prefix", prefix], cwd=REPO,
                                env=user_env(cache_home),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = console.read_text()
            started = TRAIN_START.search(text)
            log = Path(started.group(2)) / ".keel" / "log.txt" if started else None
            found = FIRST_STEP.findall(log.read_text()) if log is not None and log.exists() else []
            if len(found) > earlier:
                return float(found[earlier])
            if proc.poll() is not None:
                raise RuntimeError(f"keel run {' '.join(args)} ended (exit {proc.returncode}) before a first step:\n"
                                   + text[-3000:])
            time.sleep(0.5)
        raise TimeoutError(f"no first step within {timeout:.0f}s: {console}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # the step checkpoints and stops; keel exits 130
            try:
                proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def import_floor() -> float:
    """Seconds for a fresh interpreter to import the training step's stack and list 8 devices: the
    median of 3, after one that warms the page cache."""
    code = ("import os; os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'; "
            "import keel.train.step, jax; assert len(jax.devices()) == 8")
    times = []
    for _ in range(4):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, env=user_env())
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(EXPERIMENTS), action="append")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take to its first step")
    args = parser.parse_args()
    names = args.only or list(EXPERIMENTS)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    floor = import_floor()
    print(f"baseline: a fresh interpreter imports the training stack and lists 8 devices in {floor:.1f}s")
    results = {}
    with tempfile.TemporaryDirectory(prefix="keel-first-step-") as prefix:
        for name in names:
            cache_home = os.path.join(prefix, f"cache-{name}")
            cold = first_step(EXPERIMENTS[name], prefix, cache_home, args.timeout, earlier=0)
            cached = first_step(EXPERIMENTS[name], prefix, cache_home, args.timeout, earlier=1)
            results[name] = (cold, cached)
            print(f"{name}: first step {cold:.1f}s after its process started (target {TARGETS[name]:.0f}s); "
                  f"resumed with the compilation cache {cached:.1f}s (target {CACHED_TARGET:.0f}s)")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    for name, (cold, cached) in results.items():
        print(f"ratio {name} first step / import floor: cold {cold / floor:.1f}x, cached {cached / floor:.1f}x; "
              f"/ target: cold {cold / TARGETS[name]:.2f}x, cached {cached / CACHED_TARGET:.2f}x")


if __name__ == "__main__":
    main()
