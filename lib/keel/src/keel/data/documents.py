"""The on-disk document set that ingestion steps write and the tokenizer and tokenize steps read.

Layout under a step's output path:

    documents.json                      counts, shard lists, bad-record report (written last)
    train.texts.npy, validation.texts.npy
                                        uint64 (documents, 2): each document's `text_hash` and UTF-8
                                        bytes, in shard order, so that a training step can see one
                                        set's held-out texts in another's training split
                                        (`keel.train.data_checks`)
    .keel/summary.json                  documents, bytes, records skipped and repaired by kind
    train/docs-00000.jsonl.zst          one JSON object per line: {"id": ..., "text": ...}
    validation/docs-00000.jsonl.zst

A document's draw is a pure function of its id (a SHA-256 of the id against the validation
fraction), so adding or removing other documents never changes it. A training draw always goes to
train; a validation draw that is a near-copy of the training documents goes to train instead
(`write_documents`), so adding a training document it copies moves it into train, and removing
that document moves it back. Shards are zstd-compressed JSON lines, cut at a fixed number of
uncompressed text bytes; the same documents in the same order always give byte-identical shards.
"""

from __future__ import annotations

import array
import hashlib
import io
import json
import posixpath
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import zstandard

from keel.data.quality import RecordLog
from keel.data.summary import write_summary
from keel.executor import storage

SPLITS = ("train", "validation")
INDEX_FILE = "documents.json"
TEXTS_FILE = "{split}.texts.npy"
FORMAT = "keel.documents/v1"
ZSTD_LEVEL = 3


class EmptyDataError(ValueError):
    """A data step would write nothing usable (no documents, no tokens): it fails instead."""


@dataclass(frozen=True)
class Document:
    id: str
    text: str


def id_digest(doc_id: str) -> bytes:
    """A document id's SHA-256: its first 8 bytes, a number in [0, 2**64), decide its split
    (`split_of`); its first 16 tell it from every other id (`DocumentIds`)."""
    return hashlib.sha256(doc_id.encode("utf-8")).digest()


def text_hash(text: str) -> int:
    """A document text's 64-bit hash, whitespace collapsed: two sets holding one text under other
    ids (the same record in two files), or with other line endings, give it the same hash."""
    return int.from_bytes(hashlib.sha256(" ".join(text.split()).encode("utf-8")).digest()[:8], "big")


def split_of(doc_id: str, validation_fraction: float) -> str:
    """'validation' for a stable `validation_fraction` share of ids, else 'train'. The shares nest: a
    document held out at one fraction is held out at every larger one, so two document sets holding
    the same document at different fractions can put it in different splits."""
    return _split_of_digest(id_digest(doc_id), validation_fraction)


def _split_of_digest(digest: bytes, validation_fraction: float) -> str:
    return "validation" if int.from_bytes(digest[:8], "big") / 2.0**64 < validation_fraction else "train"


def check_validation_fraction(value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"validation_fraction must be in [0, 1), got {value}")


class _ShardedSplitWriter:
    """Writes one split's documents into size-capped zstd JSON-lines shards."""

    def __init__(self, root: str, split: str, shard_bytes: int):
        self.root = root
        self.split = split
        self.shard_bytes = shard_bytes
        self.shards: list[str] = []
        self.texts = array.array("Q")  # text_hash, bytes; per document
        self.documents = 0
        self.bytes = 0
        self._buffer = io.BytesIO()
        self._buffer_text_bytes = 0

    def add(self, doc: Document) -> None:
        text_bytes = len(doc.text.encode("utf-8"))
        self.texts.extend((text_hash(doc.text), text_bytes))
        self._buffer.write(json.dumps({"id": doc.id, "text": doc.text}, ensure_ascii=False).encode("utf-8"))
        self._buffer.write(b"\n")
        self._buffer_text_bytes += text_bytes
        self.documents += 1
        self.bytes += text_bytes
        if self._buffer_text_bytes >= self.shard_bytes:
            self._flush()

    def close(self) -> None:
        if self._buffer_text_bytes or not self.shards:
            self._flush()

    def _flush(self) -> None:
        name = f"{self.split}/docs-{len(self.shards):05d}.jsonl.zst"
        fs, path = storage.split(storage.join(self.root, name))
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        with fs.open(path, "wb") as f:
            f.write(zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(self._buffer.getvalue()))
        self.shards.append(name)
        self._buffer = io.BytesIO()
        self._buffer_text_bytes = 0


