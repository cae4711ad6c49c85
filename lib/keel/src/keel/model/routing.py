"""Token -> expert routing, its balance statistics, and quantile balancing's global histogram.

Routing works on tokens flattened to one `Token` axis. The router runs in fp32 and adds the
non-learned `router_bias` (stop-gradient) only to the *selection* logits:

- sigmoid_topk_threshold: top-(k+1) of logits + bias; the first k are the routes, the (k+1)-th
  value is the token's threshold; combine weights are sigmoid(unbiased logits) of the k routes,
  renormalised to sum to `routing_renorm_sum`.
- softmax_topk: top-k of logits (+ bias); combine weights are the softmax over the k chosen logits.

Quantile balancing: per expert, beta_e is the value that exactly k/E of the valid tokens of the
*global* batch exceed in (unbiased logit - threshold), estimated from a `qb_histogram_bins`-bin
histogram summed over every batch shard. Setting next step's bias to -beta (centred) makes each
expert the choice of about k/E of the tokens.
"""

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
from haliax import Axis, NamedArray
from jax import shard_map
from jax.sharding import PartitionSpec as P
from jax.sharding import get_abstract_mesh, reshard

from keel.model.axes import TOP_K
from keel.spec.model import MoELMConfig, Routing
from keel.model.layout import plus, token_axes


class Routes(eqx.Module):
    selected: NamedArray  # [Token, TopK] int32 expert ids
    weights: NamedArray  # [Token, TopK] combine weights
    logits: NamedArray  # [Token, Experts] fp32, without the bias
    threshold: NamedArray | None  # [Token] fp32: the (k+1)-th biased logit (sigmoid routing only)


def route(u: NamedArray, router: NamedArray, router_bias: NamedArray | None, config: MoELMConfig) -> Routes:
    """u [Token, Embed], router [Embed, Experts], router_bias [Experts] -> Routes."""
    Embed, Experts = router.axes
    k = config.experts_per_token
    TopK = Axis(TOP_K, k)
    # fp32 as declared: without HIGHEST, XLA computes an fp32 dot in TF32 on GPUs and in bf16 passes
    # on TPUs, and rounded logits flip near-ties in the top-k and blur the balancing quantiles
    logits = hax.dot(u.astype(jnp.float32), router.astype(jnp.float32), axis=Embed, precision=jax.lax.Precision.HIGHEST)
    biased = logits if router_bias is None else plus(logits, jax.lax.stop_gradient(router_bias.astype(jnp.float32)))
    if config.routing is Routing.SIGMOID_TOPK_THRESHOLD:
        values, indices = _top_k(biased, Experts, Axis(TOP_K, k + 1))
        selected = indices[TOP_K, :k]
        threshold = values[TOP_K, k]
        weights = hnn.sigmoid(_take_experts(logits, selected, Experts))
        weights = weights * (config.routing_renorm_sum / (hax.sum(weights, TopK) + 1e-9))
    else:
        _, selected = _top_k(biased, Experts, TopK)
        weights = hnn.softmax(_take_experts(logits, selected, Experts), axis=TopK)
        threshold = None
    selected = selected.astype(jnp.int32)
    return Routes(selected=selected, weights=weights.astype(u.dtype), logits=logits, threshold=threshold)


def _top_k(scores: NamedArray, Experts: Axis, TopK: Axis) -> tuple[NamedArray, NamedArray]:
    """(values, indices) [Token, TopK] of the TopK.size largest scores [Token, Experts] of each token,
    on each token shard: XLA's SPMD partitioner does not split a top-k, and would gather every
    token's scores onto every device first."""
    axes = token_axes()
    if not axes:
        return hax.top_k(scores, Experts, TopK.size, new_axis=TopK)
    Token = next(ax for ax in scores.axes if ax != Experts)
    spec = P(axes, None)
    values, indices = shard_map(lambda s: tuple(jax.lax.top_k(s, TopK.size)), mesh=get_abstract_mesh(), in_specs=spec,
                                out_specs=(spec, spec))(reshard(scores.rearrange((Token, Experts)).array, spec))
    return hax.named(values, (Token, TopK)), hax.named(indices, (Token, TopK))


def _take_experts(logits: NamedArray, selected: NamedArray, Experts: Axis) -> NamedArray:
    """logits[t, selected[t, j]] as [Token, TopK]."""
    Token = selected.axes[0]
    selected = selected.rearrange((Token, ...))
    raw = jnp.take_along_axis(logits.rearrange((Token, Experts)).array, selected.array, axis=1)
    return hax.named(raw, selected.axes)


