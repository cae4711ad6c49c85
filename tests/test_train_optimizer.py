"""Optimizer groups, the learning-rate schedule and the scheduled weight-decay change."""

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jaxprs import equations
from model_tiny import compiled_init, hero_like

from defaults.models import tiny_moe
from keel.spec import GroupedOptimizerConfig, ScheduleConfig, TrainConfig, WeightDecayChange
from keel.spec.matrices import matrix_axes
from keel.train.optimizer import Optimizer, lr_schedule, optimizer_labels, param_paths

HERO_GROUPS = {  # the model's leaf paths (Stacked layers under `layers.stacked`)
    "layers.stacked.attn.q": "muonh", "layers.stacked.attn.o": "muonh", "layers.stacked.moe.experts.gate": "muonh",
    "layers.stacked.moe.experts.down": "muonh", "layers.stacked.shared.up": "muonh",
    "layers.stacked.moe.latent_down": "muonh", "layers.stacked.moe.latent_up": "muonh",
    "layers.stacked.attn_norm.gated.down": "muonh", "final_norm.gated.up": "muonh", "embed_norm.gated.down": "muonh",
    "lm_head": "adamh",
    "embedding": "adam", "layers.stacked.moe.router": "adam", "layers.stacked.attn.gate": "adam",
    "final_norm.norm.weight": "adam", "layers.stacked.attn.conv_key.kernel": "adam",
    "layers.stacked.conv_moe_output.kernel": "adam", "layers.stacked.moe.latent_norm.weight": "adam",
    "layers.stacked.moe.router_bias": "frozen",
}


def test_hero_groups_put_every_model_parameter_where_the_hero_trains_it():
    from keel.model.transformer import init_model

    config = GroupedOptimizerConfig(muon_lr=1e-2, adam_lr=1e-3)
    params = jax.eval_shape(lambda: init_model(tiny_moe, jax.random.PRNGKey(0)))
    labels = dict(zip(jax.tree.leaves(param_paths(params)), jax.tree.leaves(optimizer_labels(config, params))))
    assert len(labels) == len(tiny_moe.parameter_axes())
    for path, group in HERO_GROUPS.items():
        assert labels[path] == group, path
    muonh = {p for p, g in labels.items() if g == "muonh"}
    assert len(muonh) == 4 + 3 + 3 + 2 + 2 * 4  # q/k/v/o, experts, shared, latent projections, 4 GatedNorms


def test_schedule_warms_up_then_decays_linearly_to_its_fraction():
    lr = lr_schedule(2.0, 100, warmup_fraction=0.1, min_lr_ratio=0.05)
    assert float(lr(0)) == 0.0
    assert float(lr(10)) == pytest.approx(2.0)
    assert float(lr(55)) == pytest.approx((2.0 + 0.1) / 2, rel=1e-5)
    assert float(lr(100)) == pytest.approx(0.1)


def test_adamw_decays_matrices_and_no_norm_gain_or_bias_of_any_layer():
    from keel.model.transformer import init_model
    from keel.spec import AdamWConfig
    from keel.train.loop import _params

    # every parameter one (the init's zero gates and router bias would not move under any decay)
    shapes = _params(jax.eval_shape(lambda: init_model(hero_like(), jax.random.PRNGKey(0))))
    params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), shapes)
    train = TrainConfig(batch_size=1, seq_len=1, num_steps=10, schedule=ScheduleConfig(0.0, 1.0),
                        optimizer=AdamWConfig(lr=0.1, weight_decay=0.5))
    tx = Optimizer(train, params).transform()
    updates, _ = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), jax.jit(tx.init)(params), params)
    moved = {path: bool(jnp.any(u != 0)) for path, u in zip(jax.tree.leaves(param_paths(params)), jax.tree.leaves(updates))}
    vectors = [p for p in moved if p.endswith("norm.weight") or p.endswith("router_bias")]
    assert {"layers.stacked.attn_norm.norm.weight", "final_norm.norm.weight", "layers.stacked.moe.router_bias"} <= set(vectors)
    assert not any(moved[p] for p in vectors), [p for p in vectors if moved[p]]  # [layers, embed] is a gain per layer
    assert all(moved[p] for p in ("layers.stacked.attn.q", "layers.stacked.moe.router", "layers.stacked.moe.experts.gate",
                                  "embedding", "lm_head"))


