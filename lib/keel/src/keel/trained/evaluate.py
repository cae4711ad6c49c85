"""The eval step: a checkpoint's loss, perplexity and bits per byte on token caches -> eval.json.

The loss is the training loop's own validation loss (`keel.train.loop.eval_loss_fn` over
`validation_losses`: the same batches, model, transport and dtypes), so on the run's validation
cache it equals the loop's last `eval/loss`. Bits per byte put runs with different tokenizers on
one scale: loss / ln 2 x targets / bytes over the evaluated sequences. The loss is a mean over the
next-token targets the loss weighs (not a row's last position, not across a document boundary),
so it is multiplied by their count, not by every token; each sequence's bytes are the UTF-8 bytes
of exactly those targets (`keel.data.tokenizer.predicted_tokens`) as the tokenize step recorded
them, so the figure is the bits per byte of the predicted text. The targets are counted here from
the loss's own weights and checked against that definition. Before the checkpoint loads, each
cache is held to the run's record (`data.json`): the same tokenizer, and validation documents the
run did not train on.
"""

from __future__ import annotations

import math

import haliax as hax
import jax
import numpy as np
from levanter.models.loss import next_token_loss_weight

from keel.data.cache_files import STATS_FILE, has_split
from keel.data.datasets import load_token_cache, read_sequence_bytes
from keel.data.tokenizer import predicted_tokens
from keel.executor import storage, warn
from keel.executor.replicas import join_replicas
from keel.mesh.mesh import run_topology
from keel.model.axes import POS
from keel.model.loss import next_token_weight
from keel.spec.topology import BATCH_AXES
from keel.spec.trained import EvalConfig
from keel.train import compile_cache
from keel.train.data_checks import check_cache_vocab, check_evaluated_documents_held_out, check_same_tokenizer_as_run
from keel.train.loop import eval_loss_fn, validation_losses
from keel.trained.load import checkpoint_path, load_model

EVAL_FILE = "eval.json"


def eval_step(config: EvalConfig) -> None:
    """Step function: evaluate `config.model` on every cache of `config.data`, write eval.json (from the
    first process of an eval on several: each evaluates the same batches, laid out over all of them)."""
    join_replicas(config.coordinator)  # an eval on several hosts: one jax world (a no-op alone)
    seq_len = config.model.train.seq_len
    batch_size, num_batches = config.batches
    shards = run_topology(config.model.topology).batch_shards
    if batch_size % shards:  # a run with a topology was checked at declaration (EvalConfig)
        raise ValueError(f"EvalConfig.batch_size={batch_size} does not split over the {shards} devices the eval runs on, "
                         "which a run declaring no topology lays its mesh out on: give a multiple of "
                         f"{shards}, or declare the run's topology")
    datasets = evaluated_caches(config)
    compile_cache.use(config.output_path, "eval")  # the run's own evaluation program, when it trained here
    loaded = load_model(config.model)
    with jax.set_mesh(loaded.mesh):
        evaluate = eval_loss_fn(loaded.lm, loaded.static, loaded.shardings, loaded.transport, loaded.compute_dtype)
        sampled = validation_losses(evaluate, loaded.arrays, datasets, batch_size=batch_size,
                                    num_batches=num_batches, mesh=loaded.mesh, batch_axes=BATCH_AXES,
                                    seed=config.model.train.seed)
    results = {label: dataset_result(loss, config.data[label], config.split, rows, seq_len,
                                     targets_in(datasets[label], rows))
               for label, (loss, rows) in sampled.items()}
    losses = {label: loss for label, (loss, _) in sampled.items()}
    report = {
        "run": config.model.run,
        "checkpoint": checkpoint_path(config.model),
        "step": config.model.step,
        "transport": loaded.transport.name,
        "split": config.split,
        "loss": sum(losses.values()) / len(losses),
        "datasets": results,
    }
    if jax.process_index() != 0:
        return
    storage.write_json(storage.join(config.output_path, EVAL_FILE), report)
    for label, r in results.items():
        print(f"eval {label}: loss {r['loss']:.4f}  perplexity {r['perplexity']:.2f}  bits/byte "
              f"{'n/a' if r['bits_per_byte'] is None else format(r['bits_per_byte'], '.4f')}")
    not_finite = [label for label, loss in losses.items() if not math.isfinite(loss)]
    if not_finite:
        warn(f"the loss on {', '.join(not_finite)} is not finite ({', '.join(str(losses[n]) for n in not_finite)}): the "
             f"checkpoint at step {config.model.step} diverged, or its sample held no token to predict; evaluate an "
             "earlier checkpoint (checkpoint=...)")


