"""The MLP side of a block: latent routed experts plus always-active shared SwiGLU experts."""

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import NamedArray

from keel.model.axes import TOKEN, ModelAxes, init_matrix
from keel.spec.model import Balancing, MoELMConfig
from keel.model.layout import flatten_tokens, unflatten_tokens
from keel.model.norms import apply_rms_norm, rms_norm
from keel.model.routing import quantile_beta, route, routing_stats
from keel.spec.transports import TransportSpec
from keel.model.transports import dispatch


def swiglu_weights(key, experts, inputs, mlp, config: MoELMConfig) -> tuple[NamedArray, NamedArray, NamedArray]:
    """gate, up [experts, inputs, mlp] and down [experts, mlp, inputs] of a bank of SwiGLU experts."""
    k_gate, k_up, k_down = jax.random.split(key, 3)
    return (
        init_matrix(k_gate, (experts, inputs, mlp), config),
        init_matrix(k_up, (experts, inputs, mlp), config),
        init_matrix(k_down, (experts, mlp, inputs), config),
    )


class RoutedExperts(eqx.Module):
    """SwiGLU experts at the latent width; `Experts` is the axis expert parallelism splits."""

    gate: NamedArray  # [Experts, Latent, ExpertMlp]
    up: NamedArray  # [Experts, Latent, ExpertMlp]
    down: NamedArray  # [Experts, ExpertMlp, Latent]

    @staticmethod
    def init(config: MoELMConfig, *, key) -> "RoutedExperts":
        a = ModelAxes.of(config)
        return RoutedExperts(*swiglu_weights(key, a.Experts, a.Latent, a.ExpertMlp, config))


class SharedExperts(eqx.Module):
    """`num_shared_experts` SwiGLU experts on the full width, every token through all of them."""

    gate: NamedArray  # [SharedExperts, Embed, SharedMlp]
    up: NamedArray  # [SharedExperts, Embed, SharedMlp]
    down: NamedArray  # [SharedExperts, SharedMlp, Embed]

    @staticmethod
    def init(config: MoELMConfig, *, key) -> "SharedExperts":
        a = ModelAxes.of(config)
        return SharedExperts(*swiglu_weights(key, a.SharedExperts, a.Embed, a.SharedMlp, config))

    def __call__(self, u: NamedArray) -> NamedArray:
        Shared, Embed, Mlp = self.gate.axes
        dtype = u.dtype
        gate = hax.dot(u, self.gate.astype(dtype), axis=Embed)
        hidden = hnn.silu(gate) * hax.dot(u, self.up.astype(dtype), axis=Embed)
        return hax.dot(hidden, self.down.astype(dtype), axis=(Shared, Mlp))


class LatentMoE(eqx.Module):
    """Router on the full-width token; experts on its latent projection (or on it directly).

    router_bias is a model leaf so checkpoints carry it, but no gradient reaches it: the training
    loop sets it from the previous step's quantile-balancing betas (`routing.next_router_bias`).
    """

    router: NamedArray  # [Embed, Experts], used in fp32
    router_bias: NamedArray | None  # [Experts], quantile balancing only
    latent_down: NamedArray | None  # [Embed, Latent]
    latent_norm: hnn.RmsNorm | None
    latent_up: NamedArray | None  # [Latent, Embed]
    experts: RoutedExperts
    config: MoELMConfig = eqx.field(static=True)

    @staticmethod
    def init(config: MoELMConfig, *, key) -> "LatentMoE":
        a = ModelAxes.of(config)
        k_router, k_down, k_up, k_experts = jax.random.split(key, 4)
        latent = config.latent_dim is not None
        return LatentMoE(
            router=init_matrix(k_router, (a.Embed, a.Experts), config),
            router_bias=hax.zeros(a.Experts) if config.has_router_bias else None,
            latent_down=init_matrix(k_down, (a.Embed, a.Latent), config) if latent else None,
            latent_norm=rms_norm(a.Latent, config) if latent else None,
            latent_up=init_matrix(k_up, (a.Latent, a.Embed), config) if latent else None,
            experts=RoutedExperts.init(config, key=k_experts),
            config=config,
        )

    def __call__(self, u: NamedArray, valid: NamedArray, *, transport: TransportSpec) -> tuple[NamedArray, dict]:
        """u [Batch, Pos, Embed], valid [Batch, Pos] -> (routed output [Batch, Pos, Embed], per-layer stats)."""
        cfg = self.config
        a = ModelAxes.of(cfg)
        Batch, Pos = valid.axes
        tokens = flatten_tokens(u, Batch, Pos, TOKEN)
        valid_t = flatten_tokens(valid, Batch, Pos, TOKEN)
        routes = route(tokens, self.router, self.router_bias, cfg)

        if self.latent_down is None:
            z = tokens.rename({a.Embed.name: a.Latent.name})
        else:
            z = apply_rms_norm(self.latent_norm, hax.dot(tokens, self.latent_down.astype(u.dtype), axis=a.Embed))
        experts = self.experts
        out, dropped, sized = dispatch(
            z,
            routes.selected,
            routes.weights,
            valid_t,
            experts.gate.astype(u.dtype),
            experts.up.astype(u.dtype),
            experts.down.astype(u.dtype),
            transport=transport,
            capacity_factor=cfg.capacity_factor,
        )
        if self.latent_up is None:
            out = out.rename({a.Latent.name: a.Embed.name})
        else:
            out = hax.dot(out, self.latent_up.astype(u.dtype), axis=a.Latent)

        stats = routing_stats(routes, valid_t, a.Experts)
        assignments = jnp.maximum(jnp.sum(valid_t.array) * cfg.experts_per_token, 1)
        stats["dropped_fraction"] = hax.named(dropped / assignments, ())
        # The kernel's own word on what it ran (0: no capacity), for the loop to check against the plan.
        stats["kernel_transport"] = hax.named(jnp.int32(transport.name.code), ())
        stats["kernel_capacity_factor"] = hax.named(jnp.float32(sized or 0.0), ())
        if cfg.balancing is Balancing.QUANTILE:
            stats["qb_beta"] = quantile_beta(routes, valid_t, cfg)
        return unflatten_tokens(out, TOKEN, Batch, Pos), stats
