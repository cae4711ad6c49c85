"""What a step holds on a GPU beyond its state: the transient buffers at its peak.

With per-layer remat a step works one layer at a time, so the peak is the state (what lives
between steps, plus the offloaded state the step copies in) and one layer's worth of:

- `all_to_all_buffers`: the send and the receive buffer of one expert exchange;
- `expert_intermediates`: the expert matmuls' gate and up outputs and their product, kept for the
  layer's backward, over every row the GPU's receive buffer can hold (capacity x its even share);
- `gathered_weights`: the largest FSDP-split layer gathered whole, twice (the one computing and
  the next, prefetched), and its gradients before the reduce-scatter;
- `attention_scores`: with the vanilla kernel only, one layer's whole score matrix and the
  probabilities softmax makes of it (`attention_scores_gb`); the blockwise kernels hold neither.

Each is a named part, so a verdict says what the peak is made of.
"""

from __future__ import annotations

from keel.spec.dtypes import DTYPE_BYTES
from keel.spec.model import AttentionBackend
from keel.spec.resolved import Parameter, ResolvedRun

GB = 1e9


def fsdp_shards(run: ResolvedRun, parameter: Parameter) -> int:
    """Into how many pieces FSDP splits a leaf inside a rack, to be gathered for compute: every
    split but `experts` over `expert` (expert parallelism moves the tokens to the weights)."""
    count = 1
    for (name, _), entry in zip(parameter.axes, parameter.placement or ()):
        if name == "experts":
            continue
        for axis in (entry,) if isinstance(entry, str) else entry or ():
            if axis != "replica_dcn":
                count *= run.mesh_axes[axis]
    return count


def gathered_layer_gb(run: ResolvedRun, compute_bytes: int) -> float:
    """Bytes of one layer's (or the embedding's / lm_head's) FSDP-split weights gathered whole on a
    GPU: per leaf its shard times the pieces FSDP splits it into."""
    layers = run.config.model.num_layers
    per_layer, largest_other = 0.0, 0.0
    for p in run.parameters:
        shards = fsdp_shards(run, p)
        if shards == 1:
            continue
        whole = run.per_device(p) * shards * compute_bytes
        if p.axes and p.axes[0][0] == "layers":
            per_layer += whole / layers
        else:
            largest_other = max(largest_other, whole)
    return max(per_layer, largest_other) / GB


def transients(run: ResolvedRun, a2a: dict | None, capacity_factor: float | None, compute_bytes: int) -> dict[str, float]:
    """The transient parts (GB per GPU) of a step under one transport phase (`a2a`: its all-to-all
    figures, None when it moves no tokens; `capacity_factor`: the one its kernel is handed,
    `keel.spec.transports.kernel_capacity_factor`, None for a transport that pads nothing)."""
    model, tokens = run.config.model, run.tokens_per_device
    rows = tokens * model.experts_per_token * (capacity_factor or 1.0) if model.num_experts else 0
    return {
        "all_to_all_buffers": 2 * a2a["buffer_gb_per_layer"] if a2a else 0.0,
        "expert_intermediates": 3 * rows * model.expert_dim * compute_bytes / GB,
        "gathered_weights": 3 * gathered_layer_gb(run, compute_bytes),
        "attention_scores": attention_scores_gb(run),
    }


def attention_scores_gb(run: ResolvedRun) -> float:
    """GB per GPU of the vanilla kernel's [sequences, heads, seq_len, seq_len] matrices: keel's
    attention asks it for fp32 (`keel.model.attention`), and Levanter's reference path holds the
    scores and the softmax's probabilities together at the softmax. A sliding window only masks
    the matrix, which stays seq_len x seq_len. 0 for the blockwise kernels, which never hold it whole."""
    config = run.config
    if config.model.attention_backend is not AttentionBackend.VANILLA:
        return 0.0
    sequences = config.train.batch_size // config.topology.batch_shards
    return 2 * sequences * config.model.num_heads * config.train.seq_len ** 2 * DTYPE_BYTES["float32"] / GB
