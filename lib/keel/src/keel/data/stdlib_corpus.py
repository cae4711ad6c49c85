"""A real corpus present on every machine: the running Python's standard-library sources.

About 30 MB of code and docstrings for CPython 3.12 (half of it under `test/`). The content differs
between Python releases, so the full version (and the implementation) are fields of the config and
therefore of the step's identity: a default taken from the interpreter that declares the step, and
checked against the interpreter that runs it. The version stands for the files' contents in the
identity: the step does not fingerprint its ~2,000 source files (`keel.executor.inputs`), since a
Python release fixes them and a plan need not stat them all. Files are read in sorted
relative-path order, which makes the `max_files` / `max_bytes` caps (for fast tests and
tutorials) deterministic too: the corpus ends before the first file that would exceed a cap.

`packages` keeps only some top-level packages (a directory such as `email`, or a module's stem
such as `typing`): topic-like components of one corpus, e.g. for the hero twin's mixture, where
`stdlib_families(n, disjoint_from=general)` splits the packages the general corpus does not read
into n families of about equal size.
"""

from __future__ import annotations

import difflib
import os
import platform
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

from keel.data.documents import (NEAR_DUPLICATE_OVERLAP, Document, check_near_duplicate_overlap, check_validation_fraction,
                                 write_documents)
from keel.data.quality import BadRecord, RecordLog
from keel.executor.step import this_output
from keel.spec.data import DOCUMENTS

_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def _built_here(directory_or_file: str) -> bool:
    """A file the Python build writes for its own machine, not library source: `_sysconfigdata_*.py`
    (the install prefix and compiler flags, its name the platform's) and `config-<version>-<platform>/`.
    Read, they made one identity's corpus differ between machines (and moved the `max_bytes` cut)."""
    return directory_or_file.startswith(("_sysconfigdata_", "config-"))


@dataclass(frozen=True)
class StdlibCorpusConfig:
    makes: ClassVar[str] = DOCUMENTS
    python_version: str = field(default_factory=platform.python_version)
    python_implementation: str = field(default_factory=platform.python_implementation)
    include_tests: bool = True
    max_files: int | None = None
    max_bytes: int | None = None
    packages: tuple[str, ...] = ()
    """Top-level packages or modules to keep (empty: all)."""
    validation_fraction: float = 0.01
    near_duplicate_overlap: float | None = NEAR_DUPLICATE_OVERLAP
    """A validation draw sharing this share of its lines with the training files goes to train
    (`keel.data.documents.TrainingLines`: the codec tables under `encodings/` are near-copies)."""
    shard_bytes: int = 8 * 2**20
    output_path: str = this_output()

    def __post_init__(self):
        if isinstance(self.packages, str) or not all(isinstance(p, str) for p in self.packages):
            raise ValueError(f"StdlibCorpusConfig.packages must be a tuple of package names, got {self.packages!r}"
                             + (f": use ({self.packages!r},)" if isinstance(self.packages, str) else ""))
        check_validation_fraction(self.validation_fraction)
        check_near_duplicate_overlap(self.near_duplicate_overlap, "StdlibCorpusConfig.near_duplicate_overlap")
        for name in ("max_files", "max_bytes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"StdlibCorpusConfig.{name} must be positive or None, got {value}")


def top_level(relative: str) -> str:
    """The top-level package (or module) a standard-library file belongs to: `email/mime/text.py`
    -> `email`, `typing.py` -> `typing`."""
    return relative.split("/", 1)[0].removesuffix(".py")


def stdlib_families(count: int, include_tests: bool = False, disjoint_from: StdlibCorpusConfig | None = None
                    ) -> list[tuple[str, ...]]:
    """The standard library's top-level packages in `count` families of about equal size: runs of
    consecutive names (sorted), each closed once it holds its share of the bytes still left.

    `disjoint_from` leaves out every package that corpus reads a file of. Corpora that share
    documents must not split them differently: `split_of` holds out a document by its id's hash, so
    a corpus with a larger `validation_fraction` holds out documents that one with a smaller
    fraction trains on, and its validation loss then measures memorisation."""
    root = sysconfig.get_paths()["stdlib"]
    taken = {top_level(f) for f in corpus_files(disjoint_from)} if disjoint_from is not None else set()
    sizes: dict[str, int] = {}
    for relative in stdlib_files(include_tests):
        if top_level(relative) not in taken:
            sizes[top_level(relative)] = sizes.get(top_level(relative), 0) + os.path.getsize(os.path.join(root, relative))
    names, left = sorted(sizes), sum(sizes.values())
    if not 1 <= count <= len(names):  # an empty family, as `packages`, would read the whole library
        raise ValueError(f"stdlib_families(count={count}): give 1 to {len(names)}, the top-level packages left"
                         + (" after disjoint_from's" if disjoint_from is not None else ""))
    families: list[list[str]] = [[]]
    filled = 0
    for i, name in enumerate(names):
        families[-1].append(name)
        filled += sizes[name]
        left_names, left_families = len(names) - i - 1, count - len(families)
        if left_families and (filled >= left / (left_families + 1) or left_names == left_families):
            families.append([])
            left -= filled
            filled = 0
    return [tuple(f) for f in families]


def stdlib_files(include_tests: bool) -> list[str]:
    """Relative paths of the standard library's .py files, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _SKIPPED_DIRS and not _built_here(d)]
        relative_dir = os.path.relpath(directory, root).replace(os.sep, "/")
        parts = [] if relative_dir == "." else relative_dir.split("/")
        if not include_tests and any(p in ("test", "tests", "idle_test") for p in parts):
            continue
        found.extend("/".join([*parts, f]) for f in files if f.endswith(".py") and not _built_here(f))
    return sorted(found)


def corpus_files(config: StdlibCorpusConfig) -> list[str]:
    """Relative paths of the files `config` reads, in order: its packages, up to its caps."""
    root = sysconfig.get_paths()["stdlib"]
    every = stdlib_files(config.include_tests)
    unknown = sorted(set(config.packages) - {top_level(f) for f in every})
    if unknown:  # a typo kept the others and read nothing of it
        hints = "; ".join(f"{name!r}: did you mean {', '.join(map(repr, close))}?" for name in unknown
                          if (close := difflib.get_close_matches(name, {top_level(f) for f in every}, n=2)))
        raise ValueError(f"StdlibCorpusConfig.packages: {', '.join(map(repr, unknown))} is no top-level package or module "
                         f"of this Python's standard library{' (tests left out)' if not config.include_tests else ''}"
                         + (f" ({hints})" if hints else "") + "; `keel.data.stdlib_families` lists them")
    files = [f for f in every if not config.packages or top_level(f) in config.packages]
    kept, total_bytes = [], 0
    for relative in files[: config.max_files]:
        size = os.path.getsize(os.path.join(root, relative))
        if config.max_bytes is not None and total_bytes + size > config.max_bytes:
            break
        total_bytes += size
        kept.append(relative)
    return kept


def _documents(config: StdlibCorpusConfig, log: RecordLog) -> Iterator[Document]:
    root = sysconfig.get_paths()["stdlib"]
    for relative in corpus_files(config):
        with open(os.path.join(root, relative), "rb") as f:
            data = f.read()
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
        near_duplicate_overlap=config.near_duplicate_overlap,
        shard_bytes=config.shard_bytes,
        log=log,
        source={"stdlib": sysconfig.get_paths()["stdlib"], "python": " ".join(running)},
        what=f"the standard library (max_files={config.max_files}, max_bytes={config.max_bytes}"
             + (f", packages {config.packages[0]} .. {config.packages[-1]})" if config.packages else ")"),
    )
