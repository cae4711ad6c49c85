"""The keel MoE language model: embedding, a scanned stack of identical blocks, final norm, lm_head.

Block: h += conv_attn(attn(norm(h))); u = norm(h); h += conv_moe(moe(u) + shared(u)), where each
norm is RMSNorm followed by GatedNorm. All layers share one parameter structure, so they are one
`haliax.nn.Stacked` scanned once per step; which layers are global is a per-layer flag scanned
alongside them (see attention.py).

Packed documents: `segment_ids` [Batch, Pos] give each token's document; attention and the short
convolutions never cross a document boundary. A negative segment id marks padding: such tokens
are skipped by the routed experts and the routing statistics (the shared experts, attention and
convolutions compute on them, and the loss masks them).
"""

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray
from haliax.jax_utils import shaped_rng_split
from haliax.nn.scan import Stacked

from keel.model.attention import Attention
from keel.model.axes import POS, ModelAxes, init_matrix
from keel.spec.model import Balancing, ConvSite, MoELMConfig
from keel.model.conv import CausalDepthwiseConv
from keel.model.layout import gathered
from keel.model.moe import LatentMoE, SharedExperts
from keel.model.norms import NormSite
from keel.spec.transports import TransportSpec


class Block(eqx.Module):
    attn_norm: NormSite
    attn: Attention
    conv_attention_output: CausalDepthwiseConv | None
    mlp_norm: NormSite
    moe: LatentMoE | None
    shared: SharedExperts | None
    conv_moe_output: CausalDepthwiseConv | None

    @staticmethod
    def init(config: MoELMConfig, *, key) -> "Block":
        a = ModelAxes.of(config)
        k_an, k_attn, k_mn, k_moe, k_shared = jax.random.split(key, 5)

        def conv(site: ConvSite):
            return CausalDepthwiseConv.init(a.ConvKernel, a.Embed) if site in config.conv_sites else None

        return Block(
            attn_norm=NormSite.init(config, key=k_an),
            attn=Attention.init(config, key=k_attn),
            conv_attention_output=conv(ConvSite.ATTENTION_OUTPUT),
            mlp_norm=NormSite.init(config, key=k_mn),
            moe=LatentMoE.init(config, key=k_moe) if config.num_experts else None,
            shared=SharedExperts.init(config, key=k_shared) if config.num_shared_experts else None,
            conv_moe_output=conv(ConvSite.MOE_OUTPUT),
        )

    def __call__(self, h, segment_ids, valid, is_global, *, transport: TransportSpec):
        self = gathered(self)
        Pos = segment_ids.resolve_axis(POS)
        branch = self.attn(self.attn_norm(h), segment_ids, is_global.array, Pos)
        if self.conv_attention_output is not None:
            branch = self.conv_attention_output(branch, segment_ids, Pos)
        h = h + branch

        u = self.mlp_norm(h)
        stats: dict = {}
        branch = hax.zeros_like(u)
        if self.moe is not None:
            branch, stats = self.moe(u, valid, transport=transport)
        if self.shared is not None:
            branch = branch + self.shared(u)
        if self.conv_moe_output is not None:
            branch = self.conv_moe_output(branch, segment_ids, Pos)
        return h + branch, stats


class MoELM(eqx.Module):
    embedding: NamedArray  # [Vocab, Embed]
    embed_norm: NormSite | None
    layers: Stacked[Block]
    final_norm: NormSite
    lm_head: NamedArray | None  # [Embed, Vocab]; None when tied to the embedding
    config: MoELMConfig = eqx.field(static=True)

    def lm_head_weight(self) -> NamedArray:
        return self.embedding if self.lm_head is None else self.lm_head

    def activations(
        self,
        input_ids: NamedArray,
        segment_ids: NamedArray,
        *,
        transport: TransportSpec = TransportSpec(),
        compute_dtype=jnp.float32,
    ) -> tuple[NamedArray, dict]:
        """Final hidden states [Batch, Pos, Embed] and the aux dict (see `__call__`)."""
        cfg = self.config
        a = ModelAxes.of(cfg)
        h = gathered(self.embedding).astype(compute_dtype).take(a.Vocab, input_ids)
        if self.embed_norm is not None:
            h = gathered(self.embed_norm)(h)
        flags = hax.named(jnp.array([cfg.is_global_layer(i) for i in range(cfg.num_layers)]), a.Layers)
        valid = segment_ids >= 0
        h, stats = self.layers.scan(h, segment_ids, valid, flags, transport=transport)
        h = gathered(self.final_norm)(h)
        return h, _aux(stats, cfg)

    def __call__(
        self,
        input_ids: NamedArray,
        segment_ids: NamedArray,
        *,
        transport: TransportSpec = TransportSpec(),
        compute_dtype=jnp.float32,
    ) -> tuple[NamedArray, dict]:
        """input_ids, segment_ids [Batch, Pos] -> (logits [Batch, Pos, Vocab], aux).

        aux (per-layer arrays carry the `layers` axis):
          routing_counts [Layers, Experts], max_load [Layers], load_balancing_loss [Layers],
          dropped_fraction [Layers] (assignments a fixed-capacity transport dropped),
          kernel_transport [Layers] (`TransportName.code` of the transport each layer's kernel ran),
          kernel_capacity_factor [Layers] (the capacity factor it was called with; 0: none can drop),
          qb_beta [Layers, Experts] (quantile balancing only: feed to `next_router_bias`),
          aux_loss (scalar): aux_loss_coef x the summed load-balancing loss, 0 unless balancing='aux_loss'.
        """
        h, aux = self.activations(input_ids, segment_ids, transport=transport, compute_dtype=compute_dtype)
        Embed = ModelAxes.of(self.config).Embed
        return hax.dot(h, gathered(self.lm_head_weight()).astype(h.dtype), axis=Embed), aux


def _aux(stats: dict, config: MoELMConfig) -> dict:
    aux = dict(stats)
    if config.balancing is Balancing.AUX_LOSS:
        aux["aux_loss"] = config.aux_loss_coef * hax.sum(stats["load_balancing_loss"]).array
    else:
        aux["aux_loss"] = jnp.zeros((), jnp.float32)
    return aux


def init_model(config: MoELMConfig, key) -> MoELM:
    """A freshly initialised model: truncated-normal matrices, unit norm gains, identity convs,
    zero attention gates and router bias."""
    a = ModelAxes.of(config)
    k_embed, k_en, k_layers, k_fn, k_head = jax.random.split(key, 5)
    layers = Stacked.init(a.Layers, Block, gradient_checkpointing=True)(
        config, key=shaped_rng_split(k_layers, config.num_layers)
    )
    return MoELM(
        embedding=init_matrix(k_embed, (a.Vocab, a.Embed), config),
        embed_norm=NormSite.init(config, key=k_en) if config.embed_norm else None,
        layers=layers,
        final_norm=NormSite.init(config, key=k_fn),
        lm_head=None if config.tie_embeddings else init_matrix(k_head, (a.Embed, a.Vocab), config),
        config=config,
    )


def with_router_bias(model: MoELM, router_bias: NamedArray) -> MoELM:
    """The model with its stored router bias [Layers, Experts] replaced."""
    if not model.config.has_router_bias:
        raise ValueError("this model keeps no router bias: only balancing='quantile' uses one")
    current = model.layers.stacked.moe.router_bias
    return eqx.tree_at(lambda m: m.layers.stacked.moe.router_bias, model, router_bias.rearrange(current.axes))
