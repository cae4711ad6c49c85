"""The fact sheet of a training step: every figure of a run derived from its declaration.

`fact_sheet(config)` checks the declaration (see `checks`) and returns a JSON-ready dict:
parameters, mesh, tokens and FLOPs, memory per GPU (judged at the step's peak, `peak`), all-to-all
traffic, observed time, the step-time model (`step_time`), mixture phases, transport timeline,
launch figures (`launch`), the "claims checked" section and the verdict (`verdicts`). Pure
arithmetic on plain configs: no jax, so `keel plan` on the 535B run is instant.

Memory model (bytes per GPU): the resolved run's state table (`ResolvedRun.state_at`, the very
table the running step checks its live state against): every leaf split as its placement says
(`keel.spec.placement`: routed experts over `expert`, the token embedding replicated,
`embed`-wide arrays FSDP over the rack, the rest replicated), in the master dtype, each optimizer
moment typed like its leaf and placed like it but for the token embedding's, which are FSDP
(MuonH: one, Adam/AdamH/AdamW: two, the router bias none: it is set, not trained). Gradients are
laid out like the trained leaves, in the master dtype (the step takes them of the master weights,
casting to the compute dtype inside). With per-layer rematerialisation one residual tensor per
layer is kept for the backward pass.
"""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

from keel.spec.transports import TRANSPORTS, kernel_capacity_factor
from keel.spec.checks import PlanError, mixture_phases
from keel.spec.resolved import ResolvedRun, resolve, spec_json
from keel.spec.dtypes import bytes_of
from keel.plan.launch import launch
from keel.plan.peak import backward_transients, layer_activations_per_token, update_transients
from keel.plan.step_time import observed_here, seconds_to, step_time, stretches
from keel.plan.verdicts import verdict
from keel.spec.train import CLAIM_FIGURES, TrainStepConfig

GB = 1e9
TOKEN_ID_BYTES = 4  # int32 ids: uint16 cannot hold a vocabulary above 65,536


def mesh(config: TrainStepConfig) -> dict | None:
    topo, train = config.topology, config.train
    if topo is None:
        return None
    sequences = train.batch_size // topo.batch_shards
    return {
        "axes": topo.axis_sizes,
        "racks": topo.racks,
        "gpus_per_rack": topo.gpus_per_rack,
        "gpus": topo.num_devices,
        "experts_per_gpu": topo.experts_per_device(config.model),
        "sequences_per_gpu": sequences,
        "tokens_per_gpu": sequences * train.seq_len,
    }


def training(config: TrainStepConfig) -> dict:
    model, train = config.model, config.train
    active = model.param_counts()["active"]
    flops_per_token = model.flops_per_token(train.seq_len)
    return {
        "batch_size": train.batch_size,
        "seq_len": train.seq_len,
        "tokens_per_step": train.tokens_per_step,
        "num_steps": train.num_steps,
        "total_tokens": train.total_tokens,
        "tokens_per_active_param": train.total_tokens / active,
        "flops_6nt": 6 * active * train.total_tokens,
        "flops_per_token": flops_per_token,
        "flops_with_attention": flops_per_token * train.total_tokens,
    }


def optimizer(config: TrainStepConfig, declared: Any) -> dict:
    """The resolved optimizer; `rates_from` says whether its peak rates were declared or derived
    by a law (`lr_scale` x the law's at this run's size)."""
    train = config.train
    opt = train.optimizer
    out = {"kind": type(opt).__name__, **{k: getattr(opt, k) for k in opt.__dataclass_fields__
                                          if not k.endswith("_params") and k not in ("lr_law", "lr_scale")}}
    law = getattr(declared, "lr_law", None)
    out["rates_from"] = "declared" if law is None else f"LR law x {declared.lr_scale:g}"
    out["warmup_steps"] = math.floor(train.schedule.warmup_fraction * train.num_steps)
    out["decay_to_fraction"] = train.schedule.decay_to_fraction
    out["z_loss"] = train.z_loss
    wd = train.weight_decay_change
    if wd is not None:
        out["weight_decay_change"] = {"start_step": wd.start_step, "peak": wd.peak, "groups": list(wd.groups),
                                      "rate_at_start": wd.peak * (1 - wd.start_step / train.num_steps)}
    return out


