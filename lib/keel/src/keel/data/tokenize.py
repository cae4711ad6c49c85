"""Tokenize a document set into Levanter token caches of packed fixed-length sequences.

Layout under the step's output path:

    train/        a Levanter TreeCache (levanter.store), one record per sequence:
    validation/       {"input_ids": int32[seq_len], "segment_ids": int32[seq_len]}
    train.bytes.npy, validation.bytes.npy
                  int64[sequences]: UTF-8 bytes of the text each sequence decodes to (special
                  tokens count none), what bits per byte divide by so tokenizers compare
    tokenize.json counts per split and the tokenizer's special ids (written last)
    .keel/summary.json  the same counts; a train split that fills no sequence fails the step

The caches are written with Levanter's own `SerialCacheWriter`, so `TreeCache.load` and Levanter's
dataset classes read them. The work runs as a pipeline: a thread reads and decompresses shards; two
threads encode batches of `batch_documents` with `tokenizers`' `encode_batch_fast` (the same ids as
`encode_batch`, without character offsets; its Rust core releases the GIL and encodes a batch's
documents on every core), up to ENCODE_AHEAD batches ahead, so one batch's last long documents
overlap the next batch rather than leave cores idle; the calling thread packs, counts each
sequence's bytes from a per-token table (`SequenceBytes`: what decoding would give, without
decoding) and hands sequences to a thread that writes them. Everything besides encoding (ids to
arrays, reading, packing, counting, Levanter's writer) then costs about a tenth of the tokenizer's
own CPU time on the stdlib corpus, measured per thread; `benchmarks/tokenize_throughput.py`
compares the step with raw calls. (A process pool over shards was measured too: no faster on 2
cores, since the tokenizer already keeps them busy, and it pays for moving token arrays between
processes.) Special-token strings inside a document are encoded as text, so only the step adds
bos/eos.

Sequences are handed to the writer in fixed groups of `WRITE_ROWS`, so the bytes on disk do not
depend on the (execution-only) batch size. The step starts by removing whatever an interrupted
attempt left, and Levanter writes a cache's ledger only when the cache is complete, so a killed run
leaves no loadable cache and a rerun rebuilds an identical one.
"""

from __future__ import annotations

import io
import logging
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

from keel.data.documents import SPLITS, EmptyDataError, read_index, read_shard, shard_urls
from keel.data.packing import SequencePacker
from keel.data.summary import write_summary
from keel.data.tokenizer import SequenceBytes, load_tokenizer
from keel.executor import storage
from keel.spec.data import TokenizeConfig

logger = logging.getLogger(__name__)

STATS_FILE = "tokenize.json"
BYTES_FILE = "{split}.bytes.npy"
FORMAT = "keel.token_cache/v1"
WRITE_ROWS = 1024
_QUEUE_DEPTH = 4
ENCODE_THREADS = 2  # batches encoding at once: one's last long documents overlap the next one's start
ENCODE_AHEAD = 3  # batches handed to the encoding threads ahead of the one being packed


