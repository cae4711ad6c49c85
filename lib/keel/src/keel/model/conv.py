"""Short causal depthwise convolution that never mixes tokens of different packed documents."""

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
from haliax import Axis, AxisSpec, NamedArray



class CausalDepthwiseConv(eqx.Module):
    """y[t] = sum_j kernel[j] * x[t - j] over j < conv_kernel, per channel, within one document.

    The kernel is identity-initialised (kernel[0] = 1, the rest 0), so a fresh model behaves as if
    the convolution were absent. Taps that reach before the start of the row or into an earlier
    document (a different segment id) contribute nothing.
    """

    kernel: NamedArray  # [ConvKernel, *Channels]

    @staticmethod
    def init(ConvKernel: Axis, Channels: AxisSpec) -> "CausalDepthwiseConv":
        identity = hax.nn.one_hot(0, ConvKernel, dtype=jnp.float32)
        return CausalDepthwiseConv(kernel=identity.broadcast_axis(Channels).rearrange((ConvKernel, ...)))

    def __call__(self, x: NamedArray, segment_ids: NamedArray, Pos: Axis) -> NamedArray:
        ConvKernel = self.kernel.axes[0]
        kernel = self.kernel.astype(x.dtype)
        out = x * kernel[ConvKernel, 0]
        for shift in range(1, ConvKernel.size):
            shifted_x = _shift_right(x, Pos, shift, fill=0)
            in_row = hax.arange(Pos) >= shift
            same_doc = in_row & (_shift_right(segment_ids, Pos, shift, fill=0) == segment_ids)
            out = out + hax.where(same_doc, shifted_x, 0) * kernel[ConvKernel, shift]
        return out


def _shift_right(x: NamedArray, Pos: Axis, shift: int, fill) -> NamedArray:
    """x[t - shift] at position t, `fill` where t - shift < 0."""
    head = hax.full_like(x[Pos, :shift], fill)
    return hax.concatenate(Pos, [head, x[Pos, : Pos.size - shift]])

