"""Tokenizers: train a byte-level BPE on a document set, or name an existing one; load either.

A trained tokenizer's output directory holds `tokenizer.json` (Hugging Face `tokenizers`) and a
`tokenizer_config.json` naming its bos/eos/pad tokens, the layout Levanter's own tokenizer loader
(`levanter.tokenizers.load_tokenizer(dir)`) reads. Anything that takes a tokenizer reference takes
such a directory, a path to a `tokenizer.json`, or a hub name (only where a hub is reachable).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from keel.data.documents import iter_documents
from keel.executor import storage
from keel.executor.step import this_output

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


@dataclass(frozen=True)
class TrainTokenizerConfig:
    """Train a byte-level BPE on the train split of the document set at `documents`."""

    documents: str
    vocab_size: int = 1024
    bos_token: str | None = "<|bos|>"
    eos_token: str = "<|endoftext|>"
    pad_token: str | None = "<|pad|>"
    min_frequency: int = 2
    max_training_bytes: int | None = None
    output_path: str = this_output()

    def __post_init__(self):
        specials = self.special_tokens
        if len(set(specials)) != len(specials):
            raise ValueError(f"TrainTokenizerConfig: bos/eos/pad tokens must differ, got {specials}")
        if self.vocab_size < 256 + len(specials):
            raise ValueError(
                f"TrainTokenizerConfig.vocab_size={self.vocab_size} is too small: a byte-level BPE needs "
                f"256 byte tokens plus {len(specials)} special tokens"
            )

    @property
    def special_tokens(self) -> tuple[str, ...]:
        return tuple(t for t in (self.eos_token, self.bos_token, self.pad_token) if t is not None)


@dataclass(frozen=True)
class LoadedTokenizer:
    """A `tokenizers.Tokenizer` with the ids of its special tokens (None where it has none)."""

    tokenizer: Any
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()


def _training_texts(config: TrainTokenizerConfig) -> Iterator[str]:
    used = 0
    for doc in iter_documents(config.documents, "train"):
        if config.max_training_bytes is not None and used >= config.max_training_bytes:
            return
        used += len(doc.text.encode("utf-8"))
        yield doc.text


def train_tokenizer(config: TrainTokenizerConfig) -> None:
    """Step function: train the BPE and write tokenizer.json and tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        min_frequency=config.min_frequency,
        special_tokens=list(config.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_texts(config), trainer)
    storage.write_atomic(storage.join(config.output_path, TOKENIZER_FILE), tokenizer.to_str(pretty=True))
    special = {"bos_token": config.bos_token, "eos_token": config.eos_token, "pad_token": config.pad_token}
    storage.write_json(storage.join(config.output_path, TOKENIZER_CONFIG_FILE), special)


def load_tokenizer(
    ref: str, *, bos_token: str | None = None, eos_token: str | None = None, pad_token: str | None = None
) -> LoadedTokenizer:
    """Load a tokenizer directory, a tokenizer.json path or a hub name; explicit special tokens win."""
    from tokenizers import Tokenizer

    if ref.endswith(".json"):
        tokenizer_file, config_file = ref, storage.join(ref.rsplit("/", 1)[0] if "/" in ref else ".", TOKENIZER_CONFIG_FILE)
    else:
        tokenizer_file, config_file = storage.join(ref, TOKENIZER_FILE), storage.join(ref, TOKENIZER_CONFIG_FILE)
    text = storage.read_text(tokenizer_file)
    if text is not None:
        tokenizer = Tokenizer.from_str(text)
        names = storage.read_json(config_file) or {}
    elif not os.path.exists(ref) and "://" not in ref:
        tokenizer = Tokenizer.from_pretrained(ref)  # a hub name; fails offline with the hub's own error
        names = {}
    else:
        raise FileNotFoundError(f"no {TOKENIZER_FILE} at {ref!r}")
    names.update({k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token), ("pad_token", pad_token)) if v})

    def id_of(key: str) -> int | None:
        token = names.get(key)
        if isinstance(token, dict):  # transformers writes {"content": ...}
            token = token.get("content")
        if token is None:
            return None
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer {ref!r} has no token {token!r} (its {key})")
        return token_id

    return LoadedTokenizer(tokenizer, id_of("bos_token"), id_of("eos_token"), id_of("pad_token"))