def test_weight_decay_change_hits_named_groups_from_its_step_and_the_router_bias_never_moves():
    params = {
        "layers": {"attn": {"gate": jnp.ones((4, 2)), "q": jnp.ones((4, 4))},
                   "moe": {"router": jnp.ones((4, 3)), "router_bias": jnp.ones((3,))}},
        "embedding": jnp.ones((5, 4)),
    }
    train = TrainConfig(batch_size=1, seq_len=1, num_steps=10, schedule=ScheduleConfig(0.0, 1.0),
                        optimizer=GroupedOptimizerConfig(muon_lr=0.1, adam_lr=0.5),
                        weight_decay_change=WeightDecayChange(start_step=2, peak=0.4))
    tx = Optimizer(train, params).transform()
    state = tx.init(params)
    zero = jax.tree.map(jnp.zeros_like, params)
    history = []
    for _ in range(4):
        updates, state = tx.update(zero, state, params)
        params = optax.apply_updates(params, updates)
        history.append(jax.tree.map(lambda x: float(x.ravel()[0]), params))
    gate = [h["layers"]["attn"]["gate"] for h in history]
    assert gate[:2] == [1.0, 1.0]  # steps 0 and 1: no decay yet
    assert gate[2] == pytest.approx(1.0 - 0.5 * 0.4 * (1 - 2 / 10))  # adam lr x peak x (1 - step / steps)
    assert gate[3] == pytest.approx(gate[2] * (1.0 - 0.5 * 0.4 * (1 - 3 / 10)))
    assert [h["layers"]["moe"]["router"] for h in history] == gate
    for untouched in (("layers", "attn", "q"), ("embedding",), ("layers", "moe", "router_bias")):
        value = history[-1]
        for key in untouched:
            value = value[key]
        assert value == 1.0, untouched

    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.3), params)
    updates, _ = tx.update(grads, state, params)
    assert np.all(np.asarray(updates["layers"]["moe"]["router_bias"]) == 0)


# MuonH on logical matrices. Rectangular matrices (q [32, 2*8], an expert [16, 8], ...), so that
# Gaussian gradients are well conditioned and their Newton-Schulz image lands in its band.
MUONH_MODEL = hero_like(num_heads=2, head_dim=8, num_kv_heads=1, expert_dim=8)
LOGICAL = {  # parameter -> (its leaf, the axes its logical matrices are made of: stack, rows, cols)
    "q": (lambda m: m.layers.stacked.attn.q, ("layers",), ("embed",), ("heads", "head_size")),
    "k": (lambda m: m.layers.stacked.attn.k, ("layers",), ("embed",), ("kv_heads", "head_size")),
    "o": (lambda m: m.layers.stacked.attn.o, ("layers",), ("heads", "head_size"), ("embed",)),
    "experts.gate": (lambda m: m.layers.stacked.moe.experts.gate, ("layers", "experts"), ("latent",), ("expert_mlp",)),
    "experts.down": (lambda m: m.layers.stacked.moe.experts.down, ("layers", "experts"), ("expert_mlp",), ("latent",)),
    "shared.down": (lambda m: m.layers.stacked.shared.down, ("layers", "shared_experts"), ("shared_mlp",), ("embed",)),
    "latent_down": (lambda m: m.layers.stacked.moe.latent_down, ("layers",), ("embed",), ("latent",)),
    "attn_norm.gated.down": (lambda m: m.layers.stacked.attn_norm.gated.down, ("layers",), ("embed",), ("gate_rank",)),
    "attn_norm.gated.up": (lambda m: m.layers.stacked.attn_norm.gated.up, ("layers",), ("gate_rank",), ("embed",)),
    "final_norm.gated.up": (lambda m: m.final_norm.gated.up, (), ("gate_rank",), ("embed",)),
}


def _matrices(x, stack, rows, cols) -> np.ndarray:
    """x as [matrices, rows, cols]: its stack axes flattened, each side's axes flattened."""
    x = x.rearrange((*stack, *rows, *cols))
    sizes = [x.resolve_axis(n).size for n in (*stack, *rows, *cols)]
    rows_size, cols_size = int(np.prod(sizes[len(stack):len(stack) + len(rows)])), int(np.prod(sizes[len(stack) + len(rows):]))
    return np.asarray(x.array, np.float64).reshape(-1, rows_size, cols_size)


def _muonh_step(model, mesh=None):
    """(params, one grouped-optimizer update) on fixed Gaussian gradients at a constant muon_lr of 1e-2."""
    params = eqx.filter(model, eqx.is_inexact_array)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    grads = jax.tree.unflatten(tree, [jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])
    if mesh is not None:
        grads = jax.tree.map(lambda g, p: jax.device_put(g, p.sharding), grads, params)
    # Newton-Schulz in fp32 here: the sharded and unsharded updates are compared to 1e-4, which bf16
    # (the hero's, and the default) does not hold across two summation orders.
    train = TrainConfig(batch_size=1, seq_len=1, num_steps=10, schedule=ScheduleConfig(0.0, 1.0),
                        optimizer=GroupedOptimizerConfig(muon_lr=1e-2, adam_lr=1e-3, newton_schulz_dtype="float32"))
    tx = Optimizer(train, params).transform()
    updates, _ = jax.jit(tx.update)(grads, jax.jit(tx.init)(params), params)
    return params, updates


