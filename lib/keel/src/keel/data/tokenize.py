"""Tokenize a document set into Levanter token caches of packed fixed-length sequences.

Layout under the step's output path:

    train/        a Levanter TreeCache (levanter.store), one record per sequence:
    validation/       {"input_ids": int32[seq_len], "segment_ids": int32[seq_len]}
    train.bytes.npy, validation.bytes.npy
                  int64[sequences]: UTF-8 bytes of the tokens the loss predicts in each sequence
                  (`SequenceBytes`; special tokens count none), what bits per byte divide by so
                  tokenizers compare
    tokenize.json counts per split, the tokenizer's special ids and its identity (`tokenizer_identity`,
                  which a training step holds its caches to) (written last)
    .keel/summary.json  the same counts; a train split that fills no sequence fails the step

The caches are written with Levanter's own `SerialCacheWriter`, so `TreeCache.load` and Levanter's
dataset classes read them. The work runs as one pipeline over both splits, train then validation:
a thread reads and decompresses shards, parsing documents as batches take them; one thread per
core encodes batches of `batch_documents` with `tokenizers`' `encode_batch_fast` (the same ids as
`encode_batch`, without character offsets; its Rust core releases the GIL), up to two batches per
thread ahead of the one being packed; the calling thread packs, counts each sequence's predicted
bytes (`SequenceBytes`: from a per-token table for byte-level tokenizers, by batch decoding for
others) and hands sequences to one thread that opens both caches at the start and writes them in
split order, so the train split's last write and ledger overlap the validation split's encoding.

Each batch encodes on one thread, with `tokenizers`' own thread pool off (`serial_tokenizer`):
called from one thread, `encode_batch_fast` spreads a batch over every core with rayon, while the
threads here already keep every core busy, and two thread pools on the same cores only contend.
Raw calls on the stdlib corpus (2 cores, interleaved runs) encode 17-44% more tokens per second
this way than through rayon; the step itself gained -2%, +5% and +15% (median tokens/s of interleaved A/B
runs), less than the raw calls since its other Python work (ids to arrays, reading, packing,
counting: about 0.7 CPU s of its 6 for 6.5M tokens) holds the GIL that the encoding threads need
between batches. `benchmarks/tokenize_throughput.py` compares the step with raw calls, both ways
of threading among them. (A process pool over shards was measured too: no faster on 2 cores, and
it pays for moving token arrays between processes.) Special-token strings inside a document are
encoded as text, so only the step adds bos/eos.

Sequences are handed to the writer in fixed groups of about `WRITE_TOKENS` tokens, so the bytes on
disk do not depend on the (execution-only) batch size; Levanter's writer costs per group, and groups
of 4M tokens cost it 40% less CPU than groups of 1M (0.20 s against 0.34 s for 6.5M tokens). The
step starts by removing whatever an interrupted attempt left, and Levanter writes a cache's ledger
only when the cache is complete, so a killed run leaves no loadable cache and a rerun rebuilds an
identical one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing

import numpy as np
from levanter.store.cache import SerialCacheWriter
from tqdm import tqdm

from keel.data.arrays import write_array
from keel.data.cache_files import BYTES_FILE, STATS_FILE
from keel.data.datasets import FORMAT, exemplar
from keel.data.documents import SPLITS, EmptyDataError, read_index, read_shard, shard_urls
from keel.data.packing import SequencePacker
from keel.data.summary import write_summary
from keel.data.tokenizer import SequenceBytes, load_tokenizer
from keel.executor import storage, warn
from keel.executor.resources import machine_cores
from keel.spec.data import TokenizeConfig

logger = logging.getLogger(__name__)

WRITE_TOKENS = 1 << 22  # per group handed to Levanter's writer: 4096 sequences of 1024 tokens
_QUEUE_DEPTH = 4
ENCODE_AHEAD = 2  # batches per encoding thread handed over ahead of the one being packed
LEFT_OUT_WARNS = 0.1
"""A split whose last, partial sequence (left out of its cache) holds more than this share of its
tokens is warned of: the documents it cuts are missing from training or evaluation."""
PARALLELISM = "TOKENIZERS_PARALLELISM"  # read by `tokenizers` at every call
_FINISH, _END = object(), object()  # a cache writer's thread: this cache is complete; stop


def _threaded(produce, depth: int = _QUEUE_DEPTH) -> Iterator:
    """Run the generator `produce()` on a thread, yielding its items here; re-raises its errors."""
    items: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def run():
        try:
            for item in produce():
                while not stop.is_set():
                    try:
                        items.put(("item", item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            items.put(("done", done))
        except BaseException as e:  # handed to the consumer, which raises it
            items.put(("error", e))

    thread = threading.Thread(target=run, daemon=True, name="keel-tokenize-reader")
    thread.start()
    try:
        while True:
            kind, value = items.get()
            if kind == "error":
                raise value
            if kind == "done":
                return
            yield value
    finally:
        stop.set()


class _CacheWriterThread:
    """Writes one Levanter cache per directory, one after the other, with a SerialCacheWriter fed
    from a queue in fixed groups of `rows` sequences.

    One thread writes them all, so the writes reach the disk in the order a split-by-split run
    makes them; `finish()` ends the current cache, whose last sequences and ledger the thread then
    writes while the caller goes on with the next. The thread opens the caches itself, all at
    once at the start, so the first batches encode meanwhile."""

    def __init__(self, cache_dirs: list[str], rows: int):
        self._rows = rows
        self._queue: queue.Queue = queue.Queue(maxsize=_QUEUE_DEPTH)
        self._error: BaseException | None = None
        self._unfinished = len(cache_dirs)
        self._pending: list = []
        self._pending_rows = 0
        self._thread = threading.Thread(target=self._run, args=(cache_dirs,), daemon=True, name="keel-tokenize-writer")
        self._thread.start()

    def _run(self, cache_dirs: list[str]) -> None:
        try:
            for writer in [SerialCacheWriter(cache_dir, exemplar()) for cache_dir in cache_dirs]:
                while (item := self._queue.get()) is not _FINISH:
                    if item is _END:
                        return  # stopped by an error: this cache gets no ledger
                    writer.write_batch(item)
                writer.__exit__(None, None, None)  # the ledger: this cache is complete
        except BaseException as e:  # raised on the calling thread
            self._error = e
        while self._queue.get() is not _END:
            pass  # drained, so that the caller's puts never block

    def add(self, input_ids, segment_ids) -> None:
        if self._error is not None:
            raise self._error
        self._pending.append((input_ids, segment_ids))
        self._pending_rows += len(input_ids)
        if self._pending_rows >= self._rows:
            ids = np.concatenate([p[0] for p in self._pending])
            segs = np.concatenate([p[1] for p in self._pending])
            whole = len(ids) // self._rows * self._rows
            for start in range(0, whole, self._rows):
                self._queue.put({"input_ids": ids[start : start + self._rows], "segment_ids": segs[start : start + self._rows]})
            self._pending = [(ids[whole:], segs[whole:])]
            self._pending_rows = len(ids) - whole

    def finish(self) -> None:
        """Queue the current cache's last sequences and its ledger; what is added next goes to the next cache."""
        if self._pending_rows:
            ids = np.concatenate([p[0] for p in self._pending])
            segs = np.concatenate([p[1] for p in self._pending])
            self._queue.put({"input_ids": ids, "segment_ids": segs})
        self._pending, self._pending_rows = [], 0
        self._queue.put(_FINISH)
        self._unfinished -= 1

    def __enter__(self) -> "_CacheWriterThread":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """On success finish every cache and wait for the ledgers; on an error stop the thread,
        leaving the cache being written incomplete (no ledger)."""
        if exc_type is None:
            while self._unfinished:
                self.finish()
        self._queue.put(_END)
        self._thread.join()
        if exc_type is None and self._error is not None:
            raise self._error


