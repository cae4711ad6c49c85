"""summary.json beside a data step's manifest: what the step produced and what it lost, in numbers.

Every data step (documents, tokenizer, tokenize) writes one into its output's `.keel/` folder and
prints its one-line form on the console, so a loss is seen where the run is watched and kept
where the output is (`keel.data.read_summary(output_path)`).
"""

from __future__ import annotations

from keel.executor import storage
from keel.executor.status import keel_path

SUMMARY_FILE = "summary.json"


def write_summary(output_path: str, summary: dict, line: str) -> None:
    storage.write_json(keel_path(output_path, SUMMARY_FILE), summary)
    print(line, flush=True)


def read_summary(output_path: str) -> dict | None:
    return storage.read_json(keel_path(output_path, SUMMARY_FILE))
