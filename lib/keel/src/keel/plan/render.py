"""The fact sheet as text, for `keel plan`: one short line per figure, DOES NOT FIT where memory does not."""

from __future__ import annotations


def _n(x: float) -> str:
    return f"{x:,.0f}"


def _e(x: float) -> str:
    return f"{x:.3g}".replace("e+", "e")


def gb_text(x: float) -> str:
    """GB (1e9 bytes) at the hero's scale; MB or KB for small twins."""
    if x is None:
        return "n/a"
    if x >= 0.1 or x == 0:
        return f"{x:,.1f} GB"
    return f"{x * 1e3:,.1f} MB" if x >= 1e-4 else f"{x * 1e6:,.1f} KB"


def _rack(gb: float | None) -> str:
    return "n/a" if gb is None else f"{gb / 1000:,.1f} TB" if gb >= 1000 else gb_text(gb)


def _tera(tokens: float) -> str:
    return f" ({tokens / 1e12:.2f}T)" if tokens >= 1e11 else ""


def tokens_text(x: float) -> str:
    """Trillions at the hero's scale; the count itself for small runs."""
    return f"{x / 1e12:.2f}T" if x >= 1e11 else _n(x)


def _parameters(p: dict) -> list[str]:
    lines = [f"parameters   total {_n(p['total'])}   active {_n(p['active'])}"]
    for name, count in p["components"].items():
        if count:
            active = p["active_components"].get(name)
            suffix = f"   (active {_n(active)})" if active is not None and active != count else ""
            lines.append(f"  {name:<20}{_n(count):>20}{suffix}")
    return lines


def _mesh(m: dict | None) -> list[str]:
    if m is None:
        return ["mesh         (no topology declared)"]
    axes = " x ".join(f"{k} {v}" for k, v in m["axes"].items() if v > 1) or "single device"
    return [
        f"mesh         {axes}  =  {m['gpus']} GPUs ({m['racks']} racks x {m['gpus_per_rack']})",
        f"  per GPU: {m['experts_per_gpu']} experts, {m['sequences_per_gpu']} sequences, {_n(m['tokens_per_gpu'])} tokens",
    ]


def _training(t: dict, o: dict) -> list[str]:
    lines = [
        f"tokens       {_n(t['tokens_per_step'])} per step ({_n(t['batch_size'])} x {t['seq_len']}) x {_n(t['num_steps'])} steps"
        f" = {_n(t['total_tokens'])} ({t['tokens_per_active_param']:.1f} per active parameter)",
        f"FLOPs        6 x active x tokens = {_e(t['flops_6nt'])};  with attention and lm_head = "
        f"{_e(t['flops_with_attention'])} ({_e(t['flops_per_token'])} per token)",
    ]
    if o["kind"] == "GroupedOptimizerConfig":
        lr = f"MuonH/AdamH {o['muon_lr']:.6f}, Adam {o['adam_lr']:.6f}"
        if o["rates_from"] != "declared":
            lr += f" ({o['rates_from']} at this size)"
    else:
        lr = f"AdamW {o['lr']:g}"
    lines.append(f"optimizer    {lr}; warmup {_n(o['warmup_steps'])} steps, decay to {o['decay_to_fraction']:g} of peak; "
                 f"z-loss {o['z_loss']:g}")
    wd = o.get("weight_decay_change")
    if wd:
        lines.append(f"  weight decay from step {_n(wd['start_step'])}: the group's learning rate x {wd['peak']:g} x "
                     f"(1 - step/{_n(t['num_steps'])}), the factor {wd['rate_at_start']:.4f} at start, on "
                     f"{', '.join(wd['groups'])}")
    return lines


PEAK_PARTS = {"all_to_all_buffers": "all-to-all buffers", "layer_activations": "layer activations",
              "gathered_weights": "gathered weights", "attention_scores": "vanilla attention scores and probabilities",
              "newton_schulz_loop": "Newton-Schulz loop"}


def _parts(transients: dict[str, float]) -> str:
    return " + ".join(f"{gb_text(v)} {PEAK_PARTS.get(k, k.replace('_', ' '))}" for k, v in transients.items() if v)


def _verdict(fits: bool | None, hbm: float) -> str:
    if fits is None:
        return "no hardware declared to fit it in"
    return f"fits {gb_text(hbm)} HBM" if fits else f"DOES NOT FIT {gb_text(hbm)} HBM"


