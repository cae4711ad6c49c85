"""Raw ingestion: local text/JSON-lines/Parquet files or a Hugging Face dataset -> a keel document set.

A document's id is where it came from, relative to the input (`dir/file.jsonl:17`, `notes.txt:1`,
`hf:json/train:42`), so it does not depend on the machine the files sit on, and neither does the
train/validation split derived from it.

What counts toward the step's identity: every identity field of the config, and the contents of
every file it reads (`input_files()`: each input, each glob match, each local `data_files` of an
HF dataset), fingerprinted by the executor (`keel.executor.inputs`). Editing, adding or removing
a file makes the step and everything downstream stale. `input_version`, when set, stands for the
files instead (nothing is listed or hashed; bump it when they change): for inputs too large to
list on every plan or not reachable from where `keel plan` runs.

Losses are loud: a record that cannot be read is skipped and counted by kind with its file:line,
and more than `max_bad_fraction` of them fail the step (`on_bad_record='fail'`: the first one
does); undecodable bytes are replaced or their line skipped (`on_decode_error`), line by line;
no documents at all is an error.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

import fsspec

from keel.data.documents import (NEAR_DUPLICATE_OVERLAP, Document, check_near_duplicate_overlap, check_validation_fraction,
                                 write_documents)
from keel.data.quality import BadRecord, BadRecordError, RecordLog, not_text
from keel.executor import storage
from keel.executor.step import External, OutputOf, Step, StepDeclarationError, execution_only, this_output
from keel.spec.data import DOCUMENTS

FORMATS = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
BOM = b"\xef\xbb\xbf"
"""The UTF-8 byte-order mark that Windows tools (and `encoding="utf-8-sig"`) put before a file's
first line: not part of its text, and `json.loads` refuses it."""


class OnBadRecord(StrEnum):
    """What to do with a record that cannot be read: skip and count it, or fail the step."""

    SKIP = "skip"
    FAIL = "fail"

    def __repr__(self) -> str:
        return repr(self.value)


class OnDecodeError(StrEnum):
    """What to do with a line holding bytes that are not UTF-8: replace them (U+FFFD) or skip the line."""

    REPLACE = "replace"
    SKIP = "skip"

    def __repr__(self) -> str:
        return repr(self.value)


DEFAULT_SHARD_BYTES = 32 * 2**20
HF_FILE_BUILDERS = ("json", "csv", "parquet", "text", "arrow")
"""`datasets` builders that read `data_files` (fingerprinted); any other path is a hub dataset."""


def _paths(field: str, value) -> tuple:
    """`value` as a tuple of paths or globs (a `pathlib.Path` as its text, so the file is
    fingerprinted and read like one spelled out); a dependency (`output_of`, a step) stays as it is."""
    if isinstance(value, (str, os.PathLike)):
        raise ValueError(f"{field} must be a tuple of paths or globs, not one {type(value).__name__}: use "
                         f"({os.fspath(value)!r},)")
    if not isinstance(value, (tuple, list)):
        raise ValueError(f"{field} must be a tuple of paths or globs, not a {type(value).__name__} ({value!r})")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, os.PathLike):
            item = os.fspath(item)
        if not isinstance(item, (str, OutputOf, Step, External)):
            raise ValueError(f"{field}[{i}] is a {type(item).__name__} ({item!r}): give a path or glob (a string)")
        out.append(item)
    return tuple(out)


@dataclass(frozen=True)
class HfDatasetSpec:
    """A Hugging Face `datasets` source, read in streaming mode (no local Arrow cache).

    `path` is a hub id (needs a reachable hub; pin `revision`, which stands for its contents) or a
    builder such as "json"/"parquet" together with `data_files` (whose contents count toward
    identity, as `inputs` do).
    """

    path: str
    name: str | None = None
    split: str = "train"
    data_files: tuple[str, ...] = ()
    revision: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "data_files", _paths("HfDatasetSpec.data_files", self.data_files))
        if self.path in HF_FILE_BUILDERS and not self.data_files:
            raise ValueError(f"HfDatasetSpec({self.path!r}) is a file builder with no data_files: give the files it reads "
                             f"(HfDatasetSpec({self.path!r}, data_files=('data/part-*',)))")
        if self.path not in HF_FILE_BUILDERS and not self.revision:
            raise ValueError(f"HfDatasetSpec({self.path!r}) is a hub dataset with no revision: pin one (a commit or tag, "
                             "revision='...'), which stands for its contents in the step's identity; unpinned, a "
                             "dataset updated on the hub would still be read from the old cached documents")


@dataclass(frozen=True)
class IngestConfig:
    """Ingest `inputs` (files or globs, read in the given order, each glob sorted) or `hf_dataset`.

    - `text_field`: the field (JSON lines) or column (Parquet) holding a document's text; a .txt
      file is one document.
    - `validation_fraction`: the share of documents (by a hash of their id) in the validation split.
    - `near_duplicate_overlap`: a validation draw with at least this share of its distinct lines
      in the training documents is a near-copy and goes to train; None keeps every draw in
      validation and skips the index of training lines (8 bytes a line).
    - `on_bad_record`: 'skip' a record that cannot be read (not JSON, no `text_field`, text not a
      string) and count it, or 'fail' at the first one. `max_bad_fraction` (execution-only): the
      share of skipped records above which the step fails anyway.
    - `on_decode_error`: a line with bytes that are not UTF-8 (or a JSON text escaping half of a
      UTF-16 pair) gets them 'replace'd with U+FFFD (counted as repaired) or is skipped (counted
      as a bad record).
    - `input_version`: stands for the input files' contents in the identity (see the module doc).
    """

    makes: ClassVar[str] = DOCUMENTS

    inputs: tuple[str, ...] = ()
    hf_dataset: HfDatasetSpec | None = None
    text_field: str = "text"
    validation_fraction: float = 0.01
    near_duplicate_overlap: float | None = NEAR_DUPLICATE_OVERLAP
    on_bad_record: OnBadRecord = OnBadRecord.SKIP
    on_decode_error: OnDecodeError = OnDecodeError.REPLACE
    shard_bytes: int = DEFAULT_SHARD_BYTES
    input_version: str | None = None
    output_path: str = this_output()
    max_bad_fraction: float = execution_only(default=0.01)

    def __post_init__(self):
        if bool(self.inputs) == (self.hf_dataset is not None):
            raise ValueError("IngestConfig: set exactly one of `inputs` (files or globs) and `hf_dataset`")
        object.__setattr__(self, "inputs", _paths("IngestConfig.inputs", self.inputs))
        for name, kind in (("on_bad_record", OnBadRecord), ("on_decode_error", OnDecodeError)):
            try:
                object.__setattr__(self, name, kind(getattr(self, name)))
            except ValueError:
                raise ValueError(f"IngestConfig.{name} must be one of {tuple(k.value for k in kind)}, got "
                                 f"{getattr(self, name)!r}") from None
        if not 0 <= self.max_bad_fraction <= 1:
            raise ValueError(f"IngestConfig.max_bad_fraction must be in [0, 1], got {self.max_bad_fraction}")
        if self.shard_bytes <= 0:
            raise ValueError(f"IngestConfig.shard_bytes must be positive, got {self.shard_bytes}")
        check_validation_fraction(self.validation_fraction)
        check_near_duplicate_overlap(self.near_duplicate_overlap, "IngestConfig.near_duplicate_overlap")

    def input_files(self) -> dict[str, str]:
        """{name in the identity: url} of every file this step reads, for the executor to
        fingerprint; nothing when `input_version` stands for them. Names are spelled as declared
        (a relative input stays relative), so the identity does not depend on the machine."""
        if self.input_version is not None:
            return {}
        if self.hf_dataset is not None:  # a hub dataset's `revision` pins it; a builder's data_files are files
            if self.hf_dataset.path not in HF_FILE_BUILDERS:
                return {}
            return {f.name: f.url for f in _hf_files(self.hf_dataset)}
        return {f.name: f.url for f in expand_inputs(tuple(p for p in self.inputs if isinstance(p, str)))}


@dataclass(frozen=True)
class InputFile:
    url: str
    id_prefix: str
    """The file relative to its glob's base (its documents' id prefix)."""
    name: str
    """The file as the declaration spells it: the glob's base as written, then the match."""


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


