"""Tokens/s of keel's tokenize step against raw `tokenizers` encode_batch, same documents, same process.

The step reads zstd shards, encodes, packs into sequences and writes Levanter caches; the baselines
only call the tokenizer on the same documents, already in memory, in batches of the same size:
`encode_batch`, and `encode_batch_fast` (no character offsets; what the step itself calls). The
ratio printed last is against the faster of the two, so the step cannot look good merely by
skipping offsets. Each is run `--repeats` times, alternating, best of each kept. Levanter is
imported before timing (a one-off ~8 s import that is not throughput).

    uv run python benchmarks/tokenize_throughput.py [--max-bytes N] [--repeats R]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from keel.data import (
    StdlibCorpusConfig,
    TokenizeConfig,
    TrainTokenizerConfig,
    build_stdlib_corpus,
    iter_documents,
    load_tokenizer,
    tokenize_documents,
    train_tokenizer,
)
from keel.data.tokenize import STATS_FILE
from keel.executor import storage


def raw_encode(encode, texts: list[str], batch: int) -> tuple[int, float]:
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(texts), batch):
        tokens += sum(len(e) for e in encode(texts[i : i + batch], add_special_tokens=False))
    return tokens, time.perf_counter() - start


def step_run(config: TokenizeConfig) -> tuple[int, float]:
    start = time.perf_counter()
    tokenize_documents(config)
    elapsed = time.perf_counter() - start
    splits = storage.read_json(storage.join(config.output_path, STATS_FILE))["splits"].values()
    return sum(s["tokens"] - s["documents"] for s in splits), elapsed  # minus the eos the step adds per document


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-bytes", type=int, default=16_000_000, help="cap on the stdlib corpus (0: all of it)")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-documents", type=int, default=TokenizeConfig.batch_documents)
    args = parser.parse_args()

    import levanter.store.cache  # noqa: F401  (the import is a fixed start-up cost, not throughput)

    with tempfile.TemporaryDirectory() as root:
        corpus, tok_dir, cache = (os.path.join(root, d) for d in ("corpus", "tokenizer", "cache"))
        build_stdlib_corpus(StdlibCorpusConfig(max_bytes=args.max_bytes or None, output_path=corpus))
        train_tokenizer(TrainTokenizerConfig(documents=corpus, vocab_size=args.vocab_size,
                                             max_training_bytes=4_000_000, output_path=tok_dir))
        tokenizer = load_tokenizer(tok_dir).tokenizer
        texts = [d.text for split in ("train", "validation") for d in iter_documents(corpus, split)]
        config = TokenizeConfig(documents=corpus, tokenizer=tok_dir, seq_len=1024, output_path=cache,
                                batch_documents=args.batch_documents)
        print(f"corpus: {len(texts)} documents, {sum(len(t.encode()) for t in texts) / 1e6:.1f} MB; "
              f"cpus: {os.cpu_count()}; batch: {args.batch_documents} documents")

        baselines = {"encode_batch": tokenizer.encode_batch, "encode_batch_fast": tokenizer.encode_batch_fast}
        best = dict.fromkeys([*baselines, "tokenize step"], 0.0)
        for repeat in range(args.repeats):
            rates = {}
            for name, encode in baselines.items():
                tokens, seconds = raw_encode(encode, texts, args.batch_documents)
                rates[name] = tokens / seconds
            step_tokens, step_s = step_run(config)
            if step_tokens != tokens:
                raise AssertionError(f"the step tokenized {step_tokens} tokens, the raw tokenizer {tokens}")
            rates["tokenize step"] = step_tokens / step_s
            best = {name: max(best[name], rates[name]) for name in best}
            print(f"repeat {repeat} ({tokens} tokens): " + "; ".join(f"{n} {r:,.0f} tokens/s" for n, r in rates.items()))
        print("best: " + "; ".join(f"{n} {r:,.0f} tokens/s" for n, r in best.items()))
        print(f"ratio vs encode_batch: {best['tokenize step'] / best['encode_batch']:.3f}")
        raw = max(best["encode_batch"], best["encode_batch_fast"])
        print(f"ratio (tokenize step / fastest raw encode_batch call): {best['tokenize step'] / raw:.3f}")


if __name__ == "__main__":
    main()
