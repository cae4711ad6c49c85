"""Tokenizers: train a byte-level BPE on a document set, or name an existing one; load either.

A trained tokenizer's output directory holds `tokenizer.json` (Hugging Face `tokenizers`) and a
`tokenizer_config.json` naming its bos/eos/pad tokens, the layout Levanter's own tokenizer loader
(`levanter.tokenizers.load_tokenizer(dir)`) reads. Anything that takes a tokenizer reference takes
such a directory, a path to a `tokenizer.json`, or a hub name (only where a hub is reachable).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from keel.data.documents import EmptyDataError, iter_documents, read_index
from keel.data.summary import write_summary
from keel.executor import storage
from keel.spec.data import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, TrainTokenizerConfig, tokenizer_files

logger = logging.getLogger(__name__)


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


class _TrainingTexts:
    """The train split's texts (up to `max_training_bytes`), counted as the trainer reads them."""

    def __init__(self, config: TrainTokenizerConfig):
        self.config = config
        self.documents = self.bytes = 0

    def __iter__(self) -> Iterator[str]:
        for doc in iter_documents(self.config.documents, "train"):
            if self.config.max_training_bytes is not None and self.bytes >= self.config.max_training_bytes:
                return
            self.documents += 1
            self.bytes += len(doc.text.encode("utf-8"))
            yield doc.text


def train_tokenizer(config: TrainTokenizerConfig) -> None:
    """Step function: train the BPE and write tokenizer.json and tokenizer_config.json.

    An empty train split is an error; a vocabulary smaller than asked (too little text for that
    many merges) is said on the console and in summary.json."""
    if not read_index(config.documents)["splits"]["train"]["documents"]:
        raise EmptyDataError(f"TrainTokenizerConfig.documents: the train split of {config.documents} has no documents "
                             "to train on: give the documents step more data or a smaller validation_fraction")
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
    texts = _TrainingTexts(config)
    tokenizer.train_from_iterator(texts, trainer)
    storage.write_atomic(storage.join(config.output_path, TOKENIZER_FILE), tokenizer.to_str(pretty=True))
    special = {"bos_token": config.bos_token, "eos_token": config.eos_token, "pad_token": config.pad_token}
    storage.write_json(storage.join(config.output_path, TOKENIZER_CONFIG_FILE), special)
    trained = tokenizer.get_vocab_size()
    line = f"tokenizer: {trained:,} tokens from {texts.documents:,} documents ({texts.bytes:,} bytes)"
    warnings = []
    if trained < config.vocab_size:
        warnings.append(f"trained {trained:,} tokens, fewer than the {config.vocab_size:,} asked "
                        f"(TrainTokenizerConfig.vocab_size): {texts.bytes:,} bytes of text hold no more pairs seen "
                        f"{config.min_frequency}+ times; give it more text, or lower vocab_size or min_frequency")
    summary = {"vocab_size": trained, "asked": config.vocab_size, "documents": texts.documents, "bytes": texts.bytes,
               "warnings": warnings}
    write_summary(config.output_path, summary, line + "".join(f"\n  {w}" for w in warnings))


def load_tokenizer(
    ref: str, *, bos_token: str | None = None, eos_token: str | None = None, pad_token: str | None = None
) -> LoadedTokenizer:
    """Load a tokenizer directory, a tokenizer.json path or a hub name; explicit special tokens win."""
    tokenizer_file, config_file = tokenizer_files(ref)
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


def _byte_level_bytes() -> dict[str, int]:
    """The ByteLevel decoder's map from the 256 alphabet characters back to bytes (GPT-2's
    `bytes_to_unicode`, inverted): printable bytes stand for themselves, the rest for chr(256 + n)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


class SequenceBytes:
    """Counts the UTF-8 bytes of the text each row of token ids decodes to: for every row, exactly
    `len(tokenizer.decode(row, skip_special_tokens=True).encode("utf-8"))`.

    Decoding every sequence costs about a fifth of what encoding it did, so for the common case
    (a ByteLevel decoder, every added token special) the count comes from a table instead: each
    token's bytes are what the decoder maps its characters to, special tokens have none, and a row
    whose tokens are each whole UTF-8 holds exactly the sum of their lengths. A row with a token
    that is part of a character (bytes above 0x7f cut between tokens, or a sequence boundary cut
    through a character) is joined and decoded as the decoder does (invalid bytes become U+FFFD,
    3 bytes each). Any other tokenizer is decoded, and so is every row from the first call on
    whose first rows the table and the decoder disagree (a `tokenizers` that decodes differently)."""

    CHECKED_ROWS = 8

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._token_bytes = _token_bytes(tokenizer)
        self._checked = False
        if self._token_bytes is not None:  # one gather per row: length, plus 2**32 for a partial token
            self._coded = np.array([len(b) + (0 if _is_utf8(b) else 1 << 32) for b in self._token_bytes], dtype=np.int64)

    @property
    def decodes(self) -> bool:
        """True where every row is decoded (no table for this tokenizer)."""
        return self._token_bytes is None

    def __call__(self, input_ids):
        """int64[rows]: the bytes of each row of the int array `input_ids` (rows, seq_len)."""
        if self._token_bytes is None:
            return self.decoded(input_ids)
        sums = self._coded[input_ids].sum(axis=1)
        counts = sums & 0xFFFFFFFF
        table = self._token_bytes
        for row in np.flatnonzero(sums >> 32):
            text = b"".join([table[i] for i in input_ids[row].tolist()]).decode("utf-8", errors="replace")
            counts[row] = len(text.encode("utf-8"))
        if not self._checked and len(counts):
            self._checked = True
            if not np.array_equal(counts[: self.CHECKED_ROWS], self.decoded(input_ids[: self.CHECKED_ROWS])):
                logger.warning("byte counts from the token table differ from decoding: decoding every sequence")
                self._token_bytes = None
                return self.decoded(input_ids)
        return counts

    def decoded(self, input_ids):
        """The same counts, by decoding every row, one at a time on this thread: `decode_batch`
        would wait behind the encoding batches in `tokenizers`' shared thread pool (the step's
        first call, which checks the table, stalled its pipeline for half a second)."""
        decode = self.tokenizer.decode
        rows = np.asarray(input_ids).tolist()
        return np.array([len(decode(row, skip_special_tokens=True).encode("utf-8")) for row in rows], dtype=np.int64)


def _token_bytes(tokenizer) -> list[bytes] | None:
    """Each id's bytes as `decode(..., skip_special_tokens=True)` emits them, or None where the
    tokenizer's decoding is not a per-token byte map (another decoder, or added tokens that are
    not special, which decode outside the decoder)."""
    if type(tokenizer.decoder) is not decoders.ByteLevel:
        return None
    added = tokenizer.get_added_tokens_decoder()
    if not all(token.special for token in added.values()):
        return None
    to_byte = _byte_level_bytes()
    table = []
    for token_id in range(max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1):
        if token_id in added:
            table.append(b"")  # special: skipped
            continue
        token = tokenizer.id_to_token(token_id)
        if token is None:
            return None
        try:
            table.append(bytes([to_byte[c] for c in token]))
        except KeyError:  # a character outside the alphabet: the decoder keeps the token's own UTF-8
            table.append(token.encode("utf-8"))
    return table


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True