def memory(run: ResolvedRun, a2a_rows: list[dict]) -> dict | None:
    """Bytes per GPU on device and on host, for each stretch of the run (split where the master
    weights come back from the host and at transport switches): the state summed over the
    parameter table (each leaf as placed on the mesh; optimizer state by its `state_placement`), the
    offloaded state the step copies in, and the step's transient buffers at its two peaks
    (`keel.plan.peak`: a layer's backward, the optimizer's update). "fits" is judged at the larger;
    the host's share is checked against the host RAM."""
    config = run.config
    topo, train, hw, model = config.topology, config.train, config.hardware, config.model
    if topo is None:
        return None
    hbm = topo.hbm_per_gpu_gb or (hw.hbm_per_device_gb if hw else None)
    compute = bytes_of(train.compute_dtype, "train.compute_dtype")
    bytes_of(train.master_dtype, "train.master_dtype")
    params = sum(run.per_device(p) for p in run.parameters)
    residual = run.tokens_per_device * model.hidden_dim * compute
    # The train state's own bytes per device (`ResolvedRun.state_at`: what the running step records
    # and checks, leaf by leaf); gradients are laid out and typed like the trained parameters.
    state = run.state_at(0)
    trained = {f"model/{p.path}" for p in run.parameters if p.trained}

    def saved_residuals(transport) -> float:
        """What the forward keeps for the backward (GB per GPU) under a transport phase: one residual
        per layer with remat, else every activation of every layer, its expert rows as many as the
        phase's kernel holds (`kernel_capacity_factor`: the ring's expert_parallel times the tokens'
        assignments, not its declared 1.0)."""
        if train.remat:
            return model.num_layers * residual / GB
        rows = kernel_capacity_factor(transport.transport, transport.capacity_factor, topo.expert_parallel)
        per_token = sum(layer_activations_per_token(model, rows or 1.0).values())
        return model.num_layers * run.tokens_per_device * compute * per_token / GB

    saved = {start: saved_residuals(run.transport_at(start)) for start, _ in stretches(run)}
    parts = {
        "master_weights": sum(leaf.bytes_per_device for leaf in state if leaf.path.startswith("model/")) / GB,
        "gradients": sum(leaf.bytes_per_device for leaf in state if leaf.path in trained) / GB,
        "optimizer_state": sum(leaf.bytes_per_device for leaf in state if leaf.path.startswith("opt_state/")) / GB,
        "residual_per_layer": residual / GB,
        # the least of the phases' (each phase's own is its "saved_residuals_gb")
        "saved_residuals": min(saved.values()),
    }
    offload = train.host_offload
    phases = []
    for start, _ in stretches(run):
        on_host = ["master_weights"] if offload.master_on_host(start) else []
        if offload.optimizer_state:
            on_host.append("optimizer_state")
        device_parts = ["gradients", "saved_residuals"] + [
            p for p in ("master_weights", "optimizer_state") if p not in on_host
        ]
        known = [saved[start] if p == "saved_residuals" else parts[p] for p in device_parts]
        device = None if None in known else sum(known)
        transport = run.transport_at(start)
        a2a = next((r for r in a2a_rows if r["from_step"] == transport.start_step), None)
        rows = kernel_capacity_factor(transport.transport, transport.capacity_factor, topo.expert_parallel)
        transient, update = backward_transients(run, a2a, rows, compute), update_transients(run)
        host = sum(parts[p] for p in on_host)
        # keel.train.offload copies the host-resident state in for the step's compute: at its
        # peak the device holds it too (it lives on the host between steps).
        state_peak = None if device is None else device + host
        backward = None if state_peak is None else state_peak + sum(transient.values())
        updating = None if state_peak is None or not update else state_peak - saved[start] + sum(update.values())
        peak = None if backward is None else max(backward, updating or 0.0)
        host_per_host = host * hw.gpus_per_host if hw and hw.gpus_per_host else None
        phases.append({
            "from_step": start,
            "transport": transport.transport,
            "on_device": device_parts,
            "on_host": on_host,
            "saved_residuals_gb": saved[start],
            "device_gb": device,
            "rack_gb": None if device is None else device * topo.gpus_per_rack,
            "host_gb": host,
            "step_peak_gb": state_peak if on_host else None,
            "transient_gb": transient,
            "backward_peak_gb": backward,
            "update_gb": update,
            "update_peak_gb": updating,
            "peak_in": None if peak is None else "update" if updating and updating > backward else "backward",
            "peak_gb": peak,
            "headroom_gb": None if hbm is None or peak is None else hbm - peak,
            "fits": None if hbm is None or peak is None else peak <= hbm,
            "host_per_host_gb": host_per_host,
            "host_fits": None if host_per_host is None or not hw.host_ram_per_host_gb else
            host_per_host <= hw.host_ram_per_host_gb,
        })
    return {
        "parameters_per_gpu": params,
        "parts_gb": parts,
        "phases": phases,
        "hbm_per_gpu_gb": hbm,
        "hbm_per_rack_gb": hbm * topo.gpus_per_rack if hbm else None,
        "host_ram_per_host_gb": hw.host_ram_per_host_gb if hw else None,
        "remat": train.remat,
    }


