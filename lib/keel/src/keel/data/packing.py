"""Pack tokenized documents into fixed-length sequences with per-sequence segment ids.

Documents are laid end to end; a document longer than the room left continues in the next
sequence. Within a sequence, segment ids count documents from 0 (the piece that started in an
earlier sequence is segment 0 too), so `segment_ids[i] == segment_ids[j]` exactly when tokens i and
j come from the same document: what attention masks and causal convolutions need. The tokens that
do not fill a last sequence are dropped and counted.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class SequencePacker:
    """Accumulates documents' token ids and hands back whole `(n, seq_len)` sequences."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len
        self._tokens = np.zeros((0,), dtype=np.int32)
        self._doc_index = np.zeros((0,), dtype=np.int64)
        self._next_doc = 0

    def add(self, documents: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Append documents; return the (input_ids, segment_ids) of every sequence now complete."""
        lengths = np.array([len(d) for d in documents], dtype=np.int64)
        doc_index = np.repeat(np.arange(self._next_doc, self._next_doc + len(documents)), lengths)
        self._next_doc += len(documents)
        tokens = np.concatenate([self._tokens, *documents]) if documents else self._tokens
        doc_index = np.concatenate([self._doc_index, doc_index])
        complete = len(tokens) // self.seq_len * self.seq_len
        self._tokens, self._doc_index = tokens[complete:], doc_index[complete:]
        input_ids = tokens[:complete].reshape(-1, self.seq_len)
        rows = doc_index[:complete].reshape(-1, self.seq_len)
        segment_ids = (rows - rows[:, :1]).astype(np.int32)
        return input_ids, segment_ids

    @property
    def leftover_tokens(self) -> int:
        return len(self._tokens)
