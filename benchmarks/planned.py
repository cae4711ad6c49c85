"""The resolved run of a benchmark's keel model: what the training loop lays its state out from."""

from keel import External
from keel.mesh import RackTopology
from keel.model import MoELMConfig
from keel.plan.resolved import ResolvedRun, resolve
from keel.train import TrainConfig
from keel.train.config import TrainStepConfig


def planned(model: MoELMConfig, train: TrainConfig, topology: RackTopology) -> ResolvedRun:
    """Resolve `model` trained with `train` on `topology`, reading a synthetic in-memory stream."""
    data = External("benchmark/tokens", "memory://benchmark-tokens", version="synthetic")
    return resolve(TrainStepConfig(model=model, data=data, train=train, topology=topology))
