"""grug's fixed-capacity all-to-all with one collective per direction, for XLA:CPU.

grug's `fixed_all_to_all` sends each local expert's rows with its own all-to-all (a loop, so that
accelerators overlap one expert's transfer with another's matmuls), then returns them the same
way: 2 x local experts collectives per layer forward, as many again in the backward pass and again
in its recompute: 24 per layer for small_moe, which a dense model does not have. On XLA:CPU every
collective is a rendezvous of all the simulated devices' threads on the same few cores. Here the
same send buffer [local experts, shards, capacity, H] travels in one all-to-all each way (6 per
layer) and the local experts run as one batched matmul.

It computes grug's function exactly: the same capacity, the same rank-within-expert drop rule and
the same slot layout, built from grug's own helpers (pinned with Levanter in uv.lock), so the
same assignments are dropped and `dropped` counts them the same way.
"""

import math

import jax
import jax.numpy as jnp
from jax import shard_map
from jax.sharding import PartitionSpec as P
from jax.sharding import reshard
from levanter.grug._moe.common import _assignment_validity, _scaled_capacity
from levanter.grug._moe.ep_common import _ranks_within_groups
from levanter.grug._moe.ep_fixed_all_to_all import _combine_gather, _dispatch_gather

from keel.model.layout import token_axes


def batched_fixed_all_to_all(x, selected, weights, valid, w13, w2, *, mesh, capacity_factor: float):
    """x [T, H], selected/weights [T, K], valid [T] split over the token axes; w13 [E, H, 2F] (gate
    then up) and w2 [E, F, H] split over `expert`. Returns (out [T, H], dropped assignments: int32)."""
    axes = token_axes()
    tokens, experts = P(axes), P("expert", None, None)

    def local(x, selected, weights, valid, w13, w2):
        return _local(x, selected, weights, valid, w13, w2, num_experts=num_experts,
                      capacity_factor=capacity_factor, token_axes=axes)

    num_experts = w13.shape[0]
    args = [reshard(a, spec) for a, spec in zip((x, selected, weights, valid, w13, w2),
                                               (tokens, tokens, tokens, tokens, experts, experts))]
    return shard_map(local, mesh=mesh, in_specs=(tokens, tokens, tokens, tokens, experts, experts),
                     out_specs=(tokens, P()), check_vma=False)(*args)


def _local(x, selected, weights, valid, w13, w2, *, num_experts, capacity_factor, token_axes):
    """One token shard: rank assignments within their expert, keep those under capacity, send all
    local experts' buckets in one all-to-all, run them, send the results back in one more."""
    local_experts = w13.shape[0]
    shards, (tokens, topk), hidden = num_experts // local_experts, selected.shape, x.shape[1]
    assignments = tokens * topk
    capacity = max(math.ceil(capacity_factor * assignments / num_experts), 1)
    send_size = local_experts * shards * capacity

    ok = _assignment_validity(valid, tokens=tokens, topk=topk)
    n_ok = jnp.sum(ok, dtype=jnp.int32)
    logical = _scaled_capacity(n_ok, capacity_factor=capacity_factor, divisor=num_experts, maximum=capacity)
    flat = selected.reshape(-1).astype(jnp.int32)
    expert = jnp.where(ok, flat, 0)
    slot = _ranks_within_groups(flat, num_groups=num_experts, valid=ok)
    keep = ok & (slot < logical)
    # [local expert, destination shard, slot]: grug's send layout, so one all-to-all splits axis 1
    linear = jnp.where(keep, (expert % local_experts) * shards * capacity + (expert // local_experts) * capacity
                       + slot, send_size)
    sources = jnp.full((send_size,), assignments, jnp.int32).at[linear].set(jnp.arange(assignments, dtype=jnp.int32),
                                                                           mode="drop")
    token_of = jnp.where(sources < assignments, sources // topk, tokens)
    send = _dispatch_gather(x, token_of, linear, keep).reshape(local_experts, shards, capacity, hidden)

    received = jax.lax.all_to_all(send, "expert", split_axis=1, concat_axis=1, tiled=True)
    hidden_rows = jnp.einsum("lrh,lhf->lrf", received.reshape(local_experts, shards * capacity, hidden), w13)
    gate, up = jnp.split(hidden_rows, 2, axis=-1)
    done = jnp.einsum("lrf,lfh->lrh", jax.nn.silu(gate) * up, w2).reshape(local_experts, shards, capacity, hidden)
    returned = jax.lax.all_to_all(done, "expert", split_axis=1, concat_axis=1, tiled=True)

    rows = _combine_gather(returned.reshape(send_size, hidden), jnp.minimum(linear, send_size - 1), keep, sources)
    out = jnp.einsum("tkh,tk->th", rows.reshape(tokens, topk, hidden), weights.astype(rows.dtype),
                     preferred_element_type=jnp.float32).astype(x.dtype)
    dropped = jax.lax.psum(n_ok - jnp.sum(keep, dtype=jnp.int32), token_axes)
    return out, dropped
