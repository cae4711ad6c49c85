"""CPU seconds per test file, its subprocesses included: where a CPU-bound suite's time goes.

On 2 cores the suite is CPU-bound, so a test's wall time (`--durations`) grows with whatever the
other worker runs beside it, while the CPU it spends does not: its own, and that of the processes
it starts and waits for (`keel run`, training steps, their children). Each worker measures its
tests; the controller adds up what the workers send when they finish and prints the heaviest files
after the durations. A file's module fixtures count in it. Processes that nobody waits for (a
local cluster's workers) are not counted, so the total is somewhat below the run's `time`.
tests/conftest.py loads this plugin.
"""

from __future__ import annotations

import json
import resource
from collections import Counter

import pytest

SHOWN = 10
_spent: Counter[str] = Counter()  # test file -> CPU seconds, in this process


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = _cpu_seconds()
    yield
    _spent[item.nodeid.split("::")[0]] += _cpu_seconds() - before


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)  # set on a pytest-xdist worker
    if workeroutput is not None:
        workeroutput["keel_cpu_per_file"] = json.dumps(_spent)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """On the controller: a worker finished and sent what its tests spent."""
    _spent.update(json.loads(getattr(node, "workeroutput", {}).get("keel_cpu_per_file", "{}")))


@pytest.hookimpl(trylast=True)  # after pytest's durations: the last lines of a CI log
def pytest_terminal_summary(terminalreporter):
    if not _spent:
        return
    total = sum(_spent.values())
    terminalreporter.write_sep("=", f"CPU seconds per test file, subprocesses included: {total:.1f} s in all")
    for path, seconds in _spent.most_common(SHOWN):
        terminalreporter.write_line(f"{seconds:8.1f}s  {100 * seconds / total:4.1f}%  {path}")
