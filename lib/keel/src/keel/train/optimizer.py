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
import optax
from levanter.optim.adamh import scale_by_adamh as levanter_adamh
from levanter.optim.config import AdamConfig
from levanter.utils.jax_utils import leaf_key_paths

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


def scheduled_weight_decay(mask, lr: Schedule, rate: Schedule) -> optax.GradientTransformation:
    """Decoupled weight decay on masked parameters: update -= lr(t) * rate(t) * param.

    Applied after the adaptive step (as in AdamW), so it shrinks weights independently of the
    gradient statistics.
    """
    def init_fn(params):
        del params
        return ScheduleState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params):
        factor = lr(state.count) * rate(state.count)

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


class _Groups(NamedTuple):
    transforms: dict[str, optax.GradientTransformation]
    lr: dict[str, Schedule]  # each group's learning rate


def optimizer_labels(optimizer, params):
    """A tree shaped like `params` holding each parameter's group (`config.optimizer_group`)."""
    return jax.tree.map(lambda path: optimizer_group(optimizer, path), param_paths(params))


def build_optimizer(train, params) -> tuple[optax.GradientTransformation, dict[str, Schedule]]:
    """The optax transform a `TrainConfig` declares, plus the learning-rate schedule of each of its
    groups (the very functions the transforms step with: the loop logs them as `lr/<group>` and
    checks them against the resolved run).

    Peak rates are `config.peak_lr`'s (AdamH at the MuonH rate). The router bias
    (`config.FROZEN_PARAMS`) receives no update at all. A `WeightDecayChange` adds decoupled weight
    decay on its groups, scaled by each parameter's own learning rate.
    """
    sched, opt = train.schedule, train.optimizer

    def schedule(group: str) -> Schedule:
        return lr_schedule(peak_lr(opt, group), train.num_steps, sched.warmup_fraction, sched.decay_to_fraction)

    if isinstance(opt, AdamWConfig):
        groups = _adamw_groups(opt, schedule("adamw"))
    elif isinstance(opt, GroupedOptimizerConfig):
        groups = _hero_groups(opt, {group: schedule(group) for group in ("muonh", "adamh", "adam")})
    else:
        raise TypeError(f"TrainConfig.optimizer: unsupported {type(opt).__name__}; use AdamWConfig or GroupedOptimizerConfig")

    labels = optimizer_labels(opt, params)
    present = set(jax.tree.leaves(labels))
    transform = grouped({**groups.transforms, "frozen": optax.set_to_zero()}, labels)
    change = train.weight_decay_change
    if change is not None:
        in_groups = mask_params(params, change.groups)
        rate = decay_schedule(change.peak, change.start_step, train.num_steps)
        decays = [
            scheduled_weight_decay(jax.tree.map(lambda m, lab: bool(m and lab == name), in_groups, labels), lr, rate)
            for name, lr in groups.lr.items()
        ]
        transform = optax.chain(transform, *decays)
    return transform, {group: lr for group, lr in groups.lr.items() if group in present}


def _adamw_groups(opt, lr: Schedule) -> _Groups:
    def matrices(group_params):  # decay matrices only; computed on the group's own (masked) tree
        return jax.tree.map(lambda x: x.ndim >= 2, group_params)

    adamw = optax.adamw(lr, opt.beta1, opt.beta2, opt.eps, weight_decay=opt.weight_decay, mask=matrices)
    return _Groups({"adamw": adamw}, {"adamw": lr})


def _hero_groups(opt, lr: dict[str, Schedule]) -> _Groups:
    transforms = {
        "muonh": scale_by_muonh(lr["muonh"], momentum=opt.muon_momentum, nesterov=opt.muon_nesterov,
                                ns_steps=opt.muon_ns_steps, eps=opt.muon_eps, dtype=jnp.dtype(opt.newton_schulz_dtype)),
        "adamh": scale_by_adamh(lr["adamh"], b1=opt.beta1, b2=opt.beta2, eps=opt.eps),
        "adam": optax.adam(lr["adam"], b1=opt.beta1, b2=opt.beta2, eps=opt.eps),
    }
    return _Groups(transforms, lr)
