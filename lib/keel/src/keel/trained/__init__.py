"""keel.trained: what to do with finished training runs: compare them, evaluate and sample checkpoints.

Step functions (their configs are declarations in `keel.spec`):
    compare_step  CompareConfig  runs' metrics -> comparison.md / .json / .png   (keel.trained.compare)
    eval_step     EvalConfig     checkpoint + token caches -> eval.json           (keel.trained.evaluate)
    sample_step   SampleConfig   checkpoint + prompts -> samples.jsonl            (keel.trained.sample)
Declare them with `defaults.default_compare`, `default_eval` and `default_sample`.
"""


def __getattr__(name: str):
    """A declaration that moved to `keel.spec` says so, instead of a bare ImportError."""
    import keel.spec

    if name in keel.spec.__all__:
        raise ImportError(f"{__name__}.{name} is a declaration: import it from keel.spec (from keel.spec import {name})")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