def _matches(pattern: str, field: str) -> list[InputFile]:
    fs, path = storage.split(pattern)
    wildcard = any(ch in path for ch in "*?[")
    matches = sorted(fs.glob(path)) if wildcard else ([path] if fs.exists(path) else [])
    matches = [m for m in matches if not fs.isdir(m)]
    if not matches and not wildcard and fs.isdir(path):
        suffixes = ", ".join(f"{pattern.rstrip('/')}/*{suffix}" for suffix in (".jsonl", ".txt"))
        raise FileNotFoundError(f"{field}: {pattern!r} is a directory, not a file: give a glob of its files, e.g. {suffixes}")
    if not matches:
        relative = "://" not in pattern and not os.path.isabs(pattern)
        where = f" (a relative path, read from the working directory {os.getcwd()})" if relative else ""
        raise FileNotFoundError(f"{field}: {pattern!r} matches no file{where}")
    base = _glob_base(path).rstrip("/")
    declared_base = _glob_base(pattern).rstrip("/")
    protocol = pattern.partition("://")[0] + "://" if "://" in pattern else ""
    files = []
    for match in matches:
        try:
            match.encode("utf-8")
        except UnicodeEncodeError:  # a name the file system holds as bytes (os.fsdecode's surrogates): ids are UTF-8
            raise BadInputFileError(f"{field}: the name of {match!r} is not UTF-8, so its documents' ids cannot name it: "
                                    "rename the file") from None
        relative = match[len(base) + 1 :] if base and match.startswith(base + "/") else match.rsplit("/", 1)[-1]
        name = (f"{declared_base}/{relative}" if declared_base else relative) if wildcard else pattern
        files.append(InputFile(protocol + match, relative, name))
    return files


