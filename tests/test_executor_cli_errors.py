"""Graph and command-line mistakes: one `keel: error: ...` line naming the fix, exit code 2, before any step runs."""

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

import keel
from keel import Step, output_of, this_output
from keel.cli import console_main
from keel.executor import storage
from keel.executor.graph import CycleError
from keel.executor.identity import Identities
from keel.executor.plan import Graph, plan_graph
from keel.executor.run import run_steps

HEADER = '''
import os
from dataclasses import dataclass
from typing import Optional

from keel import Step, main, output_of, this_output


@dataclass(frozen=True)
class C:
    n: int
    inputs: tuple = ()
    label: str = "x"
    checkpoint_every: int | None = 100
    retries: Optional[int] = 3
    version: str | None = None
    output_path: str = this_output()


def f(config):
    with open(os.environ["KEEL_TEST_COUNTER"], "a") as out:
        out.write(f"{config.n}\\n")
    os.makedirs(config.output_path, exist_ok=True)
    with open(os.path.join(config.output_path, "n.txt"), "w") as out:
        out.write(f"{config.n}\\n")

'''

PLAIN = 'a = Step("x/a", f, C(1))\ntop = Step("x/top", f, C(0, (output_of(a),)))\nif __name__ == "__main__":\n    main([top])\n'


@dataclass(frozen=True)
class Cfg:
    n: int
    inputs: object = ()
    output_path: str = this_output()


def noop(config):
    pass


@pytest.fixture
def counter(tmp_path, monkeypatch):
    path = tmp_path / "counter.txt"
    monkeypatch.setenv("KEEL_TEST_COUNTER", str(path))
    return path


def experiment(tmp_path, body: str) -> str:
    path = tmp_path / "exp.py"
    path.write_text(HEADER + body)
    return str(path)


def keel_error(capsys, *argv: str) -> str:
    """Run `keel ARGV` in-process; assert exit code 2 and a single error line; return that line."""
    code = console_main(list(argv))
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert "Traceback" not in out + err
    assert err.startswith("keel: error: ") and err.count("\n") == 1, err
    return err.strip()


def ran(counter) -> list[str]:
    return counter.read_text().split() if counter.exists() else []


# 1. step names


def test_two_different_steps_with_one_name_are_refused(tmp_path, capsys, counter):
    exp = experiment(tmp_path, 'a1 = Step("x/a", f, C(1))\na2 = Step("x/a", f, C(2))\ntop = Step("x/top", f, C(0, (a1, a2)))\n'
                               'if __name__ == "__main__":\n    main([top])\n')
    for command in ("run", "plan", "status"):
        line = keel_error(capsys, command, exp, "--prefix", str(tmp_path / "out"), "--set", "x/a.n=3")
        assert "two different steps are named 'x/a' (config.n: 1 -> 2)" in line and "rename one" in line
    assert ran(counter) == [] and not (tmp_path / "out").exists()


def test_one_step_declared_twice_runs_once(tmp_path, capsys, counter):
    exp = experiment(tmp_path, 'a1 = Step("x/a", f, C(1))\na2 = Step("x/a", f, C(1))\n'
                               'left = Step("x/left", f, C(2, (a1,)))\nright = Step("x/right", f, C(3, (a2,)))\n'
                               'if __name__ == "__main__":\n    main([left, right, a2])\n')
    prefix = str(tmp_path / "out")
    assert console_main(["plan", exp, "--prefix", prefix, "--json", "--set", "x/a.n=5"]) == 0
    names = [s["name"] for s in json.loads(capsys.readouterr().out)["steps"]]
    assert sorted(names) == ["x/a", "x/left", "x/right"]
    assert console_main(["run", exp, "--prefix", prefix, "--force", "x/a"]) == 0
    assert sorted(ran(counter)) == ["1", "2", "3"]


def test_same_step_object_twice_is_fine():
    a = Step("m/a", noop, Cfg(1))
    graph = Graph([Step("m/b", noop, Cfg(2, (a, output_of(a, "f")))), a], "memory://keel-same-object")
    assert [s.name for s in graph.order] == ["m/a", "m/b"]


# 2. cycles and depth


def test_step_that_depends_on_itself(tmp_path, capsys, counter):
    exp = experiment(tmp_path, 'box = []\na = Step("x/a", f, C(1, box))\nbox.append(a)\n'
                               'if __name__ == "__main__":\n    main([a])\n')
    for command in ("run", "plan"):
        line = keel_error(capsys, command, exp, "--prefix", str(tmp_path / "out"))
        assert line.startswith("keel: error: dependency cycle: x/a -> x/a;") and "remove the reference" in line
    assert ran(counter) == []


