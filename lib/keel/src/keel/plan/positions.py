"""Positions in a run declared as fractions of its tokens, resolved to the steps they land on.

A phase start, a weight-decay start or a transport switch means "after this share of the run's
tokens"; declared that way, a variant with another batch or length moves it with the run (and a
scaled-down twin scales it), where a step number would stay put. `steps_at` resolves them and
refuses, naming the position, one outside the run or an order the run cannot have.
"""

from __future__ import annotations

from typing import Callable

from keel.spec.checks import PlanError


def steps_at(fractions: dict[str, float], num_steps: int, *, field: str,
             to_step: Callable[[float], int] = round, ordered: bool = False) -> dict[str, int]:
    """{name: the step `fraction x num_steps` lands on} (`to_step` rounds it, e.g. onto a mixture
    block); `ordered` requires strictly increasing steps in the declared order (mixture phases)."""
    steps = {}
    for name, fraction in fractions.items():
        if not 0 <= fraction < 1:
            raise PlanError(f"{field}[{name!r}]={fraction!r} is not a fraction of the run in [0, 1): declare where "
                            "it lands as a share of the run's tokens")
        steps[name] = to_step(fraction * num_steps)
    values = list(steps.values())
    if ordered and any(b <= a for a, b in zip(values, values[1:])):
        landed = ", ".join(f"{name} at step {step:,} ({fractions[name]:.4g})" for name, step in steps.items())
        raise PlanError(f"{field}: {landed}: each must land strictly after the one before; move the fractions apart "
                        "(or use fewer, longer steps)")
    return steps