def expand_inputs(inputs: tuple[str, ...]) -> list[InputFile]:
    """Every input file, in declaration order; each glob sorted. Checks formats first."""
    files = _distinct_files(inputs, "IngestConfig.inputs")
    for f in files:
        _format_of(f.url)
    return files


def _distinct_files(patterns: tuple[str, ...], field: str) -> list[InputFile]:
    """The files `patterns` match, refusing two whose documents' ids would collide."""
    files = [f for pattern in patterns for f in _matches(pattern, field)]
    by_prefix: dict[str, InputFile] = {}
    for f in files:
        other = by_prefix.setdefault(f.id_prefix, f)
        if other is not f:  # their documents' ids would collide
            raise StepDeclarationError(f"{field}: {other.url} and {f.url} both give documents the "
                                       f"ids '{f.id_prefix}:N' (a file's id is its path below its pattern's fixed "
                                       "folder): match them with one glob from a folder above both, e.g. "
                                       "'data/*/notes.txt'")
    return files


def _decode(raw: bytes, url: str, line: int, config: IngestConfig, log: RecordLog) -> str | None:
    """One line as text: undecodable bytes replaced (and counted) or the line skipped, as declared."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if _skipped_as_declared("not valid UTF-8", "not valid UTF-8, bytes replaced with U+FFFD",
                                f"{e.reason} at byte {e.start}", url, line, config, log):
            return None
        return raw.decode("utf-8", errors="replace")


def _without_lone_surrogates(text: str, url: str, line: int, config: IngestConfig, log: RecordLog) -> str | None:
    """The text, when it is UTF-8 text. A JSON escape can spell half of a UTF-16 pair ("\\ud83d" of an
    emoji cut in two), which no UTF-8 text holds: such a record is repaired (U+FFFD in its place)
    or skipped as `on_decode_error` says, as undecodable bytes are."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError as e:
        if _skipped_as_declared("unpaired UTF-16 surrogate", "unpaired UTF-16 surrogate, replaced with U+FFFD",
                                f"{e.reason} at character {e.start}", url, line, config, log):
            return None
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _skipped_as_declared(kind: str, repaired: str, detail: str, url: str, line: int, config: IngestConfig,
                         log: RecordLog) -> bool:
    """Count a line that is not UTF-8 text as `on_decode_error` says: skipped as `kind` (True), or
    repaired as `repaired` (False: the caller puts U+FFFD in place)."""
    if config.on_decode_error is OnDecodeError.SKIP:
        log.skip(BadRecord(url, line, kind, detail + "; skipped, as on_decode_error='skip' says"))
        return True
    log.repair(BadRecord(url, line, repaired, detail))
    return False


