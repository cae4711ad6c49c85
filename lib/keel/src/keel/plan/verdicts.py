"""Whether a run fits where it is going, judged at the step's peak: the check `keel plan` exits
non-zero on and `keel run` refuses (unless the step declares `train.refuse_unfit=False`)."""

from __future__ import annotations

from keel.spec.checks import PlanError


def verdict(sheet: dict, enforced: bool) -> dict:
    """The memory problems of a fact sheet: every stretch whose peak exceeds the HBM, every one
    whose offloaded state exceeds a host's RAM; `fits` False with any problem, None when the sheet
    cannot tell."""
    memory = sheet.get("memory") or {}
    problems = []
    for phase in memory.get("phases", ()):
        if phase["fits"] is False:
            problems.append(f"from step {phase['from_step']:,} the peak is {phase['peak_gb']:.1f} GB per GPU (in the {phase['peak_in']}), "
                            f"{-phase['headroom_gb']:.1f} GB over the {memory['hbm_per_gpu_gb']:g} GB HBM")
        if phase["host_fits"] is False:
            problems.append(f"from step {phase['from_step']:,} the offloaded state is {phase['host_per_host_gb']:.1f} "
                            f"GB per host, over its {memory['host_ram_per_host_gb']:g} GB RAM")
    known = [p["fits"] for p in memory.get("phases", ())]
    fits = False if problems else None if not known or None in known else True
    return {"fits": fits, "problems": problems, "enforced": enforced}


def check_fits(sheets: list[dict]) -> None:
    """Raise `PlanError` naming each step that does not fit and has not declared it may run anyway."""
    refused = [s for s in sheets if s["verdict"]["problems"] and s["verdict"]["enforced"]]
    if refused:
        named = [s["step"] or "STEP" for s in refused]  # a sheet made outside a graph has no step name
        raise PlanError(" / ".join(f"{name}: {'; '.join(s['verdict']['problems'])}" for name, s in zip(named, refused))
                        + ": does not fit; lower the batch per GPU (more racks or a smaller batch), offload more state, "
                        "or run anyway with " + " ".join(f"--set {name}:train.refuse_unfit=false" for name in named))
