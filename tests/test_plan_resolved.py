"""The resolved run is the run: the planner's parameter table, placements, optimizer groups and
transport capacities are what the trainer instantiates, places, optimizes and dispatches with.

Each check compares the jax-free `keel.spec.resolved.resolve` against live objects on the 2 x 4
rack mesh: the model's real leaves, the arrays' shardings, the optimizer's own state, and the
capacity the MoE kernel is called with.
"""

import dataclasses
import random

import haliax as hax
import jax
import optax
import pytest
from model_tiny import hero_like

from defaults.models import tiny_moe
from keel import External
from keel.spec import AdamWConfig, ConvSite, GroupedOptimizerConfig, RackTopology, TrainConfig, TransportPhase
from keel.mesh.mesh import build_mesh
from keel.spec.resolved import resolve
from keel.spec.train import TrainStepConfig
from keel.train.lm import KeelLM
from keel.train.optimizer import Optimizer, param_paths

RACKS = RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4)
CACHE = External("test/cache", "/nowhere")


def _random_configs(n: int, seed: int = 7):
    rng = random.Random(seed)
    for _ in range(n):
        yield hero_like(
            num_layers=rng.choice([1, 2, 3]),
            tie_embeddings=rng.random() < 0.3,
            embed_norm=rng.random() < 0.5,
            gated_norm_rank=rng.choice([0, 4]),
            attention_gate=rng.random() < 0.5,
            conv_sites=tuple(s for s in ConvSite if rng.random() < 0.5),
            latent_dim=rng.choice([None, 16]),
            num_shared_experts=rng.choice([0, 1, 2]),
            hidden_dim=rng.choice([32, 48]),
            **rng.choice([{}, dict(balancing="aux_loss", aux_loss_coef=0.01, routing="softmax_topk", routing_renorm_sum=1.0)]),
        )


def _twin_model():
    from keel.cli import load_experiment

    steps = load_experiment("experiments/hero_535b.py", "tiny")
    return next(s for s in steps if s.name.startswith("train/")).config.model


def _step_config(model, optimizer=None):
    train = TrainConfig(batch_size=16, seq_len=16, num_steps=10,
                        optimizer=optimizer or GroupedOptimizerConfig(muon_lr=1e-2, adam_lr=1e-3))
    return TrainStepConfig(model=model, data=CACHE, train=train, topology=RACKS)


def _params(model_config):
    """The model's parameters (shapes) as the optimizer is built on them."""
    import equinox as eqx

    from keel.model.transformer import init_model

    return eqx.filter_eval_shape(init_model, model_config, jax.random.PRNGKey(0))


MODELS = {"tiny_moe": lambda: tiny_moe, "twin": _twin_model,
          **{f"random{i}": (lambda c=c: c) for i, c in enumerate(_random_configs(4))}}


@pytest.mark.parametrize("which", list(MODELS))
def test_the_parameter_table_is_the_models_leaves_by_their_real_paths_and_axes(which):
    """(Where each leaf lives is checked on the state the loop trains: test_train_layout.py.)"""
    model_config = MODELS[which]()
    run = resolve(_step_config(model_config))
    is_named = lambda x: isinstance(x, hax.NamedArray)  # noqa: E731
    params = _params(model_config)
    live = dict(zip(jax.tree.leaves(param_paths(params)), jax.tree.leaves(params, is_leaf=is_named)))
    assert [p.path for p in run.parameters] == list(live), "the same leaves, by their real paths"
    for p in run.parameters:
        assert tuple((ax.name, ax.size) for ax in live[p.path].axes) == p.axes, p.path


def test_the_planners_optimizer_groups_are_the_optimizers_own():
    config = _step_config(tiny_moe)
    run = resolve(config)
    params = _params(tiny_moe)
    tx = Optimizer(config.train, params).transform()
    state = jax.eval_shape(tx.init, params)
    paths = jax.tree.leaves(param_paths(params))

    def holders(tree) -> set[str]:  # the parameters a group keeps state for (others are MaskedNode)
        leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, (optax.MaskedNode, hax.NamedArray)))
        return {path for path, leaf in zip(paths, leaves) if not isinstance(leaf, optax.MaskedNode)}

    inner = state.inner_states
    assert holders(inner["muonh"].inner_state.momentum) == {p.path for p in run.parameters if p.group == "muonh"}
    assert holders(inner["adam"].inner_state[0].mu) == {p.path for p in run.parameters if p.group == "adam"}
    assert {p.path for p in run.parameters if not p.trained} == {"layers.stacked.moe.router_bias"}
    assert {p.path for p in run.parameters if p.group == "adamh"} == {"lm_head"}


def test_adamw_puts_everything_but_the_router_bias_in_one_group():
    run = resolve(_step_config(tiny_moe, AdamWConfig(lr=1e-3)))
    assert {p.group for p in run.parameters} == {"adamw", "frozen"}


