"""The validation loss is the mean over every predicted token of the sample, each sequence once: a
last batch short of rows is filled with masked copies, and batches weigh by the targets they hold."""

import numpy as np
import pytest

from keel.train.loop import validation_losses
from train_standin import BATCH_AXES, rack_mesh

SEQ = 8


class Rows:
    """A token cache's split of `n` sequences: row i's tokens are all i, its documents end at `cuts[i]`."""

    def __init__(self, n: int, cuts: dict[int, int]):
        self.n, self.cuts = n, cuts

    def as_sync_dataset(self):
        return self

    def __len__(self) -> int:
        return self.n

    def get_batch(self, indices):
        return [{"input_ids": np.full(SEQ, i, np.int32),
                 "segment_ids": (np.arange(SEQ) >= self.cuts.get(i, SEQ)).astype(np.int32)} for i in indices]


def mean_of_rows(arrays, batch) -> float:
    """What the model's loss is here: each predicted token's loss is its row's index."""
    ids, segments = np.asarray(batch["input_ids"]), np.asarray(batch["segment_ids"])
    weight = (segments[:, 1:] == segments[:, :-1]) & (segments[:, :-1] >= 0)
    return float((ids[:, :-1] * weight).sum() / weight.sum())


def test_each_sequence_counts_once_and_each_target_the_same():
    rows = Rows(13, cuts={3: 4, 11: 2})  # two rows hold two documents: 6 targets instead of 7
    (loss, picked), = validation_losses(mean_of_rows, None, {"v": rows}, batch_size=8, num_batches=4,
                                        mesh=rack_mesh(), batch_axes=BATCH_AXES).values()
    assert sorted(picked) == list(range(13))  # all 13, in 2 batches: the second of 5 rows and 3 fillers
    targets = {i: SEQ - 1 - (i in rows.cuts) for i in range(13)}
    assert loss == sum(i * t for i, t in targets.items()) / sum(targets.values())


@pytest.mark.slow  # compiles a model's loss
def test_the_evaluated_loss_leaves_out_an_auxiliary_balancing_loss():
    """Trained on cross-entropy plus the balancing term; the loop's evaluation (`eval_loss_fn`, which
    the eval step calls too) gives cross-entropy alone, which perplexity and bits per byte are made of."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec
    from model_tiny import compiled_init, hero_like

    from keel.spec import Balancing
    from keel.spec.transports import TransportSpec
    from keel.train.lm import KeelLM
    from keel.train.loop import eval_loss_fn

    config = hero_like(balancing=Balancing.AUX_LOSS, aux_loss_coef=0.5)
    batch = {"input_ids": np.random.default_rng(0).integers(0, 64, (8, 16)).astype(np.int32),
             "segment_ids": np.zeros((8, 16), np.int32)}
    mesh = rack_mesh()
    lm = KeelLM(config, mesh)
    with jax.set_mesh(mesh):
        model = compiled_init(config, jax.random.PRNGKey(0))
        trained, _ = lm.loss(model, batch, transport=TransportSpec(), z_loss=0.0, compute_dtype=jnp.float32)
        arrays, static = eqx.partition(model, eqx.is_array)
        shardings = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), arrays)
        evaluated = eval_loss_fn(lm, static, shardings, TransportSpec(), jnp.float32)(arrays, batch)
    assert float(trained) > float(evaluated) + 0.1  # the balancing term is trained on, not evaluated
