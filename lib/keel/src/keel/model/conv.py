"""Short causal depthwise convolution that never mixes tokens of different packed documents."""

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import Axis, AxisSpec, NamedArray

from keel.model.layout import times



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
        out = times(x, kernel[ConvKernel, 0])
        for shift in range(1, ConvKernel.size):
            # Before the row's start the shifted x is 0, so only the document test is needed.
            same_doc = _shift_right(segment_ids, Pos, shift, fill=0) == segment_ids
            out = out + times(hax.where(same_doc, _shift_right(x, Pos, shift, fill=0), 0), kernel[ConvKernel, shift])
        return out


def _shift_right(x: NamedArray, Pos: Axis, shift: int, fill) -> NamedArray:
    """x[t - shift] at position t, `fill` where t - shift < 0: one pad and one static slice, which
    XLA fuses into their consumer (a concatenation with a `full_like` head built a separate array)."""
    axis = x.axis_indices(Pos)
    widths = [(0, 0)] * x.ndim
    widths[axis] = (shift, 0)
    padded = jnp.pad(x.array, widths, constant_values=fill)
    return hax.named(jax.lax.slice_in_dim(padded, 0, Pos.size, axis=axis), x.axes)
