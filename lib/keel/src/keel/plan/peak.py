"""What a step holds on a GPU beyond its state: the transient buffers at its two peaks.

The backward works one layer at a time. With per-layer remat it first computes the layer's forward
again, so its peak is the state (what lives between steps, plus the offloaded state the step copies
in and the residuals the forward saved) and one layer's worth of:

- `all_to_all_buffers`: the send and the receive buffer of one expert exchange;
- `layer_activations`: everything the layer's forward leaves for its backward
  (`layer_activations_per_token`: norms, attention, the router, the expert rows the GPU's receive
  buffer can hold (capacity x its even share) with their gate, up and product, the shared experts),
  but the received rows, which are the receive buffer; without remat the saved residuals hold them;
- `gathered_weights`: the largest FSDP-split layer gathered whole, twice (the one computing and
  the next, prefetched), and its gradients before the reduce-scatter;
- `attention_scores`: with the vanilla kernel only, one layer's whole score matrix and the
  probabilities softmax makes of it (`attention_scores_gb`); the blockwise kernels hold neither.

The optimizer's update comes after the backward has freed the saved residuals; MuonH's Newton-Schulz
loop then holds `newton_schulz_loop`, and a replicated weight whose optimizer state is split (the
token embedding's, `keel.spec.placement`) its update gathered whole, `gathered_updates`
(`update_transients`). Each is a named part, so a verdict says
what the peak is made of.
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


def backward_transients(run: ResolvedRun, a2a: dict | None, capacity_factor: float | None, compute_bytes: int) -> dict[str, float]:
    """The transient parts (GB per GPU) of a layer's backward under one transport phase (`a2a`: its
    all-to-all figures, None when it moves no tokens; `capacity_factor`: the one its kernel is
    handed, `keel.spec.transports.kernel_capacity_factor`, None for a transport that pads nothing)."""
    layer = 0.0
    if run.config.train.remat:
        per_token = sum(layer_activations_per_token(run.config.model, capacity_factor or 1.0).values())
        received = a2a["buffer_gb_per_layer"] if a2a else 0.0
        layer = run.tokens_per_device * per_token * compute_bytes / GB - received
    return {
        "all_to_all_buffers": 2 * a2a["buffer_gb_per_layer"] if a2a else 0.0,
        "layer_activations": layer,
        "gathered_weights": 3 * gathered_layer_gb(run, compute_bytes),
        "attention_scores": attention_scores_gb(run),
    }


def update_transients(run: ResolvedRun) -> dict[str, float]:
    """The transient parts (GB per GPU) of the optimizer's update: one MuonH Newton-Schulz loop of
    `newton_schulz_elements_per_device` elements, gathered whole. An iteration holds x, its Gram
    matrix, the Gram matrix squared (each no larger than x: x is transposed to be wide) and the next
    x in the Newton-Schulz dtype, beside the gathered weights and update in the master dtype, which
    the loop's result is applied to. Beside it (counted as held at once), the update of every
    trained weight whose optimizer state is split finer than the weight, gathered to the weight's
    placement in the master dtype."""
    train = run.config.train
    parts = {}
    elements = run.newton_schulz_elements_per_device()
    if elements:
        per_element = 4 * DTYPE_BYTES[train.optimizer.newton_schulz_dtype] + 2 * DTYPE_BYTES[train.master_dtype]
        parts["newton_schulz_loop"] = elements * per_element / GB
    gathered = sum(run.per_device(p) * DTYPE_BYTES[train.master_dtype] for p in run.parameters
                   if p.trained and p.state_placement != p.placement)
    if gathered:
        parts["gathered_updates"] = gathered / GB
    return parts


def layer_activations_per_token(model, capacity_factor: float) -> dict[str, float]:
    """Values one token leaves in one layer's forward for its backward (without rematerialisation),
    by site: the norms and GatedNorms, q/k/v (and the key convolution), the attention output before
    and after XSA and the gate, the output projection and its convolution; the router logits, the
    latent projection, every routed expert's gate/up/activation/output over its rows (the token's
    `experts_per_token` assignments x `capacity_factor`, a fixed-shape transport's padding), the
    shared experts, the MoE output convolution. A lower bound: attention scores are not kept (a
    fused kernel recomputes them)."""
    d, heads, hd = model.hidden_dim, model.num_heads, model.head_dim
    kv, gate_rank = model.num_kv_heads * hd, model.gated_norm_rank
    norms = 2 * (d + (gate_rank + d if gate_rank else 0))
    attention = heads * hd * (3 if model.xsa else 2) + 2 * kv + (kv if model.conv_sites else 0) + heads + 2 * d
    routed = 0.0
    if model.num_experts:
        rows = model.experts_per_token * capacity_factor
        routed = model.num_experts * 2 + (2 * model.latent_dim if model.latent_dim else 0) \
            + rows * (3 * model.expert_dim + model.expert_input_dim) + d
    shared = model.num_shared_experts * 3 * model.shared_expert_dim
    return {"norms": norms, "attention": attention, "routed_experts": routed, "shared_experts": shared,
            "residual_and_convolutions": 2 * d}


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
