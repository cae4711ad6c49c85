"""Tokens/s of keel's tokenize step against raw `tokenizers` calls, same documents, same process.

The step reads zstd shards, encodes, packs into sequences, counts each sequence's bytes and writes
Levanter caches; the baselines only call the tokenizer on the same documents, already in memory:
`encode_batch` and `encode_batch_fast` (no character offsets; what the step itself calls) in
batches of the step's size, `encode_batch_fast` once over every document (no batch boundaries
at all: the most the tokenizer's own threads can do), and `encode_batch_fast` on the step's
batches from one thread per core with the tokenizer's threads off (how the step calls it). The
ratio printed last is against the fastest of the four, so the step cannot look good merely by
skipping offsets, by batching differently or by threading differently. A fifth run, not a
baseline, is the step's own encoding function on those threads: the raw call, then each document's
ids as an int32 array (the Python list `Encoding.ids` makes, then `np.fromiter`: the one way the
`tokenizers` API hands ids out, which the raw calls skip and any consumer of them pays); it splits
the step's gap to the raw call into that conversion and the rest. Rates are medians of
`--repeats` runs. On a shared 2-core host one call's rate moves by a third between repeats (the
threaded raw call: 1.11M to 1.88M tokens/s within one run of 5 repeats), and a ratio of bests set
the luckiest of the four raw calls' 4 x repeats runs against the luckiest of the step's repeats:
it fell with the noise. The bests and their ratio are printed too.
Every raw run starts from a freshly loaded tokenizer (loaded untimed), as the step starts from the
one it loads: a `tokenizers` BPE keeps a cache of the words it has split, so a tokenizer reused
across runs encodes every run after its first from a warm cache, which the step never has (the
threaded raw call on the stdlib corpus, 2 cores, 8 interleaved pairs: median 3.42 s and 6.7 CPU s
warm against 4.02 s and 7.8 CPU s fresh). Each is run `--repeats` times, the order rotating each
repeat; CPU seconds per million tokens are printed too, since a shared machine's
load moves wall-clock rates far more than it moves CPU cost. Levanter is imported before timing (a
one-off ~8 s import, not throughput), and each step run writes into an empty directory, as the
executor gives a step: the previous run's output is removed untimed (otherwise every run but the
first would time deleting a whole cache).

    uv run python benchmarks/tokenize_throughput.py [--max-bytes N] [--repeats R]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from keel.data import (
    build_stdlib_corpus,
    iter_documents,
    load_tokenizer,
    StdlibCorpusConfig,
    tokenize_documents,
    train_tokenizer,
)
from keel.spec import TokenizeConfig, TrainTokenizerConfig
from keel.data.tokenize import STATS_FILE, _encoder, encode_threads, serial_tokenizer
from keel.executor import storage


def measured(run) -> tuple[int, float, float]:
    """(tokens, wall seconds, CPU seconds of this process's threads) of `run()`, which returns tokens."""
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = run()
    return tokens, time.perf_counter() - wall, time.process_time() - cpu


def raw_encode(encode, texts: list[str], batch: int) -> int:
    return sum(len(e) for i in range(0, len(texts), batch) for e in encode(texts[i : i + batch], add_special_tokens=False))


def threaded_tokens(encode, texts: list[str], batch: int, tokens) -> int:
    """`encode` on each batch from one thread per core, the tokenizer's own threads off (how the step
    calls it); the tokens `tokens(result)` counts in each batch's result, summed."""
    batches = [texts[i : i + batch] for i in range(0, len(texts), batch)]
    with serial_tokenizer(), ThreadPoolExecutor(encode_threads()) as pool:
        return sum(tokens(result) for result in pool.map(encode, batches))


def raw_encode_threads(encode, texts: list[str], batch: int) -> int:
    return threaded_tokens(lambda b: encode(b, add_special_tokens=False), texts, batch, lambda out: sum(map(len, out)))


def encoder_threads(loaded, config: TokenizeConfig, texts: list[str], batch: int) -> int:
    """The step's own encoding function on those threads: the raw call, then each document's ids as
    an int32 array with the step's bos/eos (the tokens counted without them)."""
    added = int(config.add_bos) + int(config.add_eos)
    return threaded_tokens(_encoder(config, loaded), texts, batch, lambda arrays: sum(len(a) - added for a in arrays))


def step_run(config: TokenizeConfig) -> int:
    tokenize_documents(config)
    splits = storage.read_json(storage.join(config.output_path, STATS_FILE))["splits"].values()
    return sum(s["tokens"] - s["documents"] for s in splits)  # minus the eos the step adds per document


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-bytes", type=int, default=16_000_000, help="cap on the stdlib corpus (0: all of it)")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-documents", type=int, default=TokenizeConfig.batch_documents)
    args = parser.parse_args()

    import levanter.store.cache  # noqa: F401  (the import is a fixed start-up cost, not throughput)

    with tempfile.TemporaryDirectory() as root:
        corpus, tok_dir, cache = (os.path.join(root, d) for d in ("corpus", "tokenizer", "cache"))
        build_stdlib_corpus(StdlibCorpusConfig(max_bytes=args.max_bytes or None, output_path=corpus))
        train_tokenizer(TrainTokenizerConfig(documents=corpus, vocab_size=args.vocab_size,
                                             max_training_bytes=4_000_000, output_path=tok_dir))

        def fresh():
            """A freshly loaded tokenizer (`load_tokenizer`'s, with its special ids), set as the step sets its own."""
            loaded = load_tokenizer(tok_dir)
            loaded.tokenizer.encode_special_tokens = True  # "<|endoftext|>" inside a document is text
            return loaded

        texts = [d.text for split in ("train", "validation") for d in iter_documents(corpus, split)]
        config = TokenizeConfig(documents=corpus, tokenizer=tok_dir, seq_len=1024, output_path=cache,
                                batch_documents=args.batch_documents)
        print(f"corpus: {len(texts)} documents, {sum(len(t.encode()) for t in texts) / 1e6:.1f} MB; "
              f"cpus: {os.cpu_count()}; batch: {args.batch_documents} documents")

        threads = encode_threads()
        encoder = f"the step's encoding function ({threads} threads)"  # not a raw call: what the gap is made of
        runs = {  # each takes a freshly loaded tokenizer (the step loads its own)
            "encode_batch": lambda t: raw_encode(t.tokenizer.encode_batch, texts, args.batch_documents),
            "encode_batch_fast": lambda t: raw_encode(t.tokenizer.encode_batch_fast, texts, args.batch_documents),
            "encode_batch_fast (one call)": lambda t: raw_encode(t.tokenizer.encode_batch_fast, texts, len(texts)),
            f"encode_batch_fast ({threads} threads)": lambda t: raw_encode_threads(t.tokenizer.encode_batch_fast, texts,
                                                                                  args.batch_documents),
            encoder: lambda t: encoder_threads(t, config, texts, args.batch_documents),
            "tokenize step": lambda t: step_run(config),
        }
        raws = [name for name in runs if name not in ("tokenize step", encoder)]
        rates: dict[str, list[float]] = {name: [] for name in runs}
        cpus: dict[str, list[float]] = {name: [] for name in runs}  # CPU s per million tokens: what load inflates less
        for repeat in range(args.repeats):
            counts = {}
            order = list(runs)[repeat % len(runs):] + list(runs)[: repeat % len(runs)]
            for name in order:
                loaded = fresh()
                counts[name], wall, cpu = measured(lambda: runs[name](loaded))
                if storage.exists(cache):  # untimed: the next step run starts from an empty output
                    storage.delete_tree(cache)
                rates[name].append(counts[name] / wall)
                cpus[name].append(cpu / counts[name] * 1e6)
                print(f"repeat {repeat}: {name} {counts[name] / wall:,.0f} tokens/s, {cpu / counts[name] * 1e6:.2f} CPU s/M tokens")
            if len(set(counts.values())) != 1:
                raise AssertionError(f"token counts differ: {counts}")
        print(f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
        print("best: " + "; ".join(f"{n} {max(rates[n]):,.0f} tokens/s ({min(cpus[n]):.2f} CPU s/M)" for n in runs))
        fastest_best = max(raws, key=lambda n: max(rates[n]))
        print(f"ratio of bests (tokenize step / {fastest_best}): {max(rates['tokenize step']) / max(rates[fastest_best]):.3f}")
        rate = {n: statistics.median(r) for n, r in rates.items()}
        cpu_cost = {n: statistics.median(c) for n, c in cpus.items()}
        print("median: " + "; ".join(f"{n} {rate[n]:,.0f} tokens/s ({cpu_cost[n]:.2f} CPU s/M)" for n in runs))
        print(f"CPU cost ratio (cheapest raw call / tokenize step, medians): "
              f"{min(cpu_cost[n] for n in raws) / cpu_cost['tokenize step']:.3f}")
        for name in raws:
            print(f"ratio vs {name}: {rate['tokenize step'] / rate[name]:.3f}")
        fastest = max(raws, key=rate.get)
        per_token = {n: 1 / rate[n] for n in (fastest, encoder, "tokenize step")}  # seconds per token, medians
        extra = per_token["tokenize step"] - per_token[fastest]
        if extra > 0:
            print(f"of the step's extra time per token over {fastest}, {(per_token[encoder] - per_token[fastest]) / extra:.0%} "
                  f"is its encoding function's (the ids as int32 arrays: {rate[encoder] / rate[fastest]:.3f} of the raw "
                  "call), the rest reading, packing, counting bytes and writing")
        print(f"ratio (tokenize step / fastest raw call, {fastest}, median tokens/s): "
              f"{rate['tokenize step'] / rate[fastest]:.3f}")


if __name__ == "__main__":
    main()