def clear_documents(output_path: str) -> None:
    """Remove what an earlier, interrupted attempt left, so a rerun starts from nothing."""
    for name in (INDEX_FILE, *SPLITS, *(TEXTS_FILE.format(split=s) for s in SPLITS)):
        url = storage.join(output_path, name)
        if storage.exists(url):
            storage.delete_tree(url)


NEAR_DUPLICATE_OVERLAP = 0.5
"""In the stdlib corpus an ordinary module shares about 20% of its distinct lines with the other
modules; the `encodings/` codec tables share 66-97% with their siblings."""


def normalised_lines(text: str) -> set[int]:
    """Hashes of a document's distinct lines, whitespace collapsed and lowercased; lines under 8
    characters (blank, brackets, `pass`) say nothing about copying and are left out."""
    out = set()
    for line in text.splitlines():
        line = " ".join(line.split()).lower()
        if len(line) >= 8:
            out.add(hash(line))
    return out


def check_near_duplicate_overlap(value: float | None, field: str) -> None:
    if value is not None and not 0 < value <= 1:
        raise ValueError(f"{field}={value!r}: give a share of a document's lines in (0, 1], or None to keep "
                         "every drawn document in validation")


class TrainingLines:
    """The normalised lines of every training document, as 8-byte hashes in sorted numpy chunks:
    a Python set of them held ~63 bytes a line, 1.1 GB of memory per GB of the stdlib's code."""

    CHUNK = 1 << 22
    """Hashes gathered before they are sorted into a chunk (32 MB; sorting copies them twice)."""

    def __init__(self) -> None:
        self._chunks: list = []  # sorted, distinct int64 arrays
        self._pending = array.array("q")

    def add(self, text: str) -> None:
        self._pending.extend(normalised_lines(text))
        if len(self._pending) >= self.CHUNK:
            self._seal()

    def _seal(self) -> None:
        import numpy as np  # here, as in write_documents: declaring a graph imports this module

        chunk = np.sort(np.frombuffer(self._pending, dtype=np.int64))  # np.unique took 25x as long
        self._chunks.append(chunk[np.concatenate(([True], chunk[1:] != chunk[:-1]))])
        self._pending = array.array("q")

    def near_duplicate(self, text: str, overlap: float) -> bool:
        """Whether at least `overlap` of the document's distinct normalised lines are training lines."""
        import numpy as np

        if self._pending:
            self._seal()
        lines = np.fromiter(normalised_lines(text), dtype=np.int64)
        found = np.zeros(len(lines), dtype=bool)
        for chunk in self._chunks:
            found |= chunk[np.searchsorted(chunk, lines).clip(max=len(chunk) - 1)] == lines
        return bool(len(lines)) and int(found.sum()) >= overlap * len(lines)


