"""A real corpus present on every machine: the running Python's standard-library sources.

About 30 MB of code and docstrings for CPython 3.12 (half of it under `test/`). The content differs
between Python releases, so the full version (and the implementation) are fields of the config and
therefore of the step's identity: a default taken from the interpreter that declares the step, and
checked against the interpreter that runs it. The version stands for the files' contents in the
identity: the step does not fingerprint its ~2,000 source files (`keel.executor.inputs`), since a
Python release fixes them and a plan need not stat them all. Files are read in sorted
relative-path order, which makes the `max_files` / `max_bytes` caps (for fast tests and
tutorials) deterministic too: the corpus ends before the first file that would exceed a cap.
"""

from __future__ import annotations

import os
import platform
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field

from keel.data.documents import Document, check_validation_fraction, write_documents
from keel.data.quality import BadRecord, RecordLog
from keel.executor.step import this_output

_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class StdlibCorpusConfig:
    python_version: str = field(default_factory=platform.python_version)
    python_implementation: str = field(default_factory=platform.python_implementation)
    include_tests: bool = True
    max_files: int | None = None
    max_bytes: int | None = None
    validation_fraction: float = 0.01
    shard_bytes: int = 8 * 2**20
    output_path: str = this_output()

    def __post_init__(self):
        check_validation_fraction(self.validation_fraction)
        for name in ("max_files", "max_bytes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"StdlibCorpusConfig.{name} must be positive or None, got {value}")


def stdlib_files(include_tests: bool) -> list[str]:
    """Relative paths of the standard library's .py files, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _SKIPPED_DIRS]
        relative_dir = os.path.relpath(directory, root).replace(os.sep, "/")
        parts = [] if relative_dir == "." else relative_dir.split("/")
        if not include_tests and any(p in ("test", "tests", "idle_test") for p in parts):
            continue
        found.extend("/".join([*parts, f]) for f in files if f.endswith(".py"))
    return sorted(found)


def _documents(config: StdlibCorpusConfig, log: RecordLog) -> Iterator[Document]:
    root = sysconfig.get_paths()["stdlib"]
    total_bytes = 0
    for count, relative in enumerate(stdlib_files(config.include_tests)):
        if config.max_files is not None and count >= config.max_files:
            return
        with open(os.path.join(root, relative), "rb") as f:
            data = f.read()
        if config.max_bytes is not None and total_bytes + len(data) > config.max_bytes:
            return
        total_bytes += len(data)
        log.look()
        try:
            yield Document(f"stdlib/{relative}", data.decode("utf-8"))
        except UnicodeDecodeError as e:  # a few test files are deliberately in other encodings: skipped, counted
            log.skip(BadRecord(relative, data.count(b"\n", 0, e.start) + 1, "file not valid UTF-8", e.reason))


def build_stdlib_corpus(config: StdlibCorpusConfig) -> None:
    """Step function: write the standard library's sources as a keel document set."""
    running = (platform.python_version(), platform.python_implementation())
    if running != (config.python_version, config.python_implementation):
        raise RuntimeError(
            f"StdlibCorpusConfig asks for {config.python_implementation} {config.python_version}'s standard "
            f"library but this step runs on {running[1]} {running[0]}: run it with that Python, or declare "
            f"python_version={running[0]!r} (a different corpus, so a different output)"
        )
    log = RecordLog()  # no limit on skipped files: the few that are not UTF-8 are known, and counted
    write_documents(
        config.output_path,
        _documents(config, log),
        validation_fraction=config.validation_fraction,
        shard_bytes=config.shard_bytes,
        log=log,
        source={"stdlib": sysconfig.get_paths()["stdlib"], "python": " ".join(running)},
        what=f"the standard library (max_files={config.max_files}, max_bytes={config.max_bytes})",
    )