def _exemplar():
    return {"input_ids": np.zeros((0,), dtype=np.int32), "segment_ids": np.zeros((0,), dtype=np.int32)}


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
    """Feeds a Levanter SerialCacheWriter from a queue, in fixed groups of WRITE_ROWS sequences."""

    def __init__(self, cache_dir: str):
        self._writer = SerialCacheWriter(cache_dir, _exemplar())
        self._queue: queue.Queue = queue.Queue(maxsize=_QUEUE_DEPTH)
        self._error: BaseException | None = None
        self._pending: list = []
        self._pending_rows = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="keel-tokenize-writer")
        self._thread.start()

    def _run(self):
        while (batch := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._writer.write_batch(batch)
                except BaseException as e:
                    self._error = e

    def add(self, input_ids, segment_ids) -> None:
        if self._error is not None:
            raise self._error
        self._pending.append((input_ids, segment_ids))
        self._pending_rows += len(input_ids)
        if self._pending_rows >= WRITE_ROWS:
            ids = np.concatenate([p[0] for p in self._pending])
            segs = np.concatenate([p[1] for p in self._pending])
            whole = len(ids) // WRITE_ROWS * WRITE_ROWS
            for start in range(0, whole, WRITE_ROWS):
                self._queue.put({"input_ids": ids[start : start + WRITE_ROWS], "segment_ids": segs[start : start + WRITE_ROWS]})
            self._pending = [(ids[whole:], segs[whole:])]
            self._pending_rows = len(ids) - whole

    def __enter__(self) -> "_CacheWriterThread":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """On success write the rest, then the ledger that marks the cache complete; on an error
        stop the thread and leave the cache incomplete (no ledger)."""
        if exc_type is None and self._pending_rows:
            ids = np.concatenate([p[0] for p in self._pending])
            segs = np.concatenate([p[1] for p in self._pending])
            self._queue.put({"input_ids": ids, "segment_ids": segs})
        self._queue.put(None)
        self._thread.join()
        if exc_type is None:
            if self._error is not None:
                raise self._error
            self._writer.__exit__(None, None, None)


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


def _encoded(encode, batches: Iterator[list[str]], threads: int = ENCODE_THREADS,
             ahead: int = ENCODE_AHEAD) -> Iterator[list]:
    """`encode(batch)` of each batch, in order, with up to `ahead` batches submitted to `threads` threads."""
    pool = ThreadPoolExecutor(threads, thread_name_prefix="keel-tokenize-encode")
    pending: deque = deque()
    try:
        for batch in batches:
            pending.append(pool.submit(encode, batch))
            if len(pending) >= ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _tokenize_split(config: TokenizeConfig, loaded, split: str, total_documents: int, count_bytes) -> dict:

    packer = SequencePacker(config.seq_len)
    urls = shard_urls(config.documents, split)
    documents = tokens = sequences = 0
    sequence_bytes = []
    bar = tqdm(total=total_documents, desc=f"tokenize {split}", unit="doc", unit_scale=True, mininterval=1.0)
    batches = _threaded(lambda: _document_batches(urls, config.batch_documents))
    encoded = _encoded(_encoder(config, loaded), batches)
    with bar, closing(batches), closing(encoded), _CacheWriterThread(storage.join(config.output_path, split)) as writer:
        start = time.perf_counter()
        for arrays in encoded:
            input_ids, segment_ids = packer.add(arrays)
            if len(input_ids):
                writer.add(input_ids, segment_ids)
                sequence_bytes.append(count_bytes(input_ids))
            documents += len(arrays)
            tokens += sum(len(a) for a in arrays)
            sequences += len(input_ids)
            bar.update(len(arrays))
            bar.set_postfix_str(f"{tokens / max(time.perf_counter() - start, 1e-9):,.0f} tok/s", refresh=False)
    sequence_bytes = np.concatenate(sequence_bytes) if sequence_bytes else np.zeros((0,), np.int64)
    _write_array(storage.join(config.output_path, BYTES_FILE.format(split=split)), sequence_bytes)
    return {
        "documents": documents,
        "tokens": tokens,
        "sequences": sequences,
        "dropped_tokens": packer.leftover_tokens,
        "bytes": int(sequence_bytes.sum()),
    }


def _write_array(url: str, array) -> None:

    buffer = io.BytesIO()
    np.save(buffer, array)
    fs, path = storage.split(url)
    fs.pipe_file(path, buffer.getvalue())


def read_sequence_bytes(cache_root: str, split: str):
    """The per-sequence UTF-8 byte counts of a split (None for a cache written without them)."""

    url = storage.join(cache_root, BYTES_FILE.format(split=split))
    if not storage.exists(url):
        return None
    fs, path = storage.split(url)
    return np.load(io.BytesIO(fs.cat_file(path)))


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
    count_bytes = SequenceBytes(loaded.tokenizer)  # UTF-8 bytes each sequence decodes to, special tokens none
    splits = {}
    for split in SPLITS:
        started = time.perf_counter()
        splits[split] = _tokenize_split(config, loaded, split, index["splits"][split]["documents"], count_bytes)
        elapsed = max(time.perf_counter() - started, 1e-9)
        logger.info(
            "tokenized %s: %d documents, %d tokens, %d sequences in %.1fs (%.0f docs/s, %.0f tokens/s)",
            split, splits[split]["documents"], splits[split]["tokens"], splits[split]["sequences"],
            elapsed, splits[split]["documents"] / elapsed, splits[split]["tokens"] / elapsed,
        )
    _check_not_empty(config, splits)
    stats = {
        "format": FORMAT,
        "seq_len": config.seq_len,
        "fields": ["input_ids", "segment_ids"],
        "vocab_size": loaded.vocab_size,
        "bos_id": loaded.bos_id,
        "eos_id": loaded.eos_id,
        "pad_id": loaded.pad_id,
        "splits": splits,
    }
    warnings = []
    if index["splits"]["validation"]["documents"] and not splits["validation"]["sequences"]:
        warnings.append(f"the validation split's {splits['validation']['tokens']:,} tokens do not fill one "
                        f"{config.seq_len}-token sequence: there is nothing to evaluate on")
    line = ("tokenized: " + ", ".join(f"{split} {s['sequences']:,} sequences ({s['tokens']:,} tokens from "
                                       f"{s['documents']:,} documents)" for split, s in splits.items()))
    write_summary(config.output_path, {**{k: stats[k] for k in ("seq_len", "vocab_size", "splits")}, "warnings": warnings},
                  line + "".join(f"\n  {w}" for w in warnings))
    storage.write_json(storage.join(config.output_path, STATS_FILE), stats)


def _check_not_empty(config: TokenizeConfig, splits: dict) -> None:
    """No tokens, or too few to fill one training sequence, is an error: nothing could train on it."""
    train = splits["train"]
    if not train["sequences"]:
        raise EmptyDataError(
            f"the train split of {config.documents} gave {train['tokens']:,} tokens ({train['documents']:,} documents), "
            f"not enough for one sequence of TokenizeConfig.seq_len={config.seq_len}: give it more documents or a "
            "shorter seq_len"
        )
