"""How long `keel plan` takes on the hero, against a bare Python interpreter start.

Planning must stay instant (no jax, levanter or haliax is imported; the tests check that). Two
figures, each the best of `--repeats` fresh processes:

- `keel plan experiments/hero_535b.py --json`, the whole process (interpreter, CLI start,
  loading the experiment file, fact sheet); target < 10 s on this shared machine;
- the fact sheet alone inside a process (`fact_sheets_for(load_experiment(...))`, timed after
  keel's CLI module is imported); target < 1 s.

Baseline: `python -c pass`, the cost of starting the interpreter at all. The ratio printed last is
the whole `keel plan` process over that baseline.

    uv run python benchmarks/plan_latency.py [--repeats 3]
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERO = str(ROOT / "experiments" / "hero_535b.py")
IN_PROCESS = (
    "import time\nfrom keel.cli import load_experiment\nt = time.perf_counter()\n"
    "from keel.plan import fact_sheets_for\n"
    f"fact_sheets_for(load_experiment({HERO!r}))\n"
    "print(time.perf_counter() - t)\n"
)


def wall(cmd: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    keel = str(Path(sys.executable).parent / "keel")
    plan_cmd = [keel, "plan", HERO, "--json", "--prefix", "/tmp/keel-hero-plan"]
    bare, plan, sheet = [], [], []
    for _ in range(args.repeats):  # alternated, so machine load hits all three alike
        bare.append(wall([sys.executable, "-c", "pass"]))
        plan.append(wall(plan_cmd))
        out = subprocess.run([sys.executable, "-c", IN_PROCESS], check=True, capture_output=True, text=True, cwd=ROOT)
        sheet.append(float(out.stdout))
    print(f"keel plan hero, whole process: {min(plan):7.3f} s  (target < 10 s)")
    print(f"hero fact sheet, in process:   {min(sheet):7.3f} s  (target < 1 s)")
    print(f"python -c pass (baseline):     {min(bare):7.3f} s")
    print(f"ratio keel plan / bare interpreter: {min(plan) / min(bare):.1f}x")


if __name__ == "__main__":
    main()
