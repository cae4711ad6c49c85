"""`default_train`: the training step of an experiment, in one call.

    model_step = default_train("tiny_moe", data=cache, model=tiny_moe, train=TrainConfig(...),
                               topology=RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4))

The step is named `train/<name>`; its identity is the model, the data (and through it every
upstream step), the optimizer, schedule, seed, batch size, sequence length and step count.
Topology, hardware, transports, checkpoint/log cadence, eval batch counts, precision and remat are
execution-only: changing them resumes the same run under the same output path. The declaration is
checked once, by `keel.plan.resolved.resolve`, when `keel plan` or `keel run` starts (and again by
the step itself): a mistake is a `keel: error:` naming the field before any step runs.
"""

from __future__ import annotations

from typing import Any

from keel import Resources, Step
from keel.data import Mixture
from keel.executor.step import External, OutputOf
from keel.mesh import Hardware, RackTopology
from keel.model import MoELMConfig
from keel.train import TrainConfig, TrainStepConfig
from keel.train.step import train_step


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
) -> Step:
    """A `Step` that trains `model` on `data` (a Mixture, or a tokenize step / External cache)."""
    if not isinstance(data, (Mixture, Step, External, OutputOf)):
        raise TypeError(
            f"default_train({name!r}): data is a {type(data).__name__}; give a keel.data.Mixture, a tokenize Step "
            "or an External token cache"
        )
    config = TrainStepConfig(model=model, data=data, train=train, topology=topology, hardware=hardware)
    return Step(f"train/{name}", train_step, config, resources=resources, description=description, isolated=True)