def all_to_all(run: ResolvedRun) -> list[dict]:
    """Expert-parallel bytes each GPU sends per step, for each transport phase.

    Fixed-capacity transports send padded buffers of capacity_factor x the assignments; the ragged
    one sends the assignments themselves (of which 1/ep go to the GPU's own experts and stay on it);
    `ring` all-gathers the other ep - 1 GPUs' tokens of the expert group and reduce-scatters their
    outputs instead (every row counted leaves the GPU: `off_gpu_fraction` 1). A layer sends one
    dispatch and one combine forward, two more backward and, with remat, the forward pair again.
    `dense` and `local` move no tokens.
    """
    config = run.config
    topo, train, model = config.topology, config.train, config.model
    if topo is None or not model.num_experts:
        return []
    compute = bytes_of(train.compute_dtype, "train.compute_dtype")
    tokens = run.tokens_per_device
    row_bytes = model.expert_input_dim * compute
    buffers_per_layer = 2 * (2 + (1 if train.remat else 0))
    out = []
    for phase in run.transports:
        if not TRANSPORTS[phase.transport].moves_tokens:
            continue
        if phase.transport == "ring":  # the other GPUs' tokens only: every row counted leaves the GPU
            kind, factor, rows = "all_gather", 1.0, tokens * (topo.expert_parallel - 1)
            off_gpu = 1.0
        else:  # padded buffers are sent whole; the ragged transport sends only the real assignments
            padded = TRANSPORTS[phase.transport].pads_sends
            factor = phase.capacity_factor if padded else 1.0
            kind, rows = ("padded" if padded else "ragged"), tokens * model.experts_per_token * factor
            off_gpu = 1 - 1 / topo.expert_parallel  # rows routed to the GPU's own experts stay on it
        buffer = rows * row_bytes
        out.append({
            "transport": phase.transport,
            "kind": kind,
            "from_step": phase.start_step,
            "capacity_factor": factor,
            "width": model.expert_input_dim,
            "dtype": train.compute_dtype,  # rows travel in the compute dtype
            "buffer_gb_per_layer": buffer / GB,
            "gb_per_step_per_gpu": buffer * buffers_per_layer * model.num_layers / GB,
            "exchanges_per_step": buffers_per_layer * model.num_layers,
            "off_gpu_fraction": off_gpu,  # share of gb_per_step_per_gpu that other GPUs send or receive
        })
    return out


