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
    """Accumulates documents' token ids and hands back whole `(n, seq_len)` sequences.

    Segment ids come from where documents start, not from a per-token document index: a count of
    starts per position, cumulated along each row, is one int32 pass over the tokens."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len
        self._tokens = np.zeros((0,), dtype=np.int32)
        self._starts = np.zeros((0,), dtype=np.int64)  # positions in _tokens where documents start

    def add(self, documents: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Append documents; return the (input_ids, segment_ids) of every sequence now complete."""
        lengths = np.fromiter(map(len, documents), dtype=np.int64, count=len(documents))
        ends = len(self._tokens) + np.cumsum(lengths)
        starts = np.concatenate([self._starts, ends - lengths])
        tokens = np.concatenate([self._tokens, *documents]) if documents else self._tokens
        complete = len(tokens) // self.seq_len * self.seq_len
        done = np.searchsorted(starts, complete)  # starts at `complete` belong to the next sequence
        self._tokens, self._starts = tokens[complete:], starts[done:] - complete
        input_ids = tokens[:complete].reshape(-1, self.seq_len)
        return input_ids, self._segment_ids(starts[:done], input_ids.shape)

    @staticmethod
    def _segment_ids(starts: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
        """Documents started up to each token within its row; a start at a row's first token counts
        none there, and an empty document counts where it would have started."""
        counts = np.zeros(shape, dtype=np.int32)
        np.add.at(counts.reshape(-1), starts, 1)
        counts[:, 0] = 0
        return np.cumsum(counts, axis=1, dtype=np.int32, out=counts)

    @property
    def leftover_tokens(self) -> int:
        return len(self._tokens)
