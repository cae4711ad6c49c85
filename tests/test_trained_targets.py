"""The targets bits per byte count bytes of (`keel.data.tokenizer.predicted_tokens`) are the ones the
loss weighs (`keel.model.loss`, Levanter's mask of a row's last position), and the eval step says so."""

import numpy as np
import pytest

from keel.data.tokenizer import predicted_tokens
from keel.trained import evaluate


class _Rows:
    """A dataset of segment ids alone, as `targets_in` reads it."""

    def __init__(self, segments):
        self.segments = segments

    def as_sync_dataset(self):
        return self

    def get_batch(self, rows):
        return [{"segment_ids": self.segments[i]} for i in rows]


def test_the_counted_tokens_are_the_targets_the_loss_weighs(monkeypatch):
    rng = np.random.default_rng(0)
    segments = np.sort(rng.integers(-1, 4, size=(12, 16)), axis=1).astype(np.int32)  # padding (-1) first, then documents
    segments[0] = 0  # one document the whole row
    predicted = predicted_tokens(segments)
    assert not predicted[:, 0].any() and predicted[0].sum() == 15
    assert evaluate.targets_in(_Rows(segments), range(12)) == predicted.sum()

    monkeypatch.setattr(evaluate, "predicted_tokens", lambda s: np.ones(np.shape(s), bool))  # a definition that drifted
    with pytest.raises(RuntimeError, match="predicted_tokens no longer matches keel.model.loss"):
        evaluate.targets_in(_Rows(segments), range(12))
