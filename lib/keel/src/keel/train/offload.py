"""Host offload: which parts of the train state live in which memory kind at step s.

The one rule, derived from `TrainConfig.host_offload` (a `HostOffload`):

- master weights (the model's float arrays, in `master_dtype`) live in host memory
  (`pinned_host`) for the steps before `master_weights_until_step`, on the device from it on;
- the optimizer state (every array of `opt_state`) lives in host memory throughout when
  `optimizer_state` is declared;
- everything else (the step counter, any non-float model array) lives on the device.

`layout_at(offload, step)` is that rule (`HostOffload.memory_kinds_at`, which the planner's state
table reads too); `shardings(state, layout)` turns it into the shardings of
the live state, which the training loop pins as the in/out shardings of its jitted step. Inside
the step `to_device` copies the host arrays to device memory for compute; the new state goes
back to the host through the step's out shardings, so both copies are part of the one
executable. When the layout changes (the master weights come back at
`master_weights_until_step`) the loop moves the state once and compiles a step for the new
layout. The checkpoint format does not depend on the layout: a restore places arrays by its
exemplar's shardings, memory kinds included (`TrainCheckpoints.restore`).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from keel.spec.train import DEVICE, HOST, HostOffload

STATE_PARTS = ("master_weights", "optimizer_state")


@dataclass(frozen=True)
class Layout:
    """The memory kind of each offloadable part of the train state."""

    master_weights: str = DEVICE
    optimizer_state: str = DEVICE

    @property
    def on_host(self) -> tuple[str, ...]:
        return tuple(part for part in STATE_PARTS if getattr(self, part) == HOST)

    def __str__(self) -> str:
        return f"host: {', '.join(self.on_host)}" if self.on_host else "all on device"


def layout_at(offload: HostOffload, step: int) -> Layout:
    """Where the state lives while step `step` (0-based, the state's `step` counter) runs."""
    return Layout(**offload.memory_kinds_at(step))


def part_of(key: str, leaf) -> str | None:
    """Which offloadable part a leaf under the state's top-level `key` belongs to (None: neither)."""
    if key == "model" and jnp.issubdtype(leaf.dtype, jnp.floating):
        return "master_weights"
    if key == "opt_state":
        return "optimizer_state"
    return None


def shardings(state, layout: Layout):
    """The sharding of every array of `state` ({"step", "model", "opt_state"}, arrays or
    ShapeDtypeStructs with shardings) with the memory kind `layout` gives its part."""

    def placed(key, leaf):
        part = part_of(key, leaf)
        return leaf.sharding.with_memory_kind(getattr(layout, part) if part else DEVICE)

    return {key: jax.tree.map(lambda x, k=key: placed(k, x), sub) for key, sub in state.items()}


def memory_kinds(state) -> dict[str, set[str]]:
    """The memory kinds the arrays of each part of a live state sit in (e.g. for a check or a log)."""
    kinds: dict[str, set[str]] = {part: set() for part in (*STATE_PARTS, "other")}
    for key, sub in state.items():
        for leaf in jax.tree.leaves(sub):
            kinds[part_of(key, leaf) or "other"].add(leaf.sharding.memory_kind)
    return kinds


def to_device(tree, tree_shardings):
    """Inside jit: each array of `tree` whose sharding is in host memory, copied to device memory."""

    def fetch(x, sharding):
        if sharding.memory_kind == DEVICE:
            return x
        return jax.device_put(x, sharding.with_memory_kind(DEVICE))

    return jax.tree.map(fetch, tree, tree_shardings)


def check_supported(layout: Layout, device) -> None:
    """Refuse a host layout on devices without a `pinned_host` memory (naming the fix)."""
    if not layout.on_host:
        return
    kinds = {memory.kind for memory in device.addressable_memories()}
    if HOST not in kinds:
        raise ValueError(
            f"TrainConfig.host_offload puts {', '.join(layout.on_host)} in {HOST!r} memory, but {device.platform} "
            f"devices offer only {sorted(kinds)}: set host_offload=HostOffload() on this platform"
        )