def test_cycles_through_a_mutated_list_or_with_config(tmp_path, capsys):
    exp = experiment(tmp_path, 'box = []\na = Step("x/a", f, C(1, box))\nbox.append(Step("x/b", f, C(2, (output_of(a),))))\n'
                               'if __name__ == "__main__":\n    main([a])\n')
    assert "dependency cycle: x/a -> x/b -> x/a;" in keel_error(capsys, "plan", exp, "--prefix", str(tmp_path / "out"))
    exp = experiment(tmp_path, 'box = []\na = Step("x/a", f, C(1, box))\nbox.append(a.with_config(C(2, box)))\n'
                               'if __name__ == "__main__":\n    main([a])\n')
    assert "dependency cycle: x/a -> x/a;" in keel_error(capsys, "run", exp, "--prefix", str(tmp_path / "out"))


def test_cycle_hidden_from_memoised_deps_is_still_caught():
    box: list = []
    a = Step("m/a", noop, Cfg(1, box))
    assert a.deps == ()  # computed before the list is mutated
    box.append(Step("m/b", noop, Cfg(2, (a,))))
    with pytest.raises(CycleError, match=r"m/a -> m/b -> m/a"):
        Identities().hash(a)


def test_deep_acyclic_chain_hashes_without_recursion():
    step = Step("deep/0", noop, Cfg(0))
    for i in range(1, 10_000):
        step = Step(f"deep/{i}", noop, Cfg(i, output_of(step)))
    assert len(Identities().hash(step)) == 10  # straight to the top: no deep recursion
    graph = Graph([step], "memory://keel-deep-chain")
    assert len(plan_graph(graph)) == 10_000


# 3. regular expressions


def test_bad_force_and_only_regex(tmp_path, capsys, counter):
    exp = experiment(tmp_path, PLAIN)
    prefix = str(tmp_path / "out")
    assert keel_error(capsys, "run", exp, "--prefix", prefix, "--force", "a[").startswith(
        "keel: error: --force 'a[': not a regular expression (unterminated character set")
    assert keel_error(capsys, "plan", exp, "--prefix", prefix, "--force", "a[").startswith("keel: error: --force 'a[': not a regular expression (")
    assert keel_error(capsys, "run", exp, "--prefix", prefix, "--only", "(x").startswith("keel: error: --only '(x': not a regular expression (")
    assert ran(counter) == []


# 4-6. the prefix


def test_unknown_prefix_scheme(tmp_path, capsys):
    exp = experiment(tmp_path, PLAIN)
    line = keel_error(capsys, "plan", exp, "--prefix", "foo://x")
    assert "--prefix foo://x: unknown storage scheme 'foo://'" in line and "gs://" in line
    assert "did you mean gs://?" in keel_error(capsys, "run", exp, "--prefix", "gss://bucket/x")


def test_prefix_under_a_file(tmp_path, capsys, counter):
    exp = experiment(tmp_path, PLAIN)
    (tmp_path / "afile").write_text("not a folder")
    for command, prefix in (("run", "afile/out"), ("plan", "afile/out"), ("status", "afile")):
        line = keel_error(capsys, command, exp, "--prefix", str(tmp_path / prefix))
        assert f"--prefix {tmp_path / prefix}: cannot read there (NotADirectoryError" in line and "pass a --prefix" in line
    assert ran(counter) == []


def test_prefix_without_write_permission(tmp_path, capsys, counter):
    exp = experiment(tmp_path, PLAIN)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        try:
            (locked / "probe").write_text("")
            pytest.skip("this user (root?) can write to a mode-500 folder")
        except PermissionError:
            pass
        line = keel_error(capsys, "run", exp, "--prefix", str(locked / "out"))
        assert "cannot write there (PermissionError" in line and "can read and write" in line
        assert console_main(["plan", exp, "--prefix", str(locked / "out")]) == 0  # plan only reads
    finally:
        locked.chmod(0o700)
    assert ran(counter) == []


def test_plan_writes_nothing_and_run_leaves_no_probe(tmp_path, capsys, counter):
    exp = experiment(tmp_path, PLAIN)
    prefix = tmp_path / "out"
    assert console_main(["plan", exp, "--prefix", str(prefix)]) == 0 and not prefix.exists()
    assert console_main(["run", exp, "--prefix", str(prefix)]) == 0
    assert sorted(os.listdir(prefix)) == [".keel", "x"] and sorted(ran(counter)) == ["0", "1"]
    assert len(os.listdir(prefix / ".keel" / "content")) == 2  # the content index: one entry per finished step


