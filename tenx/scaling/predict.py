"""`tenx predict`: the whole predicted loss curve of a run, with a band, as prediction.json and a PNG.

Two sources:
- a ladder (`predict_from_ladder`): the curve law (tenx.scaling.curve) fitted jointly to every logged step
  of every ladder run, then evaluated on the target config's own schedule and parameter count;
- the run itself (`predict_from_run`): the law fitted to the curve so far, its shape pinned softly by
  priors, extrapolated to the run's last step. Call it again as the run goes on.

The file format is tenx.monitor.prediction_file's (versioned); the monitor watches a run against it.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import numpy as np

from tenx import rundir
from tenx.errors import ConfigError, TenxError
from tenx.model.flops import count_params
from tenx.monitor.loss_plot import plot_prediction
from tenx.monitor.prediction_file import Prediction, write_prediction
from tenx.scaling.curve import (
    DEFAULT_LAW,
    EXTRAPOLATION_LAW,
    CurvePrediction,
    extrapolate_run,
    fit_curves,
    predict_curve,
    read_curves,
    schedule_from_config,
    shape_prior,
)
from tenx.train.config import RunConfig, tokens_per_step, total_steps
from tenx.utils.io import check_output_file

PREDICTION = rundir.PREDICTION
PREDICTION_PNG = rundir.PREDICTION_PNG


def params_of(cfg: RunConfig) -> int:
    """Total parameters of cfg's model (the vocabulary from model.vocab_size or data.dir's manifest)."""
    from tenx.scaling.ladder.rungs import vocab_size_of

    try:
        vocab = vocab_size_of(cfg)
    except (OSError, TenxError) as e:
        raise ConfigError(
            f"model.vocab_size: not set, and data.dir {cfg.data.dir} gives no vocabulary ({e}); set "
            "model.vocab_size or prepare the data first"
        ) from None
    return count_params(cfg.model.resolved(vocab)).total


STORED_POINTS = 2000
"""prediction.json stores at most about this many steps of a longer curve: half log-spaced (the fast start),
half evenly spaced (a late decay), and the last step; readers interpolate between them (Prediction.at)."""

MAX_BOOTSTRAP = 1000
"""The most bootstrap refits `tenx predict` makes (each is a whole fit; 1000 already pins a 95% band)."""

QUANTITIES = {"loss": "train_loss", "val_loss": "val_loss"}
"""Metrics column -> prediction.json's `quantity`: the training loss (smoothed) or the validation loss."""


