"""Optax optimizers for keel models: AdamW, and the hero's grouped MuonH / AdamH / Adam optimizer.

Parameters are put in groups by regular expressions over their dotted paths (Levanter's
`leaf_key_paths`), so the grouping is declared in the config and never depends on module classes.
Levanter's pieces are reused: the learning-rate schedule, `scale_by_adamh`, and (in
`keel.train.muonh`, which finds each parameter's logical matrices from its axis names) the
Newton-Schulz coefficients and the norm-preserving ("hyperball") update.
"""

from __future__ import annotations

import re
from typing import Callable, Mapping, NamedTuple, Sequence

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from levanter.optim.adamh import scale_by_adamh as levanter_adamh
from levanter.optim.config import AdamConfig
from levanter.utils.jax_utils import leaf_key_paths

from keel.model.axes import LAYERS
from keel.spec.train import AdamWConfig, GroupedOptimizerConfig, optimizer_group, peak_lr
from keel.train.muonh import scale_by_muonh

Schedule = Callable[[jax.Array], jax.Array]


def lr_schedule(peak: float, num_steps: int, warmup_fraction: float, min_lr_ratio: float) -> Schedule:
    """Linear warmup over `warmup_fraction` of the steps, then linear decay to `min_lr_ratio * peak`."""
    shape = AdamConfig(learning_rate=peak, warmup=warmup_fraction, min_lr_ratio=min_lr_ratio, lr_schedule="linear")
    return shape.lr_scheduler(num_steps)


def decay_schedule(peak: float, start_step: int, num_steps: int) -> Schedule:
    """0 before `start_step`; from it `peak x (1 - step / num_steps)` (the hero's linear anneal)."""
    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        return jnp.where(step >= start_step, peak * (1.0 - step / num_steps), 0.0)

    return schedule


def param_paths(params):
    """A tree shaped like `params` whose leaves are dotted paths (`blocks.attn.w_q`, ...)."""
    return leaf_key_paths(params, is_leaf=_is_named)


def _is_named(x) -> bool:
    return isinstance(x, hax.NamedArray)


def mask_params(params, patterns: Sequence[str]):
    """True for parameters whose path matches one of `patterns`."""
    compiled = [re.compile(p) for p in patterns]
    return jax.tree.map(lambda path: any(p.search(path) for p in compiled), param_paths(params))


class ScheduleState(NamedTuple):
    count: jax.Array


def scheduled_weight_decay(mask, factor_at: Schedule) -> optax.GradientTransformation:
    """Decoupled weight decay on masked parameters: update -= factor_at(t) * param (the factor: the
    parameter's learning rate x the decay rate).

    Applied after the adaptive step (as in AdamW), so it shrinks weights independently of the
    gradient statistics.
    """
    def init_fn(params):
        del params
        return ScheduleState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params):
        factor = factor_at(state.count)

        def decay(m, u, p):
            return u - factor * p if m else u

        updates = jax.tree.map(decay, mask, updates, params)  # mask first: its leaves may sit above arrays
        return updates, ScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


def scale_by_adamh(lr: Schedule, *, b1: float, b2: float, eps: float) -> optax.GradientTransformation:
    """Levanter's AdamH (Adam direction, norm-preserving update) with a scheduled learning rate."""
    return optax.inject_hyperparams(lambda learning_rate: levanter_adamh(b1, b2, eps, learning_rate))(learning_rate=lr)


def grouped(
    transforms: Mapping[str, optax.GradientTransformation], labels
) -> optax.GradientTransformation:
    """Each label's parameters go through that label's transform (optax.multi_transform).

    The labels tree has the model's type, which may be callable (an Equinox module with
    `__call__`): optax would call it, so it is handed over behind a function.
    """
    return optax.multi_transform(dict(transforms), lambda _: labels)


def optimizer_labels(optimizer, params):
    """A tree shaped like `params` holding each parameter's group (`keel.spec.train.optimizer_group`)."""
    return jax.tree.map(lambda path: optimizer_group(optimizer, path), param_paths(params))


Rates = Mapping[str, jax.Array]
"""The values an optimizer steps with at one step, by name: `lr/<group>` for each group and, with a
`WeightDecayChange`, `weight_decay/<group>` (the group's learning rate x the decay rate)."""

_RATE_BLOCK = 1024  # steps of rates computed at once on the host


