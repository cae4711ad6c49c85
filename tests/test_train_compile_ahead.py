"""Compiling ahead: the loop compiles each training step from the state's declared shapes and
shardings before the state exists, and that abstract state is exactly the live one (in every
layout the run will use), so the executable compiled ahead is the one the loop runs."""

import jax
import jax.numpy as jnp
import pytest

from keel.spec.train import AdamWConfig, HostOffload, TrainConfig, TransportPhase

pytestmark = pytest.mark.slow

BASE = dict(batch_size=16, seq_len=64, eval_every=4, eval_batches=1, num_steps=6, optimizer=AdamWConfig(lr=1e-2),
            rolling_checkpoint_minutes=None)


def _run(tmp_path, **fields):
    from train_standin import loop_inputs

    from keel.train.loop import _Run

    config = TrainConfig(**BASE, **fields)
    inputs = loop_inputs(config, use_wandb=False)
    with jax.set_mesh(inputs.mesh):
        return _Run(config, inputs, str(tmp_path / "tiny_ahead-0123abcd89"))


def _described(tree):
    return jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), tree)


def test_the_state_compiled_against_is_the_live_state_in_every_layout(tmp_path):
    from keel.train import offload

    offload_until_3 = HostOffload(master_weights_until_step=3, optimizer_state=True)
    run = _run(tmp_path, host_offload=offload_until_3,
               transports=(TransportPhase(0, "fixed_all_to_all"), TransportPhase(3, "ring")))
    first = (TransportPhase(0, "fixed_all_to_all"), offload.layout_at(offload_until_3, 0))
    assert list(run._step_fns) == [first] and run._step_fns[first].ahead  # submitted before the state existed
    assert run.layout == first[1] and run.layout.on_host == ("master_weights", "optimizer_state")
    for step in (0, 3):
        run._place(step)
        declared = compile_ahead_state(run, offload.layout_at(offload_until_3, step))
        assert _described(declared) == _described(run.state_arrays), step
    assert run._next_change(0) == 3 and run._next_change(3) is None
    with jax.set_mesh(run.inputs.mesh):
        run._step_fns[first].get()  # the background compile finished, without error


def compile_ahead_state(run, layout):
    from keel.train import compile_ahead, offload

    return compile_ahead.abstract(run.state_shapes, offload.shardings(run.state_shapes, layout))


def test_a_compile_that_fails_in_the_background_fails_where_the_function_is_used():
    from keel.train.compile_ahead import Compiler
    from train_standin import rack_mesh

    compiler = Compiler(rack_mesh())
    pending = compiler.ahead("a mismatched matmul", jax.jit(jnp.dot), jax.ShapeDtypeStruct((2, 3), jnp.float32),
                             jax.ShapeDtypeStruct((4, 5), jnp.float32))
    with pytest.raises(TypeError, match="dot_general requires contracting dimensions to have the same shape"):
        pending.get()
    assert pending.waited is not None and pending.ahead
