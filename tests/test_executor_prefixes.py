"""A prefix at a store's root (`memory://`, `gs://bucket`) plans like any other: a finished step
directly under it is cached, and an earlier run of it with another identity is stale."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from keel import Step, this_output
from keel.executor.plan import CACHED, STALE, Graph, plan_graph
from keel.executor.run import run_steps
from keel.executor.storage import write_atomic


@dataclass(frozen=True)
class Cfg:
    n: int
    output_path: str = this_output()


def make(config: Cfg) -> None:
    write_atomic(f"{config.output_path}/x.txt", str(config.n))


@pytest.fixture
def memory_root(monkeypatch):
    """An empty `memory://` store for the test (the store is one per process)."""
    monkeypatch.setattr(MemoryFileSystem, "store", {})
    monkeypatch.setattr(MemoryFileSystem, "pseudo_dirs", [""])
    return "memory://"


def test_a_finished_step_at_the_root_of_a_memory_store_is_cached(memory_root):
    step = Step(f"top-{uuid.uuid4().hex[:8]}", make, Cfg(1))
    assert run_steps([step], memory_root, echo=lambda _: None).ran == [step.name]
    [plan] = plan_graph(Graph([step], memory_root))
    assert plan.output_path.startswith(f"memory://{step.name}-")
    assert plan.state == CACHED, (plan.state, plan.reason)
    again = run_steps([step], memory_root, echo=lambda _: None)
    assert again.ran == [] and again.reused == []


def test_an_earlier_run_at_the_root_of_a_memory_store_makes_the_step_stale(memory_root):
    name = f"top-{uuid.uuid4().hex[:8]}"
    assert run_steps([Step(name, make, Cfg(1))], memory_root, echo=lambda _: None).ok
    [plan] = plan_graph(Graph([Step(name, make, Cfg(2))], memory_root))
    assert plan.state == STALE and plan.reason == "config.n: 1 -> 2", (plan.state, plan.reason)



@pytest.mark.parametrize("how", ["--prefix=~/out", "KEEL_PREFIX=~/out"])
def test_a_tilde_the_shell_left_in_a_prefix_is_the_home_folder(tmp_path, monkeypatch, how):
    """bash leaves `~` after `=` as it is; keel reads it as the user's home, not a folder named `~`."""
    from pathlib import Path

    from keel.cli import console_main

    hello = str(Path(__file__).resolve().parent.parent / "experiments/tutorials/hello_world.py")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    option, value = how.split("=", 1)
    if option == "KEEL_PREFIX":
        monkeypatch.setenv("KEEL_PREFIX", value)
    assert console_main(["run", hello] + ([how] if option == "--prefix" else [])) == 0
    assert (tmp_path / "home" / "out" / "tutorial").is_dir() and not (tmp_path / "~").exists()