def state_layout(run: ResolvedRun) -> list[dict] | None:
    """Every array of the train state as the trainer lays it out (path, shape, dtype, spec, memory
    kind, bytes per device), from each step where the host-offload layout changes: what the
    running step records in `.keel/layout.json` and refuses to train without."""
    if run.mesh_axes is None:
        return None
    offload = run.config.train.host_offload.master_weights_until_step
    starts = [0] + ([offload] if offload and offload < run.config.train.num_steps else [])
    return [{"from_step": start, "leaves": [leaf.record() for leaf in run.state_at(start)]} for start in starts]


def parameter_table(run: ResolvedRun) -> list[dict]:
    """Every leaf as the run holds it: path, named axes, dtype, placement (its own and its optimizer
    state's), optimizer group."""
    return [{
        "path": p.path,
        "axes": dict(p.axes),
        "dtype": p.dtype,
        "placement": None if p.placement is None else spec_json(p.placement),
        "state_placement": None if p.state_placement is None else spec_json(p.state_placement),
        "rule": p.rule,
        "group": p.group,
        "trained": p.trained,
        "per_device": run.per_device(p) if run.mesh_axes else None,
    } for p in run.parameters]


def cross_rack(config: TrainStepConfig, memory_facts: dict | None) -> dict | None:
    """Bytes each GPU sends across racks per step: its gradient shard's all-reduce over the
    replicas, and the quantile-balancing histograms (layers x experts x bins, int32) summed globally.
    A ring all-reduce of B bytes over R replicas sends 2 (R - 1) / R x B per participant."""
    topo, model = config.topology, config.model
    if topo is None or memory_facts is None or topo.racks == 1:
        return None
    ring = 2 * (topo.racks - 1) / topo.racks
    histogram = model.num_layers * model.num_experts * model.qb_histogram_bins * 4 if model.has_router_bias else 0
    return {
        "gradient_all_reduce_gb": ring * memory_facts["parts_gb"]["gradients"],
        "router_histogram_gb": ring * histogram / GB,
    }


def _date(text: str, field: str) -> dt.date:
    try:
        return dt.date.fromisoformat(text)
    except (TypeError, ValueError):
        raise PlanError(f"{field}={text!r} is not an ISO date: write it as 'yyyy-mm-dd'") from None


def _check_observations(facts, start: dt.date) -> None:
    """Observations come on or after the start, and a later step never on an earlier date: either
    mistake moved the projected end silently."""
    dated = sorted((seen.step, _date(seen.date, f"facts.observed[{i}].date"), i) for i, seen in enumerate(facts.observed))
    for step, date, i in dated:
        if date < start:
            raise PlanError(f"facts.observed[{i}].date={date.isoformat()} is before facts.start_date={start.isoformat()}: "
                            "a step is reached after the run starts; fix the date or the start")
    for (step, date, i), (later_step, later_date, j) in zip(dated, dated[1:]):
        if later_date < date:
            raise PlanError(f"facts.observed[{j}] reaches step {later_step:,} on {later_date.isoformat()}, before "
                            f"facts.observed[{i}] reached step {step:,} ({date.isoformat()}): fix one of the two dates")


def _rest_of_run(config: TrainStepConfig, predicted: dict | None, last: dict) -> tuple[float, str]:
    """(steps a day, what it is) the run after its last observation can go at full goodput: the
    last measured rate to the end of the stretch it was measured in, then the modelled step times
    of the stretches after it, where that is faster than the measured rate alone (a later, faster
    phase the run has not reached yet: a projection made before the hero's switch allowed for its
    ragged steps)."""
    measured = (last["steps_per_day"], f"the last measured rate, at step {last['step']:,}")
    num_steps = config.train.num_steps
    stretches = (predicted or {}).get("stretches")
    if not stretches or num_steps <= last["step"]:
        return measured
    current = next((s for s in stretches if s["from_step"] <= last["step"] <= s["to_step"]), None)
    until = current["to_step"] + 1 if current else num_steps
    seconds = (until - last["step"]) * last["step_seconds"] + seconds_to(stretches, num_steps) - seconds_to(stretches, until)
    rest = (num_steps - last["step"]) * 86_400 / seconds
    if rest > measured[0] * (1 + 1e-9):
        return rest, f"the measured rate to step {until - 1:,}, the modelled step times after it"
    return measured


