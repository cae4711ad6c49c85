"""Tokenizers: train a byte-level BPE on a document set, or name an existing one; load either.

A trained tokenizer's output directory holds `tokenizer.json` (Hugging Face `tokenizers`) and a
`tokenizer_config.json` naming its bos/eos/pad tokens, the layout Levanter's own tokenizer loader
(`levanter.tokenizers.load_tokenizer(dir)`) reads. Anything that takes a tokenizer reference takes
such a directory, a path to a `tokenizer.json`, or a hub name (only where a hub is reachable).
"""

from __future__ import annotations

import hashlib
import json
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


@dataclass(frozen=True)
class LoadedTokenizer:
    """A `tokenizers.Tokenizer` with the ids of its special tokens (None where it has none)."""

    tokenizer: Any
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None

    @property
    def vocab_size(self) -> int:
        """One more than the largest id, added tokens included: the embedding rows its ids need. Not
        `get_vocab_size()`, the count of tokens, which is smaller where the ids leave gaps."""
        return max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    @property
    def vocabulary(self) -> str:
        """A digest of every token with its id, added tokens included: what its ids mean, not where
        the tokenizer lay nor how the library serialises it."""
        tokens = sorted(self.tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])
        return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


class _TrainingTexts:
    """The train split's texts, counted as the trainer reads them: at most `max_training_bytes`, the
    document that reaches the cap cut there (on a character boundary; whole, one large first document
    gave the trainer 220 kB under a 1,000-byte cap)."""

    def __init__(self, config: TrainTokenizerConfig):
        self.config = config
        self.documents = self.bytes = 0
        self.capped = False  # whether the cap stopped the reading before the split's end

    def __iter__(self) -> Iterator[str]:
        cap = self.config.max_training_bytes
        for doc in iter_documents(self.config.documents, "train"):
            encoded = doc.text.encode("utf-8")
            if cap is not None and self.bytes + len(encoded) > cap:
                self.capped = True
                text = encoded[:cap - self.bytes].decode("utf-8", errors="ignore")
                if text:
                    self.documents += 1
                    self.bytes += len(text.encode("utf-8"))
                    yield text
                return
            self.documents += 1
            self.bytes += len(encoded)
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
                        f"{config.min_frequency}+ times; give it more text"
                        f"{' (raise max_training_bytes, which stopped it)' if texts.capped else ''}, "
                        "or lower vocab_size or min_frequency")
    summary = {"vocab_size": trained, "asked": config.vocab_size, "documents": texts.documents, "bytes": texts.bytes,
               "warnings": warnings}
    write_summary(config.output_path, summary, line + "".join(f"\n  {w}" for w in warnings))


def _looks_like_a_path(ref: str) -> bool:
    """A tokenizer named as a file or folder rather than a hub repo ('org/name'): a typo in it
    should say the file is missing, not that the hub has no such repo."""
    return ref.startswith((".", "/", "~")) or ref.endswith(".json") or ref.count("/") > 1


def load_tokenizer(
    ref: str, *, bos_token: str | None = None, eos_token: str | None = None, pad_token: str | None = None
) -> LoadedTokenizer:
    """Load a tokenizer directory, a tokenizer.json path or a hub name; explicit special tokens win.

    Truncation and padding saved in the file are turned off: keel packs whole documents into its
    own sequences, and a published tokenizer.json often carries either. Kept, truncation cut every
    document to its length with no word said, and padding put pad ids inside documents, as many as
    the other documents of their encode batch made, so the cache depended on `batch_documents`."""
    tokenizer_file, config_file = tokenizer_files(ref)
    text = storage.read_text(tokenizer_file)
    if text is not None:
        try:
            tokenizer = Tokenizer.from_str(text)
        except Exception as exc:  # noqa: BLE001 - the Rust library raises a bare Exception with its parser's words
            raise ValueError(f"{tokenizer_file} is not a Hugging Face tokenizers file ({exc}): give the tokenizer's "
                             f"folder or its {TOKENIZER_FILE} (TokenizeConfig.tokenizer), not its vocab.json or "
                             "tokenizer_config.json") from None
        names = storage.read_json(config_file) or {}
    elif not os.path.exists(ref) and "://" not in ref and not _looks_like_a_path(ref):
        tokenizer = Tokenizer.from_pretrained(ref)  # a hub name; fails offline with the hub's own error
        names = {}
    else:
        where = "" if os.path.exists(ref) or "://" in ref or os.path.isabs(ref) else f" (relative to {os.getcwd()})"
        raise FileNotFoundError(f"no {TOKENIZER_FILE} at {ref!r}{where}: give the tokenizer's folder or its "
                                f"{TOKENIZER_FILE} (TokenizeConfig.tokenizer), or a hub name such as 'org/name'")
    tokenizer.no_truncation()
    tokenizer.no_padding()
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


