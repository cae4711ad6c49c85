"""keel.train: training configs (plain dataclasses, no jax) and, by import path, the step function.

Only configs are imported here so that declaring and planning a run stays instant; the training
loop and optimizers live in their own modules and import jax when they run.
"""

from keel.train.config import (
    AdamWConfig,
    Claim,
    GroupedOptimizerConfig,
    HostOffload,
    LaunchPlan,
    LrScalingLaw,
    RunFacts,
    ScheduleConfig,
    SpeedObservation,
    SpikeGuardConfig,
    TrainConfig,
    TrainStepConfig,
    TransportPhase,
    WeightDecayChange,
    steps_for_tokens_per_param,
)

__all__ = [
    "AdamWConfig",
    "Claim",
    "GroupedOptimizerConfig",
    "HostOffload",
    "LaunchPlan",
    "LrScalingLaw",
    "RunFacts",
    "ScheduleConfig",
    "SpeedObservation",
    "SpikeGuardConfig",
    "TrainConfig",
    "TrainStepConfig",
    "TransportPhase",
    "WeightDecayChange",
    "steps_for_tokens_per_param",
]
