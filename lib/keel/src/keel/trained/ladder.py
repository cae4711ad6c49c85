"""Loss prediction from a scaling ladder: fit L(C) = E + A * (C / C0)^-alpha to small runs, predict a bigger one.

A ladder is a few finished training runs over a range of compute C (training FLOPs: the fact
sheet's FLOPs per token, attention and lm_head included, times the tokens trained). The fit step
reads each run's final validation loss, fits the curve with scipy's `curve_fit` (C0, the ladder's
geometric mean compute, only keeps the numbers well conditioned) and writes the prediction for
the target's compute with a 95% band from the jackknife over the rungs (`Fit.band`). A training step declares the prediction as `predicted_loss=`;
`keel plan` prints it, and `keel status`, `keel compare` and the dashboard set the run's final
validation loss against it and flag a run that leaves the band. No jax here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from keel.executor import storage
from keel.executor.step import OutputOf, Step, StepDeclarationError, this_output
from keel.spec.metrics import METRICS_FILE, latest_by_step, read_metrics

FIT_FILE, PREDICTION_FILE, CHECK_FILE = "fit.json", "prediction.json", "check.json"
BAND = 0.95


@dataclass(frozen=True)
class LadderConfig:
    """The fit step: `runs` maps labels to finished training steps, `compute` the same labels to
    their training FLOPs; `target` names the predicted run and `target_compute` its FLOPs.

    Where a run is a declared training step, its compute is derived from that step's own config,
    so a `--set` that retrains a rung on more steps or another batch changes what the fit reads
    too; `compute` stands for runs given as paths (and for the resolved config the step receives)."""

    runs: dict[str, str]
    target: str
    target_compute: float
    compute: dict[str, float] = field(default_factory=dict)
    output_path: str = this_output()

    def __post_init__(self):
        derived = {label: training_compute(run.config.model, run.config.train) for label, run in self.runs.items()
                   if isinstance(run, Step)}
        if derived:
            object.__setattr__(self, "compute", {**self.compute, **derived})
        if set(self.runs) != set(self.compute):
            raise ValueError(f"LadderConfig: runs {sorted(self.runs)} and compute {sorted(self.compute)} name different runs")
        if len(self.runs) < 4:
            raise ValueError(f"LadderConfig: {len(self.runs)} runs cannot fit 3 parameters with a residual to spare: give 4 or more")
        if len({round(math.log(c), 6) for c in self.compute.values()}) < len(self.compute):
            raise ValueError("LadderConfig: two runs have the same compute; give each rung its own")


@dataclass(frozen=True)
class PredictionCheckConfig:
    """The predicted run against its prediction, once it has trained: `run` is the training step,
    `prediction` the prediction.json it declared."""

    run: str
    prediction: str
    output_path: str = this_output()


@dataclass(frozen=True)
class Fit:
    """L(C) = E + A * (C / c0)^-alpha; `covariance` of (E, A, alpha) as least squares estimates it
    (None when not finite), `leave_one_out` the parameters refitted without each rung in turn."""

    E: float
    A: float
    alpha: float
    c0: float
    covariance: list[list[float]] | None
    leave_one_out: list[tuple[float, float, float]]

    def loss(self, compute: float, params: tuple[float, float, float] | None = None) -> float:
        E, A, alpha = params or (self.E, self.A, self.alpha)
        return E + A * (compute / self.c0) ** -alpha

    def band(self, compute: float) -> tuple[float, float, str]:
        """The 95% band of L(compute): the jackknife's standard error over the rungs (how far the
        prediction moves when one rung is left out) times Student's t with n - 1 degrees of freedom.
        With 3 parameters and a handful of rungs the covariance says little (one or two residual
        degrees of freedom, a parameter often at its bound); the jackknife says how much the
        prediction rests on each rung."""
        from scipy import stats

        n = len(self.leave_one_out)
        values = [self.loss(compute, p) for p in self.leave_one_out]
        mean = sum(values) / n
        se = math.sqrt((n - 1) / n * sum((v - mean) ** 2 for v in values))
        half = float(stats.t.ppf((1 + BAND) / 2, n - 1)) * se
        centre = self.loss(compute)
        return centre - half, centre + half, f"jackknife over {n} rungs"


def fit_power_law(compute: list[float], loss: list[float]) -> Fit:
    """Least squares of L = E + A (C/c0)^-alpha with 0 <= E < min(loss), A > 0, 0 < alpha < 3, and
    the same fit without each rung in turn (4 rungs or more)."""
    import numpy as np

    c, y = np.asarray(compute, float), np.asarray(loss, float)
    if len(c) < 4:
        raise ValueError(f"a ladder of {len(c)} rungs: fitting 3 parameters and their uncertainty takes 4 or more")
    c0 = float(np.exp(np.log(c).mean()))
    params, cov = _curve_fit(c / c0, y)
    finite = cov is not None and bool(np.all(np.isfinite(cov)))
    loo = [_curve_fit(np.delete(c, i) / c0, np.delete(y, i))[0] for i in range(len(c))]
    return Fit(*params, c0=c0, covariance=cov.tolist() if finite else None, leave_one_out=loo)


def _curve_fit(x, y):
    import warnings

    import numpy as np
    from scipy.optimize import curve_fit

    def curve(x, E, A, alpha):
        return E + A * x ** -alpha

    floor = float(y.min())
    start = (0.5 * floor, max(float(y.max() - 0.5 * floor), 1e-3), 0.3)
    with warnings.catch_warnings():  # an exactly determined fit has no covariance: handled by the caller
        warnings.simplefilter("ignore")
        params, cov = curve_fit(curve, x, y, p0=start, bounds=([0.0, 0.0, 1e-3], [floor, np.inf, 3.0]), maxfev=20_000)
    return tuple(float(p) for p in params), (cov if len(x) > 3 else None)


def final_val_loss(run_path: str) -> tuple[int, float] | None:
    """(step, eval/loss) of the run's last evaluation, or None before its first."""
    try:
        evals = latest_by_step(read_metrics(storage.join(run_path, METRICS_FILE)), "eval/loss")
    except FileNotFoundError:
        return None
    return (max(evals), evals[max(evals)]) if evals else None