REPLACEMENT = "\ufffd"  # what a decoder emits for a byte that is no whole character: 3 UTF-8 bytes


def predicted_tokens(segment_ids) -> np.ndarray:
    """bool[rows, seq_len]: the tokens the next-token loss predicts, as targets. Position j is one
    where the loss weighs position j - 1 (`keel.model.loss.next_token_weight`: same, non-padding
    document; Levanter's `next_token_loss_weight`: never a row's last position), so a row's first
    token and each document's first token in a row are context only. The eval step checks these
    against the loss's own weights (`keel.trained.evaluate.targets_in`)."""
    segments = np.asarray(segment_ids)
    predicted = np.zeros(segments.shape, dtype=bool)
    predicted[:, 1:] = (segments[:, 1:] == segments[:, :-1]) & (segments[:, :-1] >= 0)
    return predicted


class SequenceBytes:
    """Counts, for every row, the UTF-8 bytes of the tokens the loss predicts (`predicted_tokens`;
    special tokens count none): what bits per byte divide by, so that loss / ln 2 x targets / bytes
    is the bits per byte of the text predicted, not of the context tokens too.

    Where the tokenizer has a byte table (a ByteLevel decoder, every added token special), each
    predicted token counts its own bytes, so a character cut between tokens or by a row's end counts
    each of its bytes once, in the token that holds it. Any other tokenizer is decoded: each run of
    predicted tokens counts the text it adds to the token before it (the context a decoder may need,
    such as a word's leading space), the decoding of both less that of the context token alone (so
    a run after a document's bos leaves out the space SentencePiece puts before its first word,
    which the text lacks). A decoder emits U+FFFD for bytes that make no whole character, a
    character cut by the row's start or end; each counts as one byte, the one it stands for. That
    is exact where every byte is a token (SentencePiece's byte fallback: rows packed as the step
    packs them count exactly their predicted tokens' bytes) and up to two bytes off per cut
    character where a token holds several of its bytes. A U+FFFD of the text itself is
    undercounted so. A whole array of rows is two `decode_batch` calls, in `tokenizers`' Rust (5.7M
    tokens/s on the stdlib corpus)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        table = _token_bytes(tokenizer)
        self._lengths = None if table is None else np.array([len(b) for b in table], dtype=np.int64)

    @property
    def decodes(self) -> bool:
        """True where every row is decoded (no table for this tokenizer)."""
        return self._lengths is None

    def __call__(self, input_ids, segment_ids) -> np.ndarray:
        """int64[rows]: the predicted bytes of each row of the int arrays (rows, seq_len)."""
        predicted = predicted_tokens(segment_ids)
        if self._lengths is None:
            return self.decoded(input_ids, predicted)
        return np.where(predicted, self._lengths[np.asarray(input_ids)], 0).sum(axis=1)

    def decoded(self, input_ids, predicted) -> np.ndarray:
        """The counts by decoding each run of predicted tokens with its context token."""
        rows = np.asarray(input_ids).tolist()
        owners, runs = [], []  # each run's row; its ids, the context token first
        for row, (ids, mask) in enumerate(zip(rows, np.asarray(predicted))):
            edges = np.flatnonzero(np.diff(mask, prepend=False, append=False)).tolist()
            for start, end in zip(edges[::2], edges[1::2]):  # predicted[start:end]; start >= 1
                owners.append(row)
                runs.append(ids[start - 1 : end])
        counts = np.zeros(len(rows), dtype=np.int64)
        if runs:
            with_context = self.tokenizer.decode_batch(runs, skip_special_tokens=True)
            context = self.tokenizer.decode_batch([run[:1] for run in runs], skip_special_tokens=True)
            added = [_decoded_bytes(text) - _decoded_bytes(before) for text, before in zip(with_context, context)]
            np.add.at(counts, owners, added)
        return counts


def _decoded_bytes(text: str) -> int:
    """UTF-8 bytes of decoded `text`, a U+FFFD counted as the one byte it stands for."""
    return len(text.encode("utf-8")) - 2 * text.count(REPLACEMENT)


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

