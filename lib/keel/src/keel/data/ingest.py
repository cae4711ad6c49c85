"""Raw ingestion: local text/JSON-lines/Parquet files or a Hugging Face dataset -> a keel document set.

A document's id is where it came from, relative to the input (`dir/file.jsonl:17`, `notes.txt:1`,
`hf:json/train:42`), so it does not depend on the machine the files sit on, and neither does the
train/validation split derived from it. The step's identity holds the input paths or globs, not
the bytes behind them: bump `input_version` when files change in place.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass

from keel.data.documents import (
    BadRecord,
    BadRecordLog,
    Document,
    check_validation_fraction,
    write_documents,
)
from keel.executor import storage
from keel.executor.step import this_output

logger = logging.getLogger(__name__)

FORMATS = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
BAD_RECORD_POLICIES = ("skip", "fail")
DEFAULT_SHARD_BYTES = 32 * 2**20


@dataclass(frozen=True)
class HfDatasetSpec:
    """A Hugging Face `datasets` source, read in streaming mode (no local Arrow cache).

    `path` is a hub id (needs a reachable hub) or a builder such as "json"/"parquet" together
    with `data_files`.
    """

    path: str
    name: str | None = None
    split: str = "train"
    data_files: tuple[str, ...] = ()
    revision: str | None = None


@dataclass(frozen=True)
class IngestConfig:
    """Ingest `inputs` (files or globs, read in the given order, each glob sorted) or `hf_dataset`."""

    inputs: tuple[str, ...] = ()
    hf_dataset: HfDatasetSpec | None = None
    text_field: str = "text"
    validation_fraction: float = 0.01
    on_bad_record: str = "skip"
    shard_bytes: int = DEFAULT_SHARD_BYTES
    input_version: str | None = None
    output_path: str = this_output()

    def __post_init__(self):
        if bool(self.inputs) == (self.hf_dataset is not None):
            raise ValueError("IngestConfig: set exactly one of `inputs` (files or globs) and `hf_dataset`")
        if isinstance(self.inputs, str):
            raise ValueError("IngestConfig.inputs must be a tuple of paths or globs, not one string: use (path,)")
        if self.on_bad_record not in BAD_RECORD_POLICIES:
            raise ValueError(f"IngestConfig.on_bad_record must be one of {BAD_RECORD_POLICIES}, got {self.on_bad_record!r}")
        if self.shard_bytes <= 0:
            raise ValueError(f"IngestConfig.shard_bytes must be positive, got {self.shard_bytes}")
        check_validation_fraction(self.validation_fraction)


def _format_of(path: str) -> str:
    for suffix in sorted(FORMATS, key=len, reverse=True):
        if path.endswith(suffix):
            return suffix
    raise ValueError(f"IngestConfig.inputs: {path} has an unsupported format; supported suffixes: {', '.join(FORMATS)}")


def _glob_base(pattern: str) -> str:
    """The directory part of `pattern` before its first wildcard (the file's parent for plain paths)."""
    head = pattern
    for i, ch in enumerate(pattern):
        if ch in "*?[":
            head = pattern[:i]
            break
    else:
        return pattern.rsplit("/", 1)[0] if "/" in pattern else ""
    return head.rsplit("/", 1)[0] if "/" in head else ""


def expand_inputs(inputs: tuple[str, ...]) -> list[tuple[str, str]]:
    """(url, id prefix) for every input file, in declaration order; each glob sorted. Checks formats first."""
    files: list[tuple[str, str]] = []
    for pattern in inputs:
        fs, path = storage.split(pattern)
        matches = sorted(fs.glob(path)) if any(ch in path for ch in "*?[") else ([path] if fs.exists(path) else [])
        matches = [m for m in matches if not fs.isdir(m)]
        if not matches:
            raise FileNotFoundError(f"IngestConfig.inputs: {pattern!r} matches no file")
        base = _glob_base(path).rstrip("/")
        protocol = pattern.partition("://")[0] + "://" if "://" in pattern else ""
        for match in matches:
            _format_of(match)
            relative = match[len(base) + 1 :] if base and match.startswith(base + "/") else match.rsplit("/", 1)[-1]
            files.append((protocol + match, relative))
    return files


def _open_lines(url: str, fmt: str) -> io.BufferedIOBase:
    fs, path = storage.split(url)
    raw = fs.open(path, "rb")
    if fmt == ".jsonl.gz":
        return gzip.GzipFile(fileobj=raw)
    if fmt == ".jsonl.zst":
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    return raw


def _text_of(record, text_field: str) -> tuple[str | None, str]:
    if not isinstance(record, dict):
        return None, f"expected a JSON object, got {type(record).__name__}"
    if text_field not in record:
        return None, f"missing text field {text_field!r} (fields: {', '.join(sorted(record)) or 'none'})"
    text = record[text_field]
    if not isinstance(text, str):
        return None, f"text field {text_field!r} is {type(text).__name__}, not a string"
    return text, ""


def _read_jsonl(url: str, fmt: str, prefix: str, text_field: str, bad: BadRecordLog) -> Iterator[Document]:
    with _open_lines(url, fmt) as stream:
        for line_number, raw in enumerate(stream, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                bad.report(BadRecord(url, line_number, f"not valid UTF-8 JSON: {e}"))
                continue
            text, reason = _text_of(record, text_field)
            if text is None:
                bad.report(BadRecord(url, line_number, reason))
                continue
            yield Document(f"{prefix}:{line_number}", text)


def _read_txt(url: str, prefix: str, bad: BadRecordLog) -> Iterator[Document]:
    fs, path = storage.split(url)
    data = fs.cat_file(path)
    try:
        yield Document(f"{prefix}:1", data.decode("utf-8"))
    except UnicodeDecodeError as e:
        bad.report(BadRecord(url, data.count(b"\n", 0, e.start) + 1, f"not valid UTF-8: {e.reason}"))


def _read_parquet(url: str, prefix: str, text_field: str, bad: BadRecordLog) -> Iterator[Document]:
    import pyarrow.parquet as pq

    fs, path = storage.split(url)
    with fs.open(path, "rb") as f:
        parquet = pq.ParquetFile(f)
        if text_field not in parquet.schema_arrow.names:
            bad.report(BadRecord(url, 0, f"no column {text_field!r} (columns: {', '.join(parquet.schema_arrow.names)})"))
            return
        row = 0
        for batch in parquet.iter_batches(columns=[text_field]):
            for text in batch.column(0).to_pylist():
                row += 1
                if not isinstance(text, str):
                    bad.report(BadRecord(url, row, f"text field {text_field!r} is {type(text).__name__}, not a string"))
                    continue
                yield Document(f"{prefix}:{row}", text)


def _read_files(config: IngestConfig, bad: BadRecordLog) -> Iterator[Document]:
    for url, prefix in expand_inputs(config.inputs):
        fmt = _format_of(url)
        if fmt == ".txt":
            yield from _read_txt(url, prefix, bad)
        elif fmt == ".parquet":
            yield from _read_parquet(url, prefix, config.text_field, bad)
        else:
            yield from _read_jsonl(url, fmt, prefix, config.text_field, bad)


def _read_hf(spec: HfDatasetSpec, text_field: str, bad: BadRecordLog) -> Iterator[Document]:
    import datasets

    rows = datasets.load_dataset(
        spec.path,
        spec.name,
        split=spec.split,
        data_files=list(spec.data_files) or None,
        revision=spec.revision,
        streaming=True,
    )
    source = f"hf:{spec.path}" + (f"/{spec.name}" if spec.name else "") + f"/{spec.split}"
    for row_number, record in enumerate(rows, start=1):
        text, reason = _text_of(record, text_field)
        if text is None:
            bad.report(BadRecord(source, row_number, reason))
            continue
        yield Document(f"{source}:{row_number}", text)


def ingest_documents(config: IngestConfig) -> None:
    """Step function: read every input record, write the split, sharded document set."""
    bad = BadRecordLog(fail=config.on_bad_record == "fail")
    if config.hf_dataset is not None:
        documents = _read_hf(config.hf_dataset, config.text_field, bad)
        source = {"hf_dataset": dataclasses.asdict(config.hf_dataset)}
    else:
        expand_inputs(config.inputs)  # fail on a missing file or unknown format before reading anything
        documents = _read_files(config, bad)
        source = {"inputs": list(config.inputs), "input_version": config.input_version}
    index = write_documents(
        config.output_path,
        documents,
        validation_fraction=config.validation_fraction,
        shard_bytes=config.shard_bytes,
        bad_records=bad,
        source=source,
    )
    if bad.count:
        logger.warning("skipped %d bad records; first: %s", bad.count, bad.examples[0])
    splits = index["splits"]
    logger.info(
        "ingested %d train / %d validation documents (%d bad records skipped)",
        splits["train"]["documents"],
        splits["validation"]["documents"],
        bad.count,
    )
