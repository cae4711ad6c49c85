"""After training: compare runs, evaluate checkpoints, sample from them, one call each.

    table = default_compare("lr_sweep", runs=[run_a, run_b])
    scores = default_eval("lr_sweep/a", model=run_a, data={"stdlib": tokens})          # checkpoint="final"
    samples = default_sample("lr_sweep/a", model=run_a, prompts=["def "], max_tokens=48, seed=0)

Steps are named `compare/<name>`, `eval/<name>` and `sample/<name>`. Each depends on the training
steps it reads, so it is cached like any step and reruns when a run changes; evaluating another
checkpoint is another identity. Eval and sample steps run in a process of their own with the
devices their training step declared, and load the checkpoint on the same layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from keel import Resources, Step
from keel.data import Mixture, TokenizeConfig
from keel.executor.identity import Identities
from keel.executor.step import External, OutputOf
from keel.train import TrainStepConfig
from keel.trained import CompareConfig, EvalConfig, SampleConfig, TrainedModel
from keel.trained.compare import compare_step
from keel.trained.evaluate import eval_step
from keel.trained.sample import sample_step


def default_compare(name: str, *, runs: Sequence[Step]) -> Step:
    """A step writing comparison.md / .json / .png of training steps `runs`, labelled by step name."""
    for run in runs:
        _training(f"default_compare({name!r})", run)
    labels = [run.name for run in runs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"default_compare({name!r}): runs {labels} name one step twice: list each run once")
    return Step(f"compare/{name}", compare_step, CompareConfig(runs={run.name: run for run in runs}),
                description=f"compare {len(runs)} runs")


def default_eval(name: str, *, model: Step, data: dict[str, Step | External], checkpoint: str | int = "final",
                 split: str = "validation", batch_size: int | None = None, num_batches: int | None = None,
                 resources: Resources | None = None) -> Step:
    """A step writing eval.json: loss, perplexity and bits per byte of `model`'s checkpoint on each
    labelled token cache. Batches default to the run's own validation reads (its batch size and
    eval_batches), so its validation cache reproduces the run's last eval loss."""
    where = f"default_eval({name!r})"
    train = _training(where, model).train
    config = EvalConfig(
        model=trained_model(where, model, checkpoint),
        data=dict(data),
        batch_size=batch_size or train.batch_size,
        num_batches=num_batches or train.eval_batches,
        split=split,
    )
    return Step(f"eval/{name}", eval_step, config, resources=resources, isolated=True)


def default_sample(name: str, *, model: Step, prompts: Sequence[str], max_tokens: int = 64, temperature: float = 1.0,
                   seed: int = 0, checkpoint: str | int = "final", tokenizer: Step | External | str | None = None,
                   resources: Resources | None = None) -> Step:
    """A step writing samples.jsonl: a completion per prompt. The tokenizer is the one the run's
    data was tokenized with (found through its tokenize steps); pass `tokenizer=` for a run on
    caches keel did not tokenize."""
    where = f"default_sample({name!r})"
    data = _training(where, model).data
    if tokenizer is None:
        encoding = _tokenize_config(where, data)
        tokenizer, special = encoding.tokenizer, dict(add_bos=encoding.add_bos, bos_token=encoding.bos_token,
                                                       eos_token=encoding.eos_token)
    else:
        special = {}
    config = SampleConfig(model=trained_model(where, model, checkpoint), tokenizer=tokenizer, prompts=tuple(prompts),
                          max_tokens=max_tokens, temperature=temperature, seed=seed, **special)
    return Step(f"sample/{name}", sample_step, config, resources=resources, isolated=True)


def trained_model(where: str, step: Step, checkpoint: str | int) -> TrainedModel:
    """The `TrainedModel` of training step `step` at `checkpoint` ("final": its last step)."""
    config = _training(where, step)
    if checkpoint == "final":
        checkpoint = config.train.num_steps
    elif isinstance(checkpoint, str):
        raise ValueError(f"{where}: checkpoint={checkpoint!r}: give 'final' or a step number")
    return TrainedModel(run=step, step=checkpoint, model=config.model, train=config.train,
                        topology=config.topology, hardware=config.hardware)


def _training(where: str, step: Any) -> TrainStepConfig:
    if not isinstance(step, Step) or not isinstance(step.config, TrainStepConfig):
        raise TypeError(f"{where}: {step!r} is not a training step: pass the Step that default_train returned")
    return step.config


def _tokenize_config(where: str, data: Any) -> TokenizeConfig:
    """The one TokenizeConfig behind a run's data (a tokenize step, or a mixture of them)."""
    caches = list(data.components.values()) if isinstance(data, Mixture) else [data]
    identities = Identities()
    found: dict[tuple, TokenizeConfig] = {}
    for cache in caches:
        step = cache.step if isinstance(cache, OutputOf) else cache
        if not isinstance(step, Step) or not isinstance(step.config, TokenizeConfig):
            raise ValueError(f"{where}: the run reads {step!r}, not a keel tokenize step, so its tokenizer is "
                             "unknown: pass tokenizer=... (a tokenizer step, External or path)")
        c = step.config
        tokenizer = identities.hash(c.tokenizer) if isinstance(c.tokenizer, (Step, External)) else c.tokenizer
        found[(tokenizer, c.add_bos, c.bos_token, c.eos_token)] = c
    if len(found) > 1:
        raise ValueError(f"{where}: the run's mixture components were tokenized {len(found)} different ways: pass "
                         "tokenizer=... to say which one to sample with")
    return next(iter(found.values()))
