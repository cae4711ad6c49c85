"""Models, mesh and data for the training tests.

- `MICRO`: a micro keel MoE with every hero feature on (`micro_lm`, `loop_inputs`): what the
  training tests train.
- `StandinLM`: a one-layer stand-in (embedding -> one QB-routed grug MoE layer -> lm_head) with the
  `TrainableLM` call shape; quick to compile, for tests of the loop's machinery across processes.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp

from keel.model import Balancing, ConvSite, MoELMConfig, Routing

MICRO = MoELMConfig(
    hidden_dim=32,
    num_layers=2,
    vocab_size=128,
    max_seq_len=64,
    embed_norm=True,
    num_heads=2,
    head_dim=16,
    num_kv_heads=2,
    num_global_kv_heads=1,
    global_every=2,
    sliding_window=32,
    rope_fraction=0.5,
    qk_norm=True,
    qk_mult=1.3,
    xsa=True,
    attention_gate=True,
    conv_sites=(ConvSite.KEY, ConvSite.ATTENTION_OUTPUT, ConvSite.MOE_OUTPUT),
    gated_norm_rank=8,
    num_experts=8,
    experts_per_token=2,
    latent_dim=16,
    expert_dim=16,
    num_shared_experts=1,
    shared_expert_dim=16,
    routing=Routing.SIGMOID_TOPK_THRESHOLD,
    routing_renorm_sum=2.5,
    balancing=Balancing.QUANTILE,
    qb_histogram_bins=100,
    capacity_factor=4.0,
)
"""Capacity 4x the even share: the fixed-capacity transport drops nothing, so transports agree."""


def micro_lm(mesh):
    from keel.train.lm import KeelLM

    return KeelLM(MICRO, mesh)



def micro_lm(mesh):
    from keel.train.lm import KeelLM

    return KeelLM(MICRO, mesh)



GRUG_TRANSPORTS = {"fixed_all_to_all": "fixed_all_to_all", "ring": "ring", "local": "scatter"}


class StandinModel(eqx.Module):
    embedding: jax.Array  # [V, D]
    router: jax.Array  # [1, D, E]
    router_bias: jax.Array  # [1, E]
    w_gate: jax.Array  # [E, D, F]
    w_up: jax.Array  # [E, D, F]
    w_down: jax.Array  # [E, F, D]
    lm_head: jax.Array  # [D, V]


@dataclasses.dataclass(frozen=True)
class StandinLM:
    vocab: int = 128
    hidden: int = 32
    experts: int = 8
    k: int = 2
    ffn: int = 32
    capacity_factor: float = 4.0

    def init(self, key):
        ks = jax.random.split(key, 6)
        s = 0.5 / self.hidden**0.5
        n = lambda k, shape: s * jax.random.normal(k, shape, jnp.float32)  # noqa: E731
        return StandinModel(
            embedding=n(ks[0], (self.vocab, self.hidden)),
            router=n(ks[1], (1, self.hidden, self.experts)),
            router_bias=jnp.zeros((1, self.experts), jnp.float32),
            w_gate=n(ks[2], (self.experts, self.hidden, self.ffn)),
            w_up=n(ks[3], (self.experts, self.hidden, self.ffn)),
            w_down=n(ks[4], (self.experts, self.ffn, self.hidden)),
            lm_head=n(ks[5], (self.hidden, self.vocab)),
        )

    def loss(self, model: StandinModel, batch, *, transport, z_loss: float, compute_dtype):
        from jax.sharding import PartitionSpec as P
        from jax.sharding import get_abstract_mesh, reshard
        from levanter.grug.grug_moe import MoEExpertMlp, QBRoutedMoE
        from levanter.utils.activation import ActivationFunctionEnum

        mesh = get_abstract_mesh()
        tokens = batch["input_ids"]
        B, S = tokens.shape
        token_axes = ("replica_dcn", "data", "expert")
        x = model.embedding.at[tokens.reshape(-1)].get(out_sharding=P(token_axes, None)).astype(compute_dtype)
        experts = MoEExpertMlp(
            w_gate=model.w_gate.astype(compute_dtype),
            w_up=model.w_up.astype(compute_dtype),
            w_down=model.w_down.astype(compute_dtype),
            implementation=GRUG_TRANSPORTS[transport.transport],
            activation=ActivationFunctionEnum.silu,
            capacity_factor=transport.capacity_factor or self.capacity_factor,
        )
        valid = jnp.ones((B * S,), jnp.bool_)
        valid = reshard(valid, P(token_axes))
        routed, stats = QBRoutedMoE(num_experts_per_token=self.k, batch_axes=token_axes)(
            x, valid, router=model.router[0], router_bias=model.router_bias[0], expert_mlp=experts, mesh=mesh
        )
        h = x + routed
        logits = jnp.einsum("td,dv->tv", h, model.lm_head.astype(compute_dtype)).astype(jnp.float32)
        targets = jnp.roll(tokens, -1, axis=1).reshape(-1)
        mask = jnp.ones((B, S), jnp.float32).at[:, -1].set(0).reshape(-1)
        mask = reshard(mask, P(token_axes))
        lse = jax.nn.logsumexp(logits, axis=-1)
        targets = reshard(targets, P(token_axes))
        target_logit = jnp.sum(logits * jax.nn.one_hot(targets, self.vocab, dtype=logits.dtype), axis=-1)
        ce = jnp.sum((lse - target_logit) * mask) / jnp.sum(mask)
        zl = jnp.sum(lse**2 * mask) / jnp.sum(mask)
        counts = stats["routing_counts"]
        aux = {
            "qb_beta": stats["qb_beta"][None, :],
            "dropped_fraction": stats["capacity_overflow"] / (B * S * self.k),
            "router_balance": jnp.max(counts) / jnp.maximum(jnp.mean(counts), 1.0),
            "ce_loss": ce,
        }
        return ce + z_loss * zl, aux

    def apply_router_update(self, model: StandinModel, aux):
        beta = aux["qb_beta"]
        bias = -(beta - jnp.mean(beta, axis=-1, keepdims=True))
        return eqx.tree_at(lambda m: m.router_bias, model, bias.astype(model.router_bias.dtype))


BATCH_AXES = ("replica_dcn", "data", "expert")


def rack_mesh(racks: int = 2, per_rack: int = 4):
    """8 simulated devices as racks x GPUs, explicit axes (replica_dcn, data, expert, model)."""
    import numpy as np
    from jax.sharding import AxisType, Mesh

    devices = np.array(jax.devices()[: racks * per_rack]).reshape(racks, 1, per_rack, 1)
    return Mesh(devices, ("replica_dcn", "data", "expert", "model"), axis_types=(AxisType.Explicit,) * 4)


def arithmetic_sequences(n: int, *, seq_len: int, vocab: int, seed: int, delay_per_item: float = 0.0):
    """A learnable dataset: each sequence counts up by 3 from a random start (mod vocab)."""
    import asyncio

    import numpy as np
    from levanter.data.dataset import ListAsyncDataset

    starts = np.random.RandomState(seed).randint(0, vocab, n)
    items = [
        {
            "input_ids": ((s + 3 * np.arange(seq_len)) % vocab).astype(np.int32),
            "segment_ids": np.zeros(seq_len, np.int32),
        }
        for s in starts
    ]

    class Throttled(ListAsyncDataset):
        """Reads slowly, so that a test can kill a run in the middle."""

        async def get_batch(self, indices):
            await asyncio.sleep(delay_per_item * len(indices))
            return await super().get_batch(indices)

    return Throttled(items) if delay_per_item else ListAsyncDataset(items)


def standin_inputs(
    lm: StandinLM | None = None, *, seq_len: int = 64, delay_per_item: float = 0.0, use_wandb: bool = True
):
    from keel.train.config import TransportPhase
    from keel.train.loop import LoopInputs

    lm = lm or StandinLM()
    return LoopInputs(
        lm=lm,
        mesh=rack_mesh(),
        batch_axes=BATCH_AXES,
        train_data=arithmetic_sequences(512, seq_len=seq_len, vocab=lm.vocab, seed=0, delay_per_item=delay_per_item),
        val_data={"held_out": arithmetic_sequences(32, seq_len=seq_len, vocab=lm.vocab, seed=1)},
        default_transport=TransportPhase(0, "fixed_all_to_all"),
        use_wandb=use_wandb,
        fetch_batches=1 if delay_per_item else 8,
    )


def loop_inputs(*, seq_len: int = 64, delay_per_item: float = 0.0, use_wandb: bool = True):
    from keel.train.config import TransportPhase
    from keel.train.loop import LoopInputs

    mesh = rack_mesh()
    return LoopInputs(
        lm=micro_lm(mesh),
        mesh=mesh,
        batch_axes=BATCH_AXES,
        train_data=arithmetic_sequences(512, seq_len=seq_len, vocab=MICRO.vocab_size, seed=0, delay_per_item=delay_per_item),
        val_data={"held_out": arithmetic_sequences(32, seq_len=seq_len, vocab=MICRO.vocab_size, seed=1)},
        default_transport=TransportPhase(0, "fixed_all_to_all"),
        use_wandb=use_wandb,
        fetch_batches=1 if delay_per_item else 8,
    )
