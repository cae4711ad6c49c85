"""Where every parameter lives on the rack mesh: one rule table, read by the runtime (to build
partition specs) and by the planner (to count bytes per device). Plain data, no jax.

A placement is one entry per array axis: None (replicated along it), a mesh axis name, or a tuple
of mesh axis names the axis is split over. The first rule that applies decides:

| rule | applies to | placement |
|---|---|---|
| routed experts | arrays with `experts` and `expert_mlp` axes | `experts` over `expert`; `latent` FSDP over `data` when it divides |
| token embedding | the weight `embedding` (not its optimizer state) | replicated (a lookup would gather it anyway) |
| FSDP | arrays with an `embed` axis divisible by data x expert | `embed` over (`data`, `expert`) |
| replicated | everything else (gains, router bias, small kernels) | replicated |

Every placement is replicated across racks (`replica_dcn`): parameters and optimizer state are
sharded inside a rack's fast domain only. Optimizer state is placed like its parameter, except
where the parameter's rule places the weight only (`weights_only`: the token embedding): its
state takes the next rule that applies, so the embedding's Adam moments are FSDP like the rest of
the optimizer state. Adam's update is elementwise, so a moment's shard updates on its own; the
update is then gathered into the replicated weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

Axes = tuple[tuple[str, int], ...]
Placement = tuple["str | tuple[str, ...] | None", ...]
FSDP_AXES = ("data", "expert")


@dataclass(frozen=True)
class PlacementRule:
    name: str
    applies: Callable[[str, dict[str, int], dict[str, int]], bool]
    """(leaf path, its axis sizes by name, mesh axis sizes) -> whether the rule decides this leaf."""
    place: Callable[[dict[str, int], dict[str, int]], dict[str, "str | tuple[str, ...]"]]
    """(its axis sizes, mesh axis sizes) -> {array axis: mesh axis or axes}; the rest replicated."""
    weights_only: bool = False
    """The rule places the weight only; its optimizer state takes the next rule that applies."""


def is_routed_experts(axis_names) -> bool:
    """Whether an array with these axis names is a routed expert weight, split over `expert`."""
    return "experts" in axis_names and "expert_mlp" in axis_names


def _experts(sizes: dict[str, int], mesh: dict[str, int]) -> dict:
    out: dict = {"experts": "expert"}
    if "latent" in sizes and sizes["latent"] % mesh["data"] == 0:
        out["latent"] = "data"
    return out


RULES: tuple[PlacementRule, ...] = (
    PlacementRule("routed experts", lambda path, sizes, mesh: is_routed_experts(sizes), _experts),
    PlacementRule("token embedding", lambda path, sizes, mesh: path == "embedding", lambda sizes, mesh: {},
                  weights_only=True),
    PlacementRule("fsdp", lambda path, sizes, mesh: "embed" in sizes and sizes["embed"] % (mesh["data"] * mesh["expert"]) == 0,
                  lambda sizes, mesh: {"embed": FSDP_AXES}),
    PlacementRule("replicated", lambda path, sizes, mesh: True, lambda sizes, mesh: {}),
)


def place(path: str, axes: Axes, mesh_axes: dict[str, int], *, state: bool = False) -> tuple[str, Placement]:
    """(rule name, placement) of the leaf `path` with these named axes on a mesh of these axis sizes;
    with `state`, of the optimizer-state arrays kept for it."""
    sizes = dict(axes)
    rule = next(r for r in RULES if r.applies(path, sizes, mesh_axes) and not (state and r.weights_only))
    chosen = rule.place(sizes, mesh_axes)
    return rule.name, tuple(chosen.get(name) for name, _ in axes)


def shards(placement: Placement, mesh_axes: dict[str, int]) -> int:
    """Into how many pieces a placement splits its array (each device holds one piece)."""
    count = 1
    for entry in placement:
        for axis in (entry,) if isinstance(entry, str) else entry or ():
            count *= mesh_axes[axis]
    return count