def _memory(m: dict | None) -> list[str]:
    if m is None:
        return []
    p = m["parts_gb"]
    hbm = m["hbm_per_gpu_gb"]
    lines = [
        f"memory/GPU   {_n(m['parameters_per_gpu'])} parameters: master weights {gb_text(p['master_weights'])}, gradients "
        f"{gb_text(p['gradients'])}, optimizer state {gb_text(p['optimizer_state'])} (the state table's bytes: keel plan --json)",
        f"  one residual per layer {gb_text(p['residual_per_layer'])}; "
        + (f"saved with remat {gb_text(p['saved_residuals'])}" if m["remat"] else
           f"kept for the backward without remat: at least {gb_text(p['saved_residuals'])} (every layer's activations)"),
    ]
    for phase in m["phases"]:
        host = (f"; host {gb_text(phase['host_gb'])} ({', '.join(phase['on_host'])}) between steps, copied in for "
                f"compute: {gb_text(phase['step_peak_gb'])} on device at the step's peak" if phase["on_host"] else "")
        rack = f"; per rack {_rack(phase['rack_gb'])} of {_rack(m['hbm_per_rack_gb'])}" if m["hbm_per_rack_gb"] else ""
        lines.append(f"  from step {_n(phase['from_step'])}: device {gb_text(phase['device_gb'])} in the step "
                     f"({', '.join(p.replace('_', ' ') for p in phase['on_device'])}){rack}{host}")
        if phase["peak_gb"] is not None:
            state = phase["step_peak_gb"] or phase["device_gb"]
            room = ("" if phase["fits"] is None else f", {gb_text(phase['headroom_gb'])} headroom" if phase["fits"]
                    else f", {gb_text(-phase['headroom_gb'])} over")  # None: no hardware declared to fit in
            backward = (f"in the backward {gb_text(phase['backward_peak_gb'])} = {gb_text(state)} state + "
                        f"{_parts(phase['transient_gb'])} ({phase['transport']})")
            update = (f"in the update {gb_text(phase['update_peak_gb'])} = {gb_text(state - phase['saved_residuals_gb'])} state "
                      f"(the saved residuals freed) + {_parts(phase['update_gb'])}") if phase["update_gb"] else None
            first, second = (update, backward) if phase["peak_in"] == "update" else (backward, update)
            lines.append(f"    peak {first}: {_verdict(phase['fits'], hbm)}{room}")
            if second:
                lines.append(f"    {second}")
        if phase["host_fits"] is not None and phase["host_gb"]:
            host_verdict = "fits" if phase["host_fits"] else "DOES NOT FIT"
            lines.append(f"    host RAM {gb_text(phase['host_per_host_gb'])} per host offloaded: {host_verdict} "
                         f"{gb_text(m['host_ram_per_host_gb'])}")
    return lines


ROWS = {
    "padded": "{width}-wide {dtype} rows, capacity {capacity_factor:g}",
    "ragged": "{width}-wide {dtype} rows as routed",
    "all_gather": "{width}-wide {dtype} rows of the whole expert group",
}
SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _all_to_all(rows: list[dict]) -> list[str]:
    short = [{**r, "dtype": SHORT_DTYPES.get(r["dtype"], r["dtype"])} for r in rows]
    return [
        f"all-to-all   {r['transport']} from step {_n(r['from_step'])}: {ROWS[r['kind']].format(**r)}: "
        f"{gb_text(r['buffer_gb_per_layer'])} per buffer per layer, {gb_text(r['gb_per_step_per_gpu'])} per step per GPU "
        f"({r['off_gpu_fraction']:.0%} leaves the GPU)"
        for r in short
    ]


def _cross_rack(c: dict | None) -> list[str]:
    if c is None:
        return []
    line = f"cross-rack   per step per GPU: gradient all-reduce {gb_text(c['gradient_all_reduce_gb'])}"
    if c["router_histogram_gb"]:
        line += f", router histogram sum {gb_text(c['router_histogram_gb'])}"
    return [line]


