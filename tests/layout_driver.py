"""Build a training step's train state exactly as the training loop does, and run the loop's own
layout check on it, in a fresh process: `python layout_driver.py OUT WHICH [--misplace PATH]`.

WHICH is `tiny_moe` (the tutorial's training step), `twin` (the hero's CPU twin) or `randomN` (a
random hero-like model). The
driver resolves the step's declaration, builds the loop's `_Run` (initialised state, optimizer,
shardings) without training, and calls `_check_layout`, which writes `OUT/.keel/layout.json` and
raises `LayoutMismatch` on any difference from the plan. `--misplace PATH` replicates the state
array PATH on purpose (a wrong placement the check must catch). The devices are the ones the
step's declared hardware gives it (`cpu_sim`, 2 racks x 4), as a training step's process sees.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


EXPERIMENTS = {"tiny_moe": ("experiments/tutorials/tiny_moe.py", None), "twin": ("experiments/hero_535b.py", "tiny")}


def step_config(which: str):
    import random

    from defaults.hardware import cpu_sim
    from defaults.optimizers import hero_lr_law
    from keel import External
    from keel.spec import RackTopology
    from keel.spec import ConvSite
    from keel.spec import TrainConfig, TransportPhase
    from keel.spec.train import TrainStepConfig
    from model_tiny import hero_like

    racks = RackTopology(racks=2, gpus_per_rack=4, expert_parallel=4)
    data = External("test/cache", "/nowhere", version="1")
    if which in EXPERIMENTS:
        from keel.cli import load_experiment

        path, scale = EXPERIMENTS[which]
        steps = load_experiment(os.path.join(os.path.dirname(HERE), path), scale)
        return next(s for s in steps if s.name.startswith("train/")).config
    else:
        rng = random.Random(int(which.removeprefix("random")))
        model = hero_like(num_layers=rng.choice([1, 2]), tie_embeddings=rng.random() < 0.3,
                          embed_norm=rng.random() < 0.5, gated_norm_rank=rng.choice([0, 4]),
                          conv_sites=tuple(s for s in ConvSite if rng.random() < 0.5),
                          latent_dim=rng.choice([None, 16]), num_shared_experts=rng.choice([0, 1, 2]),
                          hidden_dim=rng.choice([32, 48]), max_seq_len=16)
    train = TrainConfig(batch_size=16, seq_len=16, num_steps=10,
                        optimizer=hero_lr_law.optimizer(),
                        transports=(TransportPhase(0, "fixed_all_to_all"),))
    return TrainStepConfig(model=model, data=data, train=train, topology=racks, hardware=cpu_sim)


def main(out: str, which: str, misplace: str | None) -> None:
    from concurrent.futures import Future

    from defaults.hardware import cpu_sim

    os.environ.update(cpu_sim.process_env(8))
    import jax

    from keel.mesh.mesh import build_mesh
    from keel.spec.topology import BATCH_AXES
    from keel.spec.resolved import resolve
    from keel.train import compile_ahead, layout
    from keel.train.lm import KeelLM
    from keel.train.loop import LoopInputs, _Run

    config = step_config(which)
    plan = resolve(config)
    if misplace:
        planned = layout.planned_shardings

        def wrong(run, state, mesh):
            shardings = planned(run, state, mesh)
            paths = layout.state_paths(state)
            flat = [jax.sharding.NamedSharding(mesh, jax.P(), memory_kind=s.memory_kind) if p == misplace else s
                    for p, s in zip(paths, jax.tree.leaves(shardings))]
            return jax.tree.unflatten(jax.tree.structure(shardings), flat)

        layout.planned_shardings = wrong
    # The layout is the state's, not the step's: leave the loop's first training step uncompiled
    # (queued, never run) instead of compiling it on a background thread for a run this driver never
    # trains. The state's init no longer waits behind that compile (~30 s of XLA:CPU per case).
    compile_ahead.Compiler.ahead = lambda self, what, *job: compile_ahead.Pending(what, Future(), ahead=True)
    mesh = build_mesh(config.topology)
    inputs = LoopInputs(lm=KeelLM(config.model, mesh, remat=config.train.remat), mesh=mesh, batch_axes=BATCH_AXES,
                        train_data=None, val_data={}, plan=plan, use_wandb=False)
    with jax.set_mesh(mesh):
        run = _Run(plan.config.train, inputs, out)  # the resolved run's (its law's rates filled in)
        from keel.train.progress import Progress

        run.progress = Progress("layout", 0, config.train.num_steps, enabled=False)
        run._check_layout(run.start, "start")


if __name__ == "__main__":
    args = sys.argv[1:]
    flag = args.index("--misplace") if "--misplace" in args else None
    main(args[0], args[1], args[flag + 1] if flag is not None else None)