def time(config: TrainStepConfig, train_facts: dict, predicted: dict | None) -> dict | None:
    """Each measured speed with its MFU, the projection rate and the goodput it implies (projected
    over the rest of the run's rate at full goodput, `_rest_of_run`), and the completion date
    projected from the last observation."""
    facts, train, hw, topo = config.facts, config.train, config.hardware, config.topology
    if not observed_here(config)[0]:  # none declared, or measured on another layout: see step_time
        return None
    start = _date(facts.start_date, "facts.start_date")
    flops_per_step = train_facts["flops_per_token"] * train.tokens_per_step
    flops_6nt = 6 * config.model.param_counts()["active"] * train.tokens_per_step
    peak = hw.peak_flops_per_device * topo.num_devices if hw and topo and hw.peak_flops_per_device else None

    def mfu(seconds: float, flops: float) -> float | None:
        return flops / (peak * seconds) if peak else None

    speeds = [{
        "step": seen.step,
        "date": _date(seen.date, f"facts.observed[{i}].date").isoformat(),
        "step_seconds": seen.step_seconds,
        "steps_per_day": 86_400 / seen.step_seconds,
        "mfu": mfu(seen.step_seconds, flops_per_step),
        "mfu_6nt": mfu(seen.step_seconds, flops_6nt),
    } for i, seen in sorted(enumerate(facts.observed), key=lambda pair: pair[1].step)]  # i: the index as declared
    _check_observations(facts, start)
    last = speeds[-1]
    full, basis = _rest_of_run(config, predicted, last)
    if facts.projected_steps_per_day and facts.projected_steps_per_day > full * (1 + 1e-9):
        raise PlanError(f"facts.projected_steps_per_day={facts.projected_steps_per_day:g} is faster than the rest of the "
                        f"run at full goodput ({full:.0f} steps a day, {basis}): a projection allows for restarts, "
                        "evaluation and checkpoints (a goodput of at most 1); give at most that rate")
    rate = facts.projected_steps_per_day or last["steps_per_day"]
    days = (dt.date.fromisoformat(last["date"]) - start).days + (train.num_steps - last["step"]) / rate
    end = start + dt.timedelta(days=days)
    return {
        "run_id": facts.run_id,
        "start_date": start.isoformat(),
        "speeds": speeds,
        "projection": {
            "from_step": last["step"],
            "steps_per_day": rate,
            "step_seconds": 86_400 / rate,
            "goodput": rate / full,
            "goodput_of": basis,  # the full-goodput rate it is a share of
            "mfu": mfu(86_400 / rate, flops_per_step),
        },
        "projected_end_date": end.isoformat(),
        "projected_days": days,  # from the start to the projected end: what the run holds its GPUs for
        "whole_run_days_at_projection": train.num_steps / rate,
    }


def mixture(config: TrainStepConfig) -> list[dict]:
    """Each phase's steps, tokens and weights, and the shares its blocks draw (`Mixture.block_counts`):
    whole sequences per block, so a small weight is drawn a little less than declared."""
    train = config.train
    phases = mixture_phases(config.data)
    block = config.data.block_size
    out = []
    for i, ((start, weights), counts) in enumerate(zip(phases, config.data.block_counts() if phases else ())):
        end = phases[i + 1][0] if i + 1 < len(phases) else train.num_steps
        total = sum(weights.values())
        out.append({
            "start_step": start,
            "end_step": end - 1,
            "steps": end - start,
            "tokens": (end - start) * train.tokens_per_step,
            "weights": {k: v / total for k, v in weights.items()},
            "block_size": block,
            "drawn": {k: counts[k] / block for k in weights},
        })
    return out