def _time(t: dict | None) -> list[str]:
    if t is None:
        return []
    lines = [f"time         started {t['start_date']}" + (f" as {t['run_id']}" if t["run_id"] else "")]
    for s in t["speeds"]:
        mfu = f", MFU {s['mfu']:.1%} ({s['mfu_6nt']:.1%} by 6NT)" if s["mfu"] is not None else ""
        lines.append(f"  measured from step {_n(s['step'])} ({s['date']}): {s['step_seconds']:.2f} s/step = "
                     f"{_n(s['steps_per_day'])} steps/day{mfu}")
    p = t["projection"]
    mfu = f", MFU {p['mfu']:.1%}" if p["mfu"] is not None else ""
    lines.append(f"  projected from step {_n(p['from_step'])}: {_n(p['steps_per_day'])} steps/day = "
                 f"{p['step_seconds']:.2f} s/step{mfu}, a goodput of {p['goodput']:.1%} of {p['goodput_of']}")
    lines.append(f"  projected end {t['projected_end_date']} ({t['projected_days']:.0f} days after the start)")
    return lines


TERMS = {"compute": "compute", "hbm": "HBM", "all_to_all": "all-to-all", "fsdp": "FSDP", "cross_rack": "cross-rack",
         "host": "host copies"}


def _term(name: str, t: dict) -> str:
    amount = f"{_n(t['gb'])} GB" if t["gb"] is not None else ""
    if t["off_domain"]:
        amount += f", {t['off_domain']:.0%} off the fast domain"
    shown = f"{t['seconds']:.2f} s" + (f" ({amount})" if amount else "")
    if t["exposed_seconds"] == 0:
        return f"{TERMS[name]} {shown} hidden"
    if t["exposed_seconds"] < t["seconds"] - 1e-9:
        return f"{TERMS[name]} {shown}, {t['exposed_seconds']:.2f} s exposed"
    return f"{TERMS[name]} {shown}"


def _step_time(s: dict | None) -> list[str]:
    if s is None:
        return []
    if "missing" in s:
        return [f"step time    not predicted: declare {', '.join(s['missing'])}"]
    c = s["calibration"]
    label = {"own": "observed and modelled", "other layout": "predicted", None: "predicted"}[s["observations"]]
    lines = [f"step time    {label}; calibration: compute efficiency {c['compute_efficiency']:.1%}, "
             f"{c['collective_sync_s'] * 1e3:.2f} ms per expert collective (from {c['source']}: {c['fitted_on']})"]
    if s["observations"] == "other layout":
        lines.append(f"  the declared speeds were measured on another layout ({'; '.join(s['differs'])}): not used")
    if s["fit_problem"]:
        lines.append(f"  no fit on this run's observations: {s['fit_problem']}")
    for r in s["stretches"]:
        seen = f" (observed {r['observed_seconds']:.2f})" if r["observed_seconds"] is not None else ""
        kinds = " + ".join(f"{_e(v)} {k}" for k, v in r["flops_by_kind"].items())
        lines.append(f"  steps {_n(r['from_step'])}-{_n(r['to_step'])} {r['transport']}: {r['step_seconds']:.2f} s/step"
                     f"{seen}, MFU {r['mfu']:.1%}, binds: {TERMS[r['binds']]}; FLOP per GPU {kinds} (remat and padded "
                     f"rows included), {_n(r['collectives'])} expert collectives")
        lines.append("    " + "; ".join(_term(name, t) for name, t in r["terms"].items()))
    end = f", ending {s['end_date']}" if s["end_date"] else ""
    lines.append(f"  whole run at these speeds: {s['run_days']:.1f} days at full goodput{end}")
    return lines


def _launch(lf: dict) -> list[str]:
    c = lf["checkpoint"]
    write = (f"; written in {c['write_seconds']:,.0f} s at {c['store_gb_per_s']:g} GB/s" if "write_seconds" in c
             else "; declare launch.store_gb_per_s for its write time")
    lines = [f"launch       checkpoint {_rack(c['gb'])} (master weights and optimizer state) x {c['permanent']} "
             f"permanent + {c['rolling_kept']} rolling kept = {_rack(c['retained_gb'])}{write}"]
    g = lf.get("gpu_hours")
    if g:
        cost = f", cost {g['cost']:,.0f}" if g["cost"] is not None else ""
        lines.append(f"  GPU-hours {_n(g['hours'])} ({g['basis']}){cost}")
    if lf["components"]:
        reads = [f"{r['component']} {tokens_text(r['tokens_read'])}"
                 + (f" of {tokens_text(r['cache_tokens'])} ({r['epochs']:.2f} epochs{', REPEATS' if r['epochs'] > 1 else ''})"
                    if r["epochs"] is not None else "") for r in lf["components"]]
        lines.append("  tokens read per component: " + ", ".join(reads))
    return lines


