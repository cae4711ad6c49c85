"""Compiling ahead: the loop compiles each training step from the state's declared shapes and
shardings before the state exists, and that abstract state is exactly the live one (in every
layout the run will use), so the executable compiled ahead is the one the loop runs."""

import jax
import jax.numpy as jnp
import pytest
from jaxprs import equations

from keel.spec.train import (AdamWConfig, GroupedOptimizerConfig, HostOffload, ScheduleConfig, TrainConfig,
                             TransportPhase, WeightDecayChange)

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


def test_the_state_compiled_against_is_the_live_state_in_every_layout(tmp_path, monkeypatch):
    """...and on CPU devices the steps compile at XLA's backend optimisation level 1 (`CPU_STEPS`),
    the initial state, which runs once, at level 0 (`run_once_options`)."""
    from keel.train import offload

    given = []
    compile_lowered = jax.stages.Lowered.compile
    monkeypatch.setattr(jax.stages.Lowered, "compile",
                        lambda self, compiler_options=None: given.append(compiler_options) or compile_lowered(self, compiler_options))
    offload_until_3 = HostOffload(master_weights_until_step=3, optimizer_state=True)
    run = _run(tmp_path, host_offload=offload_until_3,
               transports=(TransportPhase(0, "fixed_all_to_all"), TransportPhase(3, "ring")))
    first = run._program_key(TransportPhase(0, "fixed_all_to_all"), offload.layout_at(offload_until_3, 0))
    assert list(run._step_fns) == [first] and run._step_fns[first].ahead  # submitted before the state existed
    assert run.layout == first[1] and run.layout.on_host == ("master_weights", "optimizer_state")
    with jax.set_mesh(run.inputs.mesh):
        compiled = run._step_fns[first].get()  # the background compile finished, without error
    # the program compiled ahead takes the live state as it lies: each leaf's sharding and memory kind
    live = jax.tree.map(lambda x: x.sharding, run.state_arrays)
    assert jax.tree.leaves(compiled.input_shardings[0][0]) == jax.tree.leaves(live)
    for step in (0, 3):
        run._place(step)
        _, _, submitted, *_ = run._step_job(run.transport_at(step), offload.layout_at(offload_until_3, step))
        assert _described(submitted) == _described(run.state_arrays), step  # what the loop hands its compiler
    assert run._next_change(0) == 3 and run._next_change(3) is None
    # the initial state's (run_once_options) and the step's (CPU_STEPS), compiled on two threads
    assert sorted(given, key=str) == [{"xla_backend_optimization_level": 0}, {"xla_backend_optimization_level": 1}]


def _output_dtypes(jaxpr, primitive: str, shape_has: tuple) -> list:
    """The output dtypes of every `primitive` in `jaxpr` (nested jaxprs included) whose shape
    contains each size in `shape_has`."""
    return [eqn.outvars[0].aval.dtype for eqn in equations(jaxpr) if eqn.primitive.name == primitive
            and all(eqn.outvars[0].aval.shape.count(n) >= shape_has.count(n) for n in shape_has)]


def test_a_bf16_runs_training_step_takes_its_attention_softmax_in_fp32(tmp_path, monkeypatch):
    """The reference (vanilla) kernel upcasts its scores, as Levanter's `upcast_attn` does: a bf16
    softmax loses precision, and on XLA:CPU it is also what made bf16 training steps slow. Read
    from the training step the loop compiles for a bf16 run, not from a module built beside it."""
    from keel.train import compile_ahead, offload

    monkeypatch.setattr(compile_ahead.Compiler, "ahead", lambda self, what, jitted, *args: None)  # tracing is enough
    run = _run(tmp_path, compute_dtype="bfloat16")
    _, jitted, *abstract = run._step_job(run.transport_at(0), offload.Layout())
    with jax.set_mesh(run.inputs.mesh):
        traced = jitted.trace(*abstract)
    seq = BASE["seq_len"]
    softmax_exps = _output_dtypes(traced.jaxpr.jaxpr, "exp", (seq, seq))  # over the [query, key] score matrix
    assert softmax_exps and set(softmax_exps) == {jnp.dtype(jnp.float32)}
    assert run.inputs.lm.config.attention_backend.value == "vanilla"
    # while the layers compute in bf16: their matmuls over the sequence (projections, attention output)
    assert jnp.dtype(jnp.bfloat16) in _output_dtypes(traced.jaxpr.jaxpr, "dot_general", (seq,))


