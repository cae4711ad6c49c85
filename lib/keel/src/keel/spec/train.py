"""What a training step computes (identity) and how it runs (execution-only), as plain dataclasses.

No jax here: `keel plan` reads these to derive the run's fact sheet instantly; the training loop
(`keel.train`'s step function) turns them into optax transforms and a Levanter loop.

Parameter groups (optimizer groups, weight-decay groups) are regular expressions `re.search`ed
against the model's dotted parameter paths, e.g. `layers.stacked.attn.q`,
`layers.stacked.moe.router` (every path and its axes: `MoELMConfig.parameter_axes`; `keel plan`
prints each one's group). `optimizer_group` is the one rule; the optimizer and the planner both
call it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import re
from dataclasses import dataclass, field
from typing import Any

from keel.executor.step import execution_only, this_output
from keel.spec.data import TOKEN_CACHE, check_made
from keel.spec.fields import not_whole
from keel.spec.hardware import Hardware
from keel.spec.metrics import METRICS_FILE, read_metrics, steady_tokens_per_s
from keel.spec.mixture import Mixture
from keel.spec.topology import RackTopology
from keel.spec.model import MoELMConfig
from keel.spec.transports import TRANSPORTS, TransportName, transport_name


def _whole(owner: str, config) -> None:
    bad = not_whole(config)
    if bad:
        raise ValueError(f"{owner}.{bad} must be a whole number")


def _positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{owner}.{name}={value!r} must be positive")


def _patterns(owner: str, name: str, patterns: tuple[str, ...]) -> None:
    """Parameter-path regexes compile (a typo fails here, not inside the running step)."""
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"{owner}.{name}: {pattern!r} is not a regular expression ({e})") from None


def _decay_rates(owner: str, **values: float) -> None:
    """Moment decay rates (Adam's betas, Muon's momentum): in [0, 1), or the moments diverge."""
    for name, value in values.items():
        if not 0 <= value < 1:
            raise ValueError(f"{owner}.{name}={value!r} must lie in [0, 1) (e.g. 0.9): outside it the moments do not "
                             "decay and the run diverges")


@dataclass(frozen=True)
class AdamWConfig:
    """One AdamW for every parameter; decoupled weight decay on matrices only: two axes or more
    besides `layers` (a norm's gain, stored one per layer, is no matrix)."""

    lr: float = 3e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self):
        _positive("AdamWConfig", lr=self.lr, eps=self.eps)
        _decay_rates("AdamWConfig", beta1=self.beta1, beta2=self.beta2)
        if self.weight_decay < 0:
            raise ValueError(f"AdamWConfig.weight_decay={self.weight_decay} must be >= 0")

    def at(self, model: MoELMConfig, train: TrainConfig) -> AdamWConfig:
        """Its rate is given, not derived: the same config at any size."""
        return self


MUONH_PARAMS = (
    r"\battn\.(q|k|v|o)\b",
    r"\bexperts\.",
    r"\bshared\.",
    r"\blatent_(down|up)\b",
    r"\bgated\.(down|up)\b",  # GatedNorm matrices: `<site>.gated.down` / `.up`
)
"""Matrices trained by MuonH: attention q/k/v/o, routed and shared experts, latent projections,
GatedNorm matrices."""
ADAMH_PARAMS = (r"\blm_head\b",)
"""Trained by AdamH: the lm_head. Everything else (embedding, router, router bias, attention gate,
gains, conv kernels) is trained by plain Adam."""


@dataclass(frozen=True)
class LrScalingLaw:
    """Peak learning rates from a fitted law: adam_lr = coefficient x T^tokens_exponent x
    D^width_exponent x sqrt(tokens per step) (T = total training tokens, D = hidden_dim), and
    muon_lr = muon_to_adam x adam_lr. A run's own law is declared with it (the hero's is
    `defaults.optimizers.hero_lr_law`); `optimizer()` puts it in a run's optimizer as a rule, so
    the rates follow the run's final model, batch, length and steps (after `--set`, in a twin, on a
    ladder's rungs) and `keel plan` prints what they resolve to."""

    coefficient: float
    tokens_exponent: float
    width_exponent: float
    muon_to_adam: float

    def __post_init__(self):
        _positive("LrScalingLaw", coefficient=self.coefficient, muon_to_adam=self.muon_to_adam)

    def adam_lr(self, hidden_dim: int, total_tokens: int, tokens_per_step: int) -> float:
        return (self.coefficient * total_tokens**self.tokens_exponent * hidden_dim**self.width_exponent
                * math.sqrt(tokens_per_step))

    def optimizer(self, *args: Any, scale: float = 1.0, **settings: Any) -> GroupedOptimizerConfig:
        """The grouped optimizer whose peak LRs are `scale` x this law's at the run's own size;
        `settings` are the other GroupedOptimizerConfig fields (betas, eps, ...)."""
        if args or {"batch_size", "seq_len", "num_steps"} & settings.keys():
            raise TypeError("LrScalingLaw.optimizer() takes no model, batch_size, seq_len or num_steps: the rates are "
                            "resolved from the training step's own model and TrainConfig; write law.optimizer(scale=..., "
                            "beta1=...)")
        return GroupedOptimizerConfig(lr_law=self, lr_scale=scale, **settings)


