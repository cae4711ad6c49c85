"""Launch figures: what a run costs beyond its step time, for the go / no-go decision.

- checkpoints: what one holds (every parameter in the master dtype and the optimizer state: what a
  resume needs), how many the declared cadence keeps, and the write time at the declared store
  bandwidth (`LaunchPlan.store_gb_per_s`);
- GPU-hours at the run's length (from its start to the end its own observations project, else the
  step-time model's prediction at full goodput), and their cost at a declared price;
- tokens read from each mixture component over the run (the shares its mixture blocks draw, whole
  sequences per block: `Mixture.block_counts`) against the tokens its cache holds
  (`LaunchPlan.cache_tokens`): above 1 the component repeats.
"""

from __future__ import annotations

from keel.spec.checks import PlanError
from keel.spec.dtypes import bytes_of
from keel.spec.mixture import SINGLE
from keel.spec.resolved import ResolvedRun

GB = 1e9


def checkpoints(run: ResolvedRun) -> dict:
    """Size of one checkpoint, the permanent ones the cadence keeps, and their total."""
    train = run.config.train
    master = bytes_of(train.master_dtype, "train.master_dtype")
    size = sum(p.size * master * (1 + p.moments) for p in run.parameters) / GB  # moments in the master dtype, as `state_at`
    every = train.permanent_checkpoint_every
    steps = set(range(every, train.num_steps, every)) if every else set()
    steps |= {t.start_step for t in run.transports if t.start_step > 0} | {train.num_steps}
    rolling = train.keep_rolling_checkpoints if train.rolling_checkpoint_every or train.rolling_checkpoint_minutes else 0
    return {"gb": size, "permanent": len(steps), "rolling_kept": rolling, "retained_gb": size * (len(steps) + rolling)}


def run_hours(sheet: dict) -> tuple[float, str] | None:
    """(hours, how they were found) of the whole run: from its start to the end its observed speeds
    project (the GPUs are held through its slower stretches too), else the step-time model's prediction."""
    if sheet.get("time"):
        return sheet["time"]["projected_days"] * 24, "from the start to the projected end"
    predicted = sheet.get("step_time")
    if predicted and "run_days" in predicted:
        return predicted["run_days"] * 24, "predicted, at full goodput"
    return None


def launch(run: ResolvedRun, sheet: dict) -> dict:
    config = run.config
    plan, topo = config.launch, config.topology
    ckpt = checkpoints(run)
    if plan and plan.store_gb_per_s:
        ckpt["write_seconds"] = ckpt["gb"] / plan.store_gb_per_s
        ckpt["store_gb_per_s"] = plan.store_gb_per_s
    out: dict = {"checkpoint": ckpt}
    hours = run_hours(sheet)
    if hours and topo is not None:
        gpu_hours = hours[0] * topo.num_devices
        out["gpu_hours"] = {"hours": gpu_hours, "basis": hours[1],
                            "cost": gpu_hours * plan.gpu_hour_price if plan and plan.gpu_hour_price else None}
    read: dict[str, float] = {}
    for phase in sheet["mixture"]:  # what the blocks draw (whole sequences), not the declared weights
        for name, share in phase["drawn"].items():
            read[name] = read.get(name, 0.0) + share * phase["tokens"]
    if config.data.is_single:  # one cache, no phases: it serves every token
        read[SINGLE] = float(config.train.total_tokens)
    held = dict(plan.cache_tokens) if plan else {}
    unknown = sorted(set(held) - set(read))
    if unknown:
        raise PlanError(f"launch.cache_tokens names {', '.join(unknown)}, which the mixture does not have: use its "
                        f"component names ({', '.join(sorted(read))})")
    out["components"] = [{"component": name, "tokens_read": tokens, "cache_tokens": held.get(name),
                          "epochs": tokens / held[name] if held.get(name) else None} for name, tokens in read.items()]
    return out
