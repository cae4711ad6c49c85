"""`keel gc` deletes only what no experiment reaches: never a copy of a step's record nested inside an
output (a step that bundles its dependency's folder), never another prefix's outputs whose path a
`--prefix` with `[`, `*` or `?` would match as a pattern."""

from __future__ import annotations

from pathlib import Path

from keel.cli import console_main

EXPERIMENT = '''
from dataclasses import dataclass

import fsspec

from keel import Step, main, output_of, this_output
from keel.executor.storage import join, write_atomic


@dataclass(frozen=True)
class C:
    n: int
    output_path: str = this_output()


@dataclass(frozen=True)
class D:
    src: str
    output_path: str = this_output()


def make(c):
    write_atomic(join(c.output_path, "x.txt"), str(c.n))


def bundle(c):  # an export: the dependency's whole folder, its .keel/ record included
    fs, root = fsspec.core.url_to_fs(c.src)
    for path in fs.find(root):
        write_atomic(join(c.output_path, "model", path[len(root):]), fs.cat_file(path))


a = Step("g/a", make, C(N))
b = Step("g/bundle", bundle, D(src=output_of(a)))
if __name__ == "__main__":
    main([b])
'''


def experiment(tmp_path: Path, n: int, name: str = "exp.py", target: str = "b") -> str:
    path = tmp_path / name
    path.write_text(EXPERIMENT.replace("C(N)", f"C({n})").replace("main([b])", f"main([{target}])"))
    return str(path)


def outputs(prefix: Path) -> list[str]:
    return sorted(str(p.relative_to(prefix)).split("-")[0] for p in prefix.glob("g/*"))


def test_gc_keeps_a_record_nested_inside_a_reached_output(tmp_path, capsys):
    prefix = tmp_path / "out"
    exp = experiment(tmp_path, 1)
    assert console_main(["run", exp, "--prefix", str(prefix)]) == 0
    [bundled] = list(prefix.glob("g/bundle-*/model/.keel/step.json"))
    capsys.readouterr()
    assert console_main(["gc", exp, "--prefix", str(prefix), "--yes"]) == 0
    out = capsys.readouterr().out
    assert "-- 0 unreached output(s)" in out, out
    assert bundled.exists()


def test_gc_lists_an_unreached_output_once_with_what_is_nested_in_it(tmp_path, capsys):
    prefix = tmp_path / "out"
    assert console_main(["run", experiment(tmp_path, 1, "old.py"), "--prefix", str(prefix)]) == 0
    exp = experiment(tmp_path, 2)
    assert console_main(["run", exp, "--prefix", str(prefix)]) == 0
    capsys.readouterr()
    assert console_main(["gc", exp, "--prefix", str(prefix), "--yes"]) == 0
    out = capsys.readouterr().out
    assert "-- 2 unreached output(s)" in out and "/model" not in out, out  # old a and old bundle, not the copy inside it
    assert outputs(prefix) == ["g/a", "g/bundle"]
    assert console_main(["plan", exp, "--prefix", str(prefix)]) == 0
    assert "2 cached" in capsys.readouterr().out


def test_a_prefix_with_pattern_characters_is_a_path_not_a_pattern(tmp_path, capsys):
    exp = experiment(tmp_path, 1, target="a")  # nothing nested: only the listing is tested
    other = tmp_path / "pa"  # what `p[ab]`, `p?` and `p*` match as patterns
    assert console_main(["run", exp, "--prefix", str(other)]) == 0
    before = outputs(other)
    assert before == ["g/a"]
    new = experiment(tmp_path, 2, "new.py", target="a")
    for prefix in (tmp_path / "p[ab]", tmp_path / "p?", tmp_path / "p*"):
        assert console_main(["run", new, "--prefix", str(prefix)]) == 0
        capsys.readouterr()
        assert console_main(["gc", new, "--prefix", str(prefix), "--yes"]) == 0
        out = capsys.readouterr().out
        assert "-- 0 unreached output(s)" in out and str(other) not in out, out
        assert outputs(other) == before


def test_gc_under_a_memory_prefix(tmp_path, capsys):
    prefix = "memory://keel-gc-test"
    assert console_main(["run", experiment(tmp_path, 1, "old.py"), "--prefix", prefix]) == 0
    exp = experiment(tmp_path, 2)
    assert console_main(["run", exp, "--prefix", prefix]) == 0
    capsys.readouterr()
    assert console_main(["gc", exp, "--prefix", prefix, "--yes"]) == 0
    out = capsys.readouterr().out
    assert "-- 2 unreached output(s)" in out and "-- deleted 2" in out, out
    assert console_main(["gc", exp, "--prefix", prefix]) == 0
    assert "-- 0 unreached output(s)" in capsys.readouterr().out