def ladder_step(config: LadderConfig) -> None:
    """Step function: fit.json (the rungs, the fit) and prediction.json (the target's loss and band)."""
    rungs = []
    for label, path in config.runs.items():
        found = final_val_loss(path)
        if found is None:
            raise ValueError(f"ladder run {label} ({path}) recorded no validation loss: give it eval_batches > 0")
        if not math.isfinite(found[1]):
            raise ValueError(f"ladder run {label} ({path}) ended with validation loss {found[1]} at step {found[0]}: a "
                             "power law cannot be fitted through it; look at that rung's metrics.jsonl (a diverged run "
                             "wants a lower learning rate; a split with nothing to evaluate, more validation documents)")
        rungs.append({"run": label, "compute": config.compute[label], "step": found[0], "loss": found[1]})
    fit = fit_power_law([r["compute"] for r in rungs], [r["loss"] for r in rungs])
    for r in rungs:
        r["fitted"] = fit.loss(r["compute"])
    low, high, method = fit.band(config.target_compute)
    prediction = {"target": config.target, "compute": config.target_compute, "loss": fit.loss(config.target_compute),
                  "low": low, "high": high, "band": BAND, "method": method,
                  "law": f"L(C) = {fit.E:.4f} + {fit.A:.4f} * (C / {fit.c0:.4g})^-{fit.alpha:.4f}"}
    storage.write_json(storage.join(config.output_path, FIT_FILE), {
        "rungs": rungs, "E": fit.E, "A": fit.A, "alpha": fit.alpha, "c0": fit.c0, "covariance": fit.covariance,
        "leave_one_out": fit.leave_one_out, "prediction": prediction})
    storage.write_json(storage.join(config.output_path, PREDICTION_FILE), prediction)
    for r in rungs:
        print(f"rung {r['run']}: C = {r['compute']:.3g} FLOPs, val loss {r['loss']:.4f} (fit {r['fitted']:.4f})")
    print(f"fit {prediction['law']}")
    print(describe(prediction))


def check_step(config: PredictionCheckConfig) -> None:
    """Step function: check.json and a printed line with the prediction error on the predicted run."""
    prediction = read_prediction(config.prediction)
    actual = final_val_loss(config.run)
    if prediction is None or actual is None:
        raise ValueError(f"nothing to check: prediction {config.prediction} or the run's validation loss is missing")
    error = actual[1] - prediction["loss"]
    where = judge(actual[1], prediction)
    result = {"prediction": prediction, "actual": actual[1], "step": actual[0], "error": error,
              "relative_error": error / actual[1], "verdict": where}
    storage.write_json(storage.join(config.output_path, CHECK_FILE), result)
    print(f"prediction error on {prediction['target']}: actual val loss {actual[1]:.4f} - predicted {prediction['loss']:.4f} "
          f"= {error:+.4f} ({error / actual[1]:+.1%}); "
          + ("within" if where == "within" else f"OUTSIDE ({where})")
          + f" the {prediction['band']:.0%} band [{prediction['low']:.4f}, {prediction['high']:.4f}]")