@pytest.fixture(scope="module")
def muonh_step():
    return _muonh_step(compiled_init(MUONH_MODEL, jax.random.PRNGKey(0)))


def test_muonh_matrices_are_found_from_the_axis_names():
    from keel.model.transformer import init_model

    model = jax.eval_shape(lambda: init_model(MUONH_MODEL, jax.random.PRNGKey(0)))
    for name, (leaf, stack, rows, cols) in LOGICAL.items():
        found = tuple(tuple(ax.name for ax in side) for side in matrix_axes(leaf(model).axes))
        assert found == (stack, rows, cols), name
    with pytest.raises(ValueError, match="1 matrix sides"):
        matrix_axes(model.layers.stacked.attn_norm.norm.weight.axes)  # a gain [layers, embed] is no matrix


@pytest.mark.parametrize("shape,dtype", [((24, 40), jnp.bfloat16), ((40, 24), jnp.bfloat16), ((3, 16, 16), jnp.float32)])
def test_newton_schulz_is_levanters_quintic_iteration_step_by_step(shape, dtype):
    """keel's loop over the coefficient table gives, bit for bit, Levanter's own unrolled iteration
    (`zeropower_via_newtonschulz5`, whose sharding constraint applies only under a mesh: none here)."""
    from levanter.optim.util import zeropower_via_newtonschulz5

    from keel.train.muonh import _newton_schulz

    def levanters(x):
        return zeropower_via_newtonschulz5(x, steps=7, eps=1e-7, coefficient_type="quintic")

    def keels(x):
        return _newton_schulz(x, 7, 1e-7)

    x = jax.random.normal(jax.random.key(1), shape).astype(dtype)
    batched = len(shape) == 3
    got = jax.jit(jax.vmap(keels) if batched else keels)(x)
    want = jax.jit(jax.vmap(levanters) if batched else levanters)(x)
    assert got.dtype == want.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LOGICAL))
def test_muonh_orthogonalises_each_logical_matrix_and_keeps_its_norm(muonh_step, name):
    params, updates = muonh_step
    leaf, *axes = LOGICAL[name]
    before, delta = _matrices(leaf(params), *axes), _matrices(leaf(updates), *axes)
    after = _matrices(leaf(optax.apply_updates(params, updates)), *axes)
    singular = np.linalg.svd(delta, compute_uv=False)  # the step is lr x the polar factor, up to O(lr^2)
    ratio = singular.max(axis=1) / singular.min(axis=1)
    print(name, "singular value max/min per matrix:", np.round(ratio, 3))
    assert np.all(ratio < 2)
    norms_before, norms_after = np.linalg.norm(before, axis=(1, 2)), np.linalg.norm(after, axis=(1, 2))
    np.testing.assert_allclose(norms_after, norms_before, rtol=1e-5)


@pytest.mark.slow
def test_muonh_moves_the_norms_of_rows_and_heads(muonh_step):
    """Orthogonalising per [heads, head_size] slice froze each input row of q and each head of o."""
    params, updates = muonh_step
    after = optax.apply_updates(params, updates)
    attn, new = params.layers.stacked.attn, after.layers.stacked.attn

    def norms(x, axis):
        return np.sqrt(np.asarray(hax.sum(hax.square(x), axis=axis).array))

    for old, moved, axis in ((attn.q, new.q, ("heads", "head_size")), (attn.o, new.o, ("head_size", "embed"))):
        assert np.abs(norms(moved, axis) / norms(old, axis) - 1).max() > 1e-4  # per-slice: ~1e-7 (rounding)


