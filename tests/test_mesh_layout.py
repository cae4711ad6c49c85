"""The rack mesh on 8 simulated CPU devices: where experts and batches live, and layout invariance."""

import jax
import numpy as np
import pytest
from model_tiny import compiled_init, hero_like, packed_batch

from keel.spec import RackTopology, TopologyError
from keel.mesh.mesh import build_mesh, shard_batch, shard_model, use_mesh
from keel.model.loss import TokenBatch, loss_fn
from keel.spec.transports import TransportSpec

RACKS_2X4 = RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4)


def _rows_by_device(array) -> dict[int, tuple]:
    return {d.id: tuple((s.start, s.stop) for s in idx) for d, idx in array.sharding.devices_indices_map(array.shape).items()}


def test_racks_are_contiguous_device_blocks():
    mesh = build_mesh(RACKS_2X4)
    assert dict(mesh.shape) == {"replica_dcn": 2, "data": 1, "expert": 4, "model": 1}
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    assert ids[0].ravel().tolist() == [0, 1, 2, 3] and ids[1].ravel().tolist() == [4, 5, 6, 7]


@pytest.mark.slow
def test_expert_weights_split_inside_a_rack_and_batch_over_all_devices():
    config = hero_like()
    mesh = build_mesh(RACKS_2X4)
    ids, _ = packed_batch(config)
    with use_mesh(mesh):
        model = shard_model(compiled_init(config, jax.random.PRNGKey(0)), mesh)
        batch = shard_batch(ids, mesh)
    gate = model.layers.stacked.moe.experts.gate  # [Layers, Experts, Latent, ExpertMlp]
    print("expert weight", gate.axes, gate.array.sharding.spec)
    print("batch", batch.axes, batch.array.sharding.spec)
    assert gate.array.sharding.spec == jax.P(None, "expert", "data", None)
    where = _rows_by_device(gate.array)
    per_gpu = config.num_experts // RACKS_2X4.expert
    for device in range(4):  # the expert slice of GPU i in rack 0 is the one of GPU i in rack 1
        assert where[device][1] == (device * per_gpu, (device + 1) * per_gpu)
        assert where[device] == where[device + 4]

    assert batch.array.sharding.spec == jax.P(("replica_dcn", "data", "expert"), None)
    rows = _rows_by_device(batch.array)
    assert sorted(r[0] for r in rows.values()) == [(i, i + 1) for i in range(8)]

    q = model.layers.stacked.attn.q  # [Layers, Embed, Heads, HeadSize]: FSDP inside a rack
    assert q.array.sharding.spec == jax.P(None, ("data", "expert"), None, None)
    assert model.embedding.array.sharding.is_fully_replicated


def test_device_count_must_match_the_racks():
    with pytest.raises(TopologyError, match="gpus_per_rack"):
        build_mesh(RackTopology(racks=2, gpus_per_rack=2, expert_parallel=2))


@pytest.mark.slow
def test_loss_is_identical_across_rack_layouts():
    config = hero_like(num_layers=2)
    model = compiled_init(config, jax.random.PRNGKey(0))
    ids, seg = packed_batch(config)

    def loss(model, batch):
        return loss_fn(model, batch, z_loss=1e-4, transport=TransportSpec("ring"))[0]

    losses = {"no mesh": float(jax.jit(loss)(model, TokenBatch(ids, seg)))}
    for name, topology in {
        "2 racks x 4 (expert 4)": RACKS_2X4,
        "1 rack x 8 (expert 8)": RackTopology(racks=1, gpus_per_rack=8, expert_parallel=8),
        "data parallel only": RackTopology(racks=1, gpus_per_rack=8, expert_parallel=1),
    }.items():
        mesh = build_mesh(topology)
        with use_mesh(mesh):
            batch = TokenBatch(shard_batch(ids, mesh), shard_batch(seg, mesh))
            losses[name] = float(jax.jit(loss)(shard_model(model, mesh), batch))
    print(losses)
    assert max(losses.values()) - min(losses.values()) < 1e-5


@pytest.mark.slow
def test_the_training_step_keeps_activations_split_over_the_batch():
    """No all-gather in the compiled step of the 2 x 4 mesh carries activations (a position or a
    flattened-token dimension): norm gains, conv taps, the router bias, the flattened tokens and
    the top-k all keep the batch split (each once cost an all-gather of whole activations, see
    keel.model.layout). What is gathered are weights: FSDP-split parameters for their layer, and
    expert weights inside grug's kernel."""
    import re

    from train_standin import loop_inputs

    from keel.spec.train import AdamWConfig, TrainConfig, TransportPhase
    from keel.train.loop import _Run

    # test_train_loop's progress run trains this very program (its first phase): compiled once per session
    config = TrainConfig(batch_size=16, seq_len=64, num_steps=2, optimizer=AdamWConfig(lr=1e-2), eval_batches=0,
                         z_loss=1e-4, transports=(TransportPhase(0, "fixed_all_to_all"),))
    inputs = loop_inputs(config, use_wandb=False)
    with jax.set_mesh(inputs.mesh):
        run = _Run(config, inputs, "memory://layout/tiny_layout-0123abcd89")
        step = run._step_fns[run._program_key(TransportPhase(0, "fixed_all_to_all"), run.layout)].get()
    gathers = [line for line in step.as_text().splitlines() if re.search(r"= \S+ all-gather(-start)?\(", line)]
    activation_dims = {str(64), str(16 * 64)}  # the sequence, the flattened tokens (no weight has either)
    assert gathers, "the FSDP-split weights are gathered for compute"
    for line in gathers:
        shape = re.search(r"= \w+\[([\d,]*)\]", line).group(1)
        assert not activation_dims & set(shape.split(",")), line