def _predicted_date(facts, own: bool, predicted: dict | None, step: int) -> str | None:
    """The date the run reaches `step` at the step-time model's speeds (full goodput), counted from
    the latest of this layout's own observations before `step` (else from the start date); where a
    later own observation exists too, the days between the two are shared out by the model's
    seconds, so the date lies between theirs. None without a start date or a prediction."""
    if not facts or not facts.start_date or not predicted or "stretches" not in predicted:
        return None
    stretches = predicted["stretches"]
    seen = sorted((o.step, _date(o.date, "facts.observed.date")) for o in (facts.observed if own else ()))
    before_step, before = max(((s, d) for s, d in seen if s < step), default=(0, _date(facts.start_date, "facts.start_date")))
    seconds = seconds_to(stretches, step) - seconds_to(stretches, before_step)
    after = next(((s, d) for s, d in seen if s > step), None)
    if after is not None:  # between two observations: the model says how their days divide
        span = seconds_to(stretches, after[0]) - seconds_to(stretches, before_step)
        seconds = (after[1] - before).total_seconds() * (seconds / span if span else 1.0)
    return (dt.datetime.combine(before, dt.time()) + dt.timedelta(seconds=seconds)).date().isoformat()


def transports(run: ResolvedRun, sheet: dict) -> list[dict]:
    """Each transport phase's steps and knobs, and the date it starts: observed where this
    declaration's own observations (`observed_here`) saw its first step, else (observations of
    another layout, none, or a phase the run has not reached yet) predicted at the modelled step
    times from the nearest own observations around it, or from the start date (`_predicted_date`)."""
    config = run.config
    train, facts = config.train, config.facts
    own = observed_here(config)[0]
    out = []
    for phase in run.transports:
        entry = {
            "transport": phase.transport,
            "start_step": phase.start_step,
            "end_step": phase.end_step,
            "capacity_factor": phase.capacity_factor,
            # below 1 the experts hold fewer rows than the assignments even when perfectly balanced
            "dropped_at_least": max(0.0, 1 - phase.capacity_factor) if phase.capacity_factor is not None else 0.0,
            "num_waves": phase.num_waves,
            "tokens_before": phase.start_step * train.tokens_per_step,
        }
        seen = [s for s in (facts.observed if own else ()) if s.step == phase.start_step]
        if seen:
            entry["date"], entry["date_basis"] = seen[0].date, "observed"
        else:  # another layout's observations, none, or a phase this run has not reached yet
            predicted = _predicted_date(facts, own, sheet.get("step_time"), phase.start_step)
            if predicted:
                entry["date"], entry["date_basis"] = predicted, "predicted"
        out.append(entry)
    return out


