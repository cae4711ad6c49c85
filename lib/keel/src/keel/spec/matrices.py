"""Which axes of a parameter make its logical matrices: the rule MuonH orthogonalises by
(`keel.train.muonh`) and the plan checks each MuonH parameter against (`keel.spec.checks`), so a
parameter that is no matrix is refused in `keel plan`, not inside the running step. Plain
Python: axes are anything with a `.name` (Haliax's, or `keel.spec.model` parameter axes wrapped
in `AxisName`)."""

from __future__ import annotations

from typing import NamedTuple

from keel.spec.train import STACK_AXES


class AxisName(NamedTuple):
    """An axis as the model config declares it (`MoELMConfig.parameter_axes`), with Haliax's fields."""

    name: str
    size: int


FUSED_AXES = (("heads", "head_size"), ("kv_heads", "head_size"))
"""Axes that together form one side of a matrix: an attention projection's heads x head_size."""


def matrix_axes(axes) -> tuple[tuple, tuple, tuple]:
    """(stack, rows, cols) of a parameter with these Haliax axes; each logical matrix is rows x cols.

    Stack axes (`STACK_AXES`) are vmapped over. Every other axis is one side of the matrix on its
    own, except the `FUSED_AXES` groups, which form one side together; exactly two sides must remain.
    Sides keep their stored order (keel stores inputs before outputs, as Levanter's Linear does);
    the order does not change the result anyway: the polar factor of a transpose is the transpose
    of the polar factor, and the Frobenius norm is the same.
    So q [layers, embed, heads, head_size] is one [embed, heads*head_size] matrix per layer, o is
    [heads*head_size, embed], a routed expert's gate is [latent, expert_mlp] per layer and expert.
    """
    names = {ax.name for ax in axes}

    def side_of(name: str) -> tuple[str, ...]:
        return next((g for g in FUSED_AXES if name in g and names.issuperset(g)), (name,))

    stack = tuple(ax for ax in axes if ax.name in STACK_AXES)
    by_side: dict[tuple[str, ...], list] = {}  # in order of first appearance
    for ax in axes:
        if ax.name not in STACK_AXES:
            by_side.setdefault(side_of(ax.name), []).append(ax)
    sides = list(by_side.values())
    if len(sides) != 2:
        raise ValueError(
            f"MuonH: axes {[ax.name for ax in axes]} give {len(sides)} matrix sides, not 2 (stack axes "
            f"{sorted(STACK_AXES)}; fused {FUSED_AXES}): train this parameter with Adam, or name its axes"
        )
    return stack, tuple(sides[0]), tuple(sides[1])
