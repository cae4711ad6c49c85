"""`keel.main` given something other than a flat list of steps says so in one `keel: error:` line,
naming the item and the fix, from the experiment's own command line and from `keel`."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

import keel
from keel import Step, this_output
from keel.cli import console_main


@dataclass(frozen=True)
class Cfg:
    n: int
    output_path: str = this_output()


def noop(config):
    pass


def one_error_line(capsys) -> str:
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert err.startswith("keel: error: ") and err.count("\n") == 1, err
    return err.strip()


a, b = Step("m/a", noop, Cfg(1)), Step("m/b", noop, Cfg(2))


@pytest.mark.parametrize("steps, shown", [
    ([[a, b]], "item 0 is a list ([Step('m/a'), Step('m/b')])"),
    ([a, {"b": b}.values()], "item 1 is a dict_values"),
    ([a, "m/b"], "item 1 is a str ('m/b')"),
    (a, "got a Step, not a list of steps"),
])
def test_main_given_something_other_than_a_flat_list_of_steps(tmp_path, capsys, steps, shown):
    assert keel.main(steps, argv=["plan", "--prefix", str(tmp_path)]) == 2
    line = one_error_line(capsys)
    assert line.startswith("keel: error: keel.main") and shown in line, line
    assert "keel.main([step, ...])" in line, line  # the fix


def test_keel_reports_the_same_for_an_experiment_file(tmp_path, capsys):
    exp = tmp_path / "exp.py"
    exp.write_text("from dataclasses import dataclass\nfrom keel import Step, main, this_output\n\n\n"
                   "@dataclass(frozen=True)\nclass C:\n    n: int\n    output_path: str = this_output()\n\n\n"
                   "def f(c):\n    pass\n\n\n"
                   "steps = {'a': Step('x/a', f, C(1)), 'b': Step('x/b', f, C(2))}\n"
                   "if __name__ == '__main__':\n    main([steps.values()])\n")
    assert console_main(["plan", str(exp), "--prefix", str(tmp_path / "out")]) == 2
    line = one_error_line(capsys)
    assert "keel.main: item 0 is a dict_values" in line and "keel.main([*steps])" in line, line