def stored_indexes(count: int, points: int = STORED_POINTS) -> np.ndarray:
    """Which of `count` predicted steps prediction.json keeps: all of a short curve; of a longer one, about
    `points` (log- and evenly spaced, the first and the last always), sorted and unique."""
    if count <= points:
        return np.arange(count)
    half = max(1, points // 2)
    spaced = np.concatenate(
        [np.geomspace(1, count, half) - 1, np.linspace(0, count - 1, half), [0, count - 1]]
    )
    return np.unique(spaced.round().astype(np.int64))


def _to_prediction(
    cp: CurvePrediction, window: int, source: dict[str, Any], target: dict[str, Any], quantity: str = "loss"
) -> Prediction:
    keep = stored_indexes(len(cp.steps)).tolist()
    return Prediction(
        quantity=QUANTITIES[quantity],
        step=[cp.steps[i] for i in keep],
        tokens=[int(round(cp.tokens[i])) for i in keep],
        loss=[cp.loss[i] for i in keep],
        lower=[cp.lower[i] for i in keep],
        upper=[cp.upper[i] for i in keep],
        level=cp.level,
        window=window,
        source={**source, "law": cp.law, "step_sigma": cp.step_sigma},
        target={**target, "params": cp.params, "schedule": cp.schedule},
    )


def _window(steps: int, windows: int) -> int:
    """Steps per smoothing window when `steps` are cut into `windows` (fit_curves: 48, extrapolate_run: 24)."""
    return max(1, steps // max(1, windows))


def predict_from_ladder(
    ladder_dir: str | Path,
    cfg: RunConfig,
    *,
    law: str = DEFAULT_LAW,
    world_size: int = 1,
    bootstrap: int = 30,
    config_name: str = "",
    quantity: str = "auto",
    prior_curves: str | Path | None = None,
) -> tuple[Prediction, Any]:
    """Fit `law` to every run of the ladder in `ladder_dir` (its runs/ folder) and predict `cfg`'s curve
    of `quantity` (`ladder_curves`: `auto` takes the validation loss when every run logged enough of it).
    With `prior_curves` (a curve table), the law's shape (exponents, lag, annealing) carries a soft prior
    from a fit to those curves, and the prediction's source says so.

    Returns (prediction, the fit). The band combines the fit's bootstrap and the scatter of the ladder's
    smoothed curves about it (seed and data-order noise included)."""
    ladder_dir = Path(ladder_dir)
    runs = ladder_dir / "runs"
    if not runs.is_dir():
        raise TenxError(
            f"{ladder_dir}: not a ladder directory (no runs/ folder); run `tenx ladder --out {shlex.quote(str(ladder_dir))}` first"
        )
    curves = ladder_curves(runs, quantity)
    prior, said = _curves_prior(prior_curves, law) if prior_curves is not None else (None, {})
    fit = fit_curves(curves, law, bootstrap=bootstrap, prior=prior)
    tps = tokens_per_step(cfg.train, cfg.model.seq_len, world_size)
    steps = total_steps(cfg.train, tps)
    schedule = schedule_from_config(cfg.optim, steps, tps)
    params = params_of(cfg)
    cp = predict_curve(fit, schedule, params)
    largest = max(c.params for c in curves)
    source = {
        "kind": "ladder",
        "ladder_dir": str(ladder_dir),
        "runs": len(curves),
        "size_law": fit.size_law,
        "largest_ladder_params": largest,
        "extrapolation_in_params": params / largest,
        "window_sigma": fit.window_sigma,
        **said,
    }
    target = {"config": config_name, "steps": steps, "tokens_per_step": tps, "world_size": world_size}
    q = curves[0].quantity
    window = _window(steps, 48) if q == "loss" else 1
    return _to_prediction(cp, window, source, target, q), fit


def ladder_curves(runs: Path, quantity: str = "auto") -> list[Any]:
    """The ladder runs' curves of `quantity`: `loss`, `val_loss`, or `auto`: the validation loss (no batch
    noise; what the ladder's held-out figures measure) when every run logged at least 2 after warmup
    (ladder.evals_per_run), else the training loss."""
    if quantity not in ("auto", *QUANTITIES):
        raise ConfigError(f"--quantity: {quantity!r} is not one of auto, {', '.join(QUANTITIES)}")
    if quantity != "auto":
        return read_curves(runs, quantity)
    try:
        curves = read_curves(runs, "val_loss")
    except TenxError:  # a run without validation records
        return read_curves(runs, "loss")
    enough = all(int((c.steps >= c.schedule.first_step).sum()) >= 2 for c in curves)
    return curves if enough else read_curves(runs, "loss")


def predict_from_run(
    run_dir: str | Path,
    *,
    law: str = EXTRAPOLATION_LAW,
    bootstrap: int = 20,
    quantity: str = "loss",
    prior_curves: str | Path | None = None,
) -> tuple[Prediction, Any]:
    """Extrapolate a run's curve of `quantity` (`loss` or `val_loss`) so far to its last step (its
    config's schedule). With `prior_curves` (a curve table) the law's shape prior is a fit to those curves
    instead of DEFAULT_PRIORS, and the prediction's source says so."""
    from tenx.scaling.curve import curve_from_run

    if quantity not in QUANTITIES:
        raise ConfigError(f"--quantity: {quantity!r} is not one of {', '.join(QUANTITIES)} for --run")
    curve = curve_from_run(run_dir, quantity=quantity)
    steps_so_far = int(curve.steps.max()) if len(curve.steps) else 0
    prior, said = _curves_prior(prior_curves, law) if prior_curves is not None else (None, {})
    cp, fit = extrapolate_run(curve, law, bootstrap=bootstrap, prior=prior)
    source = {"kind": "self", "run_dir": str(run_dir), "upto_step": steps_so_far, **said}
    target = {"steps": curve.schedule.steps, "tokens_per_step": curve.config.get("tokens_per_step")}
    window = _window(steps_so_far or curve.schedule.steps, 24) if quantity == "loss" else 1
    return _to_prediction(cp, window, source, target, quantity), fit


def curve_fit_of(
    fit_table: Any, *, law: str = DEFAULT_LAW, bootstrap: int = 30, split: str | None = None
) -> tuple[Any, list[Any]]:
    """Fit `law` to every observed curve of a curve table (one split): the size law across 3 or more sizes,
    else a level per size. Returns (fit, the table's runs of that split)."""
    runs = fit_table.select(split)
    curves = [r.curve() for r in runs if r.observed.any()]
    if not curves:
        raise ConfigError(f"--curves {fit_table.path}: no run has a logged loss to fit")
    return fit_curves(curves, law, bootstrap=bootstrap), runs


def _curves_prior(curves_path: str | Path, law: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The soft prior on `law`'s unit-free shape from a fit to a curve table's runs (shape_prior), and what
    the prediction's source says about it."""
    from tenx.scaling.curve.curve_table import read_curve_table

    fit, _ = curve_fit_of(read_curve_table(curves_path), law=law, bootstrap=0)
    return shape_prior(fit), {"prior": f"shape of {law} fitted to {len(fit.curves)} runs of {curves_path}"}


def check_bootstrap(bootstrap: int) -> None:
    """--bootstrap within 0..MAX_BOOTSTRAP, or a ConfigError."""
    if not 0 <= bootstrap <= MAX_BOOTSTRAP:
        raise ConfigError(f"--bootstrap: must be >= 0 and at most {MAX_BOOTSTRAP}, got {bootstrap}")


def write_outputs(
    prediction: Prediction, out_dir: str | Path, metrics: str | Path | None = None, title: str = ""
) -> dict[str, Path]:
    """prediction.json and prediction.png in `out_dir` (the plot shows `metrics` if given)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = write_prediction(out_dir / PREDICTION, prediction)
    png = plot_prediction(prediction, out_dir / PREDICTION_PNG, metrics, title)
    return {"prediction": path, "plot": png}


def check_out_dir(out: str | Path, run_dir: str | Path | None, force: bool = False) -> Path:
    """`-o DIR` as a directory `tenx predict` may write prediction.json and prediction.png into, or a
    TenxError: not an existing file; never a run directory's own prediction.json (the one the run is watched
    against: of `run_dir`, or of any run directory `out` is), even with `force`; other existing files only
    with `force`."""
    out_dir = Path(out)
    if not str(out) or (out_dir.exists() or out_dir.is_symlink()) and not out_dir.is_dir():
        raise TenxError(
            f"-o {str(out) or repr(str(out))} is not a directory: -o names the directory that gets "
            f"{PREDICTION} and {PREDICTION_PNG}"
        )
    watched = [rundir.RunDir(run_dir).prediction] if run_dir is not None else []
    if rundir.RunDir(out_dir).config.exists():
        watched.append(rundir.RunDir(out_dir).prediction)
    for name in (PREDICTION, PREDICTION_PNG):
        try:
            check_output_file(out_dir / name, force=force, inputs=tuple(watched))
        except TenxError as e:
            if name == PREDICTION and any(_same(out_dir / name, w) for w in watched):
                raise TenxError(
                    f"-o {out}: {out_dir / name} is a run's own prediction, the one it is watched against; "
                    "tenx predict never overwrites it: choose another -o"
                ) from None
            raise TenxError(f"-o {out}: {e}") from None
    return out_dir


def _same(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


def format_prediction(prediction: Prediction) -> str:
    """A few lines for the terminal: the final loss with its band, and where it came from."""
    f = prediction.final
    src = prediction.source
    where = (
        f"from {src.get('runs')} ladder runs in {src.get('ladder_dir')} ({src.get('law')} law, "
        f"{src.get('extrapolation_in_params', 0):.1f}x the largest ladder model)"
        if src.get("kind") == "ladder"
        else f"from the first {src.get('upto_step')} steps of {src.get('run_dir')} ({src.get('law')} law)"
    )
    if src.get("prior"):
        where += f"; prior: {src['prior']}"
    level = round(100 * prediction.level)
    what = "validation" if prediction.quantity == "val_loss" else "training"
    smoothed = f", smoothed over {prediction.window} steps" if prediction.window > 1 else ""
    return (
        f"predicted {what} loss at step {f['step']}: {f['loss']:.4f} nats/token "
        f"({level}% band {f['lower']:.4f} .. {f['upper']:.4f}){smoothed}\n{where}"
    )


def default_out(run_dir: str | Path | None, ladder_dir: str | Path | None, config: str) -> Path:
    """Where `tenx predict` writes without -o: RUN_DIR/extrapolation (RUN_DIR/prediction.json is the
    prediction the run is watched against, never overwritten here), or LADDER_DIR/predictions/NAME."""
    if run_dir is not None:
        return rundir.RunDir(run_dir).extrapolation
    assert ladder_dir is not None
    return Path(ladder_dir) / "predictions" / (Path(config).stem or "target")


def run_predict(
    *,
    ladder_dir: str | Path | None = None,
    config: str | None = None,
    overrides: list[str] | None = None,
    run_dir: str | Path | None = None,
    curves: str | Path | None = None,
    law: str | None = None,
    world_size: int = 1,
    bootstrap: int = 30,
    out: str | Path | None = None,
    quantity: str | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """What `tenx predict` does: predict (from a ladder for `config`, or a run from its own curve), write
    prediction.json and prediction.png, and return {"prediction", "paths", "text"}. The runs of a curve
    table: tenx.scaling.predict_curves.run_predict_table.

    `curves` with `ladder_dir` or `run_dir`: a curve table whose fit is the prior on the law's shape.
    `out`: the output directory; the default one is rewritten each time, files in any other are replaced
    only with `force`, and a run directory's own prediction.json never (check_out_dir)."""
    from tenx.train.config import load_run_config, resolve_config_path

    check_bootstrap(bootstrap)
    if (ladder_dir is None) == (run_dir is None):
        raise ConfigError(
            "tenx predict: give either --from LADDER_DIR (with --config), --run RUN_DIR, or --curves FIT "
            "--target TARGET --out DIR"
        )
    if world_size < 1:
        raise ConfigError(f"--world-size: must be >= 1, got {world_size}")
    out_dir = default_out(run_dir, ladder_dir, config or "")
    if out is not None:
        out_dir = check_out_dir(out, run_dir, force)
    if run_dir is not None:
        if config or overrides:
            raise ConfigError("tenx predict --run: the run's own config.toml is used; drop --config/--set")
        prediction, _ = predict_from_run(
            run_dir,
            law=law or EXTRAPOLATION_LAW,
            bootstrap=bootstrap,
            quantity=quantity or "loss",
            prior_curves=curves,
        )
        metrics: Path | None = rundir.RunDir(run_dir).metrics
        title = f"{run_dir}: extrapolated from its own curve"
    else:
        if not config:
            raise ConfigError("tenx predict --from: name the config to predict with --config CFG")
        cfg = load_run_config(resolve_config_path(config), overrides)
        assert ladder_dir is not None
        prediction, _ = predict_from_ladder(
            ladder_dir,
            cfg,
            law=law or DEFAULT_LAW,
            world_size=world_size,
            bootstrap=bootstrap,
            config_name=config,
            quantity=quantity or "auto",
            prior_curves=curves,
        )
        metrics, title = None, f"{config}: predicted from {ladder_dir}"
    paths = write_outputs(prediction, out_dir, metrics, title)
    text = f"{format_prediction(prediction)}\nprediction: {paths['prediction']}\nplot: {paths['plot']}"
    return {"prediction": prediction, "paths": paths, "text": text}
