"""keel.train: the training step (`keel.train.step.train_step`), its loop, optimizers, checkpoints
and live-layout checks.

Runtime: `TrainConfig` and the rest of what a training step declares live in `keel.spec`.
"""


def __getattr__(name: str):
    """A declaration that moved to `keel.spec` says so, instead of a bare ImportError."""
    import keel.spec

    if name in keel.spec.__all__:
        raise ImportError(f"{__name__}.{name} is a declaration: import it from keel.spec (from keel.spec import {name})")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
