"""What the training loop needs from a language model, and the keel MoE model behind it.

The loop is model-agnostic so that benchmarks can run Levanter's own models and a dense baseline
under exactly the same trainer, devices and data. A `TrainableLM` owns its mixed precision (it is
handed fp32 master weights and the compute dtype) and reports its routing statistics in `aux`:

- `qb_beta` [layers, experts]: this step's quantile-balancing betas (absent without QB);
- `dropped_fraction`: assignments dropped by expert capacity / all assignments;
- `router_balance`: busiest expert's load / mean load (1.0 = perfectly even).

`apply_router_update(model, aux)` returns the model whose router bias is the one for the next
step (the identity for models without quantile balancing).
"""

from __future__ import annotations

from typing import Any, Protocol


class TrainableLM(Protocol):
    def init(self, key) -> Any: ...

    def loss(self, model, batch, *, transport: str, z_loss: float, compute_dtype) -> tuple[Any, dict[str, Any]]: ...

    def apply_router_update(self, model, aux: dict[str, Any]) -> Any: ...