def _drawn(phase: dict) -> str:
    """The largest miss of a declared weight by the whole sequences its blocks draw, when it is
    over 1% of that weight."""
    misses = {k: abs(phase["drawn"][k] - w) / w for k, w in phase["weights"].items() if w > 0}
    worst = max(misses, key=misses.get, default=None)
    if worst is None or misses[worst] <= 0.01:
        return ""
    return (f"; blocks of {_n(phase['block_size'])} sequences draw {worst} at {phase['drawn'][worst]:.2%} for its "
            f"{phase['weights'][worst]:.2%} (the largest miss)")


def _mixture(phases: list[dict]) -> list[str]:
    lines = []
    for p in phases:
        top = sorted(p["weights"].items(), key=lambda kv: -kv[1])[:4]
        shares = ", ".join(f"{k} {v:.1%}" for k, v in top)
        lines.append(f"mixture      steps {_n(p['start_step'])}-{_n(p['end_step'])}: {_n(p['tokens'])} tokens"
                     f"{_tera(p['tokens'])}; {len(p['weights'])} component(s), top: {shares}{_drawn(p)}")
    return lines


def _transports(rows: list[dict]) -> list[str]:
    def knobs(r: dict) -> str:
        parts = ([f"capacity {r['capacity_factor']:g}"] if r["capacity_factor"] is not None else ["dropless"]
                 if r["transport"] in ("ring", "ragged_all_to_all") else [])
        parts += [f"{r['num_waves']} waves"] if r["num_waves"] > 1 else []
        parts += ([f"DROPS at least {r['dropped_at_least']:.0%} of the routed assignments, however balanced"]
                  if r.get("dropped_at_least") else [])
        return f" ({', '.join(parts)})" if parts else ""

    return [
        f"transport    steps {_n(r['start_step'])}-{_n(r['end_step'])}: {r['transport']}{knobs(r)}"
        + (f", from {r['date']}" + (" (predicted)" if r.get("date_basis") == "predicted" else "") if r.get("date") else "")
        + (f", after {_n(r['tokens_before'])} tokens{_tera(r['tokens_before'])}" if r["start_step"] else "")
        for r in rows
    ]


def _groups(table: list[dict]) -> list[str]:
    """How many leaves (and entries) each optimizer group trains; the full table is in --json."""
    counts: dict[str, list[int]] = {}
    for row in table:
        entries = 1
        for size in row["axes"].values():
            entries *= size
        seen = counts.setdefault(row["group"], [0, 0])
        seen[0], seen[1] = seen[0] + 1, seen[1] + entries
    frozen = [r["path"] for r in table if not r["trained"]]
    return [f"groups       {len(table)} leaves: " + ", ".join(f"{g} {n} ({_n(e)} entries)" for g, (n, e) in counts.items())
            + (f"; not trained by the optimizer: {', '.join(frozen)}" if frozen else "")
            + " (every leaf's path, axes, placement and group: keel plan --json)"]


def render_fact_sheet(sheet: dict) -> str:
    """The plain-text fact sheet `keel plan` prints."""
    lines = [f"== fact sheet: {sheet['step']}" if sheet["step"] else "== fact sheet"]
    if sheet.get("stand_ins"):
        lines += ["stand-ins    a scaled-down twin: what plays the real run's part"] + [f"  {s}" for s in sheet["stand_ins"]]
    lines += _parameters(sheet["parameters"])
    if sheet["inert"]:
        lines += [f"  no effect: model {line}" for line in sheet["inert"]]
        lines.append("  (fields the model never reads still count toward the step's identity: leave them at their defaults)")
    lines += _groups(sheet["parameter_table"])
    lines += _mesh(sheet["mesh"])
    lines += _training(sheet["training"], sheet["optimizer"])
    lines += _memory(sheet["memory"])
    lines += _all_to_all(sheet["all_to_all"])
    lines += _cross_rack(sheet["cross_rack"])
    lines += _time(sheet["time"])
    lines += _step_time(sheet["step_time"])
    lines += _mixture(sheet["mixture"])
    lines += _transports(sheet["transports"])
    lines += _launch(sheet["launch"])
    if sheet["claims"]:
        lines.append("claims checked")
        lines += [f"  \"{c['claim']}\" ({_claim_verdict(c)}): {c['finding']}" for c in sheet["claims"]]
    return "\n".join(lines)


def _claim_verdict(claim: dict) -> str:
    return "unchecked" if claim["holds"] is None else "holds" if claim["holds"] else "does not hold"
