"""The README's 'Your own data' example, run as a user runs it: a shipped .jsonl corpus -> documents
-> tokenizer -> token cache -> a tiny MoE that learns, its bad lines counted, then everything cached."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from keel.data import read_summary
from keel.executor.status import keel_path
from keel.spec.metrics import latest_by_step, METRICS_FILE, read_metrics

REPO = Path(__file__).resolve().parent.parent
TUTORIAL = "experiments/tutorials/own_data.py"
CORPUS = REPO / "experiments/tutorials/data/own_corpus.jsonl"


def test_the_shipped_corpus_is_what_its_script_makes(tmp_path):
    out = tmp_path / "corpus.jsonl"
    subprocess.run([sys.executable, str(REPO / "experiments/tutorials/data/make_own_corpus.py"), str(out)], check=True,
                   capture_output=True)
    assert out.read_bytes() == CORPUS.read_bytes() and CORPUS.stat().st_size < 200_000


def test_the_readme_walks_through_the_tutorial():
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Your own data"):]
    assert f"uv run --locked keel run {TUTORIAL}" in section
    for topic in ("text_field", "validation_fraction", "max_bad_fraction", "on_decode_error", "summary.json",
                  "input_version", "stale"):
        assert topic in section, topic


@pytest.mark.slow
def test_the_own_data_tutorial_trains_on_the_shipped_corpus_then_everything_is_cached(own_data):
    from test_step_isolation import keel

    done, graph = own_data  # run once for the session (conftest.py), on its shared prefix
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    paths = {s.name: graph.path(s) for s in graph.steps()}
    logged = Path(keel_path(paths["documents/own-notes"], "log.txt")).read_text()  # what the step printed
    assert "documents: 300 (" in logged
    assert f"skipped 1 of 301 records (0.3%): 1 not valid JSON (first: {CORPUS}:120" in logged
    assert f"repaired 1: 1 not valid UTF-8, bytes replaced with U+FFFD (first: {CORPUS}:240" in logged

    documents = read_summary(paths["documents/own-notes"])
    assert documents["documents"] == 300 and documents["skipped"]["not valid JSON"]["count"] == 1
    assert documents["splits"]["validation"]["documents"] > 0
    assert read_summary(paths["tokenizers/own-notes-bpe-384"])["warnings"] == []  # the vocabulary asked for, no less
    evals = latest_by_step(read_metrics(os.path.join(paths["train/own_notes"], METRICS_FILE)), "eval/loss")
    assert len(evals) >= 2 and evals[max(evals)] < 0.8 * evals[0], evals  # it learned

    again = keel("run", TUTORIAL, "--prefix", graph.prefix, timeout=120)
    assert again.returncode == 0 and "0 ran, 0 reused, 4 cached" in again.stdout, again.stdout + again.stderr
