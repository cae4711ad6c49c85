"""keel.model: the MoE language model's config and accounting (no jax here; the Haliax model
lives in its own modules and is imported only where it runs)."""

from keel.model.config import AttentionBackend, Balancing, ConvSite, MoELMConfig, Routing

__all__ = ["AttentionBackend", "Balancing", "ConvSite", "MoELMConfig", "Routing"]