def evaluated_caches(config: EvalConfig) -> dict:
    """label -> the `split` of that cache, as a dataset. An empty or absent split is an error, except
    in the run's own caches (`EvalConfig.own_data`), where it is left out as the training loop leaves
    it out of its validation (a document set declared without held-out documents, another tool's
    cache written without one), and said so."""
    datasets, empty, made_here = {}, [], {}
    for label, root in sorted(config.data.items()):
        stats = storage.read_json(storage.join(root, STATS_FILE))
        if stats is not None:  # a cache keel tokenized: its ids must all have an embedding and mean what the run learned
            check_cache_vocab(f"EvalConfig.data[{label!r}] ({root})", stats, config.model.model.vocab_size)
            check_same_tokenizer_as_run(f"EvalConfig.data[{label!r}] ({root})", stats, config.model.run)
            made_here[label] = (root, stats)
        dataset = load_token_cache(root, config.split, seq_len=config.model.train.seq_len) \
            if has_split(root, config.split) else None
        if dataset is not None and len(dataset):
            datasets[label] = dataset
        else:
            empty.append(f"EvalConfig.data[{label!r}] ({root})")
    if empty and (not config.own_data or not datasets):
        raise ValueError(f"the {config.split} split of {' and of '.join(empty)} is empty or absent: there is nothing to "
                         "evaluate on; give a cache with sequences in that split")
    for where in empty:
        print(f"eval: {where} has no {config.split} sequences; left out, as the run's own validation leaves it out")
    if config.split == "validation":  # held-out text, which must not be what the run trained on (its train split may)
        check_evaluated_documents_held_out({label: made_here[label] for label in datasets if label in made_here},
                                           config.model.run)
    return datasets


def targets_in(dataset, rows) -> int:
    """How many next-token targets the loss averages over in the sequences `rows`: the weights the
    loss applies (`next_token_weight`, and Levanter's mask of each row's last position), summed.
    Raises where they are not the tokens whose bytes the tokenize step counted (`predicted_tokens`),
    which would put bits per byte off by the difference."""
    items = dataset.as_sync_dataset().get_batch([int(i) for i in rows])
    stacked = np.stack([item["segment_ids"] for item in items])
    segments = hax.named(stacked, ("batch", POS))
    # position i weighs the prediction of token i + 1
    weighs = np.asarray(next_token_loss_weight(segments.resolve_axis(POS), next_token_weight(segments)).array) > 0
    if weighs[:, -1].any() or not np.array_equal(weighs[:, :-1], predicted_tokens(stacked)[:, 1:]):
        raise RuntimeError("the tokens the loss predicts are not those whose bytes the tokenize step counts: "
                           "keel.data.tokenizer.predicted_tokens no longer matches keel.model.loss")
    return int(weighs.sum())


def dataset_result(loss: float, cache_root: str, split: str, rows, seq_len: int, targets: int) -> dict:
    """Loss, perplexity and bits per byte over the sequences `rows` of a cache split (the sample the
    loss was taken on, `targets` of its tokens predicted; bits per byte is None for a cache written
    without per-sequence byte counts)."""
    counts = read_sequence_bytes(cache_root, split)
    num_bytes = int(counts[rows].sum()) if counts is not None else None
    sequences = len(rows)
    return {
        "loss": loss,
        "perplexity": math.exp(loss) if loss < 709 else math.inf,  # exp overflows a float past 709.78
        "bits_per_byte": loss / math.log(2) * targets / num_bytes if num_bytes else None,
        "sequences": sequences,
        "tokens": sequences * seq_len,
        "targets": targets,
        "bytes": num_bytes,
    }
