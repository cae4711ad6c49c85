"""Next-token loss of the keel model on packed documents, with Levanter's fused cross-entropy."""

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
from haliax import NamedArray
from levanter.models.loss import maybe_fused_next_token_loss

from keel.model.axes import POS, ModelAxes
from keel.model.layout import gathered
from keel.model.transformer import MoELM
from keel.spec.transports import TransportSpec


class TokenBatch(eqx.Module):
    """input_ids and segment_ids, both int32 [Batch, Pos]; segment id < 0 marks padding."""

    input_ids: NamedArray
    segment_ids: NamedArray


def next_token_weight(segment_ids: NamedArray) -> NamedArray:
    """1 where the next token exists and belongs to the same (non-padding) document, else 0.

    The last token of a document is not asked to predict the first token of the next one.
    """
    Pos = segment_ids.resolve_axis(POS)
    same_doc = (hax.roll(segment_ids, -1, Pos) == segment_ids) & (segment_ids >= 0)
    return same_doc.astype(jnp.float32)


def loss_fn(
    model: MoELM,
    batch: TokenBatch,
    z_loss: float = 0.0,
    transport: TransportSpec = TransportSpec(),
    compute_dtype=jnp.float32,
) -> tuple[jnp.ndarray, dict]:
    """(scalar loss, aux) for one batch: mean next-token cross-entropy over in-document targets,
    plus `z_loss` x logsumexp^2 of the final logits, plus the auxiliary balancing loss (if any).

    aux is the model's aux dict (`MoELM.__call__`) plus `lm_loss` (cross-entropy + z-loss alone).
    Run it under `keel.mesh.use_mesh(mesh)` when a mesh is used: the fused loss reads the Haliax
    axis mapping to place its shard_map.
    """
    h, aux = model.activations(batch.input_ids, batch.segment_ids, transport=transport, compute_dtype=compute_dtype)
    a = ModelAxes.of(model.config)
    # The fused loss's shard_map takes its in_specs from the axis mapping: lay the inputs out to match.
    lm_head = hax.shard(gathered(model.lm_head_weight()).astype(h.dtype))
    lm_loss = maybe_fused_next_token_loss(
        Pos=batch.input_ids.resolve_axis(POS),
        Embed=a.Embed,
        Vocab=a.Vocab,
        pred_embeddings=hax.shard(h),
        pred_lm_head=lm_head,
        true_ids=hax.shard(batch.input_ids),
        loss_weight=next_token_weight(batch.segment_ids),
        reduction=hax.mean,
        logsumexp_weight=z_loss or None,
    ).array
    return lm_loss + aux["aux_loss"], {**aux, "lm_loss": lm_loss}
