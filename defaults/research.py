"""After training: compare runs, evaluate checkpoints, sample from them, one call each.

    table = default_compare("lr_sweep", runs=[run_a, run_b])
    scores = default_eval("lr_sweep/a", run=run_a, data={"stdlib": tokens})            # checkpoint="final"
    samples = default_sample("lr_sweep/a", run=run_a, prompts=["def "], max_tokens=48, seed=0)
    ladder = default_scaling_ladder("tiny", data=tokens, model=tiny_moe, train=train, sizes=(32, 48, 64, 96),
                                    steps=(24, 32, 40, 48), target=(128, 64))
    big = default_train("big", ..., model=ladder.target_model, train=ladder.target_train, predicted_loss=ladder.prediction)
    check = ladder.check(big)                                                             # the prediction error

Steps are named `compare/<name>`, `eval/<name>`, `sample/<name>` and, for a ladder, `train/ladder/<name>/...`
and `ladder/<name>`. Each depends on the training
steps it reads, so it is cached like any step and reruns when a run changes; evaluating another
checkpoint is another identity. Eval and sample steps run in a process of their own with the
devices their training step declared, and load the checkpoint on the same layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from keel import Resources, Step, StepFunction
from keel.spec import (
    CompareConfig,
    EvalConfig,
    Hardware,
    Mixture,
    MoELMConfig,
    RackTopology,
    SampleConfig,
    TokenizeConfig,
    TrainConfig,
    TrainedModel,
    TrainStepConfig,
)
from keel.executor.identity import Identities
from keel.executor.step import External, OutputOf, output_of
from keel.trained.compare import compare_step
from keel.trained.ladder import (
    PREDICTION_FILE,
    LadderConfig,
    PredictionCheckConfig,
    check_step,
    ladder_step,
    training_compute,
)

# named, not imported: they import jax
eval_step = StepFunction("keel.trained.evaluate:eval_step")
sample_step = StepFunction("keel.trained.sample:sample_step")


def default_compare(name: str, *, runs: Sequence[Step]) -> Step:
    """A step writing comparison.md / .json / .png of training steps `runs`, labelled by step name."""
    for run in runs:
        _training(f"default_compare({name!r})", run)
    labels = [run.name for run in runs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"default_compare({name!r}): runs {labels} name one step twice: list each run once")
    return Step(f"compare/{name}", compare_step, CompareConfig(runs={run.name: run for run in runs}),
                description=f"compare {len(runs)} runs")


@dataclasses.dataclass(frozen=True)
class ScalingLadder:
    """What `default_scaling_ladder` declares: the rungs' training steps, the fit step, the
    prediction (pass it to `default_train(..., predicted_loss=)`) and the run it is made for."""

    name: str
    runs: tuple[Step, ...]
    fit: Step
    prediction: OutputOf
    target_model: MoELMConfig
    target_train: TrainConfig
    target_compute: float

    def check(self, run: Step) -> Step:
        """A step `ladder/<name>/check` after `run` (the predicted run) that prints and keeps the prediction error."""
        if not isinstance(run, Step) or getattr(run.config, "predicted_loss", None) is None:
            raise TypeError(f"ScalingLadder.check: {run!r} declares no predicted_loss: pass the run declared with "
                            "predicted_loss=ladder.prediction")
        return Step(f"ladder/{self.name}/check", check_step, PredictionCheckConfig(run=run, prediction=self.prediction),
                    description=f"{run.name}'s validation loss against the ladder's prediction")


def default_scaling_ladder(name: str, *, data: Any, model: MoELMConfig, train: TrainConfig, sizes: Sequence[int],
                           steps: Sequence[int], target: tuple[int, int],
                           topology: RackTopology | None = None, hardware: Hardware | None = None) -> ScalingLadder:
    """Small runs over a range of compute and a cached fit that predicts a bigger run's loss.

    Rung i trains `model` at hidden_dim `sizes[i]` for `steps[i]` steps (`train` otherwise: an
    optimizer whose rates are a law, `LrScalingLaw.optimizer()`, gets each rung's own); `target` is the
    predicted run's (hidden_dim, steps). The fit step `ladder/<name>` fits L(C) = E + A (C/C0)^-alpha
    to the rungs' final validation losses (`keel.trained.ladder`) and writes prediction.json."""
    if len(sizes) != len(steps):
        raise ValueError(f"default_scaling_ladder({name!r}): {len(sizes)} sizes but {len(steps)} step counts: give one each")
    if train.eval_batches <= 0:
        raise ValueError(f"default_scaling_ladder({name!r}): train.eval_batches=0 leaves nothing to fit: evaluate the rungs")
    if train.seq_len is None:  # the length the data was tokenized at, as default_train takes it
        train = dataclasses.replace(train, seq_len=(data if isinstance(data, Mixture) else Mixture.single(data))
                                    .tokenized_seq_len())

    def rung(hidden: int, num_steps: int) -> tuple[MoELMConfig, TrainConfig]:
        sized = model.replace(hidden_dim=hidden)
        return sized, dataclasses.replace(train, num_steps=num_steps, eval_every=None, evaluations=1)

    from defaults.train import default_train

    runs = []
    for hidden, num_steps in zip(sizes, steps):
        sized, trained = rung(hidden, num_steps)
        run = default_train(f"ladder/{name}/h{hidden}-s{num_steps}", data=data, model=sized, train=trained,
                            topology=topology, hardware=hardware, description=f"scaling ladder {name}: hidden {hidden}, "
                            f"{num_steps} steps")
        runs.append(run)
    target_model, target_train = rung(*target)
    target_compute = training_compute(target_model, target_train)
    fit = Step(f"ladder/{name}", ladder_step, LadderConfig(runs={r.name: r for r in runs},
                                                           target=f"hidden {target[0]}, {target[1]} steps",
                                                           target_compute=target_compute),
               description=f"fit of {len(runs)} rungs; predicts hidden {target[0]} x {target[1]} steps")
    return ScalingLadder(name, tuple(runs), fit, output_of(fit, PREDICTION_FILE), target_model, target_train, target_compute)


def default_eval(name: str, *, run: Step | None = None, data: dict[str, Step | External] | Mixture | None = None,
                 checkpoint: str | int = "final", split: str = "validation", batch_size: int | None = None,
                 num_batches: int | None = None, resources: Resources | None = None, **old: Any) -> Step:
    """A step writing eval.json: loss, perplexity and bits per byte of training step `run`'s
    checkpoint ("final": its last step, whatever its length) on each labelled token cache (`data`;
    a Mixture's components; None: the run's own). Batches default to the run's own validation
    reads (its batch size and eval_batches), so its validation cache reproduces the run's last eval
    loss. The step follows `run`: a `--set` on it reaches here."""
    where = f"default_eval({name!r})"
    _no_old_names(where, run, old)
    own_data = data is None
    data = _training(where, run).data if own_data else data
    caches = dict(data.components) if isinstance(data, Mixture) else dict(data)
    config = EvalConfig(model=trained_model(where, run, checkpoint), data=caches, batch_size=batch_size,
                        num_batches=num_batches, split=split, own_data=own_data)
    return Step(f"eval/{name}", eval_step, config, resources=resources, isolated=True)


def default_sample(name: str, *, run: Step | None = None, prompts: Sequence[str], max_tokens: int = 64, temperature: float = 1.0,
                   seed: int = 0, checkpoint: str | int = "final", tokenizer: Step | External | str | None = None,
                   add_bos: bool = False, bos_token: str | None = None, eos_token: str | None = None,
                   resources: Resources | None = None, **old: Any) -> Step:
    """A step writing samples.jsonl: a completion per prompt by training step `run`'s checkpoint.
    The tokenizer and its bos/eos convention are the ones the run's data was tokenized with (found
    through its tokenize steps); for a run on caches keel did not tokenize, pass `tokenizer=` and,
    as its documents were encoded, `add_bos=`, `bos_token=` and `eos_token=`."""
    where = f"default_sample({name!r})"
    _no_old_names(where, run, old)
    data = _training(where, run).data
    special = dict(add_bos=add_bos, bos_token=bos_token, eos_token=eos_token)
    if tokenizer is None:
        if special != dict(add_bos=False, bos_token=None, eos_token=None):
            raise TypeError(f"{where}: add_bos=, bos_token= and eos_token= go with tokenizer=; without it the run's "
                            "tokenize steps say them")
        encoding = _tokenize_config(where, data)
        tokenizer, special = encoding.tokenizer, dict(add_bos=encoding.add_bos, bos_token=encoding.bos_token,
                                                       eos_token=encoding.eos_token)
    config = SampleConfig(model=trained_model(where, run, checkpoint), tokenizer=tokenizer, prompts=tuple(prompts),
                          max_tokens=max_tokens, temperature=temperature, seed=seed, **special)
    return Step(f"sample/{name}", sample_step, config, resources=resources, isolated=True)


def trained_model(where: str, step: Step, checkpoint: str | int) -> TrainedModel:
    """The `TrainedModel` of training step `step` at `checkpoint` ("final": its last step)."""
    _training(where, step)
    try:
        return TrainedModel(run=step, checkpoint=checkpoint)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _no_old_names(where: str, run: Any, old: dict) -> None:
    """`model=` named the training step before `run=` did (a model is a model config everywhere else)."""
    if "model" in old:
        raise TypeError(f"{where}: model= is now run=: pass the training step as run=...")
    if run is None:
        raise TypeError(f"{where}: pass the training step to read as run=...")
    if old:
        raise TypeError(f"{where}: unexpected argument(s) {', '.join(sorted(old))}")


def _training(where: str, step: Any) -> TrainStepConfig:
    if not isinstance(step, Step) or not isinstance(step.config, TrainStepConfig):
        raise TypeError(f"{where}: {step!r} is not a training step: pass the Step that default_train returned")
    return step.config


def _tokenize_config(where: str, data: Mixture) -> TokenizeConfig:
    """The one TokenizeConfig behind a run's data (its mixture's tokenize steps)."""
    caches = list(data.components.values())
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