def _si(x: float) -> str:
    """453M, 1.04T: large counts the way they are spoken."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if x >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}"


def _run_days(config: TrainStepConfig, sheet: dict) -> tuple[float, str] | str | None:
    """The run's days on its schedule (its projected steps per day, downtime included). A variant
    has no schedule: its predicted days are at full goodput, which a claim quoted in calendar days
    does not compare with (the hero's "60 days" held at 58 for a variant that took 68 at its goodput)."""
    t, predicted = sheet.get("time"), sheet.get("step_time") or {}
    if t:
        days, rate = t["whole_run_days_at_projection"], t["projection"]["steps_per_day"]
        return days, f"{config.train.num_steps:,} steps at {rate:,.0f} steps/day take about {days:.0f} days"
    if "run_days" not in predicted:
        return None
    return (f"not checked: the claim counts days on the run's schedule (its projected steps per day, downtime "
            f"included), and this layout's {predicted['run_days']:.0f} days are predicted at full goodput")


def _batch_bytes(config: TrainStepConfig, sheet: dict) -> tuple[float, str]:
    model, train = config.model, config.train
    value = train.tokens_per_step * TOKEN_ID_BYTES
    two_byte_ok = model.vocab_size <= 2**16
    return value, (f"{train.tokens_per_step:,} token ids x {TOKEN_ID_BYTES} bytes = {value / 1e6:.4g} MB; "
                   + ("2-byte ids would also do" if two_byte_ok else
                      f"2-byte ids cannot hold a {model.vocab_size:,}-token vocabulary"))


def _fewest_rows(capacity_factors) -> float:
    """The smallest of the run's transport phases' capacity factors (1.0 for one that pads nothing):
    a lower bound on activations holds in every phase."""
    return min((factor or 1.0 for factor in capacity_factors), default=1.0)


def _activations_per_token(model, sheet: dict) -> float:
    """Values one token leaves in one layer's forward, at the fewest expert rows any phase holds: a
    claim's bound on what the model needs, its assignments' rows (a dropless transport 1.0). The
    memory counts what keel's kernels hold instead (`memory`: the ring's expert_parallel times)."""
    return sum(layer_activations_per_token(model, _fewest_rows(t["capacity_factor"] for t in sheet["transports"])).values())


BF16_BYTES = 2  # the quoted "one D-wide tensor" figures are a bf16 tensor, whatever the run computes in


def _activation_bytes(config: TrainStepConfig, sheet: dict) -> tuple[float, str]:
    """(what one layer's forward leaves for its backward over the whole batch, in the compute dtype
    as the run holds it; the finding, which names the quoted figure as one bf16 D-wide tensor and
    that tensor's share per GPU)."""
    model, train = config.model, config.train
    value = train.tokens_per_step * model.hidden_dim * BF16_BYTES
    compute = bytes_of(train.compute_dtype, "train.compute_dtype")
    real = _activations_per_token(model, sheet) * compute * train.tokens_per_step
    devices = config.topology.num_devices if config.topology else None
    per_gpu = f" (per GPU {value / devices / GB:.3g} GB)" if devices else ""
    return real, (f"{value / GB:.4g} GB is one bf16 {model.hidden_dim}-wide tensor over the whole global batch "
                  f"({train.tokens_per_step:,} tokens){per_gpu}, not a layer's activations: a layer's forward "
                  f"leaves at least {real / GB:,.0f} GB ({real / value:.0f}x) for its backward")


def _activation_bytes_all_layers(config: TrainStepConfig, sheet: dict) -> tuple[float, str]:
    model, train = config.model, config.train
    one_tensor = train.tokens_per_step * model.hidden_dim * BF16_BYTES * model.num_layers
    compute = bytes_of(train.compute_dtype, "train.compute_dtype")
    real = _activations_per_token(model, sheet) * compute * train.tokens_per_step * model.num_layers
    return real, (f"{one_tensor / 1e12:.3g} TB is one bf16 {model.hidden_dim}-wide tensor per layer for "
                  f"{model.num_layers} layers; without checkpointing the layers keep at least {real / 1e12:,.0f} TB "
                  f"({real / one_tensor:.0f}x), hence per-layer rematerialisation")


def _one_rack_days(config: TrainStepConfig, sheet: dict) -> tuple[float, str] | None:
    whole = _run_days(config, sheet)
    if config.topology is None:
        return None
    if not isinstance(whole, tuple):  # undetermined, or not checkable for the reason it gives
        return whole
    racks = config.topology.racks
    days = whole[0] * racks
    return days, (f"the same tokens on 1 rack instead of {racks} take {racks} x {whole[0]:.0f} = {days:,.0f} days "
                  f"({days / 365:.1f} years), against {whole[0]:.0f} days on {racks}")


def _moe_to_dense(config: TrainStepConfig, sheet: dict) -> tuple[float, str] | None:
    model = config.model
    if not model.num_experts:
        return None
    k, inp, f, d = model.experts_per_token, model.expert_input_dim, model.expert_dim, model.hidden_dim
    routed, dense_width = 3 * k * inp * f, k * f
    dense = 3 * d * dense_width
    latent = 2 * d * inp if model.latent_dim is not None else 0
    on_hidden = model.num_layers * model.num_experts * 3 * d * f
    return routed / dense, (
        f"the routed experts read {inp}-wide inputs, not {d}: {_si(routed * 2)} FLOP/token/layer forward vs "
        f"{_si(dense * 2)} for a dense SwiGLU {d}->{dense_width}->{d}: ratio {routed / dense:.3f} "
        f"({(routed + latent) / dense:.3f} with the latent projections); experts on the {d}-wide token would "
        f"hold {_si(on_hidden)} parameters")


FIGURES = {
    "run_days": _run_days,
    "batch_bytes": _batch_bytes,
    "activation_bytes_per_layer": _activation_bytes,
    "activation_bytes_all_layers": _activation_bytes_all_layers,
    "one_rack_days": _one_rack_days,
    "moe_to_dense_flops": _moe_to_dense,
}
"""Figures a declared `Claim` can name: each derives (value, finding) from the declaration and the
sheet so far, or None when the declaration does not determine it (e.g. no speed declared), or the
finding of a claim it cannot check, saying why."""
if FIGURES.keys() != set(CLAIM_FIGURES):  # the declaration names what a claim may cite; this derives each
    raise ImportError(f"keel.plan.facts.FIGURES {sorted(FIGURES)} and keel.spec.train.CLAIM_FIGURES "
                      f"{sorted(CLAIM_FIGURES)} must name the same figures")


def claims(config: TrainStepConfig, sheet: dict) -> list[dict]:
    """The run's declared claims (`RunFacts.claims`), each recomputed; a run that declares none gets none.
    A claim whose figure the declaration does not determine (a variant whose speed is not predicted)
    is listed unchecked, saying why (`holds` None)."""
    out = []
    for claim in config.facts.claims if config.facts else ():
        derived = FIGURES[claim.figure](config, sheet)
        if isinstance(derived, str):
            out.append({"claim": claim.text, "figure": claim.figure, "quoted": claim.quoted, "value": None, "holds": None,
                        "finding": derived})
            continue
        if derived is None:
            out.append({"claim": claim.text, "figure": claim.figure, "quoted": claim.quoted, "value": None, "holds": None,
                        "finding": f"not checked: this declaration does not determine {claim.figure} (declare "
                                   "facts.observed speeds, or see why the step time is not predicted)"})
            continue
        value, finding = derived
        out.append({"claim": claim.text, "figure": claim.figure, "quoted": claim.quoted, "value": value,
                    "holds": math.isclose(value, claim.quoted, rel_tol=0.05), "finding": finding})
    return out


def fact_sheet(config: TrainStepConfig, name: str = "") -> dict:
    """Every derived figure of a training step, after checking the declaration (PlanError names the field)."""
    if not isinstance(config, TrainStepConfig):
        raise PlanError(f"fact_sheet needs a TrainStepConfig, got {type(config).__name__}")
    declared, run = config, resolve(config, name)
    config = run.config  # the declaration with its derived values (a law's rates) resolved
    sheet: dict = {"step": name, "hardware": config.hardware.name if config.hardware else None,
                   "parameters": config.model.param_counts(), "inert": config.model.inert_fields()}
    sheet["parameter_table"] = parameter_table(run)
    sheet["state_layout"] = state_layout(run)
    sheet["stand_ins"] = list(config.stand_ins)
    sheet["mesh"] = mesh(config)
    sheet["training"] = training(config)
    sheet["optimizer"] = optimizer(config, declared.train.optimizer)
    sheet["all_to_all"] = all_to_all(run)
    sheet["memory"] = memory(run, sheet["all_to_all"])
    sheet["cross_rack"] = cross_rack(config, sheet["memory"])
    sheet["step_time"] = step_time(run, sheet)
    sheet["time"] = time(config, sheet["training"], sheet["step_time"])
    sheet["mixture"] = mixture(config)
    sheet["transports"] = transports(run, sheet)
    sheet["launch"] = launch(run, sheet)
    sheet["claims"] = claims(config, sheet)
    sheet["verdict"] = verdict(sheet, config.train.refuse_unfit)
    return sheet
