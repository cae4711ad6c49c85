"""keel.trained: what to do with finished training runs: compare them, evaluate and sample checkpoints.

Only configs are imported here (no jax), so declaring these steps stays instant. Step functions:
    compare_step  CompareConfig  runs' metrics -> comparison.md / .json / .png   (keel.trained.compare)
    eval_step     EvalConfig     checkpoint + token caches -> eval.json           (keel.trained.evaluate)
    sample_step   SampleConfig   checkpoint + prompts -> samples.jsonl            (keel.trained.sample)
Declare them with `defaults.default_compare`, `default_eval` and `default_sample`.
"""

from keel.trained.config import CompareConfig, EvalConfig, SampleConfig, TrainedModel

__all__ = ["CompareConfig", "EvalConfig", "SampleConfig", "TrainedModel"]
