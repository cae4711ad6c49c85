"""`MoELMConfig`: the architecture of keel's mixture-of-experts LM, and its accounting.

A plain frozen dataclass (no jax): `keel plan` reads it to count parameters and FLOPs instantly,
and the Haliax model is built from it inside the training step. Every feature of the hero
architecture is a field that can be switched off, so ablations and tiny CPU models share one
class. Feature fields default to "off" (a plain MoE transformer); presets switch them on.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import Enum

from keel.executor.step import execution_only
from keel.spec.fields import not_whole


class Routing(str, Enum):
    """How a token picks its experts and weighs their outputs."""

    SIGMOID_TOPK_THRESHOLD = "sigmoid_topk_threshold"
    """Top-(k+1) on logits + router_bias: k routes, the (k+1)-th is the token's threshold; combine
    weights are sigmoid(unbiased logits) of the k routes renormalised to `routing_renorm_sum`."""
    SOFTMAX_TOPK = "softmax_topk"
    """Plain top-k on logits; combine weights are the softmax over the k chosen logits."""


class Balancing(str, Enum):
    """How expert load is kept even."""

    QUANTILE = "quantile"
    """Quantile balancing: no loss; the next step's router_bias is minus each expert's
    (1 - k/E) quantile of (logit - threshold) over the global batch (a `qb_histogram_bins` histogram)."""
    AUX_LOSS = "aux_loss"
    """The usual auxiliary load-balancing loss, weighted by `aux_loss_coef`."""
    NONE = "none"


class ConvSite(str, Enum):
    """Where a short depthwise causal convolution (identity init) is applied."""

    KEY = "key"
    """On k right after the K projection (channels = num_kv_heads x head_dim)."""
    ATTENTION_OUTPUT = "attention_output"
    """On the attention branch output before the residual add (channels = hidden_dim)."""
    MOE_OUTPUT = "moe_output"
    """On the MoE branch output (routed + shared) before the residual add (channels = hidden_dim)."""


class AttentionBackend(str, Enum):
    """Which kernel computes attention; the values are Levanter's `AttentionBackend` names.

    Levanter's "default" is left out on purpose: it picks the kernel from the platform at trace
    time, and on GPUs that is NVTE, which would drop the local layers' window without a word.
    """

    VANILLA = "vanilla"
    """The full score matrix with every mask term (causal, window, segments), scored and
    normalised in fp32: the reference, and the fastest on XLA:CPU; memory grows with seq_len^2."""
    JAX_FLASH = "jax_flash"
    """Levanter's blockwise pure-JAX flash attention on any platform; applies every mask term
    (sequences shorter than its 1024-token block run the vanilla path)."""
    SPLASH = "splash"
    """The Pallas splash kernel (TPU only); applies the window and segments."""
    NVTE = "nvte"
    """Transformer Engine / cuDNN fused attention (NVIDIA GPUs): causal and segments only; Levanter
    ignores a sliding window there, so keel refuses it for windowed layers."""


def select_attention_backend(declared: AttentionBackend, window: int | None) -> AttentionBackend:
    """The backend a layer with this `window` (None = full causal) runs: the declared one, or a
    ValueError when that backend cannot apply the window (a mask must never be dropped silently)."""
    problem = _window_problem(declared, window)
    if problem:
        raise ValueError(f"MoELMConfig.{problem}")
    return declared


def _window_problem(declared: AttentionBackend, window: int | None) -> str | None:
    if window is None or declared is not AttentionBackend.NVTE:
        return None
    return (
        f"attention_backend='{declared.value}' cannot apply sliding_window={window} of the local layers: "
        "Levanter's Transformer Engine path ignores the window, so they would attend to every earlier token. "
        f"Use attention_backend='{AttentionBackend.JAX_FLASH.value}' (or '{AttentionBackend.VANILLA.value}'), "
        "or set sliding_window=None"
    )


def _coerce(enum_type, value, field_name):
    if isinstance(value, enum_type):
        return value
    try:
        return enum_type(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in enum_type)
        raise ValueError(f"MoELMConfig.{field_name}={value!r} is not valid: use one of {choices}") from None


@dataclass(frozen=True)
class MoELMConfig:
    """The keel MoE language model. See `param_counts` for the exact shape of every parameter."""

    # --- widths and depth
    hidden_dim: int
    num_layers: int
    vocab_size: int
    max_seq_len: int
    tie_embeddings: bool = False
    embed_norm: bool = False
    """RMSNorm (+ GatedNorm when gated_norm_rank > 0) on the embedding output."""

    # --- attention
    num_heads: int = 4
    head_dim: int = 64
    num_kv_heads: int = 4
    num_global_kv_heads: int | None = None
    """Global layers use the first this-many KV heads (None = all `num_kv_heads`)."""
    global_every: int | None = None
    """Layer i (0-based) is global if (i+1) % global_every == 0; the last layer is then always
    global. None: no global layers (every layer is local)."""
    sliding_window: int | None = None
    """Window of local layers (None = full causal attention). Global layers always see everything."""
    rope_theta: float = 10_000.0
    rope_fraction: float = 1.0
    """Fraction of head_dim rotated by RoPE on local layers (0 = no RoPE). Global layers use none."""
    attention_backend: AttentionBackend = execution_only(default=AttentionBackend.VANILLA)
    """The attention kernel of every layer (execution-only: it changes how attention runs, not what
    it computes). Checked against the local layers' window when the config is declared."""
    qk_norm: bool = False
    """RMS-normalise q and k per head, without a learned gain (eps `qk_norm_eps`), before RoPE."""
    qk_mult: float = 1.0
    """q is multiplied by this after QK norm."""
    xsa: bool = False
    """Exclusive self-attention: subtract from each head's output its component along the token's
    own value vector."""
    attention_gate: bool = False
    """Per-head gate 2*sigmoid(x W_g), W_g [hidden_dim, num_heads] zero-init, after XSA, before o."""

    # --- short convolutions and norms
    conv_kernel: int = 4
    conv_sites: tuple[ConvSite, ...] = ()
    gated_norm_rank: int = 0
    """Rank r of the GatedNorm after every RMSNorm site: x * sigmoid(silu(x W_down[D,r]) W_up[r,D]).
    0 = no GatedNorm."""

    # --- mixture of experts
    num_experts: int = 8
    """Routed experts per layer. 0 = no routed experts (a dense model made of the shared experts)."""
    experts_per_token: int = 2
    latent_dim: int | None = None
    """Width the routed experts act on: tokens are projected hidden -> latent, RMS-normed, and the
    weighted expert sum is projected back. None = experts act on hidden_dim directly."""
    expert_dim: int = 256
    """Intermediate width of each routed SwiGLU expert."""
    num_shared_experts: int = 0
    shared_expert_dim: int = 0
    """Intermediate width of each shared SwiGLU expert (on the full hidden width, always active)."""
    routing: Routing = Routing.SOFTMAX_TOPK
    routing_renorm_sum: float = 1.0
    balancing: Balancing = Balancing.NONE
    qb_histogram_bins: int = 10_000
    aux_loss_coef: float = 0.0
    capacity_factor: float = 1.25
    """The capacity of a fixed-capacity transport, as a multiple of the even share of assignments;
    what it sizes (a sender's cell per expert, a destination pool, a receiver buffer) is the
    transport's (`keel.spec.transports.TRANSPORTS`), and assignments past it are dropped."""

    # --- numerics and init
    norm_eps: float = 1e-5
    qk_norm_eps: float = 1e-6
    xsa_eps: float = 1e-6
    init_scale: float = 0.5
    """Every matrix is initialised from a normal truncated at +-3 sigma, sigma = init_scale / sqrt(hidden_dim)."""

    def __post_init__(self):
        object.__setattr__(self, "routing", _coerce(Routing, self.routing, "routing"))
        object.__setattr__(self, "balancing", _coerce(Balancing, self.balancing, "balancing"))
        backend = _coerce(AttentionBackend, self.attention_backend, "attention_backend")
        object.__setattr__(self, "attention_backend", backend)
        sites = tuple(_coerce(ConvSite, s, "conv_sites") for s in self.conv_sites)
        object.__setattr__(self, "conv_sites", sites)
        for problem in self._problems():
            raise ValueError(f"MoELMConfig.{problem}")

    # ------------------------------------------------------------------ validation
    def _problems(self):
        """Yield 'field=value ...: fix' messages, the first of which __post_init__ raises."""
        bad = not_whole(self)
        if bad:
            yield f"{bad} must be a whole number"
        for name in ("hidden_dim", "num_layers", "vocab_size", "max_seq_len", "num_heads", "head_dim", "num_kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                yield f"{name}={value!r} must be a positive integer"
        if self.num_heads % self.num_kv_heads:
            yield f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}: pick a divisor of num_heads"
        g = self.global_kv_heads
        if not 1 <= g <= self.num_kv_heads or self.num_heads % g:
            yield (
                f"num_global_kv_heads={g} must be between 1 and num_kv_heads={self.num_kv_heads} and divide "
                f"num_heads={self.num_heads}: pick a divisor of num_heads, or None for all KV heads"
            )
        if self.global_every is not None and self.global_every < 1:
            yield f"global_every={self.global_every} must be >= 1, or None for no global layers"
        if self.sliding_window is not None and not 1 <= self.sliding_window <= self.max_seq_len:
            yield (
                f"sliding_window={self.sliding_window} must be between 1 and max_seq_len={self.max_seq_len}: "
                "shrink it, or use None for full attention"
            )
        elif self.has_local_layers:
            problem = _window_problem(self.attention_backend, self.sliding_window)
            if problem:
                yield problem
        if not 0.0 <= self.rope_fraction <= 1.0:
            yield f"rope_fraction={self.rope_fraction} must lie in [0, 1] (0 = no RoPE)"
        elif self.has_local_layers and (  # only local layers rotate
                self.rotary_dim % 2 or not math.isclose(self.rotary_dim, self.rope_fraction * self.head_dim)):
            yield (
                f"rope_fraction={self.rope_fraction} x head_dim={self.head_dim} must be an even integer: "
                "choose a fraction that rotates an even number of dims"
            )
        if self.rope_theta <= 0:
            yield f"rope_theta={self.rope_theta} must be positive"
        if self.qk_mult <= 0:
            yield f"qk_mult={self.qk_mult} must be positive (1.0 = no scaling)"
        if len(set(self.conv_sites)) != len(self.conv_sites):
            yield f"conv_sites={[s.value for s in self.conv_sites]} lists a site twice: list each at most once"
        if self.conv_sites and self.conv_kernel < 1:
            yield f"conv_kernel={self.conv_kernel} must be >= 1 when conv_sites is not empty"
        if self.gated_norm_rank < 0:
            yield f"gated_norm_rank={self.gated_norm_rank} must be >= 0 (0 = no GatedNorm)"
        yield from self._moe_problems()
        for name in ("norm_eps", "qk_norm_eps", "xsa_eps", "init_scale"):
            if getattr(self, name) <= 0:
                yield f"{name}={getattr(self, name)} must be positive"

    def _moe_problems(self):
        if self.num_experts < 0:
            yield f"num_experts={self.num_experts} must be >= 0 (0 = dense model of shared experts)"
            return
        if self.num_experts == 0:
            if self.num_shared_experts < 1:
                yield "num_shared_experts=0 with num_experts=0 leaves no MLP: set num_shared_experts >= 1"
            if self.experts_per_token or self.latent_dim is not None or self.balancing is not Balancing.NONE:
                yield (
                    "num_experts=0 (dense): set experts_per_token=0, latent_dim=None and balancing='none'"
                )
        else:
            if not 1 <= self.experts_per_token < self.num_experts:
                yield (
                    f"experts_per_token={self.experts_per_token} must be >= 1 and < num_experts={self.num_experts}: "
                    "lower it or add experts"
                )
            elif self.experts_per_token == 1:  # both routings renormalise the chosen experts' gates
                yield (
                    f"experts_per_token=1 with routing='{self.routing.value}' renormalises the one chosen expert's gate "
                    "to a constant, so the loss never trains the router: set experts_per_token >= 2"
                )
            if self.expert_dim <= 0:
                yield f"expert_dim={self.expert_dim} must be positive"
            if self.latent_dim is not None and self.latent_dim <= 0:
                yield f"latent_dim={self.latent_dim} must be positive, or None for experts on hidden_dim"
            if self.capacity_factor <= 0:
                yield f"capacity_factor={self.capacity_factor} must be positive (e.g. 1.25)"
            if self.routing_renorm_sum <= 0:
                yield f"routing_renorm_sum={self.routing_renorm_sum} must be positive"
        if self.num_shared_experts < 0:
            yield f"num_shared_experts={self.num_shared_experts} must be >= 0"
        if self.num_shared_experts > 0 and self.shared_expert_dim <= 0:
            yield f"shared_expert_dim={self.shared_expert_dim} must be positive when num_shared_experts > 0"
        if self.balancing is Balancing.QUANTILE:
            if self.routing is not Routing.SIGMOID_TOPK_THRESHOLD:
                yield (
                    f"balancing='quantile' needs the top-(k+1) threshold: set routing='{Routing.SIGMOID_TOPK_THRESHOLD.value}'"
                )
            if self.qb_histogram_bins < 2:
                yield f"qb_histogram_bins={self.qb_histogram_bins} must be >= 2 for quantile balancing"
        if self.balancing is Balancing.AUX_LOSS and self.aux_loss_coef <= 0:
            yield f"aux_loss_coef={self.aux_loss_coef} must be positive with balancing='aux_loss' (e.g. 0.01)"
        if self.balancing is not Balancing.AUX_LOSS and self.aux_loss_coef:
            yield f"aux_loss_coef={self.aux_loss_coef} is only used with balancing='aux_loss': set it to 0"
        if self.routing is not Routing.SIGMOID_TOPK_THRESHOLD and self.routing_renorm_sum != 1.0:
            yield (f"routing_renorm_sum={self.routing_renorm_sum} is only used with routing="
                   f"'{Routing.SIGMOID_TOPK_THRESHOLD.value}' (softmax weights sum to 1): set it to 1.0")

    def inert_fields(self) -> list[str]:
        """'field=value, ...: why' for the fields set away from their defaults that this model never
        reads (a window when every layer is global, a balancing knob of another balancing). They
        still count toward the model's identity: two declarations of one model that differ only
        in them train it twice. `keel plan` lists them; `without_inert_fields` clears them."""
        return [f"{', '.join(f'{n}={_shown(getattr(self, n))}' for n in names)}: {why}" for why, names in self._inert()]

    def without_inert_fields(self) -> "MoELMConfig":
        """This model with every field it never reads at its default: one declaration, and one
        identity, per model trained (`defaults.models.dense_baseline` builds its models so)."""
        defaults = self._defaults()
        return self.replace(**{name: defaults[name] for _, names in self._inert() for name in names})

    def _inert(self) -> list[tuple[str, tuple[str, ...]]]:
        """(why, the fields it makes inert that are set away from their defaults), where any are."""
        dense, local = self.num_experts == 0, self.has_local_layers
        reasons = (
            (not self.global_layers, "no layer is global (global_every=None)", ("num_global_kv_heads",)),
            (not local, f"every layer is global (global_every={self.global_every} of {self.num_layers} layers)",
             ("sliding_window", "rope_fraction", "rope_theta")),
            (local and self.rotary_dim == 0, "rope_fraction=0 rotates nothing", ("rope_theta",)),
            (not self.qk_norm, "qk_norm=False", ("qk_norm_eps",)),
            (not self.xsa, "xsa=False", ("xsa_eps",)),
            (not self.conv_sites, "no convolution (conv_sites=())", ("conv_kernel",)),
            (self.num_shared_experts == 0, "no shared experts", ("shared_expert_dim",)),
            (dense, "no routed experts (num_experts=0)",
             ("expert_dim", "routing", "routing_renorm_sum", "qb_histogram_bins", "capacity_factor")),
            (not dense and self.balancing is not Balancing.QUANTILE, f"balancing={self.balancing.value}",
             ("qb_histogram_bins",)),
        )  # routing_renorm_sum with softmax routing and aux_loss_coef without its loss are refused above
        defaults = self._defaults()
        found = [(why, tuple(n for n in names if getattr(self, n) != defaults[n])) for applies, why, names in reasons if applies]
        return [(why, names) for why, names in found if names]

    @classmethod
    def _defaults(cls) -> dict:
        return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}

    # ------------------------------------------------------------------ derived structure
    @property
    def global_kv_heads(self) -> int:
        return self.num_kv_heads if self.num_global_kv_heads is None else self.num_global_kv_heads

    @property
    def rotary_dim(self) -> int:
        return int(round(self.rope_fraction * self.head_dim))

    @property
    def expert_input_dim(self) -> int:
        """Width the routed experts read and write: latent_dim, or hidden_dim without a latent."""
        return self.hidden_dim if self.latent_dim is None else self.latent_dim

    @property
    def has_router_bias(self) -> bool:
        """Quantile balancing keeps a non-learned router_bias per layer and expert."""
        return self.num_experts > 0 and self.balancing is Balancing.QUANTILE

    @property
    def has_local_layers(self) -> bool:
        return len(self.global_layers) < self.num_layers

    def is_global_layer(self, i: int) -> bool:
        """Global layers: full causal attention, no RoPE, the first `num_global_kv_heads` KV heads."""
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer {i} out of range for num_layers={self.num_layers}")
        if self.global_every is None:
            return False
        return (i + 1) % self.global_every == 0 or i == self.num_layers - 1

    @property
    def global_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_global_layer(i))

    # ------------------------------------------------------------------ accounting
    def parameter_axes(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """Every array leaf of the initialised model: its path (as Levanter's `leaf_key_paths` spells
        it) and its named axes; the contract the Haliax model is tested against, and what the
        planner, the mesh placement and the optimizer groups read.

        Per-layer arrays sit under `layers.stacked.` with a leading `layers` axis. Axis names:
        embed (hidden_dim), heads / kv_heads x head_size, latent (what routed experts read:
        latent_dim, or hidden_dim without a latent), experts, expert_mlp, shared_experts,
        shared_mlp, gate_rank, conv_kernel, vocab. No biases anywhere; QK norm has no gain.

        - embedding [vocab, embed]; lm_head [embed, vocab] unless tie_embeddings.
        - a norm site `<site>`: `<site>.norm.weight` [embed] and, with gated_norm_rank > 0, a
          GatedNorm `<site>.gated.down` [embed, gate_rank] / `.up` [gate_rank, embed]. Sites:
          embed_norm (if embed_norm), final_norm, and per layer attn_norm, mlp_norm.
        - layers.stacked.attn.q [embed, heads, head_size], .k / .v [embed, kv_heads, head_size]
          (every layer stores num_kv_heads; global layers read the first num_global_kv_heads),
          .o [heads, head_size, embed]; .gate [embed, heads] if attention_gate;
          .conv_key.kernel [conv_kernel, kv_heads, head_size] if 'key' is a conv site.
        - layers.stacked.conv_attention_output.kernel / conv_moe_output.kernel [conv_kernel, embed].
        - layers.stacked.moe.router [embed, experts]; .router_bias [experts] with quantile
          balancing: NOT trained by the optimizer (set from the previous step's quantiles) but an
          array leaf, counted in `total` (the hero's 535,477,106,688 includes its 48 x 384 entries).
        - layers.stacked.moe.latent_down [embed, latent], .latent_norm.weight [latent],
          .latent_up [latent, embed] if latent_dim is set.
        - layers.stacked.moe.experts.gate / .up [experts, latent, expert_mlp], .down [experts, expert_mlp, latent].
        - layers.stacked.shared.gate / .up [shared_experts, embed, shared_mlp], .down [.., shared_mlp, embed].
        """
        embed, vocab = ("embed", self.hidden_dim), ("vocab", self.vocab_size)
        heads, kv_heads, head = ("heads", self.num_heads), ("kv_heads", self.num_kv_heads), ("head_size", self.head_dim)
        latent, experts = ("latent", self.expert_input_dim), ("experts", self.num_experts)
        mlp, rank, kernel = ("expert_mlp", self.expert_dim), ("gate_rank", self.gated_norm_rank), ("conv_kernel", self.conv_kernel)
        shared, shared_mlp = ("shared_experts", self.num_shared_experts), ("shared_mlp", self.shared_expert_dim)
        out: dict[str, tuple[tuple[str, int], ...]] = {"embedding": (vocab, embed)}

        def norm(site: str, *lead) -> None:
            out[f"{site}.norm.weight"] = (*lead, embed)
            if self.gated_norm_rank:
                out[f"{site}.gated.down"] = (*lead, embed, rank)
                out[f"{site}.gated.up"] = (*lead, rank, embed)

        if self.embed_norm:
            norm("embed_norm")
        layer = (("layers", self.num_layers),)
        stacked = "layers.stacked"
        norm(f"{stacked}.attn_norm", *layer)
        out[f"{stacked}.attn.q"] = (*layer, embed, heads, head)
        out[f"{stacked}.attn.k"] = (*layer, embed, kv_heads, head)
        out[f"{stacked}.attn.v"] = (*layer, embed, kv_heads, head)
        out[f"{stacked}.attn.o"] = (*layer, heads, head, embed)
        if self.attention_gate:
            out[f"{stacked}.attn.gate"] = (*layer, embed, heads)
        if ConvSite.KEY in self.conv_sites:
            out[f"{stacked}.attn.conv_key.kernel"] = (*layer, kernel, kv_heads, head)
        if ConvSite.ATTENTION_OUTPUT in self.conv_sites:
            out[f"{stacked}.conv_attention_output.kernel"] = (*layer, kernel, embed)
        norm(f"{stacked}.mlp_norm", *layer)
        if self.num_experts:
            out[f"{stacked}.moe.router"] = (*layer, embed, experts)
            if self.has_router_bias:
                out[f"{stacked}.moe.router_bias"] = (*layer, experts)
            if self.latent_dim is not None:
                out[f"{stacked}.moe.latent_down"] = (*layer, embed, latent)
                out[f"{stacked}.moe.latent_norm.weight"] = (*layer, latent)
                out[f"{stacked}.moe.latent_up"] = (*layer, latent, embed)
            out[f"{stacked}.moe.experts.gate"] = (*layer, experts, latent, mlp)
            out[f"{stacked}.moe.experts.up"] = (*layer, experts, latent, mlp)
            out[f"{stacked}.moe.experts.down"] = (*layer, experts, mlp, latent)
        if self.num_shared_experts:
            out[f"{stacked}.shared.gate"] = (*layer, shared, embed, shared_mlp)
            out[f"{stacked}.shared.up"] = (*layer, shared, embed, shared_mlp)
            out[f"{stacked}.shared.down"] = (*layer, shared, shared_mlp, embed)
        if ConvSite.MOE_OUTPUT in self.conv_sites:
            out[f"{stacked}.conv_moe_output.kernel"] = (*layer, kernel, embed)
        norm("final_norm")
        if not self.tie_embeddings:
            out["lm_head"] = (embed, vocab)
        return out

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """`parameter_axes` without the names: each leaf's shape."""
        return {path: tuple(size for _, size in axes) for path, axes in self.parameter_axes().items()}

    def param_counts(self) -> dict:
        """Parameter counts: {"total", "active", "components", "active_components"}.

        `total` is the number of entries of every array leaf listed by `parameter_axes` (which
        documents each one), i.e. exactly the leaf-size count of the initialised model, the
        quantile-balancing router_bias included. `components` groups them:
        embedding, lm_head, attention (q/k/v/o), attention_gate, conv (all conv kernels),
        norms (RMSNorm gains, latent norm gain included), gated_norms (GatedNorm down/up),
        router, router_bias, latent_projections (down/up), routed_experts, shared_experts.

        `active` follows the hero convention: per token and layer, attention q/k/v/o + router
        weight + the experts_per_token routed experts + latent down/up + shared experts; no
        embedding, lm_head, norms, GatedNorms, attention gates, convolutions or router_bias.
        """
        groups = {
            "embedding": "embedding",
            "lm_head": "lm_head",
            "layers.stacked.attn.gate": "attention_gate",
            "layers.stacked.moe.router": "router",
            "layers.stacked.moe.router_bias": "router_bias",
            "layers.stacked.moe.latent_down": "latent_projections",
            "layers.stacked.moe.latent_up": "latent_projections",
        }
        components = dict.fromkeys(
            ["embedding", "lm_head", "attention", "attention_gate", "conv", "norms", "gated_norms", "router",
             "router_bias", "latent_projections", "routed_experts", "shared_experts"], 0
        )
        for name, shape in self.parameter_shapes().items():
            if name in groups:
                group = groups[name]
            elif name.endswith(".kernel"):
                group = "conv"
            elif name.startswith("layers.stacked.attn."):
                group = "attention"
            elif name.endswith(".norm.weight") or name.endswith("latent_norm.weight"):
                group = "norms"
            elif ".gated." in name:
                group = "gated_norms"
            elif name.startswith("layers.stacked.moe.experts."):
                group = "routed_experts"
            elif name.startswith("layers.stacked.shared."):
                group = "shared_experts"
            else:  # a new parameter must be placed in a group explicitly
                raise AssertionError(f"parameter {name} has no accounting group")
            components[group] += math.prod(shape)
        active_components = {
            "attention": components["attention"],
            "router": components["router"],
            "routed_experts": (
                components["routed_experts"] * self.experts_per_token // self.num_experts if self.num_experts else 0
            ),
            "latent_projections": components["latent_projections"],
            "shared_experts": components["shared_experts"],
        }
        return {
            "total": sum(components.values()),
            "active": sum(active_components.values()),
            "components": components,
            "active_components": active_components,
        }

    def attended_keys_per_query(self, seq_len: int | None = None) -> float:
        """Mean number of keys a query attends to, averaged over positions and layers (causal, windowed)."""
        seq_len = self.max_seq_len if seq_len is None else seq_len

        def mean_keys(window: int) -> float:
            w = min(window, seq_len)  # position t (0-based) sees min(t + 1, w) keys
            return (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len

        local = mean_keys(self.sliding_window or seq_len)
        n_global = len(self.global_layers)
        return (n_global * mean_keys(seq_len) + (self.num_layers - n_global) * local) / self.num_layers

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training (forward + backward = 3 x forward) FLOPs per token at `seq_len` (default max_seq_len).

        Matmuls: 6 FLOPs per weight a token multiplies through: the active parameters plus lm_head,
        attention gates and GatedNorms (the embedding is a lookup; norms, convolutions and the
        router bias are elementwise and left out). Attention: QK^T and AV cost 2 x 2 x H x d per
        attended key forward, x3 for training, with causal masking and the sliding window of
        local layers counted exactly (see `attended_keys_per_query`).
        """
        counts = self.param_counts()
        c = counts["components"]
        lm_head = self.hidden_dim * self.vocab_size  # tied or not, the logits matmul is computed
        matmul = counts["active"] + lm_head + c["attention_gate"] + c["gated_norms"]
        attention = 12 * self.num_heads * self.head_dim * self.attended_keys_per_query(seq_len) * self.num_layers
        return 6 * matmul + attention

    def replace(self, **changes) -> "MoELMConfig":
        return dataclasses.replace(self, **changes)


def _shown(value) -> str:
    """A field's value as a declaration spells it (an enum by its value)."""
    return value.value if isinstance(value, Enum) else repr(value)
