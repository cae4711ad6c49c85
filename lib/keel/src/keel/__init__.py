"""keel: declare a graph of steps in one Python file; keel plans, caches and runs it."""

from keel.executor.resources import Resources
from keel.executor.step import External, Retries, Step, execution_only, output_of, this_output

__all__ = ["External", "Resources", "Retries", "Step", "execution_only", "main", "output_of", "this_output"]


def main(steps, argv=None, *, scales=None):
    """The experiment file's command line: `python EXP.py run|plan|status|gc [options]`.

    `scales` maps names to functions returning another version of the graph (e.g. the hero's CPU
    twin), selected with `--scale NAME`.
    """
    from keel.cli import experiment_main

    return experiment_main(steps, argv, scales)
