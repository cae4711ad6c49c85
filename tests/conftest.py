"""Test-session environment: 8 simulated CPU devices (2 racks x 4), offline hubs and trackers,
and one machine cache folder for the session.

Set before anything imports jax, so every test sees the same simulated machine. Many tests train
the same small models (in this process, in pytest-xdist's other worker, in `keel run` children):
a program compiles once per session and later tests load it. The session's `XDG_CACHE_HOME` is a
fresh folder, so the machine's compilation cache that keel's training steps use
(`keel.train.compile_cache.machine_cache`) is the session's; in-process tests point JAX at the same
folder (`JAX_COMPILATION_CACHE_DIR`, which tests of what a user runs leave out, as they leave out
`XLA_FLAGS`: their steps find it as a user's would).
"""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
_MAKES_CACHE = "KEEL_TEST_CACHE_HOME" not in os.environ  # pytest-xdist's workers inherit the controller's
if _MAKES_CACHE:
    os.environ["KEEL_TEST_CACHE_HOME"] = os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="keel-test-cache-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

from keel.train import compile_cache  # noqa: E402 - imports jax: after the environment above is set

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", compile_cache.machine_cache())  # child processes of tests
compile_cache.configure(os.environ["JAX_COMPILATION_CACHE_DIR"])  # this one, whose jax is imported


def pytest_configure(config):
    """Each test file's CPU, subprocesses included, is listed after the durations (tests/cpu_report.py)."""
    config.pluginmanager.import_plugin("cpu_report")


def pytest_sessionfinish(session):
    """The process that made the session's cache folder removes it."""
    if _MAKES_CACHE:
        shutil.rmtree(os.environ["KEEL_TEST_CACHE_HOME"], ignore_errors=True)


FIRST = "test_tutorial_scaling_ladder.py"  # the suite's most parallel file: its rungs train two at a time


def pytest_collection_modifyitems(items):
    """The scaling ladder first, the files that mostly wait beside it, then the other slow files;
    the short ones fill the end. pytest-xdist hands each worker whole files (`--dist=loadfile`),
    by default those with the most tests first, so the end-to-end trainings, a few tests per file,
    came last: a 15.7-minute run ended on the scaling ladder's 2 minutes alone on one worker. Slow
    files first (`--no-loadscope-reorder` keeps this order) leave the short ones to fill the end.
    Files marked `waits` (2-17 CPU seconds in 6-52 s) then ran at the start beside an Iris cluster
    starting, and at the end beside each other: a core sat idle for 36 s of a 12.5-minute run
    (/proc/stat, 13 s of it in each place). Started beside the ladder, one worker waits while the
    other trains on both cores (the ladder at 1.5 cores instead of 1.4): idle 23-24 s, almost none
    of it in the first minute; the suite 12m17s against 12m39s the hour before."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    waiting_files = {item.path for item in items if item.get_closest_marker("waits")}

    def rank(item) -> int:
        if item.path.name == FIRST:
            return 0
        return 1 if item.path in waiting_files else 2 if item.path in slow_files else 3

    items.sort(key=rank)  # stable: each file's tests stay together, in order


@pytest.fixture(scope="session")
def shared_prefix(tmp_path_factory) -> str:
    """An output prefix that every test of the session shares, across pytest-xdist's workers.

    A step declared the same way in several test files is trained once, as it is across a user's
    experiments: the first launcher runs it, a concurrent one waits on its lease, later ones find it
    cached. Tests that need a step to run (not to be found cached) use their own `tmp_path`.
    """
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # parent: the session's, not older ones'
    path = shared / "shared-prefix"
    path.mkdir(exist_ok=True)
    return str(path)


@pytest.fixture(scope="session")
def readme_twin(shared_prefix):
    """The README's twin command, `keel run experiments/hero_535b.py --scale tiny`, as a user runs
    it (no XLA flags), once per session: (its CompletedProcess, its Graph). The twin's tests read
    this one run: that it ran, its phases and switches, its final checkpoint's evaluation."""
    from keel.cli import load_experiment
    from test_step_isolation import graph_as_run, keel

    hero = Path(__file__).resolve().parent.parent / "experiments" / "hero_535b.py"
    done = keel("run", str(hero), "--scale", "tiny", "--prefix", shared_prefix)
    return done, graph_as_run(load_experiment(str(hero), "tiny"), shared_prefix)


@pytest.fixture(scope="session")
def own_data(shared_prefix):
    """The README's own-data command, `keel run experiments/tutorials/own_data.py`, as a user runs it,
    once per session: (its CompletedProcess, its Graph). The tutorial's test reads what it trained
    and logged; the recovery test compares a killed and retried run of the same step with it."""
    from keel.cli import load_experiment
    from test_step_isolation import graph_as_run, keel

    tutorial = Path(__file__).resolve().parent.parent / "experiments" / "tutorials" / "own_data.py"
    done = keel("run", str(tutorial), "--prefix", shared_prefix)
    return done, graph_as_run(load_experiment(str(tutorial)), shared_prefix)
