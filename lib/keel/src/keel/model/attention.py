"""The reference attention: local/global schedule, half RoPE, QK norm, XSA, per-head gate, key conv.

One module serves both kinds of layer because every layer stores the same parameters (all
`num_kv_heads` KV heads; a global layer reads only the first `num_global_kv_heads`). The layer's
kind arrives as a traced flag and picks a branch with `jax.lax.cond`, so the stacked layers keep a
single scanned body while each branch keeps its window and head grouping static (a static window
is what block-sparse attention kernels can exploit), and only the chosen branch runs.

The kernel is the config's declared `attention_backend`, never Levanter's platform default: that
default is NVTE on GPUs, which drops the sliding window (`select_attention_backend` refuses it).
The reference kernel (vanilla) scores and normalises in fp32 whatever the compute dtype, as
Levanter's `upcast_attn` does: more accurate, and on XLA:CPU much faster, where bf16 elementwise
math is emulated through converts and a bf16 softmax's reductions miss YNNPACK (tiny_moe's bf16
training step 1.27x faster, small_moe's 1.10x). The other kernels keep their own precision,
jax_flash's vanilla path for sequences shorter than its block included.
"""

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray
from levanter.layers import attention as levanter_attention
from levanter.layers.attention import AttentionMask, dot_product_attention

from keel.model.axes import KEY_POS, ModelAxes, init_matrix
from keel.spec.model import AttentionBackend, ConvSite, MoELMConfig, select_attention_backend
from keel.model.conv import CausalDepthwiseConv
from keel.model.norms import rms_normalize


