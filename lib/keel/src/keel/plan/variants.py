"""Variants side by side: one row of headline figures per training step's fact sheet
(`keel plan A.py B.py`), so a launch decision compares runs on one screen.

Every row's length and GPU-hours are at full goodput, from the step-time model's stretches (which
reproduce a run's own observations where it is fitted on them): a run's own projection (its
declared steps per day, which hold its downtime) is on its fact sheet, and no variant has one, so
a table that mixed the two made a slower variant look 3 days shorter."""

from __future__ import annotations

from keel.plan.render import gb_text, tokens_text

COLUMNS = ("variant", "hardware", "steps", "tokens", "s/step", "MFU", "days at full goodput (end)", "peak/GPU",
           "verdict", "GPU-hours at full goodput")


def variant_row(label: str, sheet: dict) -> dict:
    """The headline figures of one sheet: each stretch's step time and MFU (the one this layout's
    own observations measured, else the step-time model's; a layout measured but not modelled shows
    its measurements), the run length and GPU-hours at the modelled step times (full goodput), the
    largest peak against the HBM, the verdict."""
    predicted = sheet.get("step_time") or {}
    stretches = predicted.get("stretches", [])
    speeds = (sheet.get("time") or {}).get("speeds", [])  # the run's own observations, each with its MFU

    if stretches:  # each stretch's own observation (the one the model's row was checked against), else the model
        measured = [next((o for o in speeds if o["step"] == s.get("observed_step")), None) for s in stretches]
        shown = [m or s for m, s in zip(measured, stretches)]
        basis = ["observed" if m else "predicted" for m in measured]
    else:  # no model for this hardware: what the run measured, if anything
        shown, basis = speeds, ["observed"] * len(speeds)
    seconds, mfus = [s["step_seconds"] for s in shown], [s["mfu"] for s in shown]
    days, end = predicted.get("run_days"), predicted.get("end_date")
    memory = sheet.get("memory") or {}
    peaks = [p["peak_gb"] for p in memory.get("phases", ()) if p["peak_gb"] is not None]
    fits = sheet["verdict"]["fits"]
    mesh = sheet.get("mesh") or {}
    return {
        "variant": label,
        "hardware": f"{sheet.get('hardware') or '?'} x {mesh.get('gpus', '?')}",
        "steps": sheet["training"]["num_steps"],
        "tokens": sheet["training"]["total_tokens"],
        "step_seconds": seconds,
        "mfu": mfus,
        "basis": basis,
        "days": days,
        "end_date": end,
        "peak_gb": max(peaks) if peaks else None,
        "hbm_gb": memory.get("hbm_per_gpu_gb"),
        "fits": fits,
        "gpu_hours": predicted.get("gpu_hours"),
    }


def _step_times(seconds: list[float], basis: list[str]) -> str:
    """`19.8 / 16.8 (observed)`, or each with its own basis where they differ."""
    if not seconds:
        return "n/a"
    if len(set(basis)) == 1:
        return " / ".join(f"{s:.1f}" for s in seconds) + f" ({basis[0]})"
    return " / ".join(f"{s:.1f} ({b})" for s, b in zip(seconds, basis))


def render_variants(rows: list[dict]) -> str:
    """A markdown table of `variant_row`s."""
    def cells(r: dict) -> list[str]:
        return [
            r["variant"], r["hardware"], f"{r['steps']:,}", tokens_text(r["tokens"]), _step_times(r["step_seconds"], r["basis"]),
            " / ".join(f"{m:.1%}" for m in r["mfu"] if m is not None) or "n/a",
            f"{r['days']:.0f}" + (f" ({r['end_date']})" if r["end_date"] else "") if r["days"] is not None else "n/a",
            f"{gb_text(r['peak_gb'])} of {gb_text(r['hbm_gb'])}" if r["peak_gb"] is not None else "n/a",
            {True: "fits", False: "DOES NOT FIT", None: "n/a"}[r["fits"]],
            f"{r['gpu_hours']:,.0f}" if r["gpu_hours"] is not None else "n/a",
        ]

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    return "\n".join(lines)