class HangingFS(MemoryFileSystem):
    """A store that never answers, like gs:// without network: every lookup blocks until released."""

    protocol = "keelhang"
    release = threading.Event()

    def info(self, path, **kwargs):
        self.release.wait()
        raise FileNotFoundError(path)


class ReadOnlyFS(MemoryFileSystem):
    """A store that answers but refuses writes, like a bucket without write credentials."""

    protocol = "keelreadonly"

    def pipe_file(self, path, value, **kwargs):
        raise PermissionError("403 Forbidden: no write credentials")


@pytest.fixture
def fake_stores():
    fsspec.register_implementation("keelhang", HangingFS, clobber=True)
    fsspec.register_implementation("keelreadonly", ReadOnlyFS, clobber=True)
    HangingFS.release.clear()
    yield
    HangingFS.release.set()


def test_unreachable_prefix_fails_fast(tmp_path, capsys, counter, fake_stores, monkeypatch):
    monkeypatch.setattr(storage, "PROBE_TIMEOUT_S", 0.5)
    exp = experiment(tmp_path, PLAIN)
    for command in ("run", "plan"):
        start = time.monotonic()
        line = keel_error(capsys, command, exp, "--prefix", "keelhang://bucket/keel")
        assert time.monotonic() - start < 5
        assert "--prefix keelhang://bucket/keel: no answer within 0.5s" in line and "credentials" in line
    assert ran(counter) == []


def test_store_refusing_writes(tmp_path, capsys, counter, fake_stores):
    exp = experiment(tmp_path, PLAIN)
    line = keel_error(capsys, "run", exp, "--prefix", "keelreadonly://bucket/keel")
    assert "cannot write there (PermissionError: 403 Forbidden: no write credentials)" in line
    assert console_main(["plan", exp, "--prefix", "keelreadonly://bucket/keel"]) == 0
    assert ran(counter) == []


# 7. --set ...=None


def planned_config(capsys, exp, prefix, *sets):
    argv = ["plan", exp, "--prefix", prefix, "--json"] + [a for s in sets for a in ("--set", s)]
    assert console_main(argv) == 0
    return {s["name"]: s["output_path"] for s in json.loads(capsys.readouterr().out)["steps"]}


def test_set_none_on_optional_fields(tmp_path, capsys):
    from keel.executor.overrides import apply_overrides

    exp = experiment(tmp_path, PLAIN)
    base = planned_config(capsys, exp, "memory://keel-none")
    changed = planned_config(capsys, exp, "memory://keel-none", "x/a.checkpoint_every=None", "x/a.retries=None")
    assert changed["x/a"] != base["x/a"] and changed["x/top"] != base["x/top"]

    steps = keel.cli.load_experiment(exp)
    graph = Graph(steps, "memory://keel-none")
    (top,) = apply_overrides(graph.targets, graph.order, ["x/a.checkpoint_every=None", "x/a.retries=None", "x/a.label=None"])
    (a,) = top.deps
    assert a.config.checkpoint_every is None and a.config.retries is None and a.config.label == "None"


def test_set_keeps_the_text_of_an_optional_string_as_written(tmp_path):
    from keel.executor.overrides import apply_overrides

    graph = Graph(keel.cli.load_experiment(experiment(tmp_path, PLAIN)), "memory://keel-text")
    (top,) = apply_overrides(graph.targets, graph.order, ["x/a:version=1.10", "x/top:version=010", "x/a:label=yes"])
    (a,) = top.deps
    assert a.config.version == "1.10" and top.config.version == "010" and a.config.label == "yes"  # not 1.1, 8, True


def test_a_cluster_run_on_a_memory_prefix_is_refused_before_anything_runs(capsys, monkeypatch):
    monkeypatch.setenv("KEEL_TEST_COUNTER", "")
    graph = str(Path(__file__).parent / "fixtures" / "cluster_graph.py")
    line = keel_error(capsys, "run", graph, "--prefix", "memory://keel-cluster", "--cluster", "http://127.0.0.1:9")
    assert "--prefix memory://keel-cluster lives in this process's memory" in line and "count/root" in line, line


def test_set_none_on_a_field_that_refuses_it(tmp_path, capsys):
    exp = experiment(tmp_path, PLAIN)
    line = keel_error(capsys, "plan", exp, "--prefix", "memory://keel-none", "--set", "x/a.n=None")
    assert "--set x/a.n=None: field 'n' is declared int, which does not admit None" in line and "int | None" in line


# The experiment file's own command line goes through the same checks.


