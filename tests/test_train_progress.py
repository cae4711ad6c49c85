"""A finished run whose training loss never moved from its first value (a learning rate of 1e8:
the loss flat at ln(vocab)) says so when its progress closes, instead of ending as if it learned."""

import math

from keel.train.progress import Progress


def _run(losses: list[float], total: int, start: int = 0) -> None:
    progress = Progress("run", start, total)
    for completed, loss in enumerate(losses, start=start + 1):
        progress.step(completed, loss=loss, tokens_per_s=1.0, transport="ring", phase=None)
    progress.close()


def test_a_flat_loss_is_a_warning_when_the_run_finishes(capsys, monkeypatch):
    monkeypatch.setenv("KEEL_PROGRESS", "lines")
    _run([math.log(1024)] * 30, total=30)
    assert "warning: the training loss never went 1% below its first value (6.9315" in capsys.readouterr().out


def test_the_flat_loss_warning_is_recorded_on_the_running_step(tmp_path, monkeypatch):
    """Inside a step, the warning also lands in the step's warnings, which `keel run`'s summary and
    `keel status` show (the step stays SUCCESS)."""
    from keel.executor import step_warnings

    monkeypatch.setenv("KEEL_PROGRESS", "lines")
    with step_warnings.running(str(tmp_path), whole_process=False):
        _run([math.log(1024)] * 30, total=30)
    [recorded] = step_warnings.read(str(tmp_path))
    assert recorded.startswith("the training loss never went 1% below its first value (6.9315"), recorded


def test_a_learning_run_or_an_unfinished_one_gets_no_warning(capsys, monkeypatch):
    monkeypatch.setenv("KEEL_PROGRESS", "lines")
    _run([7.0 - 0.1 * i for i in range(30)], total=30)
    _run([7.0] * 30, total=100)  # stopped early (interrupted): judged when it finishes
    _run([3.0] * 30, total=300, start=270)  # resumed near the end: a flat tail is no sign
    assert "warning" not in capsys.readouterr().out


def test_levanters_fault_injection_fires_at_its_step(monkeypatch):
    """`LEVANTER_FAULT_KIND`/`LEVANTER_FAULT_STEP` reach every training step through its progress,
    so a real run can be given a SIGKILL, SIGSTOP or error at a chosen step (here: the error)."""
    import pytest
    from levanter.recovery.faults import InjectedStickyFault

    monkeypatch.setenv("LEVANTER_FAULT_KIND", "sticky")
    monkeypatch.setenv("LEVANTER_FAULT_STEP", "3")
    progress = Progress("run", 0, 5, enabled=False)
    progress.step(1, loss=7.0, tokens_per_s=1.0, transport="ring", phase=None)
    progress.step(2, loss=7.0, tokens_per_s=1.0, transport="ring", phase=None)
    with pytest.raises(InjectedStickyFault):
        progress.step(3, loss=7.0, tokens_per_s=1.0, transport="ring", phase=None)
