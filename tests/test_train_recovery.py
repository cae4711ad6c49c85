"""A real training step that is killed mid-run (Levanter's SIGKILL fault injection) with nobody
watching: the launcher retries it as its `Retries` declare, it resumes from its newest checkpoint,
and it ends SUCCESS with the final loss of an uninterrupted run, both attempts recorded.

The run is the own-data tutorial's (60 steps of a tiny MoE), declared with retries, checkpointing
every 10 steps; the fault fires after step 25, so the retry resumes from step 20. The uninterrupted
run is the tutorial's own, which the session trains once (`conftest.own_data`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent

EXPERIMENT = '''
import runpy

from keel import Retries, Step, main

declared = runpy.run_path("experiments/tutorials/own_data.py")["model"]
model = Step(declared.name, declared.fn, declared.config, resources=declared.resources, isolated=True,
             retries=Retries(on_failure=1, on_preemption=1), progress_timeout_s=900)

if __name__ == "__main__":
    main([model])
'''


def _keel(experiment: Path, prefix: Path, *extra: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    return subprocess.run([sys.executable, "-m", "keel.cli_entry", "run", str(experiment), "--prefix", str(prefix),
                           "--set", "train/own_notes.train.permanent_checkpoint_every=10", *extra],
                          cwd=REPO, env={**clean, **env}, capture_output=True, text=True, timeout=1800)


def _final_losses(output: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = {key: next(r[key] for r in reversed(rows) if key in r) for key in ("train/loss", "eval/loss")}
    assert sorted({r["step"] for r in rows if "train/loss" in r}) == list(range(60))  # one row per step, none twice
    return last


def test_a_killed_training_step_is_retried_and_ends_with_the_uninterrupted_loss(tmp_path, own_data):
    uninterrupted, graph = own_data  # the tutorial run as the README runs it, once for the session
    assert uninterrupted.returncode == 0, (uninterrupted.stdout + uninterrupted.stderr)[-4000:]
    expected = _final_losses(Path(next(graph.path(s) for s in graph.steps() if s.name == "train/own_notes")))

    experiment = tmp_path / "exp.py"
    experiment.write_text(EXPERIMENT)
    faulted = _keel(experiment, tmp_path / "out", LEVANTER_FAULT_KIND="sigkill", LEVANTER_FAULT_STEP="25")
    assert faulted.returncode == 0, (faulted.stdout + faulted.stderr)[-4000:]
    [output] = (tmp_path / "out").glob("train/own_notes-*")
    assert "[keel] retry train/own_notes: attempt 1 ended by preemption (the step's process was killed by SIGKILL)" in faulted.stdout
    status = json.loads((output / ".keel/status").read_text())
    assert status["state"] == "SUCCESS" and [a["state"] for a in status["attempts"]] == ["preemption"], status
    assert f"Resumed from {output}/checkpoints/step-20" in (output / ".keel/log.txt").read_text()  # the newest before step 25
    assert _final_losses(output) == pytest.approx(expected, rel=1e-5)
