"""The train state as the resolved run lays it out, and the proof that the live state is that.

The resolved run (`keel.spec.resolved`) says where every array of the train state lives: its
`StateLeaf` table gives each one's path, shape, dtype, partition spec, memory kind and bytes per
device. This module is the runtime's only source of placements:

- `state_paths(state)` names each array of a live (or abstract) train state the way the table
  does: `step`, `model/<parameter path>`, `opt_state/<parameter path>/<i>`; optax's scalar
  counters (step counts, injected hyperparameters) are `opt_state/counter/<optax path>`;
- `planned_shardings(run, state, mesh)` turns the table into the NamedSharding of every array
  (device memory; `keel.train.offload` then gives each part its memory kind at a step);
- `record(state, ...)` writes down the live state as jax reports it, in the table's form, and
  `check(live, run)` compares the two leaf by leaf at the record's step and raises
  `LayoutMismatch` naming the first difference. The training loop writes the record to `.keel/layout.json` and checks it
  when it starts, resumes and changes phase (transport or host-offload switch);
- `kernel_report(metrics)` reads what the MoE kernels of the step that then ran report they ran
  (transport and capacity factor, from the step's own outputs, `KeelLM.loss`), and
  `check_kernel(report, step, run)` holds it to the resolved run's phase; the loop adds the report
  to that record as its `transport`.
"""

from __future__ import annotations

import math
from typing import Any

import haliax as hax
import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from levanter.utils.jax_utils import leaf_key_paths

from keel.executor import storage
from keel.executor.status import keel_path
from keel.spec.resolved import DEVICE, ResolvedRun, spec_json
from keel.spec.transports import TransportName
from keel.train.lm import KERNEL

LAYOUT_FILE = "layout.json"
COUNTER = "opt_state/counter/"


class LayoutMismatch(RuntimeError):
    """The live train state is not laid out, typed or scheduled as the resolved run says."""


def state_paths(state) -> list[str]:
    """The path of every array of `state` ({"step", "model", "opt_state"}, arrays or their
    ShapeDtypeStructs), in the order of `jax.tree.leaves(state)`."""
    params = jax.tree.leaves(leaf_key_paths(state["model"], is_leaf=_is_named))
    by_length = sorted(params, key=len, reverse=True)  # `a.b.c` matches before `b.c`
    seen: dict[str, int] = {}

    def opt_path(path: str, leaf) -> str:
        param = next((p for p in by_length if path == p or path.endswith("." + p)), None)
        if param is None or not leaf.shape:
            return COUNTER + path
        seen[param] = seen.get(param, 0) + 1
        return f"opt_state/{param}/{seen[param] - 1}"

    opt_paths = jax.tree.leaves(leaf_key_paths(state["opt_state"], is_leaf=_is_named))
    opt_leaves = jax.tree.leaves(state["opt_state"])
    parts = {"step": ["step"], "model": [f"model/{p}" for p in params],
             "opt_state": [opt_path(p, x) for p, x in zip(opt_paths, opt_leaves)]}
    return jax.tree.leaves({key: parts[key] for key in state})  # flattened in the order jax flattens `state`


def planned_shardings(run: ResolvedRun, state, mesh) -> Any:
    """A tree shaped like `state` holding the device-memory NamedSharding of each array, from the
    run's state table; counters are replicated. An array the table does not know is refused."""
    planned = {leaf.path: leaf for leaf in run.state_at(0)}

    def sharding(path: str) -> NamedSharding:
        if path.startswith(COUNTER):
            return NamedSharding(mesh, P(), memory_kind=DEVICE)
        if path not in planned:
            raise LayoutMismatch(f"the train state has an array {path!r} that the resolved run does not list: "
                                 "the optimizer keeps state the plan does not count (keel.spec.train.MOMENTS)")
        return NamedSharding(mesh, P(*planned[path].spec), memory_kind=DEVICE)

    return jax.tree.unflatten(jax.tree.structure(state), [sharding(p) for p in state_paths(state)])


def record(state, *, step: int, reason: str, learning_rates: dict[str, float],
           peak_learning_rates: dict[str, float]) -> dict:
    """The live state as jax reports it: per array its path, shape, dtype, spec (null, a mesh axis
    or a list of axes per dim), memory kind and the bytes of one device's shard; plus each group's
    learning rate at `step` and at its peak (the end of warmup), read from the schedules the
    optimizer steps with, and how many devices hold the state and how many jax processes those
    belong to (the replicas of a multi-host run form one world). Leaves are sorted by path, as the
    plan's table is."""
    leaves = []
    devices = set().union(*(array.sharding.device_set for array in jax.tree.leaves(state)))
    for path, array in zip(state_paths(state), jax.tree.leaves(state)):
        sharding = array.sharding
        spec = tuple(sharding.spec) + (None,) * (array.ndim - len(sharding.spec))
        shard = sharding.shard_shape(array.shape)
        leaves.append({"path": path, "shape": list(array.shape), "dtype": str(array.dtype), "spec": spec_json(spec),
                       "memory_kind": sharding.memory_kind,
                       "bytes_per_device": int(array.dtype.itemsize * math.prod(shard))})
    return {"step": step, "reason": reason, "learning_rates": learning_rates,
            "peak_learning_rates": peak_learning_rates,
            "devices": len(devices), "processes": len({device.process_index for device in devices}),
            "leaves": sorted(leaves, key=lambda leaf: leaf["path"])}


