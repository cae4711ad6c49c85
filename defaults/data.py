"""Data defaults: one call per step of the documents -> tokenizer -> token cache chain.

    corpus = stdlib_corpus(max_bytes=4_000_000)
    tokenizer = default_tokenizer("stdlib-bpe-1k", corpus, vocab_size=1024)
    cache = default_tokenize("stdlib", corpus, tokenizer, seq_len=128)

`stdlib_tokens()` is the tutorials' chain of the three, declared once.

Step names are `documents/<name>`, `tokenizers/<name>` and `tokenized/<name>`. Two experiment files
that declare the same chain get the same identities, hence one shared output.
"""

from __future__ import annotations

import os

from keel import Step, StepFunction
from keel.data import build_stdlib_corpus, HfDatasetSpec, ingest_documents, IngestConfig, StdlibCorpusConfig
from keel.spec import TokenizeConfig, TrainTokenizerConfig

# named, not imported: they import tokenizers and Levanter, which declaring a graph must not
train_tokenizer = StepFunction("keel.data.tokenizer:train_tokenizer")
tokenize_documents = StepFunction("keel.data.tokenize:tokenize_documents")


def stdlib_corpus(*, max_bytes: int | None = None, max_files: int | None = None, include_tests: bool = True,
                  validation_fraction: float = 0.01, packages: tuple[str, ...] = (), name: str = "stdlib") -> Step:
    """The running Python's standard-library sources as a document set (its version is in the
    identity); `packages` keeps some top-level packages only (`keel.data.stdlib_families`)."""
    config = StdlibCorpusConfig(include_tests=include_tests, max_files=max_files, max_bytes=max_bytes,
                                validation_fraction=validation_fraction,
                                packages=packages if isinstance(packages, str) else tuple(packages))
    return Step(f"documents/{name}", build_stdlib_corpus, config, description="Python stdlib sources")


def ingest(name: str, inputs: tuple[str, ...] = (), *, hf_dataset: HfDatasetSpec | None = None, **kwargs) -> Step:
    """A document set from files/globs (or a HF dataset); `kwargs` are IngestConfig fields: text_field,
    validation_fraction, on_bad_record, max_bad_fraction, on_decode_error, input_version, ...
    (README "Your own data"; help(keel.data.IngestConfig))."""
    config = IngestConfig(inputs=inputs if isinstance(inputs, (str, os.PathLike)) else tuple(inputs), hf_dataset=hf_dataset,
                          **kwargs)  # one string is refused there, not split into characters
    return Step(f"documents/{name}", ingest_documents, config)


def default_tokenizer(name: str, documents: Step, *, vocab_size: int = 1024, **kwargs) -> Step:
    """A byte-level BPE trained on `documents`; `kwargs` are TrainTokenizerConfig fields."""
    config = TrainTokenizerConfig(documents=documents, vocab_size=vocab_size, **kwargs)
    return Step(f"tokenizers/{name}", train_tokenizer, config)


def default_tokenize(name: str, dataset: Step, tokenizer: Step | str, *, seq_len: int = 1024, **kwargs) -> Step:
    """Pack `dataset` into `seq_len` sequences with `tokenizer` (a tokenizer step, a tokenizer.json
    path or a hub name); `kwargs` are TokenizeConfig fields."""
    config = TokenizeConfig(documents=dataset, tokenizer=tokenizer, seq_len=seq_len, **kwargs)
    return Step(f"tokenized/{name}", tokenize_documents, config)


STDLIB_BYTES = 4_000_000


def stdlib_tokens(*, seq_len: int = 128, vocab_size: int = 1024, max_bytes: int = STDLIB_BYTES) -> Step:
    """The tutorials' data chain, declared once: the running Python's standard library (its first
    `max_bytes`) -> a byte-level BPE of `vocab_size` tokens -> packed `seq_len`-token sequences.
    Every tutorial that calls it names the same three steps, so the second one finds them cached;
    each argument is in the names (a vocabulary in k where it is whole thousands of 1024, bytes
    past the default), so two chains that differ are two sets of steps."""
    corpus = stdlib_corpus(max_bytes=max_bytes, name="stdlib" if max_bytes == STDLIB_BYTES else f"stdlib-{max_bytes}b")
    vocab = f"{vocab_size // 1024}k" if vocab_size % 1024 == 0 else str(vocab_size)
    bpe = f"{corpus.name.removeprefix('documents/')}-bpe-{vocab}"
    tokenizer = default_tokenizer(bpe, corpus, vocab_size=vocab_size)
    return default_tokenize(f"{bpe}-{seq_len}", corpus, tokenizer, seq_len=seq_len)
