"""Steps that use finished training runs (compare, evaluate, sample), as plain dataclasses.

No jax here, so declaring and planning stay instant; the step functions import what they need
when they run. An eval or sample step loads a checkpoint on the device layout its run declared,
so its process sees the devices a training step with that hardware and topology would see
(`declared_process_env`, the training step's own rule).
"""

from __future__ import annotations

from dataclasses import dataclass

from keel.executor.step import execution_only, this_output
from keel.mesh.hardware import Hardware
from keel.mesh.topology import RackTopology
from keel.model.config import MoELMConfig
from keel.train.config import TrainConfig, declared_process_env


@dataclass(frozen=True)
class TrainedModel:
    """One checkpoint of a training step and what loading it takes.

    `run` is the training step's output directory (declare it as the step, which makes the step
    a dependency), `step` the checkpoint's completed optimizer steps: a different checkpoint is a
    different identity. `model` and `train` are the run's own declarations (the checkpoint's
    transport and dtypes come from `train`); the device layout is execution-only, as in training.
    """

    run: str
    step: int
    model: MoELMConfig
    train: TrainConfig
    topology: RackTopology | None = execution_only(default=None)
    hardware: Hardware | None = execution_only(default=None)

    def __post_init__(self):
        if isinstance(self.step, bool) or not isinstance(self.step, int) or not 0 < self.step <= self.train.num_steps:
            raise ValueError(f"TrainedModel.step={self.step!r}: give a checkpoint step in 1..{self.train.num_steps} "
                             "(num_steps) or 'final'")

    def process_env(self, processes: int = 1) -> dict[str, str]:
        return declared_process_env(self.hardware, self.topology, processes)


@dataclass(frozen=True)
class EvalConfig:
    """Loss, perplexity and bits per byte of a checkpoint on each token cache of `data`.

    `data` maps labels to token cache roots (tokenize steps or Externals). Each cache's `split` is
    read in order, `num_batches` batches of `batch_size` sequences, exactly as the training loop
    reads its validation batches: the run's own validation cache gives the run's last eval loss.
    """

    model: TrainedModel
    data: dict[str, str]
    batch_size: int
    num_batches: int
    split: str = "validation"
    output_path: str = this_output()

    def __post_init__(self):
        if not self.data:
            raise ValueError("EvalConfig.data is empty: name at least one token cache, e.g. {'validation': tokens}")
        if self.batch_size <= 0 or self.num_batches <= 0:
            raise ValueError(f"EvalConfig: batch_size={self.batch_size} and num_batches={self.num_batches} must be positive")

    def process_env(self, processes: int = 1) -> dict[str, str]:
        return self.model.process_env(processes)


@dataclass(frozen=True)
class SampleConfig:
    """Completions of `prompts` by a checkpoint, with the tokenizer its data was tokenized with.

    `tokenizer`, `add_bos`, `bos_token` and `eos_token` are the tokenize step's, so a prompt is
    encoded as a document was; a completion ends at the eos token or after `max_tokens`.
    `temperature` 0 is greedy; otherwise each prompt draws from its own generator seeded by
    (`seed`, its index), so a seed gives the same completions every time.
    """

    model: TrainedModel
    tokenizer: str
    prompts: tuple[str, ...]
    max_tokens: int = 64
    temperature: float = 1.0
    seed: int = 0
    add_bos: bool = False
    bos_token: str | None = None
    eos_token: str | None = None
    output_path: str = this_output()

    def __post_init__(self):
        if not self.prompts or not all(isinstance(p, str) for p in self.prompts):
            raise ValueError("SampleConfig.prompts: give a non-empty tuple of strings")
        if self.max_tokens <= 0:
            raise ValueError(f"SampleConfig.max_tokens={self.max_tokens} must be positive")
        if self.temperature < 0:
            raise ValueError(f"SampleConfig.temperature={self.temperature} must be >= 0 (0 is greedy)")

    def process_env(self, processes: int = 1) -> dict[str, str]:
        return self.model.process_env(processes)


@dataclass(frozen=True)
class CompareConfig:
    """A table and a loss plot of training runs: `runs` maps labels to training step outputs."""

    runs: dict[str, str]
    output_path: str = this_output()

    def __post_init__(self):
        if not self.runs:
            raise ValueError("CompareConfig.runs is empty: name the training steps to compare")
