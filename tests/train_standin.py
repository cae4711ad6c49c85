"""Model, mesh and data for the training tests: `MICRO`, a micro keel MoE with every hero feature
on, trained on 8 simulated devices as 2 racks x 4 over a learnable in-memory token stream
(`loop_inputs` puts them together for `keel.train.loop.train`)."""

from __future__ import annotations

import jax

from keel.spec import Balancing, ConvSite, MoELMConfig, Routing

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


def micro_lm(mesh, model: MoELMConfig = MICRO):
    from keel.train.lm import KeelLM

    return KeelLM(model, mesh)


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


def micro_plan(config, model: MoELMConfig = MICRO, expert_parallel: int = 4):
    """The resolved run of `model` (`MICRO`) trained with `config` on 2 racks x 4 (expert parallel 4)."""
    from keel import External
    from keel.spec import RackTopology
    from keel.spec.resolved import resolve
    from keel.spec.train import TrainStepConfig

    topology = RackTopology(racks=2, gpus_per_rack=4, expert_parallel=expert_parallel)
    return resolve(TrainStepConfig(model=model, data=External("test/arithmetic", "memory://arithmetic", version="1"),
                                   train=config, topology=topology))


def loop_inputs(config, *, delay_per_item: float = 0.0, use_wandb: bool = True, model: MoELMConfig = MICRO,
                expert_parallel: int = 4):
    """What `keel.train.loop.train(config, ...)` needs to train `model` (`MICRO`) with `config` (its
    resolved run included)."""
    from keel.train.loop import LoopInputs

    mesh = rack_mesh()
    return LoopInputs(
        lm=micro_lm(mesh, model),
        mesh=mesh,
        batch_axes=BATCH_AXES,
        train_data=arithmetic_sequences(512, seq_len=config.seq_len, vocab=MICRO.vocab_size, seed=0,
                                        delay_per_item=delay_per_item),
        val_data={"held_out": arithmetic_sequences(32, seq_len=config.seq_len, vocab=MICRO.vocab_size, seed=1)},
        plan=micro_plan(config, model, expert_parallel),
        use_wandb=use_wandb,
        fetch_batches=1 if delay_per_item else 8,
    )
