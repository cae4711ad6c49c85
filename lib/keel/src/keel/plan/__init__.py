"""keel.plan: the fact sheet of a training step, derived from its declaration (no jax).

`keel plan` calls `fact_sheets_for(graph)` after the step table and prints each sheet's "text".
"""

from __future__ import annotations

from collections.abc import Container

from keel.executor.step import Step
from keel.spec.checks import PlanError, check_train_step
from keel.plan.facts import fact_sheet
from keel.plan.render import render_fact_sheet
from keel.spec.resolved import ResolvedRun, resolve
from keel.plan.twin import architecture_features, scale_down
from keel.plan.variants import render_variants, variant_row
from keel.plan.verdicts import check_fits
from keel.spec.train import TrainStepConfig
from keel.trained.ladder import check_predicted_compute, plan_line

__all__ = [
    "PlanError",
    "architecture_features",
    "check_fits",
    "check_train_step",
    "fact_sheet",
    "fact_sheets_for",
    "render_fact_sheet",
    "render_variants",
    "resolve",
    "ResolvedRun",
    "variant_row",
    "scale_down",
]


def fact_sheets_for(steps, only: Container[Step] | None = None) -> list[dict]:
    """Fact sheets (each with its step name under "step" and its text under "text") of every step
    whose config is a `TrainStepConfig`; `steps` is a planned graph (its `.order`) or steps. With
    `only`, of those steps among them (what `--only` selects)."""
    sheets = []
    for step in getattr(steps, "order", steps):
        if only is not None and step not in only:
            continue
        if isinstance(step, Step) and isinstance(step.config, TrainStepConfig):
            if step.config.predicted_loss is not None:  # after `--set`, which can change the run or its ladder
                check_predicted_compute(step.name, step.config.predicted_loss, step.config.model, step.config.train)
            sheet = fact_sheet(step.config, step.name)
            sheet["text"] = render_fact_sheet(sheet)
            predicted = plan_line(steps, step) if hasattr(steps, "path") else None  # a graph knows where it is written
            if predicted:
                sheet["text"] += "\n" + predicted
            sheets.append(sheet)
    return sheets