def _text_of(record, text_field: str) -> tuple[str | None, str, str]:
    """(text, '', '') or (None, kind, detail) of a bad record."""
    if not isinstance(record, dict):
        return None, "not a JSON object", type(record).__name__
    if text_field not in record:
        fields = ", ".join(sorted(record)) or "none"
        return None, f"missing text field {text_field!r}", f"fields: {fields}; IngestConfig.text_field names the one to read"
    text = record[text_field]
    if not isinstance(text, str):
        return None, f"text field {text_field!r} not a string", type(text).__name__
    return text, "", ""


class _Zstd(io.RawIOBase):
    """A `.zst` file's decompressed bytes, frame after frame, raising at its end when the last frame
    is incomplete (a download cut short). `zstandard`'s stream reader, which fsspec opens, reads such
    a file as a shorter one: 1,417 of 3,000 records were ingested, and the step succeeded."""

    def __init__(self, raw, url: str):
        import zstandard

        self._raw, self._url, self._context = raw, url, zstandard.ZstdDecompressor()
        self._frame, self._in_frame = self._context.decompressobj(), False
        self._ready, self._at = b"", 0  # decompressed bytes, and how many of them were read

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        # Compressed reads of 64 KiB bound what one decompresses to; the offset, not a re-slice of
        # what is left, keeps each read's cost its own size (re-slicing copied the rest of the chunk
        # on every 8 KiB read: 22.7 MB of lines took 2.42 s, now 0.018 s; zstandard's reader 0.009 s).
        while self._at >= len(self._ready):
            data = self._raw.read(1 << 16)
            if not data:
                if self._in_frame:
                    raise EOFError("it ends inside a zstd frame: cut short (an interrupted download or copy?)")
                return 0
            self._ready, self._at = self._decompress(data), 0
        n = min(len(buffer), len(self._ready) - self._at)
        buffer[:n] = self._ready[self._at : self._at + n]
        self._at += n
        return n

    def _decompress(self, data: bytes) -> bytes:
        out = []
        while data:
            self._in_frame = True
            out.append(self._frame.decompress(data))
            if not self._frame.eof:
                break
            data, self._frame, self._in_frame = self._frame.unused_data, self._context.decompressobj(), False
        return b"".join(out)


def _read_jsonl(file: InputFile, config: IngestConfig, log: RecordLog) -> Iterator[Document]:
    # fsspec decompresses .gz (whose reader raises on a cut file); .zst is read by `_Zstd`, which does
    # too. The buffered reader gives every format's stream line iteration.
    compression = None if file.url.endswith(".zst") else "infer"
    with fsspec.open(file.url, "rb", compression=compression) as f, \
            io.BufferedReader(_Zstd(f, file.url) if compression is None else f) as stream:
        for line_number, raw in enumerate(stream, start=1):
            if line_number == 1:
                raw = raw.removeprefix(BOM)
            if not raw.strip():
                continue
            log.look()
            line = _decode(raw, file.url, line_number, config, log)
            if line is None:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                log.skip(BadRecord(file.url, line_number, "not valid JSON", str(e)))
                continue
            text, kind, detail = _text_of(record, config.text_field)
            if text is None:
                log.skip(BadRecord(file.url, line_number, kind, detail))
                continue
            text = _without_lone_surrogates(text, file.url, line_number, config, log)
            if text is None:
                continue
            yield Document(f"{file.id_prefix}:{line_number}", text)


