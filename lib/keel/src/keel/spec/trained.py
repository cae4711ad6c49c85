"""Steps that use finished training runs (compare, evaluate, sample), as plain dataclasses.

No jax here, so declaring and planning stay instant; the step functions import what they need
when they run. An eval or sample step loads a checkpoint on the device layout its run declared,
so its process sees the devices a training step with that hardware and topology would see
(`declared_process_env`, the training step's own rule).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from keel.executor.step import execution_only, this_output
from keel.spec.data import tokenizer_input_files
from keel.spec.hardware import Hardware
from keel.spec.topology import RackTopology
from keel.spec.model import MoELMConfig
from keel.spec.train import TrainConfig, TrainStepConfig, declared_process_env


@dataclass(frozen=True)
class TrainedModel:
    """One checkpoint of a training step, read from the step itself.

    `run` is the training step (`default_train`'s Step; its output directory when this step runs),
    `checkpoint` "final" (the run's last step, whatever its length) or a step number. The step it
    resolves to counts toward identity: another checkpoint is another result. The run's model,
    TrainConfig and device layout are derived from `run` whenever it is given or replaced, never
    copied at declaration: a `--set` on the run reaches its eval and sample steps.
    """

    run: Any
    checkpoint: int | str = execution_only(default="final")
    """How the checkpoint was named; the step it resolves to is what counts."""
    step: int = field(init=False)
    model: MoELMConfig = execution_only(init=False)
    train: TrainConfig = execution_only(init=False)
    topology: RackTopology | None = execution_only(init=False)
    hardware: Hardware | None = execution_only(init=False)

    def __post_init__(self):
        config = getattr(self.run, "config", None)
        if not isinstance(config, TrainStepConfig):
            raise TypeError(f"TrainedModel.run={self.run!r} is not a training step: pass the Step that default_train "
                            "returned")
        if self.checkpoint == "final":
            step = config.train.num_steps
        elif isinstance(self.checkpoint, bool) or not isinstance(self.checkpoint, int) \
                or not 0 < self.checkpoint <= config.train.num_steps:
            raise ValueError(f"TrainedModel.checkpoint={self.checkpoint!r}: give 'final' or a checkpoint step in "
                             f"1..{config.train.num_steps} (the run's num_steps)")
        elif not config.train.keeps_checkpoint(self.checkpoint):
            raise ValueError(f"TrainedModel.checkpoint={self.checkpoint}: the run keeps no checkpoint of step "
                             f"{self.checkpoint} ({config.train.kept_checkpoints()}); name one of those, or declare "
                             f"the run's TrainConfig.permanent_checkpoint_every as a divisor of {self.checkpoint} "
                             "(execution-only: a run already trained with such a cadence is reused as it is, and one "
                             "not trained yet keeps it)")
        else:
            step = self.checkpoint
        for name, value in (("step", step), ("model", config.model), ("train", config.train),
                            ("topology", config.topology), ("hardware", config.hardware)):
            object.__setattr__(self, name, value)

    def process_env(self, processes: int = 1) -> dict[str, str]:
        return declared_process_env(self.hardware, self.topology, processes)


@dataclass(frozen=True)
class EvalConfig:
    """Loss, perplexity and bits per byte of a checkpoint on each token cache of `data`.

    `data` maps labels to token cache roots (tokenize steps or Externals). Of each cache's `split`,
    the same seeded sample of `num_batches` batches of `batch_size` sequences is read as the training
    loop reads for its validation (`validation_losses`): the run's own validation cache gives the
    run's last eval loss.
    """

    model: TrainedModel
    data: dict[str, str]
    batch_size: int | None = None
    """None: the run's own batch size (read when the step runs, so it follows the run)."""
    num_batches: int | None = None
    """None: the run's own `eval_batches`."""
    split: str = "validation"
    own_data: bool = execution_only(default=False)
    """`data` is the run's own caches (`default_eval` without data=): a cache whose split is empty is
    left out, as the training loop leaves it out of its validation. Else an empty split is an error."""
    coordinator: str | None = execution_only(default=None)
    """Where the replicas of an eval on several processes meet ("host:port"; `resources=` with
    replicas, for a run too large for one host); None: found through Iris."""
    output_path: str = this_output()

    def __post_init__(self):
        if not self.data:
            raise ValueError("EvalConfig.data is empty: name at least one token cache, e.g. {'validation': tokens}")
        for name in ("batch_size", "num_batches"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"EvalConfig.{name}={getattr(self, name)} must be positive (or None: the run's own)")
        shards = self.model.topology.batch_shards if self.model.topology else 1
        if self.batch_size is not None and self.batch_size % shards:
            raise ValueError(f"EvalConfig.batch_size={self.batch_size} does not split over the run's {shards} batch "
                             f"shards: give a multiple of {shards} (or None: the run's own)")
        if self.num_batches is None and not self.model.train.eval_batches:
            raise ValueError("EvalConfig.num_batches=None follows the run's eval_batches, which is 0 (it never "
                             "evaluated): give num_batches")

    @property
    def batches(self) -> tuple[int, int]:
        """(batch size, number of batches): the declared ones, else the run's validation reads."""
        return (self.batch_size or self.model.train.batch_size, self.num_batches or self.model.train.eval_batches)

    def derived_identity(self) -> dict:
        """The run's `eval_batches` where `num_batches` follows it (`DerivesIdentity`): execution-only for
        the run, it decides which sequences this step evaluates (the run's batch size is in its identity)."""
        return {"eval_batches": self.model.train.eval_batches} if self.num_batches is None else {}

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
    coordinator: str | None = execution_only(default=None)
    """Where the replicas of a sample on several processes meet ("host:port"); None: found through Iris."""
    output_path: str = this_output()

    def __post_init__(self):
        if not self.prompts or not all(isinstance(p, str) for p in self.prompts):
            raise ValueError("SampleConfig.prompts: give a non-empty tuple of strings")
        if self.max_tokens <= 0:
            raise ValueError(f"SampleConfig.max_tokens={self.max_tokens} must be positive")
        if self.temperature < 0:
            raise ValueError(f"SampleConfig.temperature={self.temperature} must be >= 0 (0 is greedy)")

    def input_files(self) -> dict[str, str]:
        return tokenizer_input_files(self.tokenizer)

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