def describe(prediction: dict) -> str:
    """`predicted val loss 4.2351 (95% band 3.6616-4.8086, jackknife over 4 rungs) for hidden 128, 64 steps at C = 1.8e+11 FLOPs`."""
    return (f"predicted val loss {prediction['loss']:.4f} ({prediction['band']:.0%} band {prediction['low']:.4f}-"
            f"{prediction['high']:.4f}, {prediction['method']}) for {prediction['target']} at C = {prediction['compute']:.3g} FLOPs")


def training_compute(model, train) -> float:
    """A run's training FLOPs: FLOPs per token (attention and lm_head included) x tokens trained."""
    return model.flops_per_token(train.seq_len) * train.total_tokens


def check_predicted_compute(name: str, predicted, model, train) -> None:
    """A prediction is for one compute: refuse it for a run of another. `default_train` checks the
    declaration, and `keel plan` and `keel run` the graph after `--set`, which can change either side."""
    fit = predicted.step.config if isinstance(predicted, OutputOf) and isinstance(predicted.step, Step) else None
    if not isinstance(fit, LadderConfig):
        raise TypeError(f"{name}: predicted_loss is a {type(predicted).__name__}; give a scaling ladder's prediction "
                        "(default_scaling_ladder(...).prediction)")
    compute = training_compute(model, train)
    if abs(compute - fit.target_compute) > 1e-9 * fit.target_compute:
        raise StepDeclarationError(f"{name}: predicted_loss was made for {fit.target_compute:.4g} FLOPs, this run trains "
                                   f"{compute:.4g}: declare the run the ladder predicts (its target_model and target_train)")


def prediction_location(graph, step) -> str | None:
    """Where the prediction a training step declares (`predicted_loss=`) is written, or None."""
    declared = getattr(step.config, "predicted_loss", None)
    if isinstance(declared, OutputOf):
        return storage.join(graph.path(declared.step), declared.subpath)
    return declared if isinstance(declared, str) else None


def plan_line(graph, step) -> str | None:
    """The fact sheet's line for a training step that declares a prediction (None when it does not)."""
    location = prediction_location(graph, step)
    if location is None:
        return None
    prediction = read_prediction(location)
    if prediction is None:
        return f"prediction   not made yet: the ladder's fit writes {location} before this run trains"
    return f"prediction   {describe(prediction)}"


def read_prediction(location: str | None) -> dict | None:
    """The prediction.json at `location`, or None (no prediction declared, or the fit has not run)."""
    return storage.read_json(location) if location else None


def judge(actual: float | None, prediction: dict | None) -> str | None:
    """'within' / 'above' / 'below' the band, or 'not finite' (a NaN or infinite loss, outside any
    band; NaN compares neither above nor below); None when either is missing."""
    if actual is None or prediction is None:
        return None
    if not math.isfinite(actual):
        return "not finite"
    return "above" if actual > prediction["high"] else "below" if actual < prediction["low"] else "within"


def status_line(graph, plan) -> str | None:
    """`keel status`'s line for a run that declares a prediction: the prediction and, once the run
    has evaluated, its validation loss against the band (judged at the end; mid-run it is shown only).
    The prediction is found through the graph (`prediction_location`), as `keel plan` finds it, not
    at the path the run's step.json froze: a changed ladder or a copied prefix writes it elsewhere."""
    prediction = read_prediction(prediction_location(graph, plan.step))
    if prediction is None:
        return None
    line = describe(prediction)
    actual = final_val_loss(plan.output_path)
    if actual is not None:
        num_steps = plan.step.config.train.num_steps
        where = judge(actual[1], prediction)
        verdict = ("within the band" if where == "within" else f"OUTSIDE the band ({where})") if actual[0] == num_steps \
            else f"of {num_steps} steps: judged at the end"
        line += f"; actual {actual[1]:.4f} at step {actual[0]}: {verdict}"
    return line