def _kernel_calls(monkeypatch, model_config, phase: TransportPhase):
    """Trace the loss with the TransportSpec the training loop hands the model for `phase` (the
    resolved run's), recording what reaches grug's kernel (the platform check is lifted:
    ragged_all_to_all only traces here, XLA:CPU cannot run it)."""
    import types

    import jax.numpy as jnp
    import numpy as np

    import keel.model.transports as transports

    config = dataclasses.replace(_step_config(model_config), train=dataclasses.replace(
        _step_config(model_config).train, transports=(phase,)))
    planned = resolve(config).transports[0]
    seen = []
    no_drops = types.SimpleNamespace(dropped=jnp.zeros((), jnp.int32))
    monkeypatch.setattr(transports, "check_transport_supported", lambda *a: None)
    monkeypatch.setattr(transports, "moe_mlp", lambda x, *a, **kw: seen.append(kw) or (x, no_drops))
    mesh = build_mesh(RACKS)
    lm = KeelLM(model_config, mesh)
    rng = np.random.default_rng(0)
    batch = {"input_ids": jnp.asarray(rng.integers(0, model_config.vocab_size, (16, 16)), jnp.int32),
             "segment_ids": jnp.zeros((16, 16), jnp.int32)}
    with jax.set_mesh(mesh):
        model = jax.eval_shape(lm.init, jax.random.PRNGKey(0))  # tracing needs shapes, not values
        batch = jax.device_put(batch, jax.sharding.NamedSharding(mesh, jax.P(("replica_dcn", "data", "expert"), None)))
        jax.eval_shape(lambda m, b: lm.loss(m, b, transport=planned.spec, z_loss=0.0, compute_dtype=jnp.float32),
                       model, batch)
    return seen, planned


@pytest.mark.parametrize("declared", [None, 1.4])
def test_the_pooled_capacity_that_reaches_the_transport_is_the_declared_one(monkeypatch, declared):
    model_config = hero_like(capacity_factor=1.15, max_seq_len=16)
    phase = TransportPhase(0, "fixed_pooled_all_to_all", capacity_factor=declared, num_waves=2)
    seen, planned = _kernel_calls(monkeypatch, model_config, phase)
    assert planned.capacity_factor == (declared or 1.15)
    assert seen and {kw["pooled_transport_capacity_factor"] for kw in seen} == {planned.capacity_factor}
    assert {kw["num_expert_waves"] for kw in seen} == {2}


def test_the_ragged_receiver_capacity_is_declared_once_and_reaches_the_kernel(monkeypatch):
    """The hero's ragged all-to-all runs with a receiver capacity of 1.15 (drops < 0.02%): the plan
    says so and the kernel is handed exactly that, not a dropless 'None'."""
    model_config = hero_like(capacity_factor=1.15, max_seq_len=16)
    seen, planned = _kernel_calls(monkeypatch, model_config, TransportPhase(0, "ragged_all_to_all"))
    assert planned.capacity_factor == 1.15
    assert seen and {kw["capacity_factor"] for kw in seen} == {1.15}
    assert {kw["implementation"] for kw in seen} == {"ragged_all_to_all"}


@pytest.mark.parametrize("compute_dtype", ["bfloat16", "float32"])
def test_the_plans_all_to_all_rows_are_the_width_and_dtype_the_lowered_step_sends(monkeypatch, compute_dtype):
    """`keel plan`'s all-to-all line ("16-wide bf16 rows") names what the training step's program
    exchanges: the fixed transport's all_to_all and the ring's all_gather carry rows of the planned
    width in the run's compute dtype (a float32 run once read "bf16 rows" at float32's bytes)."""
    import re

    from train_standin import loop_inputs

    from keel.plan import facts, render
    from keel.train import compile_ahead
    from keel.train.loop import _Run

    # lowering is enough: nothing compiled ahead, no initial state computed
    monkeypatch.setattr(compile_ahead.Compiler, "ahead", lambda self, what, jitted, *args: None)
    monkeypatch.setattr(_Run, "_initial_arrays", lambda self: None)
    config = TrainConfig(batch_size=16, seq_len=64, num_steps=2, optimizer=AdamWConfig(lr=1e-2), eval_batches=0,
                         transports=(TransportPhase(0, "fixed_all_to_all"), TransportPhase(1, "ring")),
                         compute_dtype=compute_dtype)
    inputs = loop_inputs(config, use_wandb=False)
    rows = {r["transport"]: r for r in facts.all_to_all(inputs.plan)}
    element = {"bfloat16": "bf16", "float32": "f32"}[compute_dtype]
    with jax.set_mesh(inputs.mesh):
        run = _Run(config, inputs, "memory://plan-a2a/micro-0123abcd89")
        for phase, op in zip(config.transports, ("all_to_all", "all_gather")):
            row = rows[phase.transport]
            assert (row["width"], row["dtype"]) == (inputs.plan.config.model.expert_input_dim, compute_dtype)
            _, jitted, *args = run._step_job(phase, run.layout)
            sent = re.findall(rf"stablehlo\.{op}[^\n]*?: \(?tensor<((?:\d+x)+)(\w+)>", jitted.lower(*args).as_text())
            rows_sent = [dtype for shape, dtype in sent if shape.split("x")[-2] == str(row["width"])]
            assert rows_sent and set(rows_sent) == {element}, (phase.transport, sent)
    printed = render._all_to_all(list(rows.values()))
    assert all(f"{row['width']}-wide {render.SHORT_DTYPES[compute_dtype]} rows" in line for row, line in zip(rows.values(), printed))