@dataclass(frozen=True)
class GroupedOptimizerConfig:
    """The hero's optimizer: MuonH / AdamH / Adam groups, with no gradient clipping.

    MuonH (Muon with a norm-preserving "hyperball" update) and AdamH (Adam's direction with the same
    hyperball projection) use `muon_lr`; Adam uses `adam_lr` (`peak_lr` is the one rule). A
    parameter goes to the first group whose patterns match its path, else to Adam. Newton-Schulz
    runs in `newton_schulz_dtype` (the hero's: bf16) with `muon_eps` guarding its normalisation.

    The peak rates are either given (`muon_lr`, `adam_lr`) or a rule: `lr_law` x `lr_scale`,
    resolved for the run's model and TrainConfig by `at`, which `keel.plan.resolve` calls: the
    trainer, the planner and the fact sheet read the one set of rates it gives.
    """

    muon_lr: float | None = None
    adam_lr: float | None = None
    lr_law: LrScalingLaw | None = None
    lr_scale: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 6.04e-15
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_eps: float = 1e-8
    newton_schulz_dtype: str = "bfloat16"
    newton_schulz_batch: int = execution_only(default=1 << 24)
    """Elements of gathered matrices that one Newton-Schulz loop may hold per device beyond the
    largest MuonH parameter's. MuonH orthogonalises the matrices of a shape and layout together in
    loops of at most the largest parameter or this many elements, whichever is more: on the hero
    the largest parameter is far larger, so each loop holds no more than one parameter does (the
    x of the plan's `newton_schulz_loop`); on a small model every shape takes one loop, and each loop is
    a compiled program of its own (tiny_moe: 4 loops instead of 11, its training step compiling in
    10.1 s instead of 12.3 s on 2 cores). 0: never more than the largest parameter."""
    muonh_params: tuple[str, ...] = MUONH_PARAMS
    adamh_params: tuple[str, ...] = ADAMH_PARAMS

    def __post_init__(self):
        _whole("GroupedOptimizerConfig", self)
        for name in ("muonh_params", "adamh_params"):
            _patterns("GroupedOptimizerConfig", name, getattr(self, name))
        rates = (self.muon_lr is not None, self.adam_lr is not None)
        if self.lr_law is None and rates != (True, True):
            raise ValueError("GroupedOptimizerConfig: give muon_lr and adam_lr, or lr_law (e.g. "
                             "hero_lr_law.optimizer()) to derive both from the run's size")
        if self.lr_law is not None and any(rates):
            raise ValueError("GroupedOptimizerConfig: lr_law derives muon_lr and adam_lr; give the law or the rates, "
                             "not both (scale the law's rates with lr_scale)")
        _positive("GroupedOptimizerConfig", lr_scale=self.lr_scale, eps=self.eps, muon_ns_steps=self.muon_ns_steps,
                  muon_eps=self.muon_eps, **({} if self.lr_law else {"muon_lr": self.muon_lr, "adam_lr": self.adam_lr}))
        _decay_rates("GroupedOptimizerConfig", beta1=self.beta1, beta2=self.beta2, muon_momentum=self.muon_momentum)
        if self.newton_schulz_batch < 0:
            raise ValueError(f"GroupedOptimizerConfig.newton_schulz_batch={self.newton_schulz_batch}: give 0 or more "
                             "elements (0: each Newton-Schulz loop holds at most the largest MuonH parameter)")
        if self.newton_schulz_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"GroupedOptimizerConfig.newton_schulz_dtype={self.newton_schulz_dtype!r}: use "
                             "'bfloat16' (the hero's) or 'float32'")

    def at(self, model: MoELMConfig, train: TrainConfig) -> GroupedOptimizerConfig:
        """This optimizer with its peak rates resolved for `model` trained as `train` says."""
        if self.lr_law is None:
            return self
        adam = self.lr_law.adam_lr(model.hidden_dim, train.total_tokens, train.tokens_per_step) * self.lr_scale
        return dataclasses.replace(self, lr_law=None, lr_scale=1.0, muon_lr=adam * self.lr_law.muon_to_adam, adam_lr=adam)


STACK_AXES = frozenset({"layers", "experts", "shared_experts"})
"""Axes that index independent matrices (scanned layers, routed experts, shared experts): MuonH
orthogonalises each matrix along them on its own, and they keep their split while it does."""
FROZEN_PARAMS = (r"\brouter_bias\b",)
"""Parameters the optimizer never updates: the router bias is set from quantile statistics."""
MOMENTS = {"muonh": 1, "adamh": 2, "adam": 2, "adamw": 2, "frozen": 0}
"""Optimizer-state arrays each group keeps per parameter (momentum; Adam's two moments), each in the
master dtype, as the trainer keeps them."""
TRAINING_DTYPES = ("bfloat16", "float16", "float32")
"""The floating-point dtypes a run may compute in or keep its master weights in."""


