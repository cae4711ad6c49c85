"""keel.spec: the declaration layer, what an experiment file states and `keel plan` reads.

Plain frozen dataclasses and pure functions, no jax: the model (`MoELMConfig`), the hardware and
its racks (`Hardware`, `RackTopology`, placement rules), the transport registry (`TRANSPORTS`),
the data steps the planner checks (`TokenizeConfig`, `TrainTokenizerConfig`, `Mixture`), the
training step (`TrainConfig`, optimizers, schedule, `RunFacts`), the steps that read a finished
run (`EvalConfig`, `SampleConfig`, `CompareConfig`), and `resolve()`: the one resolved run
(`ResolvedRun`) that the planner prints and the trainer lays its state out by.

It imports nothing of keel but the executor; the runtime packages (`keel.model`, `keel.mesh`,
`keel.data`, `keel.train`, `keel.trained`) and the planner (`keel.plan`) are built on it
(`tests/test_layers.py` holds every package to its place).
"""

from keel.spec.checks import PlanError, check_train_step, mixture_phases
from keel.spec.data import TokenizeConfig, TrainTokenizerConfig
from keel.spec.hardware import Hardware, StepTimeCalibration
from keel.spec.mixture import Mixture, MixtureError, MixturePhase
from keel.spec.model import AttentionBackend, Balancing, ConvSite, MoELMConfig, Routing
from keel.spec.resolved import ResolvedRun, resolve
from keel.spec.topology import BATCH_AXES, MESH_AXES, RackTopology, TopologyError
from keel.spec.train import (
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
from keel.spec.trained import CompareConfig, EvalConfig, SampleConfig, TrainedModel
from keel.spec.transports import TRANSPORTS, Transport, TransportName, TransportSpec

__all__ = [
    "BATCH_AXES", "MESH_AXES", "TRANSPORTS",
    "AdamWConfig", "AttentionBackend", "Balancing", "Claim", "CompareConfig", "ConvSite", "EvalConfig",
    "GroupedOptimizerConfig", "Hardware", "HostOffload", "LaunchPlan", "LrScalingLaw", "Mixture", "MixtureError",
    "MixturePhase", "MoELMConfig", "PlanError", "RackTopology", "ResolvedRun", "Routing", "RunFacts", "SampleConfig",
    "ScheduleConfig", "SpeedObservation", "SpikeGuardConfig", "StepTimeCalibration", "TokenizeConfig", "TopologyError",
    "TrainConfig", "TrainStepConfig", "TrainTokenizerConfig", "TrainedModel", "Transport", "TransportName", "TransportPhase",
    "TransportSpec", "WeightDecayChange", "check_train_step", "mixture_phases", "resolve", "steps_for_tokens_per_param",
]
