"""The resolved run of a benchmark's keel model: what the training loop lays its state out from."""

from keel import External
from keel.spec import MoELMConfig, RackTopology, TrainConfig
from keel.spec.resolved import ResolvedRun, resolve
from keel.spec.train import TrainStepConfig


def planned(model: MoELMConfig, train: TrainConfig, topology: RackTopology) -> ResolvedRun:
    """Resolve `model` trained with `train` on `topology`, reading a synthetic in-memory stream."""
    data = External("benchmark/tokens", "memory://benchmark-tokens", version="synthetic")
    return resolve(TrainStepConfig(model=model, data=data, train=train, topology=topology))