def peak_lr(optimizer: "AdamWConfig | GroupedOptimizerConfig", group: str) -> float:
    """The peak learning rate of an optimizer group: AdamW's `lr`; for the grouped optimizer
    `muon_lr` for MuonH and AdamH (the hero's AdamH runs at the MuonH rate), `adam_lr` for Adam;
    0 for the frozen group. The optimizer and the resolved run both read it."""
    if group == "frozen":
        return 0.0
    if isinstance(optimizer, AdamWConfig):
        return optimizer.lr
    if optimizer.lr_law is not None:
        raise ValueError("peak_lr: the optimizer's rates are a rule (lr_law); read them from the resolved run "
                         "(keel.plan.resolve(...).config.train.optimizer)")
    return optimizer.muon_lr if group in ("muonh", "adamh") else optimizer.adam_lr


def optimizer_group(optimizer: "AdamWConfig | GroupedOptimizerConfig", path: str) -> str:
    """The group that trains the parameter at `path`: 'frozen' (no update at all), else for the
    grouped optimizer the first of 'muonh' / 'adamh' whose patterns match, else 'adam'; for AdamW
    'adamw'."""
    if any(re.search(p, path) for p in FROZEN_PARAMS):
        return "frozen"
    if isinstance(optimizer, AdamWConfig):
        return "adamw"
    for group, patterns in (("muonh", optimizer.muonh_params), ("adamh", optimizer.adamh_params)):
        if any(re.search(p, path) for p in patterns):
            return group
    return "adam"


@dataclass(frozen=True)
class ScheduleConfig:
    """Linear warmup over `warmup_fraction` of the steps, then linear decay to `decay_to_fraction` x peak."""

    warmup_fraction: float = 0.01
    decay_to_fraction: float = 0.05

    def __post_init__(self):
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError(f"ScheduleConfig.warmup_fraction={self.warmup_fraction} must lie in [0, 1)")
        if not 0 <= self.decay_to_fraction <= 1:
            raise ValueError(f"ScheduleConfig.decay_to_fraction={self.decay_to_fraction} must lie in [0, 1]")


@dataclass(frozen=True)
class WeightDecayChange:
    """From `start_step` on, decoupled weight decay on `groups` at `peak x (1 - step / num_steps)` times
    the group's learning rate (as AdamW's decay is), added to any decay the optimizer applies itself
    (`AdamWConfig.weight_decay`)."""

    start_step: int
    peak: float
    groups: tuple[str, ...] = (r"\battn\.gate\b", r"\bmoe\.router\b")
    """Regexes over parameter paths; the default is the hero's: attention gates and router weights."""

    def __post_init__(self):
        _whole("WeightDecayChange", self)
        _patterns("WeightDecayChange", "groups", self.groups)
        if self.start_step < 0:
            raise ValueError(f"WeightDecayChange.start_step={self.start_step} must be >= 0")
        _positive("WeightDecayChange", peak=self.peak)
        if not self.groups:
            raise ValueError("WeightDecayChange.groups is empty: name the parameter groups to decay")




@dataclass(frozen=True)
class TransportPhase:
    """From `start_step` on, dispatch tokens to experts with `transport` (execution-only).

    `capacity_factor` None keeps the model's `capacity_factor` for a transport with a capacity
    (`TRANSPORTS[name].capacity`: the sender cells, the destination pools, the ragged receiver
    buffer); `num_waves` is read by the pooled transport only. A switch checkpoints at `start_step`
    and continues under the same output path: the transport is not part of the run's identity,
    except which assignments it drops (`TrainStepConfig.derived_identity`).
    """

    start_step: int
    transport: TransportName
    capacity_factor: float | None = None
    num_waves: int = 1

    def capacity(self, model: MoELMConfig) -> float | None:
        """The capacity factor this phase runs with: its own, else the model's; None for transports
        without a capacity (`ring` is dropless, `local` and `dense` move no tokens). The resolved
        run holds it; the planner's buffer sizes and the kernel the trainer calls both read it there."""
        if TRANSPORTS[self.transport].capacity is None:
            return None
        return self.capacity_factor if self.capacity_factor is not None else model.capacity_factor

    def __post_init__(self):
        object.__setattr__(self, "transport", transport_name(self.transport, "TransportPhase.transport"))
        _whole("TransportPhase", self)
        if self.start_step < 0:
            raise ValueError(f"TransportPhase.start_step={self.start_step} must be >= 0")
        if self.capacity_factor is not None:
            _positive("TransportPhase", capacity_factor=self.capacity_factor)
        if self.num_waves < 1:
            raise ValueError(f"TransportPhase.num_waves={self.num_waves} must be >= 1")
        if self.num_waves > 1 and not TRANSPORTS[self.transport].waves:
            waved = ", ".join(repr(name.value) for name, t in TRANSPORTS.items() if t.waves)
            raise ValueError(f"TransportPhase.num_waves={self.num_waves} on {self.transport!r}, which does not send "
                             f"in waves (only {waved} does): drop num_waves")
        if self.capacity_factor is not None and TRANSPORTS[self.transport].capacity is None:
            raise ValueError(f"TransportPhase.capacity_factor={self.capacity_factor} on {self.transport!r}, which has "
                             "no capacity (it drops nothing or moves no tokens): drop capacity_factor")


DEVICE, HOST = "device", "pinned_host"
"""Memory kinds: HBM, and the host memory that offloaded state lives in between steps."""