def test_experiment_main_reports_the_same_errors(tmp_path, capsys, counter):
    a = Step("m/a", noop, Cfg(1))
    assert keel.main([a], argv=["plan", "--force", "a["]) == 2
    assert "Traceback" not in capsys.readouterr().err
    b = Step("m/b", noop, Cfg(1, (a, Step("m/a", noop, Cfg(2)))))
    assert keel.main([b], argv=["plan", "--prefix", str(tmp_path)]) == 2
    assert "two different steps are named 'm/a'" in capsys.readouterr().err

    exp = experiment(tmp_path, PLAIN)
    proc = subprocess.run([sys.executable, exp, "run", "--prefix", "foo://x"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "unknown storage scheme 'foo://'" in proc.stderr


# `keel run --cluster` and `keel dashboard`: the machine around the command, said in one line.


def test_a_cluster_run_outside_a_project_says_so_in_one_line(tmp_path, capsys, counter, monkeypatch):
    """The workers are sent the project around the current directory: with none, one line, not a
    FileNotFoundError traceback (the controller answers: its check is stubbed)."""
    import keel.executor.cluster as cluster

    monkeypatch.setattr(cluster, "check_reachable", lambda url: None)
    monkeypatch.chdir(tmp_path)
    exp = experiment(tmp_path, PLAIN)
    line = keel_error(capsys, "run", exp, "--prefix", str(tmp_path / "out"), "--cluster", "http://127.0.0.1:9")
    assert f"no pyproject.toml at or above {tmp_path.resolve()}; run keel from inside the project" in line, line
    assert ran(counter) == []


def test_a_dashboard_on_a_port_in_use_names_another(tmp_path, capsys):
    import socket

    exp = experiment(tmp_path, PLAIN)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = keel_error(capsys, "dashboard", exp, "--prefix", str(tmp_path / "out"), "--port", str(port))
    assert f"port {port} is in use (another keel dashboard?): pass --port " in line and line.endswith(" or --port 0"), line


def test_a_dashboard_exported_refuses_a_port(tmp_path, capsys):
    """`--out` writes the page instead of serving it: a `--port` beside it would do nothing."""
    exp = experiment(tmp_path, PLAIN)
    page = tmp_path / "page"
    line = keel_error(capsys, "dashboard", exp, "--prefix", str(tmp_path / "out"), "--out", str(page), "--port", "9999")
    assert f"--port 9999 does nothing with --out {page}" in line and not page.exists(), line


def test_a_lease_timeout_no_run_can_use_is_refused_before_anything_runs(tmp_path, capsys, counter, monkeypatch):
    """KEEL_LEASE_TIMEOUT of 0 had two launchers take one step's lease from each other over and over
    (34 attempts in 50 s, none recorded); text that is no number failed keel's import in a traceback."""
    exp = experiment(tmp_path, 'top = Step("x/top", f, C(0))\nif __name__ == "__main__":\n    main([top])\n')
    done = subprocess.run([sys.executable, "-m", "keel.cli_entry", "run", exp, "--prefix", str(tmp_path / "out")],
                          env={**os.environ, "KEEL_LEASE_TIMEOUT": "abc"}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("keel: error: KEEL_LEASE_TIMEOUT='abc': give the seconds"), done.stderr
    for value in ("0", "-5", "inf", "nan"):
        monkeypatch.setenv("KEEL_LEASE_TIMEOUT", value)
        assert keel_error(capsys, "run", exp, "--prefix", str(tmp_path / "out")).startswith(f"keel: error: KEEL_LEASE_TIMEOUT='{value}'")
    assert ran(counter) == []
    monkeypatch.setenv("KEEL_LEASE_TIMEOUT", "1.5")
    assert console_main(["run", exp, "--prefix", str(tmp_path / "out")]) == 0 and ran(counter) == ["0"]
    monkeypatch.delenv("KEEL_LEASE_TIMEOUT")
    with pytest.raises(ValueError, match="lease_timeout=0: give at least 1 s"):
        run_steps([Step("x/other", noop, Cfg(1))], str(tmp_path / "out"), lease_timeout=0)


@pytest.mark.parametrize("how", ["keel", "script"])
def test_a_reader_that_stops_reading_ends_the_command_quietly(tmp_path, how):
    """`keel plan EXP | head` printed a BrokenPipeError traceback once head had what it wanted."""
    hello = str(Path(__file__).resolve().parent.parent / "experiments/tutorials/hello_world.py")
    command = ([sys.executable, "-m", "keel.cli_entry", "plan", hello] if how == "keel" else [sys.executable, hello, "plan"])
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    try:
        done = subprocess.run([*command, "--prefix", str(tmp_path / "out")], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write)
    assert done.returncode == 141 and "Traceback" not in done.stderr, done.stderr
