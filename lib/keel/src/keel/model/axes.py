"""The named axes of the keel MoE model, derived from one `MoELMConfig`.

Every array of the model carries these names, so sharding rules (keel.mesh) and the checkpoint
layout speak the same language as the code: `Experts` is the axis expert parallelism splits,
`Embed` the one FSDP splits, `Batch` the one data parallelism splits.
"""

from dataclasses import dataclass

import haliax as hax
from haliax import Axis

from keel.spec.model import MoELMConfig

BATCH = "batch"
POS = "position"
KEY_POS = "key_position"
TOKEN = "token"
TOP_K = "top_k"
LAYERS = "layers"
"""The axis that stacks every layer's copy of a parameter (scanned layers)."""


@dataclass(frozen=True)
class ModelAxes:
    """Axes sized by the config; `Batch` and `Pos` come from the inputs."""

    Embed: Axis
    Heads: Axis
    KVHeads: Axis
    HeadSize: Axis
    Latent: Axis
    """Width the routed experts read and write (latent_dim, or hidden_dim without a latent)."""
    Experts: Axis
    ExpertMlp: Axis
    SharedExperts: Axis
    SharedMlp: Axis
    GateRank: Axis
    ConvKernel: Axis
    Vocab: Axis
    Layers: Axis

    @staticmethod
    def of(config: MoELMConfig) -> "ModelAxes":
        return ModelAxes(
            Embed=Axis("embed", config.hidden_dim),
            Heads=Axis("heads", config.num_heads),
            KVHeads=Axis("kv_heads", config.num_kv_heads),
            HeadSize=Axis("head_size", config.head_dim),
            Latent=Axis("latent", config.expert_input_dim),
            Experts=Axis("experts", config.num_experts),
            ExpertMlp=Axis("expert_mlp", config.expert_dim),
            SharedExperts=Axis("shared_experts", config.num_shared_experts),
            SharedMlp=Axis("shared_mlp", config.shared_expert_dim),
            GateRank=Axis("gate_rank", config.gated_norm_rank),
            ConvKernel=Axis("conv_kernel", config.conv_kernel),
            Vocab=Axis("vocab", config.vocab_size),
            Layers=Axis(LAYERS, config.num_layers),
        )


def init_matrix(key, axes, config: MoELMConfig):
    """The hero init for every matrix: normal truncated at +-3 sigma, sigma = init_scale / sqrt(hidden_dim)."""
    return hax.random.truncated_normal(key, axes, -3, 3) * (config.init_scale / config.hidden_dim**0.5)