class DocumentIds:
    """The ids seen so far, to refuse a duplicate: 16 bytes of each id's SHA-256 in sorted numpy
    chunks (a set of the ids held ~100 bytes a document, 10 GB per 10^8 documents). The latest
    batch is a dict of digest -> id, so a duplicate within it is refused at once and one of an
    earlier batch when the batch is sealed; either way the message names the id. Chunks of equal
    size merge, so a batch is searched in O(log n) chunks."""

    BATCH = 1 << 18

    def __init__(self) -> None:
        self._chunks: list = []  # sorted 'V16' arrays, sizes decreasing
        self._batch: dict[bytes, str] = {}

    def add(self, doc_id: str, digest: bytes) -> None:
        """Note `doc_id`, whose `id_digest` is `digest`."""
        key = digest[:16]
        if key in self._batch:
            raise _duplicate(doc_id)
        self._batch[key] = doc_id
        if len(self._batch) >= self.BATCH:
            self.seal()

    def seal(self) -> None:
        """Check the batch against every earlier id (before a document set's index is written)."""
        import numpy as np  # here, as in write_documents: declaring a graph imports this module

        if not self._batch:
            return
        batch = np.sort(np.frombuffer(b"".join(self._batch), dtype="V16"))
        for chunk in self._chunks:
            found = chunk[np.searchsorted(chunk, batch).clip(max=len(chunk) - 1)] == batch
            if found.any():
                raise _duplicate(self._batch[batch[found.argmax()].tobytes()])
        self._batch = {}
        while self._chunks and len(self._chunks[-1]) <= len(batch):  # two sorted runs: a merge, not a quicksort
            batch = np.sort(np.concatenate((self._chunks.pop(), batch)), kind="stable")
        self._chunks.append(batch)


def _duplicate(doc_id: str) -> ValueError:
    return ValueError(f"duplicate document id {doc_id!r}: ids must be unique within a document set")