class Optimizer:
    """The optax transform a `TrainConfig` declares, and the schedules of the rates it steps with.

    The transforms read their rates from a function of their step count. A compiled training step
    passes the values for its step as inputs (`transform(rates)`, rates from `rates_at`), and so
    does the program of the initial state (whose optimizer state records them), so neither depends
    on the schedule: runs that differ only in learning rates, warmup or length (the points of a
    sweep, a rerun with a new rate) compile each once and share it through the compilation cache.
    `transform()` evaluates the schedules at each transform's own count instead, for use outside
    the loop.
    MuonH batches its Newton-Schulz loops within the resolved run's bound (`plan`:
    `ResolvedRun.newton_schulz_elements_per_device`, the figure `keel plan` prints); without a
    plan, within the largest parameter.
    """

    def __init__(self, train, params, plan=None):
        sched, opt = train.schedule, train.optimizer
        if isinstance(opt, AdamWConfig):
            self._groups = ("adamw",)
        elif isinstance(opt, GroupedOptimizerConfig):
            self._groups = ("muonh", "adamh", "adam")
        else:
            raise TypeError(f"TrainConfig.optimizer: unsupported {type(opt).__name__}; use AdamWConfig or "
                            "GroupedOptimizerConfig")
        self.schedules: dict[str, Schedule] = {
            f"lr/{group}": lr_schedule(peak_lr(opt, group), train.num_steps, sched.warmup_fraction,
                                       sched.decay_to_fraction)
            for group in self._groups
        }
        self._labels = optimizer_labels(opt, params)
        present = set(jax.tree.leaves(self._labels))
        self.lr_groups = tuple(g for g in self._groups if g in present)
        """The groups that hold parameters: the loop logs their rates as `lr/<group>`."""
        self._train, self._params = train, params
        self._newton_schulz_elements = (plan.newton_schulz_elements_per_device() if plan is not None else 0) or None
        change = train.weight_decay_change
        if change is not None:
            decay = decay_schedule(change.peak, change.start_step, train.num_steps)
            for group in self._groups:
                self.schedules[f"weight_decay/{group}"] = _product(self.schedules[f"lr/{group}"], decay)
        self._table = jax.jit(jax.vmap(lambda step: {name: s(step) for name, s in self.schedules.items()}))
        self._blocks: dict[int, dict[str, np.ndarray]] = {}

    def transform(self, rates: Rates | None = None) -> optax.GradientTransformation:
        """The transform, stepping with `rates` (one step's values: a compiled step's inputs), or
        without them with the schedules at each transform's own step count."""
        if rates is None:
            return self._build(lambda name: self.schedules[name])
        return self._build(lambda name: lambda count: rates[name])

    def rates_at(self, step: int) -> dict[str, np.ndarray]:
        """Step `step`'s rates as host float32 scalars: the schedules evaluated by XLA (the ops they
        were evaluated with inside the step before), a block of steps at a time."""
        block = step // _RATE_BLOCK
        if block not in self._blocks:
            steps = jnp.arange(block * _RATE_BLOCK, (block + 1) * _RATE_BLOCK, dtype=jnp.int32)
            self._blocks[block] = {name: np.asarray(values) for name, values in self._table(steps).items()}
        return {name: values[step % _RATE_BLOCK] for name, values in self._blocks[block].items()}

    def _build(self, rate: Callable[[str], Schedule]) -> optax.GradientTransformation:
        """Peak rates are `keel.spec.train.peak_lr`'s (AdamH at the MuonH rate). The router
        bias (`keel.spec.train.FROZEN_PARAMS`) receives no update at all. A `WeightDecayChange`
        adds decoupled weight decay on its groups, scaled by each parameter's own learning rate."""
        opt, labels = self._train.optimizer, self._labels
        lr = {group: rate(f"lr/{group}") for group in self._groups}
        groups = (_adamw_groups(opt, lr["adamw"]) if isinstance(opt, AdamWConfig)
                  else _hero_groups(opt, lr, self._newton_schulz_elements))
        transform = grouped({**groups, "frozen": optax.set_to_zero()}, labels)
        change = self._train.weight_decay_change
        if change is None:
            return transform
        in_groups = mask_params(self._params, change.groups)
        decays = [
            scheduled_weight_decay(jax.tree.map(lambda m, lab: bool(m and lab == name), in_groups, labels),
                                   rate(f"weight_decay/{name}"))
            for name in self._groups
        ]
        return optax.chain(transform, *decays)


def _product(a: Schedule, b: Schedule) -> Schedule:
    return lambda step: a(step) * b(step)


def _is_matrix(param) -> bool:
    """Two axes or more besides `layers`: a norm's gain, stored [layers, embed], is a vector per
    layer (decaying it shrinks every layer's norm but the first and last), a router [layers, embed,
    experts] a matrix per layer."""
    if isinstance(param, hax.NamedArray):
        return sum(ax.name != LAYERS for ax in param.axes) >= 2
    return param.ndim >= 2


def _adamw_groups(opt, lr: Schedule) -> dict[str, optax.GradientTransformation]:
    def matrices(group_params):  # decay matrices only; computed on the group's own (masked) tree
        return jax.tree.map(_is_matrix, group_params, is_leaf=lambda x: isinstance(x, hax.NamedArray))

    adamw = optax.adamw(lr, opt.beta1, opt.beta2, opt.eps, weight_decay=opt.weight_decay, mask=matrices)
    return {"adamw": adamw}


def _hero_groups(opt, lr: dict[str, Schedule], newton_schulz_elements: int | None
                 ) -> dict[str, optax.GradientTransformation]:
    return {
        "muonh": scale_by_muonh(lr["muonh"], momentum=opt.muon_momentum, nesterov=opt.muon_nesterov,
                                ns_steps=opt.muon_ns_steps, eps=opt.muon_eps, dtype=jnp.dtype(opt.newton_schulz_dtype),
                                loop_elements=newton_schulz_elements),
        "adamh": scale_by_adamh(lr["adamh"], b1=opt.beta1, b2=opt.beta2, eps=opt.eps),
        "adam": optax.adam(lr["adam"], b1=opt.beta1, b2=opt.beta2, eps=opt.eps),
    }
