"""keel: declare a graph of steps in one Python file; keel plans, caches and runs it."""

from keel.executor.resources import Resources
from keel.executor.step import External, Retries, Step, StepFunction, execution_only, output_of, this_output

__all__ = ["External", "Resources", "Retries", "Step", "StepFunction", "execution_only", "main", "output_of", "this_output"]


def _install_script_excepthook() -> None:
    """`python EXP.py plan|run|...`: an exception the experiment file raises while it runs (a bad
    value, a typo, a keel.main given something other than steps) ends in one `keel: error:` block
    naming the file and line, exit code 2, as `keel plan EXP.py` says it; not a traceback. Only for
    a script run with a keel command (`keel.cli.script_error` says which exceptions qualify; a
    syntax error in the file itself stops Python before keel is imported)."""
    import sys

    main = sys.modules.get("__main__")
    if getattr(main, "__spec__", None) is not None or not str(getattr(main, "__file__", "")).endswith(".py"):
        return
    if sys.argv[1:2] not in (["run"], ["plan"], ["status"], ["gc"], ["compare"], ["dashboard"]):
        return
    previous = sys.excepthook

    def hook(kind, exc, tb):
        from keel.cli import script_error

        message = script_error(exc, sys.argv[0], main.__file__)
        if message is None:
            return previous(kind, exc, tb)
        import atexit
        import os

        print(f"keel: error: {message}", file=sys.stderr)
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(2)  # after an uncaught exception Python would exit 1

    sys.excepthook = hook


_install_script_excepthook()


def main(steps, argv=None, *, scales=None):
    """The experiment file's command line: `python EXP.py run|plan|status|gc [options]`.

    `scales` maps names to functions returning another version of the graph (e.g. the hero's CPU
    twin), selected with `--scale NAME`.
    """
    from keel.cli import experiment_main

    return experiment_main(steps, argv, scales)