def routing_stats(routes: Routes, valid: NamedArray, Experts: Axis) -> dict[str, NamedArray]:
    """Per-layer balance statistics over valid tokens of the global batch.

    routing_counts [Experts]: assignments per expert; max_load: the busiest expert's share relative
    to a perfectly even split (1.0 = balanced); load_balancing_loss: E * sum_e f_e * P_e (f: share
    of assignments, P: mean softmax probability), the usual auxiliary loss.
    """
    TopK = routes.selected.resolve_axis(TOP_K)
    chosen = hnn.one_hot(routes.selected, Experts, dtype=jnp.float32) * valid.astype(jnp.float32)
    counts = hax.sum(chosen, axis=(valid.axes[0], TopK))
    total = jnp.maximum(hax.sum(counts).array, 1.0)
    share = counts / total
    valid_f = valid.astype(jnp.float32)
    n_valid = jnp.maximum(hax.sum(valid_f).array, 1.0)
    mean_prob = hax.sum(hnn.softmax(routes.logits, axis=Experts) * valid_f, axis=valid.axes[0]) / n_valid
    return {
        "routing_counts": counts,
        "max_load": hax.max(share) * Experts.size,
        "load_balancing_loss": Experts.size * hax.sum(share * mean_prob),
    }


def quantile_beta(routes: Routes, valid: NamedArray, config: MoELMConfig) -> NamedArray:
    """beta [Experts]: the (1 - k/E) upper quantile of (logit - threshold) over the global batch's valid tokens."""
    if routes.threshold is None:
        raise ValueError("quantile balancing needs the top-(k+1) threshold (routing='sigmoid_topk_threshold')")
    Token, Experts = valid.axes[0], routes.logits.resolve_axis("experts")
    scores = (routes.logits - routes.threshold).rearrange((Token, Experts))
    ok = valid.array
    lo = hax.min(hax.where(valid, scores, jnp.inf), axis=Token).array
    hi = hax.max(hax.where(valid, scores, -jnp.inf), axis=Token).array
    bins = config.qb_histogram_bins
    width = jnp.maximum(hi - lo, 0.0) / bins

    def local_histogram(s, ok, lo, width):
        idx = jnp.clip(jnp.floor((s - lo) / jnp.where(width > 0, width, 1.0)), 0, bins - 1).astype(jnp.int32)
        rows = jnp.broadcast_to(jnp.arange(s.shape[1]), s.shape)
        return jnp.zeros((s.shape[1], bins), jnp.int32).at[rows, idx].add(ok[:, None].astype(jnp.int32))

    counts = token_sum(local_histogram, scores.array, ok, replicated=(lo, width)).astype(jnp.float32)
    # k/E of the valid tokens, rounded down as in grug's per-shard estimate.
    target = (jnp.sum(ok) * config.experts_per_token // config.num_experts).astype(jnp.float32)
    at_or_above = jnp.cumsum(counts[:, ::-1], axis=1)[:, ::-1]  # tokens in bin b or higher
    top_bin = jnp.maximum(jnp.sum(at_or_above >= target, axis=1) - 1, 0)
    in_bin = jnp.take_along_axis(counts, top_bin[:, None], axis=1)[:, 0]
    from_bin = jnp.take_along_axis(at_or_above, top_bin[:, None], axis=1)[:, 0]
    # Tokens spread evenly inside the bin: the cut leaves `target` tokens above it.
    beta = lo + (top_bin + (from_bin - target) / jnp.maximum(in_bin, 1.0)) * width
    beta = jnp.where(target > 0, beta, 0.0)
    return hax.named(beta, Experts)


def token_sum(fn, *token_arrays, replicated=()):
    """Sum fn(*local shards, *replicated) over every shard of the token (leading) dimension.

    The counts are built with scatter-adds on each shard's own tokens and then summed with one
    psum, which is how the global router histogram crosses racks. Without a mesh it is just fn.
    """
    axes = token_axes()
    if not axes:
        return fn(*token_arrays, *replicated)

    def local(*args):
        return jax.lax.psum(fn(*args), axes)

    token_specs = tuple(P(axes, *([None] * (a.ndim - 1))) for a in token_arrays)
    replicated_specs = tuple(P(*([None] * r.ndim)) for r in replicated)
    args = [reshard(a, spec) for a, spec in zip((*token_arrays, *replicated), token_specs + replicated_specs)]
    in_specs = token_specs + replicated_specs
    return shard_map(local, mesh=get_abstract_mesh(), in_specs=in_specs, out_specs=P(), check_vma=False)(*args)


def next_router_bias(betas: NamedArray) -> NamedArray:
    """Next step's router bias from this step's betas [Layers, Experts]: -beta, centred to zero mean per layer."""
    Experts = betas.resolve_axis("experts")
    return -(betas - hax.mean(betas, axis=Experts))
