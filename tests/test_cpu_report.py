"""The suite's CPU report (tests/cpu_report.py) charges a test file with the CPU of the processes its
tests start, on pytest-xdist's workers as in one process."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
BURN = '''
import subprocess, sys

def test_a_child_process_spends_cpu():
    subprocess.run([sys.executable, "-c", "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.6: pass"],
                   check=True)
'''


@pytest.mark.parametrize("workers", ["0", "2"])
def test_each_file_is_charged_with_the_cpu_of_its_subprocesses(tmp_path, workers):
    (tmp_path / "test_burn.py").write_text(BURN)
    (tmp_path / "test_idle.py").write_text("def test_nothing():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")} | {"PYTHONPATH": str(HERE)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "cpu_report", "-p", "no:cacheprovider", "-n", workers,
                           "-q", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    report = done.stdout[done.stdout.index("CPU seconds per test file"):]
    spent = {m.group(2): float(m.group(1)) for m in re.finditer(r"^\s*([0-9.]+)s\s+[0-9.]+%\s+(\S+)$", report, re.M)}
    assert list(spent) == ["test_burn.py", "test_idle.py"], report  # the heaviest first
    assert 0.5 <= spent["test_burn.py"] < 5 and spent["test_idle.py"] < 0.5, report