@dataclass(frozen=True)
class HostOffload:
    """What lives in host memory instead of HBM (execution-only; the memory fact sheet reads it).

    `master_weights_until_step`: fp32 master weights stay on the host for steps before it (None:
    always on device). `optimizer_state`: optimizer moments live on the host.
    """

    master_weights_until_step: int | None = None
    optimizer_state: bool = False

    def __post_init__(self):
        _whole("HostOffload", self)
        if self.master_weights_until_step is not None and self.master_weights_until_step < 0:
            raise ValueError(f"HostOffload.master_weights_until_step={self.master_weights_until_step} must be >= 0 "
                             "(None: the master weights stay on device)")

    def master_on_host(self, step: int) -> bool:
        return self.master_weights_until_step is not None and step < self.master_weights_until_step

    def memory_kinds_at(self, step: int) -> dict[str, str]:
        """The memory kind of each offloadable part of the train state while step `step` (0-based)
        runs: the one rule the planner's state table and the trainer's shardings both read."""
        return {"master_weights": HOST if self.master_on_host(step) else DEVICE,
                "optimizer_state": HOST if self.optimizer_state else DEVICE}


@dataclass(frozen=True)
class SpikeGuardConfig:
    """Roll a run back past a loss spike and skip the batch that caused it (`keel.train.spike_guard`).

    A step's training loss is a spike when it (or the gradient norm) is not finite, or, once
    `min_history` good steps are known, when it lies more than `threshold` robust deviations (one
    step's noise, from the median absolute deviation of the window's step-to-step changes) above
    the median of the last `window` good steps and at least `min_rise` (a fraction of that median)
    above it; the history starts again at each mixture phase. The spiking step's update is thrown
    away: the run goes back to its newest snapshot of the train state (kept in host memory every
    `snapshot_every` steps), replays the batches after it (each of which passed), skips the
    spiking batch (the step trains on the next one: the run still makes `num_steps` updates) and
    goes on. The spike after `max_rollbacks` rollbacks fails the step naming every spike. Skipped
    batches are recorded in `spike_guard.json` beside the metrics, so a resumed run skips the same
    ones. Default None: no guard, and a non-finite loss fails the run.

    Identity: the detection fields decide which batches are skipped, so they count toward the
    run's identity (a run that never spikes trains the same weights with or without the guard, but
    that is known only once it has run). `snapshot_every` and `max_rollbacks` are execution-only:
    a replay from any snapshot gives the same weights (the step is bit-exact), and the rollback
    budget only decides whether the run fails, so it can be raised to finish a run that gave up.
    """

    threshold: float = 6.0
    window: int = 50
    min_history: int = 20
    min_rise: float = 0.05
    snapshot_every: int = execution_only(default=10)
    max_rollbacks: int = execution_only(default=3)

    def __post_init__(self):
        _whole("SpikeGuardConfig", self)
        _positive("SpikeGuardConfig", threshold=self.threshold, window=self.window, min_history=self.min_history,
                  snapshot_every=self.snapshot_every)
        if self.min_history < 2:  # window >= min_history
            raise ValueError(f"SpikeGuardConfig.min_history={self.min_history}: the guard measures a step's noise from "
                             "the changes between the window's losses, which takes at least 2 (set min_history >= 2)")
        if self.min_history > self.window:
            raise ValueError(f"SpikeGuardConfig.min_history={self.min_history} exceeds window={self.window}: the "
                             "window never holds that many steps")
        if self.min_rise < 0:
            raise ValueError(f"SpikeGuardConfig.min_rise={self.min_rise} must be >= 0")
        if self.max_rollbacks < 0:
            raise ValueError(f"SpikeGuardConfig.max_rollbacks={self.max_rollbacks} must be >= 0")


