"""A dropless grouped expert MLP for XLA:CPU made of ordinary batched matmuls.

grug's local kernel groups rows with `ragged_dot`, which XLA:CPU runs about 15x slower than a
dense matmul of the same FLOPs (it works through every group for every row). Here the
expert-sorted rows are instead padded so that each group starts on a tile boundary: every tile
then belongs to one expert, and a batched matmul of tiles against their experts' weights does
the work. Static shapes hold because padding adds at most `tile - 1` rows per expert (see
`tile_rows` for the tile). Accelerators keep grug's kernel (their grouped matmuls are native).
"""

import jax
import jax.numpy as jnp


def tile_rows(assignments: int, num_experts: int) -> int:
    """A power of two near half the mean group size (8..128).

    Smaller tiles waste fewer padded rows but copy each expert's weights once per tile; half the
    mean group size keeps both costs moderate (padding adds about a quarter of the rows on average).
    """
    target = max(assignments // (2 * num_experts), 1)
    return int(min(128, max(8, 1 << (target.bit_length() - 1))))


def tiled_expert_mlp(x, selected, weights, valid, w13, w2):
    """out[t] = sum_j weights[t, j] * SwiGLU_{selected[t, j]}(x[t]); x [T, D], selected/weights [T, K],
    valid [T], w13 [E, D, 2F] (gate then up), w2 [E, F, D]. Every valid assignment is computed."""
    tokens, k = selected.shape
    num_experts, width = w13.shape[0], x.shape[1]
    assignments = tokens * k
    tile = tile_rows(assignments, num_experts)
    rows = -(-(assignments + num_experts * (tile - 1)) // tile) * tile
    n_tiles = rows // tile

    valid_a = jnp.repeat(valid, k)
    expert = jnp.where(valid_a, selected.reshape(-1), num_experts)  # padding tokens sort last, go nowhere
    counts = jnp.bincount(expert, length=num_experts + 1)[:num_experts]
    padded = -(-counts // tile) * tile
    group_start = jnp.cumsum(counts) - counts
    padded_start = jnp.cumsum(padded) - padded
    order = jnp.argsort(expert, stable=True)
    sorted_expert = expert[order]
    real_expert = jnp.minimum(sorted_expert, num_experts - 1)
    in_group = jnp.arange(assignments) - group_start[real_expert]
    slot_sorted = jnp.where(sorted_expert < num_experts, padded_start[real_expert] + in_group, rows)
    slot = jnp.zeros(assignments, jnp.int32).at[order].set(slot_sorted.astype(jnp.int32))  # row of each assignment

    token_of = jnp.arange(assignments) // k
    buffer = jnp.zeros((rows, width), x.dtype).at[slot].set(x[token_of], mode="drop")
    tile_expert = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(n_tiles) * tile, side="right")
    tile_expert = jnp.minimum(tile_expert, num_experts - 1)  # tiles past the last group: all padding

    hidden = jnp.einsum("ntd,ndf->ntf", buffer.reshape(n_tiles, tile, width), w13[tile_expert])
    gate, up = jnp.split(hidden, 2, axis=-1)
    out = jnp.einsum("ntf,nfd->ntd", jax.nn.silu(gate) * up, w2[tile_expert]).reshape(rows, width)

    per_assignment = jnp.take(out, slot, axis=0, mode="fill", fill_value=0).reshape(tokens, k, width)
    w = jnp.where(valid[:, None], weights, 0).astype(out.dtype)
    return jnp.einsum("tkd,tk->td", per_assignment, w)
