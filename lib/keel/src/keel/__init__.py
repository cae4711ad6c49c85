"""keel: declare a graph of steps in one Python file; keel plans, caches and runs it."""

from keel.executor.resources import Resources
from keel.executor.step import External, Step, execution_only, output_of, this_output

__all__ = ["External", "Resources", "Step", "execution_only", "main", "output_of", "this_output"]


def main(steps, argv=None):
    """The experiment file's command line: `python EXP.py run|plan|status|gc [options]`."""
    from keel.cli import experiment_main

    return experiment_main(steps, argv)