@dataclass(frozen=True)
class TrainConfig:
    """One training run: identity fields first, then how it runs (execution-only)."""

    batch_size: int
    """Global batch in sequences."""
    num_steps: int
    seq_len: int | None = None
    """Tokens per sequence; None: the length the data was tokenized at (`default_train` fills it
    in from the data's tokenize steps). Declare it for caches keel did not tokenize."""
    optimizer: AdamWConfig | GroupedOptimizerConfig = field(default_factory=AdamWConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    seed: int = 0
    z_loss: float = 0.0
    weight_decay_change: WeightDecayChange | None = None
    compute_dtype: str = "bfloat16"
    master_dtype: str = "float32"
    """Precision changes the weights, so both count toward the run's identity; each is one of
    `TRAINING_DTYPES`."""
    spike_guard: SpikeGuardConfig | None = None
    """Roll back past loss spikes, skipping the batches that caused them (`SpikeGuardConfig`); None:
    off, and a non-finite loss fails the run."""

    eval_every: int | None = execution_only(default=None)
    """Evaluation cadence in steps: how often the run is looked at, not what it trains."""
    evaluations: int | None = execution_only(default=None)
    """Or a cadence that follows the run's length: at most this many evaluations after training
    steps, the last after its final step, whatever num_steps becomes (a `--set`, a twin); a run that
    starts from step 0 also evaluates its initial state. Neither given: every 100 steps
    (`eval_cadence`)."""
    eval_batches: int = execution_only(default=4)
    permanent_checkpoint_every: int | None = execution_only(default=None)
    """Permanent checkpoints every N steps, never deleted (the final one and those at transport
    switches are permanent too)."""
    rolling_checkpoint_every: int | None = execution_only(default=None)
    """Rolling checkpoints every N steps, of which the newest `keep_rolling_checkpoints` are kept."""
    rolling_checkpoint_minutes: float | None = execution_only(default=60.0)
    """Rolling checkpoints by wall-clock time as well (None: off)."""
    keep_rolling_checkpoints: int = execution_only(default=1)
    """How many rolling checkpoints survive; a permanent one supersedes them all."""
    log_every: int = execution_only(default=1)
    transports: tuple[TransportPhase, ...] = execution_only(default=())
    """Transport timeline, by ascending start_step; empty = the loop's default for the mesh."""
    remat: bool = execution_only(default=True)
    """Rematerialise each layer in the backward pass."""
    host_offload: HostOffload = execution_only(default=HostOffload())
    refuse_unfit: bool = execution_only(default=True)
    """`keel run` refuses a run whose planned peak memory does not fit HBM, or whose offloaded
    state does not fit host RAM (`keel.plan.check_fits`); False runs it anyway (the peak is a plan)."""
    compilation_cache: bool = execution_only(default=True)
    """Keep XLA's compiled programs in JAX's persistent compilation cache (`keel.train.compile_cache`:
    this machine's, or the step's own on shared storage), so a rerun, a resume or a sweep's other
    points load what one run compiled instead of compiling it again."""

    def __post_init__(self):
        _whole("TrainConfig", self)
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"TrainConfig.seed={self.seed} must lie in [0, 2**32): a PRNG key holds 32 bits, so a "
                             "larger seed trains what a smaller one does, and a negative one fails at evaluation")
        if self.eval_every is not None and self.evaluations is not None:
            raise ValueError(f"TrainConfig: eval_every={self.eval_every} and evaluations={self.evaluations} both set "
                             "the evaluation cadence: give one (set the other to None)")
        _positive("TrainConfig", batch_size=self.batch_size, num_steps=self.num_steps, log_every=self.log_every,
                  **{k: v for k, v in (("eval_every", self.eval_every), ("evaluations", self.evaluations)) if v is not None},
                  **({} if self.seq_len is None else {"seq_len": self.seq_len}))
        if self.z_loss < 0:
            raise ValueError(f"TrainConfig.z_loss={self.z_loss} must be >= 0")
        if self.eval_batches < 0:
            raise ValueError(f"TrainConfig.eval_batches={self.eval_batches} must be >= 0 (0: no evaluation)")
        if self.spike_guard is not None and self.log_every != 1:
            raise ValueError(f"TrainConfig.log_every={self.log_every} with a spike_guard: a resumed run reads the guard's "
                             "history from metrics.jsonl, which would lack the steps between rows, and could skip other "
                             "batches than an uninterrupted run: keep log_every=1 with the guard")
        for name in ("compute_dtype", "master_dtype"):
            if getattr(self, name) not in TRAINING_DTYPES:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)!r} is not a dtype keel trains in: use "
                                 f"{', '.join(TRAINING_DTYPES[:-1])} or {TRAINING_DTYPES[-1]}")
        for name in ("permanent_checkpoint_every", "rolling_checkpoint_every", "rolling_checkpoint_minutes"):
            if getattr(self, name) is not None:
                _positive("TrainConfig", **{name: getattr(self, name)})
        if self.keep_rolling_checkpoints < 1:
            raise ValueError(f"TrainConfig.keep_rolling_checkpoints={self.keep_rolling_checkpoints} must be >= 1: "
                             "a resume needs the newest rolling checkpoint")
        starts = [t.start_step for t in self.transports]
        if starts != sorted(set(starts)) or (starts and starts[0] != 0):
            raise ValueError(
                f"TrainConfig.transports start at steps {starts}: list them by strictly ascending start_step, "
                "the first at step 0"
            )
        if starts and starts[-1] >= self.num_steps:
            raise ValueError(
                f"TrainConfig.transports: a phase starts at step {starts[-1]}, at or after num_steps={self.num_steps}: "
                "move it earlier or drop it"
            )
        if self.weight_decay_change and self.weight_decay_change.start_step >= self.num_steps:
            raise ValueError(
                f"TrainConfig.weight_decay_change.start_step={self.weight_decay_change.start_step} is not before "
                f"num_steps={self.num_steps}"
            )

    @property
    def eval_cadence(self) -> int:
        """Steps between evaluations: `eval_every`, else num_steps / `evaluations` rounded up (rounded
        down, 7 steps and 4 evaluations evaluated after every step), else 100."""
        if self.eval_every is not None:
            return self.eval_every
        return -(-self.num_steps // self.evaluations) if self.evaluations is not None else 100

    def keeps_checkpoint(self, step: int) -> bool:
        """Whether the finished run holds the checkpoint of `step` completed steps: the permanent ones,
        at its last step, every `permanent_checkpoint_every` and at each transport switch (what a run
        resumed on the next transport starts from). Rolling checkpoints do not outlive the last
        step's, which supersedes them. The loop saves permanent checkpoints by this rule, and an
        eval or sample of a step number is held to it at declaration."""
        every = self.permanent_checkpoint_every
        return 0 < step <= self.num_steps and (
            step == self.num_steps or bool(every and step % every == 0)
            or any(phase.start_step == step for phase in self.transports[1:]))

    def kept_checkpoints(self) -> str:
        """The checkpoints `keeps_checkpoint` keeps, in words."""
        kept = [f"its last step, {self.num_steps}"]
        if self.permanent_checkpoint_every:
            kept.append(f"every {self.permanent_checkpoint_every} steps")
        switches = [phase.start_step for phase in self.transports[1:]]
        if switches:
            kept.append(f"the transport switches at {', '.join(map(str, switches))}")
        return "it keeps " + ", ".join(kept) + "; rolling checkpoints do not outlive the last one"

    @property
    def tokens_per_step(self) -> int:
        if self.seq_len is None:
            raise ValueError("TrainConfig.seq_len is not known yet: declare it, or build the step with default_train, "
                             "which takes it from the data's tokenize steps")
        return self.batch_size * self.seq_len

    @property
    def total_tokens(self) -> int:
        return self.tokens_per_step * self.num_steps

    def transport_at(self, step: int) -> TransportPhase | None:
        """The transport phase in force at `step` (None when no timeline is declared)."""
        current = None
        for phase in self.transports:
            if phase.start_step <= step:
                current = phase
        return current


def steps_for_tokens_per_param(model: MoELMConfig, batch_size: int, seq_len: int, tokens_per_param: float) -> int:
    """Steps that train on `tokens_per_param` tokens per active parameter: round(r x active / tokens per step)."""
    return round(tokens_per_param * model.param_counts()["active"] / (batch_size * seq_len))


@dataclass(frozen=True)
class SpeedObservation:
    """A declared fact: from `step` (reached on `date`, ISO yyyy-mm-dd) the run took `step_seconds` a step."""

    step: int
    date: str
    step_seconds: float

    def __post_init__(self):
        _iso_date("SpeedObservation.date", self.date)


@dataclass(frozen=True)
class Claim:
    """A figure quoted about a run, declared next to it so that `keel plan` recomputes it.

    `figure` names what the planner derives (see `keel.plan.facts.FIGURES`): `run_days` (the whole
    run at the projected rate), `one_rack_days` (the same on one rack), `batch_bytes` (a global
    batch of token ids), `activation_bytes_per_layer` / `activation_bytes_all_layers` (what a
    layer's forward keeps for its backward over the global batch, without rematerialisation),
    `moe_to_dense_flops` (routed experts' FLOPs over a dense MLP of the same width). `quoted` is the figure as claimed, in the same unit.
    """

    text: str
    figure: str
    quoted: float


CLAIM_FIGURES = ("run_days", "one_rack_days", "batch_bytes", "activation_bytes_per_layer",
                 "activation_bytes_all_layers", "moe_to_dense_flops")
"""The figures a `Claim` can name; `keel.plan.facts.FIGURES` derives each one."""


@dataclass(frozen=True)
class RunFacts:
    """Facts about a real run declared next to it: when it started, how fast it went, what is said of it.

    `projected_steps_per_day` is the rate the end date is projected at from the last observation
    on (None: that observation's measured rate); over the rate the rest of the run can go at full
    goodput (the measured rate, or a faster phase ahead as the step-time model predicts it) it is
    the goodput the projection assumes (restarts, evaluation, checkpoints), at most 1.
    """

    start_date: str
    observed: tuple[SpeedObservation, ...] = ()
    projected_steps_per_day: float | None = None
    run_id: str | None = None
    claims: tuple[Claim, ...] = ()
    measured_on: str | None = None
    """The speed key (`keel.plan.step_time.speed_key`) of the layout the speeds were measured on: a
    declaration with another key (batch, hardware, topology, transports, ...) is a variant, whose
    step time is predicted, not observed. None: the observations are this declaration's own."""

    def __post_init__(self):
        _iso_date("RunFacts.start_date", self.start_date)


def _iso_date(field: str, text) -> None:
    """Dates are ISO `yyyy-mm-dd`: the plan counts days from them (checked here, before a plan or a run)."""
    try:
        dt.date.fromisoformat(text)
    except (TypeError, ValueError):
        raise ValueError(f"{field}={text!r} is not an ISO date: write it as 'yyyy-mm-dd'") from None


@dataclass(frozen=True)
class LaunchPlan:
    """What a launch decision needs beyond the run (execution-only; the fact sheet reads it).

    `store_gb_per_s`: the bandwidth checkpoints are written at (GB/s, whole run); `gpu_hour_price`:
    what one GPU-hour costs; `cache_tokens`: (mixture component, tokens its cache holds), so the
    sheet says how often each is read over.
    """

    store_gb_per_s: float | None = None
    gpu_hour_price: float | None = None
    cache_tokens: tuple[tuple[str, float], ...] = ()

    def __post_init__(self):
        _positive("LaunchPlan", **{name: value for name, value in (("store_gb_per_s", self.store_gb_per_s),
                                                                  ("gpu_hour_price", self.gpu_hour_price))
                                   if value is not None},
                  **{f"cache_tokens[{name!r}]": tokens for name, tokens in self.cache_tokens})
        names = [name for name, _ in self.cache_tokens]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"LaunchPlan.cache_tokens names {', '.join(map(repr, repeated))} more than once: give each "
                             "component the tokens its cache holds once")


