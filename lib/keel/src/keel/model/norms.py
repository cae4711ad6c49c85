"""RMSNorm, the parameter-free QK norm, and GatedNorm (a low-rank sigmoid gate after an RMSNorm)."""

import equinox as eqx
import haliax as hax
import jax
import haliax.nn as hnn
import jax.numpy as jnp
from haliax import Axis, NamedArray

from keel.model.axes import ModelAxes, init_matrix
from keel.spec.model import MoELMConfig
from keel.model.layout import times


def rms_normalize(x: NamedArray, axis: Axis, eps: float) -> NamedArray:
    """RMS-normalise along `axis` in fp32 without a gain (the QK norm)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * hax.rsqrt(hax.mean(hax.square(x32), axis=axis) + eps)
    return normed.astype(x.dtype)


def rms_norm(axis: Axis, config: MoELMConfig) -> hnn.RmsNorm:
    """A learned-gain RMSNorm (no bias), its gain kept in fp32; apply it with `apply_rms_norm`,
    which normalises in fp32 and applies the gain in the activations' dtype."""
    return hnn.RmsNorm.init(axis, eps=config.norm_eps, use_weight=True, use_bias=False, dtype=jnp.float32)


def apply_rms_norm(norm: hnn.RmsNorm, x: NamedArray) -> NamedArray:
    """What Haliax's `RmsNorm.__call__` computes, with the gain applied by `layout.times`, so that
    its gradient does not all-gather the activations (see keel.model.layout)."""
    return times(rms_normalize(x, norm.axis, norm.eps), norm.weight.astype(x.dtype))


class GatedNorm(eqx.Module):
    """x * sigmoid(silu(x W_down) W_up): a per-dimension gate through a rank-r bottleneck."""

    down: NamedArray  # [Embed, GateRank]
    up: NamedArray  # [GateRank, Embed]

    @staticmethod
    def init(config: MoELMConfig, *, key) -> "GatedNorm":
        axes = ModelAxes.of(config)
        k_down, k_up = jax.random.split(key, 2)
        return GatedNorm(
            down=init_matrix(k_down, (axes.Embed, axes.GateRank), config),
            up=init_matrix(k_up, (axes.GateRank, axes.Embed), config),
        )

    def __call__(self, x: NamedArray) -> NamedArray:
        GateRank = self.down.resolve_axis("gate_rank")
        Embed = self.up.resolve_axis("embed")
        hidden = hnn.silu(hax.dot(x, self.down.astype(x.dtype), axis=Embed))
        gate = hnn.sigmoid(hax.dot(hidden, self.up.astype(x.dtype), axis=GateRank))
        return x * gate


class NormSite(eqx.Module):
    """One normalisation site of the reference: RMSNorm, then GatedNorm when gated_norm_rank > 0."""

    norm: hnn.RmsNorm
    gated: GatedNorm | None

    @staticmethod
    def init(config: MoELMConfig, *, key) -> "NormSite":
        axes = ModelAxes.of(config)
        gated = GatedNorm.init(config, key=key) if config.gated_norm_rank else None
        return NormSite(norm=rms_norm(axes.Embed, config), gated=gated)

    def __call__(self, x: NamedArray) -> NamedArray:
        x = apply_rms_norm(self.norm, x)
        return x if self.gated is None else self.gated(x)

