"""What the training loop needs from a language model, and the keel MoE model behind it.

The loop is model-agnostic so that benchmarks can run Levanter's own models and a dense baseline
under exactly the same trainer, devices and data. A `TrainableLM` owns its mixed precision (it is
handed fp32 master weights and the compute dtype), is told the transport in force for the step
(a `TransportSpec` with the resolved run's capacity), and reports its routing statistics in `aux`:

- `qb_beta` [layers, experts]: this step's quantile-balancing betas (absent without QB);
- `dropped_fraction`: assignments dropped by expert capacity / all assignments;
- `router_balance`: busiest expert's load / mean load (1.0 = perfectly even);
- `kernel/transport`, `kernel/capacity_factor` [layers]: what each layer's MoE kernel reports it
  ran (`TransportName.code`; the capacity factor it was called with, 0 where none can drop). The
  loop checks them against the resolved run after the first step of each phase (`KERNEL`).

`apply_router_update(model, aux)` returns the model whose router bias is the one for the next
step (the identity for models without quantile balancing).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import haliax as hax
import jax.numpy as jnp

from keel.mesh.mesh import compute_axis_mapping
from keel.model.axes import BATCH, POS
from keel.model.loss import TokenBatch, loss_fn
from keel.model.routing import next_router_bias
from keel.model.transformer import init_model, with_router_bias

LM_LOSS = "lm_loss"
"""The aux entry with the language-modelling loss alone, without auxiliary terms (`TrainableLM.loss`)."""
KERNEL = "kernel/"
"""The prefix of the aux entries that report what the MoE kernels ran (checked, never logged)."""


class TrainableLM(Protocol):
    def init(self, key) -> Any: ...

    def loss(self, model, batch, *, transport, z_loss: float, compute_dtype) -> tuple[Any, dict[str, Any]]:
        """(the loss trained on, aux values). A loss that adds terms to the cross-entropy (an
        auxiliary balancing loss) reports the cross-entropy and z-loss alone as aux `LM_LOSS`, which
        evaluations read."""

    def apply_router_update(self, model, aux: dict[str, Any]) -> Any: ...


class KeelLM:
    """keel's Haliax MoE model (keel.model) as a `TrainableLM` on a rack mesh (keel.mesh).

    Batches are `{"input_ids", "segment_ids"}` int32 [batch, seq]; the loss is keel.model's
    `loss_fn`: next-token cross-entropy within documents, plus z-loss on the final logits, plus
    the model's auxiliary balancing loss if it has one.
    """

    def __init__(self, config, mesh, *, remat: bool = True):
        self.config, self.mesh, self.remat = config, mesh, remat

    def init(self, key):
        """The freshly initialised model; its caller jits this with the resolved run's shardings
        (`keel.train.layout.planned_shardings`), so no placement is decided here."""
        return init_model(self.config, key)

    def loss(self, model, batch, *, transport, z_loss: float, compute_dtype):
        tokens = TokenBatch(
            input_ids=hax.named(batch["input_ids"], (BATCH, POS)),
            segment_ids=hax.named(batch["segment_ids"], (BATCH, POS)),
        )
        with hax.axis_mapping(compute_axis_mapping()):
            loss, aux = loss_fn(
                self._with_remat(model),
                tokens,
                z_loss=z_loss,
                transport=transport,
                compute_dtype=compute_dtype,
            )
        out = {LM_LOSS: aux["lm_loss"]}
        if "dropped_fraction" in aux:
            out["dropped_fraction"] = jnp.mean(aux["dropped_fraction"].array)
            out["router_balance"] = jnp.mean(aux["max_load"].array)
        if "kernel_transport" in aux:
            out[KERNEL + "transport"] = aux["kernel_transport"].array
            out[KERNEL + "capacity_factor"] = aux["kernel_capacity_factor"].array
        if "qb_beta" in aux:
            out["qb_beta"] = aux["qb_beta"]
        return loss, out

    def apply_router_update(self, model, aux):
        if "qb_beta" not in aux:
            return model
        current = model.layers.stacked.moe.router_bias
        return with_router_bias(model, next_router_bias(aux["qb_beta"]).astype(current.dtype))

    def _with_remat(self, model):
        """The model with the run's remat choice (a static field)."""
        return dataclasses.replace(model, layers=dataclasses.replace(model.layers, gradient_checkpointing=self.remat))

