"""The step-time model: how long a training step takes on the declared hardware, term by term.

Per GPU and step, each term is priced on what it uses (`keel.spec.Hardware`):

| term | what | priced on | overlaps |
|---|---|---|---|
| compute | FLOPs: dense matmuls and attention; routed-expert matmuls (with the padded rows a fixed-capacity transport computes); remat's second forward | peak x compute efficiency | - |
| hbm | bytes the step at least moves: weights per pass, gradients, the optimizer update, saved residuals, expert buffers | HBM bandwidth | with compute: the larger binds |
| all_to_all | expert rows that leave the GPU, plus a sync per collective | in-domain link; the scale-out link for the share leaving the fast domain | 1/num_waves exposed for a transport that sends in waves (`Transport.waves`), else all |
| fsdp | all-gathers of FSDP-split weights (each pass) and the gradient reduce-scatter | same | prefetched under compute: only the excess shows |
| cross_rack | gradient all-reduce and router histograms across racks | scale-out link | under the backward: only the excess shows |
| host | offloaded state copied in and back | host link | none: the update waits for it |

step = max(compute, hbm) + exposed all-to-all + excess FSDP + excess cross-rack + host copies.

Two constants are on no data sheet: the compute efficiency and the sync cost per expert
collective. `calibrate` fits them on a run's observed steps (the hero's 19.8 s pooled and 16.8 s
ragged); a hardware preset carries the fitted pair for runs nobody has measured. Observations
belong to the layout they were measured on (`speed_key`): any other declaration is predicted.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from keel.spec.hardware import Hardware, StepTimeCalibration
from keel.spec.dtypes import bytes_of
from keel.plan.peak import fsdp_shards
from keel.spec.resolved import ResolvedRun
from keel.spec.train import TrainStepConfig

GB = 1e9
NEEDED = ("peak_flops_per_device", "hbm_gb_per_s", "link_gb_per_s", "scale_out_gb_per_s", "host_link_gb_per_s")


def speed_key(config: TrainStepConfig) -> str:
    """What a step's speed depends on, as one readable line (hardware; layout; batch; model size
    and FLOPs; attention kernel; transports; precision and remat; offload). Observed speeds apply to
    this key only."""
    model, train, topo, hw = config.model, config.train, config.topology, config.hardware
    counts = model.param_counts()
    transports = "+".join(  # each phase from its start step, at the capacity it runs with (the model's by default)
        f"{t.transport}@{t.start_step}" + (f"/{t.num_waves}w" if t.num_waves > 1 else "")
        + (f"/cf{t.capacity(model):g}" if t.capacity(model) is not None else "") for t in train.transports) or "default"
    offload = train.host_offload
    parts = [
        hw.name if hw else "no hardware",
        f"{topo.racks}x{topo.gpus_per_rack} ep{topo.expert_parallel} mp{topo.model_parallel}" if topo else "no topology",
        f"batch {train.batch_size}x{train.seq_len}",
        f"model {counts['total']}/{counts['active']} {model.flops_per_token(train.seq_len):.6g} FLOP/token",
        f"attention {model.attention_backend.value}",
        transports,
        f"{train.compute_dtype}/{train.master_dtype}" + (" remat" if train.remat else ""),
        "offload" + (f" master<{offload.master_weights_until_step}" if offload.master_weights_until_step else "")
        + (" optimizer" if offload.optimizer_state else ""),
    ]
    return "; ".join(parts)


def observed_here(config: TrainStepConfig) -> tuple[bool, list[str]]:
    """(whether the declared observations are this declaration's own, the key parts that differ)."""
    facts = config.facts
    if facts is None or not facts.observed:
        return False, []
    if facts.measured_on is None:
        return True, []
    mine, theirs = speed_key(config).split("; "), facts.measured_on.split("; ")
    differ = [f"{b} -> {a}" for a, b in zip(mine, theirs) if a != b]
    return not differ and len(mine) == len(theirs), differ or ([] if len(mine) == len(theirs) else ["key format"])


@dataclass(frozen=True)
class Load:
    """What one stretch of steps asks of the hardware per GPU and step: the calibration-free part."""

    start: int
    end: int
    transport: str
    flops: float
    """Executed FLOPs per GPU (remat and padded expert rows included)."""
    model_flops: float
    """The model's FLOPs per GPU (what MFU counts)."""
    seconds: dict[str, float]
    """Transfer seconds at the declared bandwidths: hbm, all_to_all, fsdp, cross_rack, host."""
    amounts_gb: dict[str, float]
    expert_flops: float
    """The routed experts' share of `flops`: what a wave's transfer can hide under."""
    collectives: int
    """Expert collectives per step (each pays the calibrated sync)."""
    a2a_exposed: float
    """Fraction of the all-to-all transfer the step waits for."""
    off_domain: dict[str, float]
    """Share of each in-rack term's bytes that leaves the fast domain (priced on the scale-out link)."""
    backward_share: float
    """Share of the compute after the forward (remat's second forward and the backward), which the
    cross-rack gradient all-reduce hides under."""


def _spread(gb: float, group: int, hw: Hardware) -> tuple[float, float]:
    """(seconds, share off the fast domain) for `gb` a GPU sends evenly to the other GPUs of a
    group: the in-domain share on the link, the rest on the scale-out link, both at once."""
    if group <= 1 or gb == 0:
        return 0.0, 0.0
    domain = min(group, hw.fast_domain_gpus or group)
    inside = (domain - 1) / (group - 1)
    return max(gb * inside / hw.link_gb_per_s, gb * (1 - inside) / hw.scale_out_gb_per_s), 1 - inside


def stretches(run: ResolvedRun) -> list[tuple[int, int]]:
    """(first, last) steps over which the step costs the same: split at transport switches and
    where the master weights come back from the host."""
    train = run.config.train
    cuts = {t.start_step for t in run.transports} | {0}
    back = train.host_offload.master_weights_until_step
    if back is not None and back < train.num_steps:
        cuts.add(back)
    starts = sorted(cuts)
    return [(s, (starts[i + 1] if i + 1 < len(starts) else train.num_steps) - 1) for i, s in enumerate(starts)]


def loads(run: ResolvedRun, sheet: dict) -> list[Load]:
    """The calibration-free cost of each stretch of the run (needs a topology and `NEEDED` hardware figures)."""
    config = run.config
    model, train, topo, hw = config.model, config.train, config.topology, config.hardware
    compute_bytes = bytes_of(train.compute_dtype, "train.compute_dtype")
    tokens = run.tokens_per_device
    passes = 3 if train.remat else 2  # forward, (remat's second forward,) backward
    routed = 6 * model.param_counts()["active_components"]["routed_experts"]
    per_token = model.flops_per_token(train.seq_len)
    mem = sheet["memory"]
    gathered = 0.0  # bytes a GPU receives per FSDP all-gather pass
    weights_read = 0.0  # bytes of (gathered) weights a GPU reads per pass
    for p in run.parameters:
        shards = fsdp_shards(run, p)
        gathered += run.per_device(p) * (shards - 1) * compute_bytes
        weights_read += run.per_device(p) * shards * compute_bytes
    # the update reads and writes the master weights and the moments and reads the gradients: the
    # memory sheet's own parts (gradients typed like the master weights, no compute-dtype copy kept)
    parts = mem["parts_gb"]
    update_gb = 2 * parts["master_weights"] + parts["gradients"] + 2 * parts["optimizer_state"]
    fsdp_gb = gathered * (passes + 1) / GB  # a gather per pass and the gradients' reduce-scatter
    fsdp_s, fsdp_off = _spread(fsdp_gb, topo.data * topo.expert, hw)
    cross = sheet["cross_rack"] or {}
    cross_gb = cross.get("gradient_all_reduce_gb", 0.0) + cross.get("router_histogram_gb", 0.0)
    out = []
    for start, end in stretches(run):
        phase = run.transport_at(start)
        a2a = next((r for r in sheet["all_to_all"] if r["from_step"] == phase.start_step), None)
        pad = a2a["capacity_factor"] if a2a and a2a["kind"] == "padded" else 1.0  # fixed buffers compute whole
        # the share of the line's bytes that crosses to other GPUs (all of the ring's, which counts only theirs)
        a2a_gb = a2a["gb_per_step_per_gpu"] * a2a["off_gpu_fraction"] if a2a else 0.0
        a2a_s, a2a_off = _spread(a2a_gb, topo.expert_parallel, hw)
        memory = next(m for m in reversed(mem["phases"]) if m["from_step"] <= start)
        host_gb = memory["host_gb"] * 2  # in and back
        # weights read each pass and their gradients written once, the update, the saved residuals
        # written and read back, every all-to-all buffer written and read
        hbm_gb = weights_read * (passes + 1) / GB + update_gb + 2 * memory["saved_residuals_gb"]
        hbm_gb += 2 * (a2a["gb_per_step_per_gpu"] if a2a else 0)
        waves = phase.num_waves  # 1 but for a transport that sends in waves (TransportPhase refuses others)
        out.append(Load(
            start, end, phase.transport,
            flops=tokens * (per_token + routed * (pad - 1)) * (passes + 1) / 3,
            expert_flops=tokens * routed * pad * (passes + 1) / 3,
            model_flops=tokens * per_token,
            seconds={"hbm": hbm_gb / hw.hbm_gb_per_s, "all_to_all": a2a_s, "fsdp": fsdp_s,
                     "cross_rack": cross_gb / hw.scale_out_gb_per_s, "host": host_gb / hw.host_link_gb_per_s},
            amounts_gb={"hbm": hbm_gb, "all_to_all": a2a_gb, "fsdp": fsdp_gb, "cross_rack": cross_gb, "host": host_gb},
            collectives=a2a["exchanges_per_step"] * waves if a2a else 0,
            a2a_exposed=1 / waves,
            off_domain={"all_to_all": a2a_off, "fsdp": fsdp_off},
            backward_share=passes / (passes + 1),
        ))
    return out


def timing(load: Load, hw: Hardware, calibration: StepTimeCalibration) -> dict:
    """Each term's seconds and what the step waits for of it; the step time, what binds, the MFU."""
    compute = load.flops / (hw.peak_flops_per_device * calibration.compute_efficiency)
    s = load.seconds
    backward = compute * load.backward_share
    hidden = min(s["all_to_all"] * (1 - load.a2a_exposed), compute * load.expert_flops / load.flops)
    sync = load.collectives * calibration.collective_sync_s
    terms = {
        "compute": (compute, compute if compute >= s["hbm"] else 0.0),
        "hbm": (s["hbm"], s["hbm"] if s["hbm"] > compute else 0.0),
        "all_to_all": (s["all_to_all"] + sync, s["all_to_all"] - hidden + sync),
        "fsdp": (s["fsdp"], max(0.0, s["fsdp"] - compute)),
        "cross_rack": (s["cross_rack"], max(0.0, s["cross_rack"] - backward)),
        "host": (s["host"], s["host"]),
    }
    step = sum(exposed for _, exposed in terms.values())
    return {
        "from_step": load.start,
        "to_step": load.end,
        "transport": load.transport,
        "terms": {name: {"seconds": t, "exposed_seconds": e, "gb": load.amounts_gb.get(name),
                         "off_domain": load.off_domain.get(name)} for name, (t, e) in terms.items()},
        "flops_per_gpu": load.flops,
        "flops_by_kind": {"dense matmuls and attention": load.flops - load.expert_flops,
                          "routed experts": load.expert_flops},
        "collectives": load.collectives,
        "binds": max(terms, key=lambda name: terms[name][1]),
        "step_seconds": step,
        "mfu": load.model_flops / (hw.peak_flops_per_device * step),
    }


def calibrate(config: TrainStepConfig, all_loads: list[Load], fallback: StepTimeCalibration | None) -> StepTimeCalibration | str:
    """The two constants fitted on the run's own observations (one per stretch, the first seen in
    it): with two or more, both (Newton's method on the first two); with one, the compute efficiency
    at the fallback's sync cost. A string says why no fit (none observed, or no physical one)."""
    hw, facts = config.hardware, config.facts
    seen = []
    for load in all_loads:
        match = [o for o in facts.observed if load.start <= o.step <= load.end]
        if match:
            seen.append((load, match[0].step_seconds))
    if not seen:
        return "no observation falls in the run"
    sync0 = fallback.collective_sync_s if fallback else 0.0
    unknowns = [1 / 0.4, sync0]

    def residuals(x: list[float]) -> list[float]:
        try:
            c = StepTimeCalibration(1 / x[0], x[1], "fit")
        except ValueError:
            return [float("nan")] * 2
        return [timing(load, hw, c)["step_seconds"] - seconds for load, seconds in seen[:2]]

    free = 2 if len(seen) > 1 else 1
    for _ in range(30):
        r = residuals(unknowns)
        if r != r or max(abs(v) for v in r[:free]) < 1e-9:
            break
        jac = []
        for j in range(free):
            probe = list(unknowns)
            probe[j] += 1e-6 * max(1.0, abs(probe[j]))
            jac.append([(a - b) / (probe[j] - unknowns[j]) for a, b in zip(residuals(probe), r)])
        if free == 1:
            unknowns[0] -= r[0] / jac[0][0]
        else:
            (a, c), (b, d) = jac  # columns: d r / d x0, d r / d x1
            det = a * d - b * c
            if det == 0:
                return "the observations cannot separate the two constants"
            unknowns[0] -= (d * r[0] - b * r[1]) / det
            unknowns[1] -= (a * r[1] - c * r[0]) / det
    efficiency, sync = 1 / unknowns[0], unknowns[1]
    where = ", ".join(f"{s:g} s at step {load.start:,}" for load, s in seen[:free])
    if not (0 < efficiency <= 1 and sync >= 0):
        return (f"no physical fit to {where} (compute efficiency {efficiency:.3g}, sync {sync:.3g} s): the model "
                "misses what these steps spend their time on")
    return StepTimeCalibration(efficiency, sync, f"{facts.run_id or 'this run'}: {where}")


def seconds_to(stretches: list[dict], step: int) -> float:
    """Seconds the predicted stretches take from step 0 to `step` (full goodput)."""
    return sum((min(r["to_step"] + 1, step) - r["from_step"]) * r["step_seconds"] for r in stretches if r["from_step"] < step)


PEAK_DTYPE = "bfloat16"
"""The dtype of `Hardware.peak_flops_per_device` (its dense matmul peak)."""


def step_time(run: ResolvedRun, sheet: dict) -> dict | None:
    """The predicted step time of each stretch of the run with its terms, the calibration used and
    the run's length at that speed; None without a topology, or hardware with a peak FLOP rate
    (simulated CPU devices have none); {"missing": [...]} when it lacks a figure the model needs."""
    config = run.config
    hw, topo, train = config.hardware, config.topology, config.train
    if hw is None or hw.peak_flops_per_device is None or topo is None or sheet["memory"] is None:
        return None
    missing = [f"hardware.{name}" for name in NEEDED if getattr(hw, name) is None]
    if missing:
        return {"missing": missing}
    own, differ = observed_here(config)
    all_loads = loads(run, sheet)
    calibration = hw.calibration
    fitted = calibrate(config, all_loads, hw.calibration) if own else None
    if isinstance(fitted, StepTimeCalibration):
        calibration = fitted
    if calibration is None:
        return {"missing": ["hardware.calibration (or observed speeds of this run to fit it on)"]}
    if train.compute_dtype != PEAK_DTYPE and not isinstance(fitted, StepTimeCalibration):
        # neither the peak nor a preset's efficiency says how fast another dtype's matmuls run
        return {"missing": [f"train.compute_dtype='{PEAK_DTYPE}' (hardware.peak_flops_per_device and its calibration "
                            f"are the dense {PEAK_DTYPE} rate; at {train.compute_dtype} only this run's own observed "
                            "speeds can say)"]}
    rows = [timing(load, hw, calibration) for load in all_loads]
    for row in rows:
        seen = [o for o in (config.facts.observed if own else ()) if row["from_step"] <= o.step <= row["to_step"]]
        row["observed_seconds"] = seen[0].step_seconds if seen else None
        row["observed_step"] = seen[0].step if seen else None  # the observation, for its other figures (MFU)
    seconds = seconds_to(rows, train.num_steps)
    start = config.facts.start_date if config.facts else None
    return {
        "end_date": (dt.date.fromisoformat(start) + dt.timedelta(seconds=seconds)).isoformat() if start else None,
        "key": speed_key(config),
        "observations": "own" if own else ("other layout" if differ else None),
        "differs": differ,
        "calibration": {"compute_efficiency": calibration.compute_efficiency,
                        "collective_sync_s": calibration.collective_sync_s, "fitted_on": calibration.fitted_on,
                        "source": "this run's observations" if calibration is fitted else f"the {hw.name} preset"},
        "fit_problem": fitted if isinstance(fitted, str) else None,
        "stretches": rows,
        "run_days": seconds / 86_400,
        "gpu_hours": seconds / 3600 * topo.num_devices,
        "mean_step_seconds": seconds / train.num_steps,
    }