def _read_txt(file: InputFile, config: IngestConfig, log: RecordLog) -> Iterator[Document]:
    """The whole file as one document, decoded line by line when a few of its lines are not UTF-8;
    a file that is binary data (`quality.not_text`) is one skipped record."""
    fs, path = storage.split(file.url)
    data = fs.cat_file(path).removeprefix(BOM)
    binary = not_text(data)  # NUL bytes are valid UTF-8: text saved as UTF-16 decodes without an error
    if binary:
        log.look()
        log.skip(BadRecord(file.url, 1, "not text (binary data)", binary + "; remove the file or fix its encoding"))
        return
    lines = data.splitlines(keepends=True)
    log.look(len(lines))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        decoded = (_decode(raw, file.url, n, config, log) for n, raw in enumerate(lines, start=1))
        text = "".join(t for t in decoded if t is not None)
    yield Document(f"{file.id_prefix}:1", text)


def _read_parquet(file: InputFile, config: IngestConfig, log: RecordLog) -> Iterator[Document]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs, path = storage.split(file.url)
    with fs.open(path, "rb") as f:
        parquet = pq.ParquetFile(f)
        if config.text_field not in parquet.schema_arrow.names:
            raise ValueError(f"IngestConfig.text_field={config.text_field!r}: {file.url} has no such column (columns: "
                             f"{', '.join(parquet.schema_arrow.names)}); set text_field to the column holding the text")
        row = 0
        for batch in parquet.iter_batches(columns=[config.text_field]):
            column = batch.column(0)
            strings = pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
            # a string column's bytes as written (Parquet does not check them): each row is decoded
            # as a line of text is, so bytes that are not UTF-8 are repaired or skipped as declared
            for value in (column.cast(pa.large_binary()) if strings else column).to_pylist():
                row += 1
                log.look()
                text = value
                if strings and value is not None:
                    text = _decode(value, file.url, row, config, log)
                    if text is None:
                        continue  # skipped as on_decode_error declares, and counted
                if not isinstance(text, str):
                    log.skip(BadRecord(file.url, row, f"text field {config.text_field!r} not a string", type(text).__name__))
                    continue
                yield Document(f"{file.id_prefix}:{row}", text)


class BadInputFileError(RuntimeError):
    """An input file that cannot be read to its end (cut short, corrupt)."""


def _unreadable() -> tuple[type[BaseException], ...]:
    """The errors of a file cut short or corrupt, as gzip, zstd and Parquet raise them (imported
    when one is raised: `keel plan` reads this module)."""
    import gzip
    import zlib

    import pyarrow as pa
    import zstandard

    return EOFError, gzip.BadGzipFile, zlib.error, zstandard.ZstdError, pa.ArrowInvalid