@dataclass(frozen=True)
class TrainStepConfig:
    """The config of a training step: what to train on what, and (execution-only) where and how fast.

    `data` is always a `Mixture` (components with phase weights): a single token cache (a tokenize
    step, its output, an `External`) is kept as the one-component mixture `Mixture.single(cache)`,
    so everything downstream reads one shape.
    """

    model: MoELMConfig
    data: Mixture
    train: TrainConfig
    topology: RackTopology | None = execution_only(default=None)
    hardware: Hardware | None = execution_only(default=None)
    output_path: str = this_output()
    facts: RunFacts | None = execution_only(default=None)
    launch: LaunchPlan | None = execution_only(default=None)

    stand_ins: tuple[str, ...] = execution_only(default=())
    """What a scaled-down twin plays the real run's part with, one line each (`keel.plan.scale_down`
    writes them; `keel plan` prints them): the hardware, a transport the hardware lacks, the data."""
    coordinator: str | None = execution_only(default=None)
    """Where the replicas of a multi-process run meet ("host:port"); None: found through Iris.
    Pin it (e.g. "127.0.0.1:<port>") when every replica runs on one machine."""
    predicted_loss: str | None = execution_only(default=None)
    """Where the loss predicted for this run is written (a scaling ladder's prediction.json:
    `default_train(..., predicted_loss=ladder.prediction)`), so the run trains after its prediction
    is made and `keel plan`, `status`, `compare` and the dashboard set its loss against the band."""
    derived_seq_len: int | None = execution_only(default=None)
    """The train.seq_len this config took from its data because it was left out (None: declared).
    Kept so that a rebuild (`dataclasses.replace`, a `--set` on the tokenize step) takes the new
    data's length again, while a seq_len set to another value stays the one declared."""

    def __post_init__(self):
        if not isinstance(self.data, Mixture):
            object.__setattr__(self, "data", Mixture.single(self.data))
        for name, cache in self.data.components.items():
            check_made("data" if self.data.is_single else f"data.components[{name!r}]", cache, TOKEN_CACHE)
        if self.train.seq_len in (None, self.derived_seq_len):  # left out: the length the data was tokenized at
            seq_len = self.data.tokenized_seq_len()
            if seq_len is None and self.train.seq_len is None:
                raise ValueError("TrainConfig.seq_len is not declared and the data are not keel tokenize steps (an "
                                 "External cache): declare train.seq_len")
            if seq_len is not None:  # None: data resolved to paths (the running step), which keep the length derived
                object.__setattr__(self, "train", dataclasses.replace(self.train, seq_len=seq_len))
                object.__setattr__(self, "derived_seq_len", seq_len)

    def positions(self) -> list[tuple[str, int]]:
        """(what, step) of every point after step 0 where the run changes what it does: a mixture
        phase, a transport, the weight-decay change, the end of master-weight offload. They are
        declared as steps, so they stay at those steps whatever the run's length."""
        train = self.train
        found = [(f"mixture phase {i}", p.start_step) for i, p in enumerate(self.data.phases)]
        found += [(f"transport {i} ({t.transport})", t.start_step) for i, t in enumerate(train.transports)]
        if train.weight_decay_change is not None:
            found.append(("weight decay change", train.weight_decay_change.start_step))
        if train.host_offload.master_weights_until_step is not None:
            found.append(("master-weight offload end", train.host_offload.master_weights_until_step))
        return [(what, step) for what, step in found if step > 0]

    def override_notes(self, before: "TrainStepConfig") -> list[str]:
        """What a `--set` changed that it does not say (`keel.executor.overrides` prints these):
        a new run length keeps every position at its declared step, so each lands at another share
        of the run (a cooldown declared for the last 20% of 390,251 steps covers 38% of 500,000); a new
        batch or sequence length keeps the run's steps, so it reads other tokens (the hero derives its
        steps from its tokens: half its batch halved every phase's tokens)."""
        notes = []
        old, new = before.train.num_steps, self.train.num_steps
        was = dict(before.positions())
        kept = [(what, step) for what, step in self.positions() if was.get(what) == step]  # not moved by a --set too
        if old != new and kept:
            moved = ", ".join(f"{what} at step {step:,} ({step / old:.1%} -> {step / new:.1%})" for what, step in kept)
            notes.append(f"train.num_steps {old:,} -> {new:,} keeps the steps its positions are declared at, so they fall "
                         f"at other shares of the run: {moved}. To keep their shares, change the length where the "
                         "experiment declares it: positions declared as shares of the run (`keel.plan.positions.steps_at`) follow it")
        if old == new and before.train.seq_len is not None and self.train.seq_len is not None:
            was_tokens, tokens = before.train.tokens_per_step, self.train.tokens_per_step
            if was_tokens != tokens:
                notes.append(f"tokens per step {was_tokens:,} -> {tokens:,} (batch_size x seq_len) keeps train.num_steps "
                             f"at {new:,}, so the run reads {tokens * new:,} tokens instead of {was_tokens * new:,} "
                             f"({tokens / was_tokens:.3g}x, every phase alike). To keep the tokens, change the "
                             "batch where the experiment declares it, with a length derived from it, or --set "
                             "train.num_steps too")
        return notes

    def derived_identity(self) -> dict:
        """Which routed assignments the run drops, as its execution-only layout decides (`DerivesIdentity`):
        for each stretch of the transport timeline whose transport has a capacity, that transport, its
        capacity factor, its waves and the expert-parallel and token shards the capacity is counted on
        (a capacity of 0.5 drops half the assignments: another run, not the same one resumed). Dropless
        stretches (`ring`, `local`, any transport without an expert axis of 2 or more) decide nothing,
        so a run dropless throughout adds nothing, and its transports and topology stay free to change."""
        topology, timeline = self.topology, []
        for phase in self.train.transports:
            factor = phase.capacity(self.model)
            rule = None if factor is None or topology is None or topology.expert_parallel < 2 else {
                "transport": phase.transport, "capacity_factor": factor,
                "num_waves": phase.num_waves if TRANSPORTS[phase.transport].waves else 1,
                "expert_parallel": topology.expert_parallel, "token_shards": topology.batch_shards}
            if not timeline or timeline[-1][1] != rule:
                timeline.append([phase.start_step, rule])
        return {"drops": timeline} if any(rule is not None for _, rule in timeline) else {}

    def resources_problem(self, resources: Any) -> str | None:
        """Why the step's `resources` (a `keel.Resources`) cannot run this layout, as a message with
        the fix; None when they ask for exactly the GPUs the topology lays out. The launcher starts
        gpu_count x replicas GPUs and the mesh needs topology.num_devices of them, so a mismatch would
        fail only at dispatch: `default_train` and a `--set` (`keel.executor.overrides`) both ask here."""
        topology = self.topology
        if topology is None and resources is not None and resources.replicas > 1:
            return (f"resources ask for {resources.replicas} replicas, but no topology is declared, and a run without "
                    "one lays every device out as one rack, its expert and FSDP axes across the hosts' slow link: "
                    "declare topology=RackTopology(racks=..., gpus_per_rack=...) with the step")
        if resources is None or topology is None or not resources.gpu_count:
            return None
        asked = resources.gpu_count * resources.replicas
        per_host = self.hardware.gpus_per_host if self.hardware else None
        if asked == topology.num_devices and per_host and resources.gpu_count != per_host:
            return (f"resources ask for {resources.gpu_count} GPUs per replica, but hardware.gpus_per_host="
                    f"{per_host} ({self.hardware.name}): a replica is one host; declare Resources.with_gpu("
                    f"{resources.gpu_type!r}, {per_host}, replicas={topology.num_devices // per_host}) with the step")
        if asked == topology.num_devices:
            return None
        replicas, left = divmod(topology.num_devices, resources.gpu_count)
        fix = (f"Resources.with_gpu({resources.gpu_type!r}, {resources.gpu_count}, replicas={replicas})" if not left
               else f"resources for {topology.num_devices} GPUs")
        return (f"resources ask for {resources.gpu_count} GPUs x {resources.replicas} replicas = {asked}, but the "
                f"topology lays out {topology.racks} racks x {topology.gpus_per_rack} = {topology.num_devices}: declare "
                f"{fix} with the step, or a topology of {asked} GPUs")

    def progress(self, output_path: str, running: bool = True) -> str | None:
        """How far a running (or stopped) training step got, from its metrics: for `keel status`
        in a second terminal, wherever the step runs (the prefix is shared storage). Its speed is
        the dashboard's and `keel compare`'s (`steady_tokens_per_s`); only a step that is `running`
        gets a time to go."""
        try:
            records = read_metrics(f"{output_path.rstrip('/')}/{METRICS_FILE}")
        except (FileNotFoundError, OSError):
            return None
        trained = [r for r in records if "train/loss" in r]
        if not trained:
            return "training: compiling or before its first step"
        last, speed = trained[-1], steady_tokens_per_s(records)
        done = last["step"] + 1
        line = f"training: step {done}/{self.train.num_steps}, loss {last['train/loss']:.4f}"
        if speed:
            seconds = (self.train.num_steps - done) * self.train.tokens_per_step / speed
            line += f", {speed:,.0f} tokens/s" + (f", about {seconds / 60:.1f} min to go" if running else "; not running")
        return line

    def process_env(self, processes: int = 1) -> dict[str, str]:
        """What each of the step's `processes` needs to see its share of the declared devices."""
        return declared_process_env(self.hardware, self.topology, processes)


def declared_process_env(hardware: Hardware | None, topology: RackTopology | None, processes: int = 1) -> dict[str, str]:
    """What each of a step's `processes` needs to see its share of the devices `hardware` and
    `topology` declare (a training step's, or an eval/sample step's running on the same layout)."""
    if hardware is None:
        return {}
    devices = topology.num_devices if topology is not None else hardware.gpus_per_rack
    if devices % processes:
        raise ValueError(f"{devices} devices do not split over {processes} processes: declare replicas that "
                         "divide topology.racks x topology.gpus_per_rack")
    return hardware.process_env(devices // processes)