def check(live: dict, run: ResolvedRun) -> None:
    """Raise `LayoutMismatch` at the first leaf (or learning rate) where `live` differs from the
    resolved run at the live record's step; counters must be replicated int/float scalars."""
    step = live["step"]
    planned = {leaf.path: leaf.record() for leaf in run.state_at(step)}
    arrays = {leaf["path"]: leaf for leaf in live["leaves"] if not leaf["path"].startswith(COUNTER)}
    for path in planned.keys() | arrays.keys():
        if path not in arrays:
            raise LayoutMismatch(f"step {step}: the plan lists {path} but the live train state has no such array")
        if path not in planned:
            raise LayoutMismatch(f"step {step}: the live train state has {path}, which the plan does not list")
    for path, want in planned.items():
        got = arrays[path]
        for field in ("shape", "dtype", "spec", "memory_kind", "bytes_per_device"):
            if got[field] != want[field]:
                raise LayoutMismatch(f"step {step}: {path}.{field} is {got[field]!r} live but {want[field]!r} in the "
                                     "resolved run (keel plan --json lists it)")
    for leaf in live["leaves"]:
        if leaf["path"].startswith(COUNTER) and (leaf["shape"] or any(leaf["spec"])):
            raise LayoutMismatch(f"step {step}: optimizer counter {leaf['path']} should be a replicated scalar, "
                                 f"is shape {leaf['shape']} spec {leaf['spec']}")
    check_rates(live, run)


RATE_TOLERANCE = 1e-6
"""How far a live learning rate may lie from the resolved run's, as a fraction of its group's peak.
The loop's rates are float32 values of the schedule computed by XLA (`Optimizer.rates_at`), the
resolved run's float64 Python: they differ by a few float32 roundings of the peak-sized terms (up
to 1.5e-7 of the peak measured), far more than 1e-6 of the rate itself early in the warmup or near
a decay to zero. A schedule one step off moves a rate by peak / warmup steps (or by the decay's
range / decay steps), which this catches for runs of up to about 10^6 decay steps."""


def check_rates(live: dict, run: ResolvedRun) -> None:
    """Raise `LayoutMismatch` where the live record's learning rate (at its step) or peak rate (at
    the end of the warmup) of a group is not the resolved run's."""
    step, peaks = live["step"], run.lr_at(run.warmup_steps)
    for key, at in (("learning_rates", step), ("peak_learning_rates", run.warmup_steps)):
        for group, want in run.lr_at(at).items():
            got = live[key].get(group)
            if got is None or abs(got - want) > RATE_TOLERANCE * peaks[group]:
                raise LayoutMismatch(f"step {step}: the {group} learning rate at step {at} is {got!r} live but "
                                     f"{want!r} in the resolved run")


def kernel_report(metrics: dict[str, Any]) -> dict | list[dict] | None:
    """What the MoE kernels of a step report they ran, from its metrics (`KeelLM.loss`'s `kernel/`
    entries, one value per layer): {"transport", "capacity_factor" (None: none can drop)} when
    every layer agrees, else one such dict per layer; None for a model without routed experts."""
    if KERNEL + "transport" not in metrics:
        return None
    codes, factors = (np.asarray(metrics[KERNEL + k]).reshape(-1) for k in ("transport", "capacity_factor"))
    layers = [{"transport": TransportName.of_code(int(code)).value,
               "capacity_factor": float(f"{factor:.7g}") if factor > 0 else None} for code, factor in zip(codes, factors)]
    return layers[0] if all(layer == layers[0] for layer in layers) else layers


def check_kernel(report: dict | list[dict], step: int, run: ResolvedRun) -> None:
    """Raise `LayoutMismatch` naming the first layer whose kernel ran another transport or capacity
    than the resolved run's phase at `step`."""
    want = run.transport_at(step)
    for layer, got in enumerate(report if isinstance(report, list) else [report]):
        factor = got["capacity_factor"]
        same_factor = (factor is None) == (want.capacity_factor is None) and (
            factor is None or abs(factor - want.capacity_factor) <= 1e-6 * want.capacity_factor)
        if got["transport"] != want.transport or not same_factor:
            raise LayoutMismatch(f"step {step}: layer {layer}'s MoE kernel ran {got['transport']!r} with capacity factor "
                                 f"{factor!r}, but the resolved run's phase is {want.transport!r} with "
                                 f"{want.capacity_factor!r}: the step was not built from the plan's transport")


def append_record(output_path: str, entry: dict) -> None:
    """Add `entry` to the step's `.keel/layout.json` ({"records": [...]}, newest last)."""
    records = _records(output_path)
    storage.write_json(keel_path(output_path, LAYOUT_FILE), {"records": [*records, entry]}, indent=None)


def add_to_last_record(output_path: str, **fields) -> None:
    """Add `fields` to the newest record of the step's `.keel/layout.json`."""
    records = _records(output_path)
    storage.write_json(keel_path(output_path, LAYOUT_FILE), {"records": [*records[:-1], {**records[-1], **fields}]},
                       indent=None)


def _records(output_path: str) -> list[dict]:
    previous = storage.read_json(keel_path(output_path, LAYOUT_FILE))
    return previous.get("records", []) if isinstance(previous, dict) else []


def _is_named(x) -> bool:
    return isinstance(x, hax.NamedArray)
