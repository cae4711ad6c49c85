"""`default_train`: the training step of an experiment, in one call.

    model_step = default_train("tiny_moe", data=cache, model=tiny_moe, train=TrainConfig(...),
                               topology=RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4))

The step is named `train/<name>`; its identity is the model, the data (and through it every
upstream step), the optimizer, schedule, seed, batch size, sequence length, step count, z-loss,
weight-decay change, spike guard and precision (`compute_dtype`, `master_dtype`: it changes the
weights). Topology, hardware, transports, checkpoint/log/eval cadence, eval batch counts, host
offload and remat are execution-only: changing them resumes the same run under the same output
path, except which routed assignments a fixed-capacity transport drops
(`TrainStepConfig.derived_identity`). The declaration is checked once, by `keel.spec.resolved.resolve`, when `keel plan` or
`keel run` starts (and again by the step itself): a mistake is a `keel: error:` naming the field
before any step runs.
"""

from __future__ import annotations

from typing import Any

from keel import Resources, Retries, Step, StepFunction
from keel.spec import Hardware, LaunchPlan, Mixture, MoELMConfig, RackTopology, RunFacts, TrainConfig, TrainStepConfig
from keel.executor.step import External, OutputOf

train_step = StepFunction("keel.train.step:train_step")  # named, not imported: it imports jax


def default_train(
    name: str,
    *,
    data: Mixture | Step | External | Any,
    model: MoELMConfig,
    train: TrainConfig,
    topology: RackTopology | None = None,
    hardware: Hardware | None = None,
    resources: Resources | None = None,
    description: str | None = None,
    predicted_loss: OutputOf | None = None,
    facts: RunFacts | None = None,
    launch: LaunchPlan | None = None,
    stand_ins: tuple[str, ...] = (),
    retries: Retries | None = None,
    progress_timeout_s: float | None = None,
) -> Step:
    """A `Step` that trains `model` on `data` (a Mixture, or a tokenize step / External cache).

    `predicted_loss` is a scaling ladder's prediction for this run (`default_scaling_ladder(...).prediction`):
    the run trains after it is made, and must have the compute it was made for. `facts` are what is
    known of a real run (speeds, claims); `launch` what a launch decision needs beyond it (checkpoint
    bandwidth, GPU-hour price, cache sizes: `keel plan`'s launch figures); `stand_ins` name what a scaled-down twin plays the real
    run's part with (`keel.plan.scale_down` says them; `keel plan` prints them). `retries` and
    `progress_timeout_s` are the step's (`keel.Step`): how often a failed or preempted attempt is
    resumed from its newest checkpoint, and how long the launcher waits for a step's heartbeat."""
    if not isinstance(data, (Mixture, Step, External, OutputOf)):
        raise TypeError(
            f"default_train({name!r}): data is a {type(data).__name__}; give a keel.spec.Mixture, a tokenize Step "
            "or an External token cache"
        )
    config = TrainStepConfig(model=model, data=data, train=train, topology=topology, hardware=hardware,
                             predicted_loss=predicted_loss, facts=facts, launch=launch, stand_ins=stand_ins)
    problem = config.resources_problem(resources)
    if problem:
        raise ValueError(f"default_train({name!r}): {problem}")
    if predicted_loss is not None:
        _check_prediction(name, predicted_loss, model, config.train)
    return Step(f"train/{name}", train_step, config, resources=resources, description=description, isolated=True,
                retries=retries, progress_timeout_s=progress_timeout_s)


def _check_prediction(name: str, predicted: Any, model: MoELMConfig, train: TrainConfig) -> None:
    """A prediction is for one compute: refuse it for a run of another."""
    from keel.trained.ladder import check_predicted_compute

    check_predicted_compute(f"default_train({name!r})", predicted, model, train)