class Attention(eqx.Module):
    q: NamedArray  # [Embed, Heads, HeadSize]
    k: NamedArray  # [Embed, KVHeads, HeadSize]
    v: NamedArray  # [Embed, KVHeads, HeadSize]
    o: NamedArray  # [Heads, HeadSize, Embed]
    gate: NamedArray | None  # [Embed, Heads], zero-init: the gate starts at 2*sigmoid(0) = 1
    conv_key: CausalDepthwiseConv | None  # on k right after the K projection
    config: MoELMConfig = eqx.field(static=True)

    @staticmethod
    def init(config: MoELMConfig, *, key) -> "Attention":
        a = ModelAxes.of(config)
        k_q, k_k, k_v, k_o = jax.random.split(key, 4)
        conv_key = None
        if ConvSite.KEY in config.conv_sites:
            conv_key = CausalDepthwiseConv.init(a.ConvKernel, (a.KVHeads, a.HeadSize))
        return Attention(
            q=init_matrix(k_q, (a.Embed, a.Heads, a.HeadSize), config),
            k=init_matrix(k_k, (a.Embed, a.KVHeads, a.HeadSize), config),
            v=init_matrix(k_v, (a.Embed, a.KVHeads, a.HeadSize), config),
            o=init_matrix(k_o, (a.Heads, a.HeadSize, a.Embed), config),
            gate=hax.zeros((a.Embed, a.Heads)) if config.attention_gate else None,
            conv_key=conv_key,
            config=config,
        )

    def __call__(self, x: NamedArray, segment_ids: NamedArray, is_global, Pos: Axis) -> NamedArray:
        """x [Batch, Pos, Embed] -> [Batch, Pos, Embed]; `is_global` is a scalar bool (traced in a scan)."""
        cfg = self.config
        a = ModelAxes.of(cfg)
        dtype = x.dtype
        q = hax.dot(x, self.q.astype(dtype), axis=a.Embed)
        k = hax.dot(x, self.k.astype(dtype), axis=a.Embed)
        v = hax.dot(x, self.v.astype(dtype), axis=a.Embed)
        if self.conv_key is not None:
            k = self.conv_key(k, segment_ids, Pos)
        if cfg.qk_norm:
            q = rms_normalize(q, a.HeadSize, cfg.qk_norm_eps)
            k = rms_normalize(k, a.HeadSize, cfg.qk_norm_eps)
        q = q * cfg.qk_mult

        def local(q, k, v):
            q, k = _rotary(q, k, Pos, a.HeadSize, cfg.rotary_dim, cfg.rope_theta)
            return self._attend(q, k, v, segment_ids, Pos, cfg.num_kv_heads, cfg.sliding_window)

        def global_(q, k, v):
            return self._attend(q, k, v, segment_ids, Pos, cfg.global_kv_heads, None)

        kinds = {cfg.is_global_layer(i) for i in range(cfg.num_layers)}
        if kinds == {False}:
            y = local(q, k, v)
        elif kinds == {True}:
            y = global_(q, k, v)
        else:
            y = jax.lax.cond(is_global, global_, local, q, k, v)

        if self.gate is not None:
            y = y * (2 * hnn.sigmoid(hax.dot(x, self.gate.astype(dtype), axis=a.Embed)))
        return hax.dot(y, self.o.astype(dtype), axis=(a.Heads, a.HeadSize))

    def _attend(self, q, k, v, segment_ids, Pos: Axis, num_kv: int, window: int | None) -> NamedArray:
        """Grouped-query attention over the first `num_kv` KV heads, then XSA; returns [.., Heads, HeadSize]."""
        cfg = self.config
        a = ModelAxes.of(cfg)
        KV = Axis(a.KVHeads.name, num_kv)
        QPerKV = Axis("q_per_kv", cfg.num_heads // num_kv)
        q = q.unflatten_axis(a.Heads, (KV, QPerKV))
        k = k[a.KVHeads, :num_kv]
        v = v[a.KVHeads, :num_kv]
        KPos = Pos.alias(KEY_POS)
        mask = AttentionMask.causal(sliding_window=window, segment_ids=(segment_ids, segment_ids))
        backend = select_attention_backend(cfg.attention_backend, window)
        y = dot_product_attention(
            Pos,
            KPos,
            a.HeadSize,
            q,
            k.rename({Pos: KPos}),
            v.rename({Pos: KPos}),
            mask=mask,
            attn_backend=levanter_attention.AttentionBackend(backend.value),
            attention_dtype=jnp.float32 if backend is AttentionBackend.VANILLA else None,
        )
        if cfg.xsa:
            # Exclusive self-attention: drop the component of each head's output along its own token's value.
            along = hax.dot(y, v, axis=a.HeadSize) / (hax.dot(v, v, axis=a.HeadSize) + cfg.xsa_eps)
            y = y - hax.broadcast_to(along, y.axes) * v
        return y.flatten_axes((KV, QPerKV), a.Heads)


def _rotary(q: NamedArray, k: NamedArray, Pos: Axis, HeadSize: Axis, rotary_dim: int, theta: float):
    """RoPE (rotate-half) on the first `rotary_dim` dims of each head; the rest pass through."""
    if rotary_dim == 0:
        return q, k
    half = rotary_dim // 2
    Freq = Axis("rotary_freq", half)
    inv_freq = hax.named(1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) * 2 / rotary_dim), Freq)
    angle = hax.arange(Pos).astype(jnp.float32).broadcast_axis(Freq) * inv_freq
    cos, sin = hax.cos(angle), hax.sin(angle)

    def rotate(x: NamedArray) -> NamedArray:
        x1 = x[HeadSize, :half].rename({HeadSize.name: Freq}).astype(jnp.float32)
        x2 = x[HeadSize, half:rotary_dim].rename({HeadSize.name: Freq}).astype(jnp.float32)
        r1 = (x1 * cos - x2 * sin).astype(x.dtype).rename({Freq: HeadSize.name})
        r2 = (x2 * cos + x1 * sin).astype(x.dtype).rename({Freq: HeadSize.name})
        rest = [x[HeadSize, rotary_dim:]] if rotary_dim < HeadSize.size else []
        return hax.concatenate(HeadSize.name, [r1, r2, *rest])

    return rotate(q), rotate(k)