def _read_files(config: IngestConfig, files: list[InputFile], log: RecordLog) -> Iterator[Document]:
    """Every file's documents. A file whose every record was skipped (a wrong `text_field`, say) fails
    the step even when the share `max_bad_fraction` bounds is small: the other inputs' records dilute
    it (a .txt file counts each line), and 40 skipped JSON records beside a 5,000-line text file were
    0.8% of them, so the step lost the file and succeeded."""
    emptied = []
    for file in files:
        fmt = _format_of(file.url)
        looked, before = log.records, log.skipped_counts()
        read = _read_txt if fmt == ".txt" else _read_parquet if fmt == ".parquet" else _read_jsonl
        try:
            yield from read(file, config, log)
        except _unreadable() as exc:  # raised without the file's name
            raise BadInputFileError(f"{file.url} could not be read ({type(exc).__name__}: {exc}); fetch or write it "
                                    "again, or leave it out of IngestConfig.inputs") from exc
        looked = log.records - looked
        kinds = {kind: n - before.get(kind, 0) for kind, n in log.skipped_counts().items() if n > before.get(kind, 0)}
        if looked and sum(kinds.values()) == looked and config.max_bad_fraction < 1:
            records = f"every one of the {looked:,} records" if looked > 1 else "the only record"
            emptied.append(f"{records} of {file.url} was skipped ({', '.join(f'{n:,} {kind}' for kind, n in kinds.items())})")
    if emptied:
        log.check()  # over the share: its message, which names the first record of each kind, comes first
        raise BadRecordError(f"{'; '.join(emptied)}: the other inputs' records kept the share under "
                             f"IngestConfig.max_bad_fraction={config.max_bad_fraction:g}, but this gave nothing; fix "
                             "the file or the config reading it (text_field, its format), or leave it out of the inputs")


def _hf_files(spec: HfDatasetSpec) -> list[InputFile]:
    """The files a `datasets` file builder reads (`data_files`, as `inputs` are matched)."""
    return _distinct_files(tuple(p for p in spec.data_files if isinstance(p, str)), "IngestConfig.hf_dataset.data_files")


def _read_hf(spec: HfDatasetSpec, text_field: str, log: RecordLog) -> Iterator[Document]:
    """A file builder's rows file by file, each document's id naming its file and row (as a local
    input's does), so adding a file moves no other document's draw; a hub dataset's by its row in
    the pinned revision's stream."""
    import datasets

    source = f"hf:{spec.path}" + (f"/{spec.name}" if spec.name else "") + f"/{spec.split}"
    if spec.path in HF_FILE_BUILDERS:
        streams = [(f"{source}/{f.id_prefix}", [f.url]) for f in _hf_files(spec)]
    else:
        streams = [(source, list(spec.data_files) or None)]
    for prefix, data_files in streams:
        rows = datasets.load_dataset(spec.path, spec.name, split=spec.split, data_files=data_files,
                                     revision=spec.revision, streaming=True)
        try:
            for row_number, record in enumerate(rows, start=1):
                log.look()
                text, kind, detail = _text_of(record, text_field)
                if text is None:
                    log.skip(BadRecord(prefix, row_number, kind, detail))
                    continue
                yield Document(f"{prefix}:{row_number}", text)
        except _unreadable() as exc:  # Arrow's parse error names no file
            where = data_files[0] if spec.path in HF_FILE_BUILDERS else source
            raise BadInputFileError(
                f"{where} could not be read by the datasets {spec.path!r} builder ({type(exc).__name__}: {exc}); a file "
                "builder reads a file whole, so IngestConfig.on_bad_record cannot skip one bad record in it: fix the "
                "file, or give it as IngestConfig.inputs, which skips and counts bad records") from exc


def ingest_documents(config: IngestConfig) -> None:
    """Step function: read every input record, write the split, sharded document set."""
    log = RecordLog(fail_fast=config.on_bad_record is OnBadRecord.FAIL, max_fraction=config.max_bad_fraction,
                    limit="IngestConfig.max_bad_fraction")
    if config.hf_dataset is not None:
        documents = _read_hf(config.hf_dataset, config.text_field, log)
        source = {"hf_dataset": dataclasses.asdict(config.hf_dataset)}
        what = f"IngestConfig.hf_dataset {config.hf_dataset.path!r}"
    else:
        files = expand_inputs(config.inputs)  # fail on a missing file or unknown format before reading anything
        documents = _read_files(config, files, log)
        source = {"inputs": list(config.inputs), "input_version": config.input_version}
        what = f"IngestConfig.inputs {list(config.inputs)}"
    write_documents(
        config.output_path,
        documents,
        validation_fraction=config.validation_fraction,
        shard_bytes=config.shard_bytes,
        log=log,
        source=source,
        what=what,
        near_duplicate_overlap=config.near_duplicate_overlap,
    )