def _document_batches(urls: list[str], batch_documents: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for url in urls:
        for doc in read_shard(url):
            batch.append(doc.text)
            if len(batch) == batch_documents:
                yield batch
                batch = []
    if batch:
        yield batch


def _split_batches(config: TokenizeConfig) -> Iterator[tuple[str, list[str]]]:
    """(split, texts) of every batch, the splits one after the other."""
    for split in SPLITS:
        for texts in _document_batches(shard_urls(config.documents, split), config.batch_documents):
            yield split, texts


def _encoder(config: TokenizeConfig, loaded):
    """texts -> one int32 array per document: bos/eos as configured around its ids."""
    # encode_batch_fast: the same ids as encode_batch without computing character offsets
    encode = getattr(loaded.tokenizer, "encode_batch_fast", loaded.tokenizer.encode_batch)
    bos = loaded.bos_id if config.add_bos else None
    eos = loaded.eos_id if config.add_eos else None

    def encode_texts(texts: list[str]) -> list:
        arrays = []
        for encoding in encode(texts, add_special_tokens=False):
            ids = encoding.ids  # a fresh list
            if bos is not None:
                ids.insert(0, bos)
            if eos is not None:
                ids.append(eos)
            arrays.append(np.fromiter(ids, dtype=np.int32, count=len(ids)))
        return arrays

    return encode_texts


def encode_threads() -> int:
    """One encoding thread per core this process may run on."""
    return machine_cores()


class _SerialTokenizer:
    """`tokenizers` encodes each call on the calling thread while a `serial_tokenizer()` block runs
    (the step's threads parallelise over batches instead). The switch is its environment variable,
    which is the process's: a tokenizer used meanwhile on another thread encodes the same ids, only
    serially. Blocks counted: two tokenize steps in one launcher overlap, and the setting from
    before the first comes back after the last (each restoring its own left it off)."""

    def __init__(self):
        self._lock, self._open, self._before = threading.Lock(), 0, None

    @contextlib.contextmanager
    def __call__(self):
        with self._lock:
            if not self._open:
                self._before = os.environ.get(PARALLELISM)
                os.environ[PARALLELISM] = "false"
            self._open += 1
        try:
            yield
        finally:
            with self._lock:
                self._open -= 1
                if not self._open:
                    if self._before is None:
                        os.environ.pop(PARALLELISM, None)
                    else:
                        os.environ[PARALLELISM] = self._before


serial_tokenizer = _SerialTokenizer()


def _encoded(encode, batches: Iterator[tuple[str, list[str]]]) -> Iterator[tuple[str, list]]:
    """(split, `encode(texts)`) of each batch, in order, on one thread per core with `ENCODE_AHEAD`
    batches per thread submitted ahead."""
    threads = encode_threads()
    ahead = ENCODE_AHEAD * threads
    pool = ThreadPoolExecutor(threads, thread_name_prefix="keel-tokenize-encode")
    pending: deque = deque()
    try:
        for split, texts in batches:
            pending.append((split, pool.submit(encode, texts)))
            if len(pending) >= ahead:
                split, future = pending.popleft()
                yield split, future.result()
        while pending:
            split, future = pending.popleft()
            yield split, future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class _SplitPacker:
    """One split's packing: its sequences, each one's bytes, and the split's counts."""

    def __init__(self, seq_len: int, count_bytes):
        self.packer = SequencePacker(seq_len)
        self.count_bytes = count_bytes
        self.documents = self.tokens = self.sequences = 0
        self.sequence_bytes: list = []

    def add(self, arrays: list) -> tuple[np.ndarray, np.ndarray]:
        """The (input_ids, segment_ids) of the sequences these documents complete."""
        input_ids, segment_ids = self.packer.add(arrays)
        if len(input_ids):
            self.sequence_bytes.append(self.count_bytes(input_ids, segment_ids))
        self.documents += len(arrays)
        self.tokens += sum(map(len, arrays))
        self.sequences += len(input_ids)
        return input_ids, segment_ids

    def stats(self, bytes_url: str) -> dict:
        """Write the byte counts to `bytes_url`; the split's counts for tokenize.json."""
        sequence_bytes = np.concatenate(self.sequence_bytes) if self.sequence_bytes else np.zeros((0,), np.int64)
        write_array(bytes_url, sequence_bytes)
        return {
            "documents": self.documents,
            "tokens": self.tokens,
            "sequences": self.sequences,
            "dropped_tokens": self.packer.leftover_tokens,
            "bytes": int(sequence_bytes.sum()),
        }


def _tokenize_splits(config: TokenizeConfig, loaded, documents: int, count_bytes) -> dict:
    """Every split through one pipeline, train then validation: the encoding threads go from one
    split's last batch straight to the next one's first, and a split's last write and ledger
    overlap the next split's encoding (rather than each split starting and draining its own)."""
    packers = {split: _SplitPacker(config.seq_len, count_bytes) for split in SPLITS}
    bar = tqdm(total=documents, desc="tokenize", unit="doc", unit_scale=True, mininterval=1.0)
    batches = _threaded(lambda: _split_batches(config))
    encoded = _encoded(_encoder(config, loaded), batches)
    writer = _CacheWriterThread([storage.join(config.output_path, split) for split in SPLITS],
                                rows=max(1, WRITE_TOKENS // config.seq_len))
    with serial_tokenizer(), writer, bar, closing(batches), closing(encoded):
        start, current = time.perf_counter(), 0
        for split, arrays in encoded:
            while SPLITS[current] != split:
                writer.finish()
                current += 1
            input_ids, segment_ids = packers[split].add(arrays)
            if len(input_ids):
                writer.add(input_ids, segment_ids)
            bar.update(len(arrays))
            bar.set_postfix_str(f"{sum(p.tokens for p in packers.values()) / max(time.perf_counter() - start, 1e-9):,.0f} tok/s",
                                refresh=False)
    return {split: packer.stats(storage.join(config.output_path, BYTES_FILE.format(split=split)))
            for split, packer in packers.items()}


def clear_token_cache(output_path: str) -> None:
    """Remove what an interrupted attempt left (never the executor's own `.keel/` folder)."""
    for name in (STATS_FILE, *SPLITS, *(BYTES_FILE.format(split=s) for s in SPLITS)):
        url = storage.join(output_path, name)
        if storage.exists(url):
            storage.delete_tree(url)


def tokenize_documents(config: TokenizeConfig) -> None:
    """Step function: write one Levanter cache per split, then `tokenize.json`."""
    loaded = load_tokenizer(config.tokenizer, bos_token=config.bos_token, eos_token=config.eos_token)
    loaded.tokenizer.encode_special_tokens = True  # "<|endoftext|>" inside a document is text, not a boundary
    for flag, token_id, name in ((config.add_bos, loaded.bos_id, "bos"), (config.add_eos, loaded.eos_id, "eos")):
        if flag and token_id is None:
            raise ValueError(
                f"TokenizeConfig.add_{name}=True but tokenizer {config.tokenizer!r} names no {name} token: "
                f"set TokenizeConfig.{name}_token or add_{name}=False"
            )
    index = read_index(config.documents)
    clear_token_cache(config.output_path)
    count_bytes = SequenceBytes(loaded.tokenizer)  # UTF-8 bytes of each sequence's predicted tokens
    started = time.perf_counter()
    splits = _tokenize_splits(config, loaded, sum(index["splits"][s]["documents"] for s in SPLITS), count_bytes)
    elapsed = max(time.perf_counter() - started, 1e-9)
    for split, counts in splits.items():
        logger.info("tokenized %s: %d documents, %d tokens, %d sequences",
                    split, counts["documents"], counts["tokens"], counts["sequences"])
    tokens = sum(counts["tokens"] for counts in splits.values())
    logger.info("tokenized %d tokens in %.1fs (%.0f tokens/s)", tokens, elapsed, tokens / elapsed)
    _check_not_empty(config, splits)
    stats = {
        "format": FORMAT,
        "seq_len": config.seq_len,
        "fields": ["input_ids", "segment_ids"],
        "vocab_size": loaded.vocab_size,  # max id + 1: what data_checks compares with the model's
        "bos_id": loaded.bos_id,
        "eos_id": loaded.eos_id,
        "pad_id": loaded.pad_id,
        "tokenizer": tokenizer_identity(config, loaded),  # what the ids mean: a run's caches must agree on it
        "documents": config.documents,  # the document set, whose splits a training step compares (data_checks)
        "splits": splits,
    }
    warnings = []
    if index["splits"]["validation"]["documents"] and not splits["validation"]["sequences"]:
        warnings.append(f"the validation split's {splits['validation']['tokens']:,} tokens do not fill one "
                        f"{config.seq_len}-token sequence: there is nothing to evaluate on")
    for split, s in splits.items():
        if s["sequences"] and s["dropped_tokens"] > LEFT_OUT_WARNS * s["tokens"]:
            warnings.append(f"the {split} split's last {s['dropped_tokens']:,} tokens ({s['dropped_tokens'] / s['tokens']:.0%} "
                            f"of them) do not fill a {config.seq_len}-token sequence and are left out of its cache: "
                            "give it more documents or a shorter seq_len")
    for warning in warnings:
        warn(warning)  # the step is done with warnings: `keel run` and `keel status` say so
    line = "tokenized: " + ", ".join(
        f"{split} {s['sequences']:,} sequences ({s['tokens']:,} tokens from {s['documents']:,} documents"
        + (f"; the last {s['dropped_tokens']:,} left out, short of a sequence)" if s["dropped_tokens"] else ")")
        for split, s in splits.items())
    write_summary(config.output_path, {**{k: stats[k] for k in ("seq_len", "vocab_size", "splits")}, "warnings": warnings},
                  line + "".join(f"\n  {w}" for w in warnings))
    storage.write_json(storage.join(config.output_path, STATS_FILE), stats)


def tokenizer_identity(config: TokenizeConfig, loaded) -> dict:
    """What an id means: the tokenizer's vocabulary (`LoadedTokenizer.vocabulary`) and the bos/eos
    ids added around each document."""
    return {"vocabulary": loaded.vocabulary, "bos_id": loaded.bos_id if config.add_bos else None,
            "eos_id": loaded.eos_id if config.add_eos else None}


def _check_not_empty(config: TokenizeConfig, splits: dict) -> None:
    """No tokens, or too few to fill one training sequence, is an error: nothing could train on it."""
    train = splits["train"]
    if not train["sequences"]:
        raise EmptyDataError(
            f"the train split of {config.documents} gave {train['tokens']:,} tokens ({train['documents']:,} documents), "
            f"not enough for one sequence of TokenizeConfig.seq_len={config.seq_len}: give it more documents or a "
            "shorter seq_len"
        )