@pytest.mark.slow
def test_muonh_step_is_the_same_on_the_rack_mesh(muonh_step):
    """FSDP and expert splits gather each logical matrix whole: sharded and unsharded steps agree."""
    from keel.spec import RackTopology
    from keel.mesh.mesh import build_mesh, shard_model, use_mesh

    mesh = build_mesh(RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4))
    with use_mesh(mesh):
        model = shard_model(compiled_init(MUONH_MODEL, jax.random.PRNGKey(0)), mesh)
        _, updates = _muonh_step(model, mesh)
    for name, (leaf, *_) in LOGICAL.items():
        sharded, plain = leaf(updates), leaf(muonh_step[1])
        assert sharded.array.sharding.spec == leaf(model).array.sharding.spec, name
        np.testing.assert_allclose(np.asarray(sharded.array), np.asarray(plain.array), rtol=1e-4, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("newton_schulz_batch", [GroupedOptimizerConfig.newton_schulz_batch, 0])
def test_newton_schulz_batches_parameters_and_holds_no_more_than_the_plan_says(newton_schulz_batch):
    """MuonH orthogonalises matrices of one shape and layout in shared loops, each carrying at most
    `ResolvedRun.newton_schulz_bytes_per_device` (the x of the plan's `newton_schulz_loop`), and
    every logical matrix goes through exactly one loop. With the default `newton_schulz_batch` tiny_moe's matrices of a shape and
    layout all share one loop; with 0 a loop holds at most the largest MuonH parameter gathered
    whole on a device, so groups split, and the largest loop is exactly the plan's figure. Read
    from the update the loop's optimizer traces on tiny_moe's parameters placed as its resolved run
    plans them."""
    import dataclasses
    import math

    from keel import External
    from keel.mesh.mesh import build_mesh, use_mesh
    from keel.model.transformer import init_model
    from keel.spec import RackTopology
    from keel.spec.resolved import resolve
    from keel.spec.train import TrainStepConfig
    from keel.train.layout import planned_shardings
    from keel.train.loop import _params

    topology = RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4)
    train = TrainConfig(batch_size=8, seq_len=16, num_steps=10, schedule=ScheduleConfig(0.0, 1.0),
                        optimizer=GroupedOptimizerConfig(muon_lr=1e-2, adam_lr=1e-3,
                                                         newton_schulz_batch=newton_schulz_batch))
    run = resolve(TrainStepConfig(model=tiny_moe, data=External("tokens", "memory://tokens", version="1"),
                                  train=train, topology=topology))
    mesh = build_mesh(topology)
    with use_mesh(mesh):
        shapes = _params(eqx.filter_eval_shape(init_model, tiny_moe, jax.random.PRNGKey(0)))  # as the loop takes them
        placed = planned_shardings(run, {"model": shapes, "opt_state": ()}, mesh)["model"]
        params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, placed)
        optimizer = Optimizer(run.config.train, params, run)  # as the loop builds it: bounded by its resolved run
        tx = optimizer.transform(optimizer.rates_at(0))
        traced = jax.make_jaxpr(tx.update)(params, jax.eval_shape(tx.init, params), params)

    def loops(jaxpr):  # the Newton-Schulz scans: ns_steps iterations carrying the matrices in its dtype
        return [eqn.outvars[0].aval for eqn in equations(jaxpr)  # a scan returns its carry first
                if eqn.primitive.name == "scan" and eqn.params["length"] == train.optimizer.muon_ns_steps]

    def per_device_bytes(aval):
        return math.prod(aval.sharding.shard_shape(aval.shape)) * aval.dtype.itemsize

    carried = list(loops(traced.jaxpr))
    muonh = [p for p in run.parameters if p.group == "muonh"]
    assert all(aval.dtype == jnp.dtype(train.optimizer.newton_schulz_dtype) for aval in carried)
    assert max(map(per_device_bytes, carried)) <= run.newton_schulz_bytes_per_device()
    matrices = sum(int(np.prod([size for name, size in p.axes if name in ("layers", "experts", "shared_experts")]))
                   for p in muonh)
    assert sum(int(np.prod(aval.shape[:-2])) for aval in carried) == matrices
    groups = {(aval.shape[1:], aval.sharding.spec) for aval in carried}  # matrices of a shape and layout
    assert 1 < len(groups) <= len(carried) < len(muonh) == 20
    if newton_schulz_batch:
        assert len(carried) == len(groups)  # each group in one loop
    else:
        assert len(carried) > len(groups)  # groups split to stay within the largest parameter
        assert max(map(per_device_bytes, carried)) == run.newton_schulz_bytes_per_device()
        # a resolved run of a narrower model bounds its loops below this one's largest parameter
        narrower = resolve(TrainStepConfig(model=dataclasses.replace(tiny_moe, hidden_dim=tiny_moe.hidden_dim // 2),
                                           data=run.config.data, train=train, topology=topology))
        with use_mesh(mesh), pytest.raises(ValueError, match=r"more than the resolved run's .* the live layout is not"):
            mismatched = Optimizer(run.config.train, params, narrower).transform(optimizer.rates_at(0))
            jax.make_jaxpr(mismatched.update)(params, jax.eval_shape(mismatched.init, params), params)


def test_a_negative_newton_schulz_batch_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"GroupedOptimizerConfig.newton_schulz_batch=-1: give 0 or more"):
        GroupedOptimizerConfig(muon_lr=1e-2, adam_lr=1e-3, newton_schulz_batch=-1)