def test_runs_that_differ_only_in_rates_schedule_and_length_lower_to_one_training_step(tmp_path, monkeypatch):
    """The optimizer's rates are the step's inputs, not constants of its program: the points of a
    learning-rate sweep, or a longer rerun, share one compiled step through the compilation cache,
    and one program of the initial state (whose optimizer state records step 0's rates).
    Each run still steps with its own rates."""
    from keel.train import compile_ahead
    from train_standin import loop_inputs

    from keel.train.loop import _Run

    monkeypatch.setattr(compile_ahead.Compiler, "ahead", lambda self, what, jitted, *args: None)  # lowering is enough
    inits, compile_now = {}, compile_ahead.compile_now

    def recording(what, jitted, *args, **options):
        if what == "the initial state":
            inits[name] = jitted.lower(*args).as_text()
        return compile_now(what, jitted, *args, **options)

    monkeypatch.setattr(compile_ahead, "compile_now", recording)
    runs = {
        "short": dict(num_steps=6, schedule=ScheduleConfig(0.0, 0.0), weight_decay_change=WeightDecayChange(2, 0.1),
                      optimizer=GroupedOptimizerConfig(muon_lr=1e-2, adam_lr=1e-3)),
        "long": dict(num_steps=600, schedule=ScheduleConfig(0.1, 0.05), weight_decay_change=WeightDecayChange(400, 0.3),
                     optimizer=GroupedOptimizerConfig(muon_lr=3e-2, adam_lr=2e-3)),
    }
    programs, rates = {}, {}
    for name, fields in runs.items():
        config = TrainConfig(**{**BASE, **fields})
        inputs = loop_inputs(config, use_wandb=False)
        with jax.set_mesh(inputs.mesh):
            run = _Run(config, inputs, str(tmp_path / f"{name}-0123abcd89"))
            _, jitted, *args = run._step_job(run.transport_at(0), run.layout)
            programs[name] = jitted.lower(*args).as_text()
        rates[name] = run.optimizer.rates_at(3)
    assert programs["short"] == programs["long"]
    assert set(inits) == {"short", "long"} and inits["short"] == inits["long"]
    assert set(rates["short"]) == {"lr/muonh", "lr/adamh", "lr/adam", "weight_decay/muonh", "weight_decay/adamh",
                                   "weight_decay/adam"}
    assert rates["short"]["lr/adam"] == pytest.approx(1e-3 * (1 - 3 / 6))  # no warmup, decay to 0
    assert rates["long"]["lr/adam"] == pytest.approx(2e-3 * 3 / 60)  # warming up over 60 steps
    assert rates["short"]["weight_decay/adam"] == pytest.approx(rates["short"]["lr/adam"] * 0.1 * (1 - 3 / 6))
    assert rates["long"]["weight_decay/adam"] == 0.0  # before its start step


def test_the_eval_step_loads_the_evaluation_program_the_loop_compiled(tmp_path, monkeypatch):
    """The loop compiles `eval_loss_fn` through its Compiler; the eval step (keel.trained) calls the
    same function directly. With different compiler options the two are different programs and the
    eval step of a run trained here compiles its evaluation again instead of loading the run's."""
    from keel.train import compile_ahead, compile_cache

    monkeypatch.setattr(compile_ahead.Compiler, "ahead", lambda self, what, jitted, *args: None)  # no training step
    run = _run(tmp_path)
    _, jitted, *args = job = run._eval_job(run.transport_at(0), run.layout)
    with jax.set_mesh(run.inputs.mesh):
        run.compiler.now(*job).get()  # the loop's evaluation, into the session's compilation cache
        jax.clear_caches()
        _, loaded = compile_cache.hits_during(lambda: jitted.lower(*args).compile())  # as a direct call compiles it
    assert loaded == 1


def test_a_compile_that_fails_in_the_background_fails_where_the_function_is_used():
    from keel.train.compile_ahead import Compiler
    from train_standin import rack_mesh

    compiler = Compiler(rack_mesh())
    pending = compiler.ahead("a mismatched matmul", jax.jit(jnp.dot), jax.ShapeDtypeStruct((2, 3), jnp.float32),
                             jax.ShapeDtypeStruct((4, 5), jnp.float32))
    with pytest.raises(TypeError, match="dot_general requires contracting dimensions to have the same shape"):
        pending.get()
    assert pending.waited is not None and pending.ahead


def test_tracing_runs_without_the_cycle_collector_while_any_thread_traces():
    """Lowering a program holds Python's cycle collector (tiny_moe's step traced 0.35 s faster), also
    when the background worker and the main thread trace at once and one of them ends first; the
    collector runs again once neither traces."""
    import gc
    import threading

    from keel.train import compile_ahead

    both_tracing, first_done, seen = threading.Barrier(2, timeout=60), threading.Event(), {}

    def program(name: str, outlast_the_other: bool):
        def f(x):
            both_tracing.wait()
            if outlast_the_other:
                assert first_done.wait(60)
            seen[name] = gc.isenabled()
            return x + 1
        return jax.jit(f)

    def trace_first():
        compile_ahead.compile_now("first", program("first", False), jnp.zeros(3)).get()
        first_done.set()

    assert gc.isenabled()
    other = threading.Thread(target=trace_first)
    other.start()
    second = compile_ahead.compile_now("second", program("second", True), jnp.zeros(3))
    other.join(60)
    assert seen == {"first": False, "second": False}
    assert gc.isenabled() and second.get()(jnp.zeros(3)).tolist() == [1.0, 1.0, 1.0]