class _HeldOut:
    """Validation draws waiting until every training line is known, in a temporary file: in a list
    they held the whole validation split in memory."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile()

    def add(self, doc: Document) -> None:
        self._file.write(json.dumps([doc.id, doc.text]).encode("ascii") + b"\n")

    def drain(self) -> Iterator[Document]:
        """Every document added, in order; the file is gone afterwards."""
        with self._file as f:
            f.seek(0)
            for line in f:
                yield Document(*json.loads(line))


def write_documents(
    output_path: str,
    documents: Iterable[Document],
    *,
    validation_fraction: float,
    shard_bytes: int,
    log: RecordLog,
    source: dict,
    what: str,
    near_duplicate_overlap: float | None = NEAR_DUPLICATE_OVERLAP,
) -> dict:
    """Split, shard and write `documents`; the index file goes last, once every shard is complete.

    A document drawn for validation that is a near-copy of the training documents (at least
    `near_duplicate_overlap` of its distinct normalised lines occur in them: `TrainingLines`)
    goes to train instead, counted in the summary: validating on near-copies of training data
    would report memorisation as generalisation. None keeps every drawn document in validation.

    Fails (no index written) when `log` counted too many skipped records or when no document is
    left; `what` names the input in those messages. Writes summary.json and prints its line.
    """
    import numpy as np  # here, not at the top: declaring a graph imports this module, and no numpy

    from keel.data.arrays import write_array

    clear_documents(output_path)
    writers = {split: _ShardedSplitWriter(output_path, split, shard_bytes) for split in SPLITS}
    ids = DocumentIds()
    empty = 0
    # validation draws wait until every training line is known, when near-copies are looked for
    held_out = _HeldOut() if near_duplicate_overlap is not None and validation_fraction > 0 else None
    train_lines = TrainingLines()
    for doc in documents:
        digest = id_digest(doc.id)
        ids.add(doc.id, digest)
        if not doc.text:
            empty += 1
            continue
        if _split_of_digest(digest, validation_fraction) == "train":
            writers["train"].add(doc)
            if held_out is not None:
                train_lines.add(doc.text)
        elif held_out is not None:
            held_out.add(doc)
        else:
            writers["validation"].add(doc)
    ids.seal()
    moved = []
    for doc in held_out.drain() if held_out is not None else ():
        copy = train_lines.near_duplicate(doc.text, near_duplicate_overlap)
        writers["train" if copy else "validation"].add(doc)
        if copy:
            moved.append(doc.id)
    for writer in writers.values():
        writer.close()
    log.check()
    total = sum(w.documents for w in writers.values())
    if not total:
        lost = "; ".join(x for x in (log.describe(), f"{empty} with empty text" if empty else "") if x)
        raise EmptyDataError(f"{what} gave no documents ({log.records} records{': ' + lost if lost else ''}): "
                             "check that the files hold records with text")
    warnings = []
    if validation_fraction > 0 and not writers["validation"].documents:
        if moved:  # drawn, then kept out: raising the fraction would draw more of the same
            warnings.append(f"the validation split is empty: all {len(moved)} documents drawn for it are near-copies of "
                            f"training documents (at least {near_duplicate_overlap:.0%} of their lines appear in training "
                            "text) and were kept in train; if they share boilerplate (a license header, a template) "
                            "rather than text, raise near_duplicate_overlap (None keeps every draw)")
        else:
            warnings.append(f"the validation split is empty: none of the {total} documents fell in validation_fraction="
                            f"{validation_fraction:g} (about {total * validation_fraction:.2g} expected); raise it to "
                            "evaluate on this data")
    if not writers["train"].documents:
        warnings.append(f"the train split is empty: all {total} documents are in validation (validation_fraction="
                        f"{validation_fraction:g}); lower it (or give more documents) to tokenize this set for training")
    index = {
        "format": FORMAT,
        "source": source,
        "validation_fraction": validation_fraction,
        "splits": {
            split: {"shards": w.shards, "documents": w.documents, "bytes": w.bytes} for split, w in writers.items()
        },
        "empty_documents": empty,
        "bad_records": {"count": log.skipped_count, "examples": [str(r) for r in log.examples]},
    }
    summary = {"documents": total, "splits": {s: {"documents": w.documents, "bytes": w.bytes} for s, w in writers.items()},
               "empty_documents": empty, **log.summary(), "warnings": warnings,
               "near_duplicates_kept_out_of_validation": {"count": len(moved), "threshold": near_duplicate_overlap,
                                                          "examples": moved[:10]}}
    line = (f"documents: {total:,} ({writers['train'].documents:,} train, {writers['validation'].documents:,} validation; "
            f"{sum(w.bytes for w in writers.values()):,} bytes) from {log.records:,} records")
    near = (f"kept {len(moved)} near-copies of training documents out of validation (e.g. {moved[0]})"
            if moved else "")
    extra = [x for x in (log.describe(), f"dropped {empty} with empty text" if empty else "", near, *warnings) if x]
    for split, writer in writers.items():
        texts = np.frombuffer(writer.texts, dtype=np.uint64).reshape(-1, 2)
        write_array(storage.join(output_path, TEXTS_FILE.format(split=split)), texts)
    write_summary(output_path, summary, line + "".join(f"\n  {x}" for x in extra))
    storage.write_json(storage.join(output_path, INDEX_FILE), index)
    return index


def read_index(documents_path: str) -> dict:
    index = storage.read_json(storage.join(documents_path, INDEX_FILE))
    if index is None or index.get("format") != FORMAT:
        raise FileNotFoundError(
            f"no keel document set at {documents_path} (expected {INDEX_FILE} written by an ingestion step)"
        )
    return index


def shard_urls(documents_path: str, split: str) -> list[str]:
    return [storage.join(documents_path, name) for name in read_index(documents_path)["splits"][split]["shards"]]


def read_shard(url: str) -> Iterator[Document]:
    """Every document of one shard, in order, each parsed as it is asked for (a reader can hand
    on the first documents before the shard's last are parsed)."""
    fs, path = storage.split(url)
    raw = zstandard.ZstdDecompressor().decompress(fs.cat_file(path), max_output_size=1 << 34)
    return (Document(**json.loads(line)) for line in raw.split(b"\n") if line)


def document_texts(documents_path: str, split: str):
    """The `text_hash` and UTF-8 bytes of every document in a split, uint64 arrays (None for a set
    written before keel recorded them)."""
    from keel.data.arrays import read_array  # numpy, as in write_documents

    texts = read_array(storage.join(documents_path, TEXTS_FILE.format(split=split)))
    return None if texts is None else (texts[:, 0], texts[:, 1])


def iter_documents(documents_path: str, split: str) -> Iterator[Document]:
    for url in shard_urls(documents_path, split):
        yield from read_shard(url)
