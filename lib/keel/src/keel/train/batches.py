"""Training and validation batches: keel.data's Levanter datasets behind Levanter's DataLoader.

Batch `s` of the training loader holds dataset items `[s * batch_size, (s + 1) * batch_size)`, and
the mixture dataset fixes which component each item comes from, so mixture phases switch exactly
at their declared steps and a resumed run reads the very batches the died run would have read.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from levanter.data.loader import DataLoader

from keel.data import build_train_dataset, build_validation_datasets
from keel.data.datasets import FIELDS


def training_datasets(mixture: Any, *, seq_len: int, batch_size: int, seed: int):
    """(train dataset, {component: validation dataset}) of a training step's mixture."""
    train = build_train_dataset(mixture, seq_len=seq_len, batch_size=batch_size, seed=seed)
    return train, build_validation_datasets(mixture, seq_len=seq_len)


def batch_loader(
    dataset, *, batch_size: int, mesh, batch_axes: tuple[str, ...], prefetch: int = 8, fetch_batches: int = 8
):
    """Levanter's DataLoader: whole batches, sharded over `batch_axes`, read `fetch_batches` at a
    time and up to `prefetch` batches ahead on the host."""
    return DataLoader(
        dataset,
        batch_size,
        mesh=mesh,
        axis_resources={"batch": batch_axes},
        max_buffered_batches=prefetch,
        fetch_batch_size=fetch_batches,
    )


def batch_sharding(mesh, batch_axes: tuple[str, ...]):
    """How every batch array [batch, seq] is laid out: rows split over `batch_axes`."""
    return NamedSharding(mesh, PartitionSpec(batch_axes, None))


def batch_shapes(*, batch_size: int, seq_len: int, mesh, batch_axes: tuple[str, ...]) -> dict[str, Any]:
    """The abstract batch the loaders produce ({field: int32 [batch, seq]}), to compile against."""
    sharding = batch_sharding(mesh, batch_axes)
    return {field: jax.ShapeDtypeStruct((batch_size, seq_len), np.int32, sharding=sharding) for field in FIELDS}
