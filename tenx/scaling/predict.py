"""`tenx predict`: the whole predicted loss curve of a run, with a band, as prediction.json and a PNG.

Two sources:
- a ladder (`predict_from_ladder`): the curve law (tenx.scaling.curve) fitted jointly to every logged step
  of every ladder run, then evaluated on the target config's own schedule and parameter count;
- the run itself (`predict_from_run`): the law fitted to the curve so far, its shape pinned softly by
  priors, extrapolated to the run's last step. Call it again as the run goes on.

The file format is tenx.monitor.prediction's (versioned); the monitor watches a run against it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tenx import rundir
from tenx.errors import ConfigError, TenxError
from tenx.model.flops import count_params
from tenx.monitor.plots import plot_prediction
from tenx.monitor.prediction import Prediction, write_prediction
from tenx.scaling.curve import (
    DEFAULT_LAW,
    EXTRAPOLATION_LAW,
    CurvePrediction,
    extrapolate_run,
    fit_curves,
    predict_curve,
    read_curves,
    schedule_from_config,
)
from tenx.train.config import RunConfig, tokens_per_step, total_steps

PREDICTION = "prediction.json"
PREDICTION_PNG = "prediction.png"


def params_of(cfg: RunConfig) -> int:
    """Total parameters of cfg's model (the vocabulary from model.vocab_size or data.dir's manifest)."""
    from tenx.scaling.planner import vocab_size_of

    try:
        vocab = vocab_size_of(cfg)
    except (OSError, TenxError) as e:
        raise ConfigError(
            f"model.vocab_size: not set, and data.dir {cfg.data.dir} gives no vocabulary ({e}); set "
            "model.vocab_size or prepare the data first"
        ) from None
    return count_params(cfg.model.resolved(vocab)).total


def _to_prediction(
    cp: CurvePrediction, window: int, source: dict[str, Any], target: dict[str, Any]
) -> Prediction:
    return Prediction(
        step=cp.steps,
        tokens=[int(round(t)) for t in cp.tokens],
        loss=cp.loss,
        lower=cp.lower,
        upper=cp.upper,
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
) -> tuple[Prediction, Any]:
    """Fit `law` to every run of the ladder in `ladder_dir` (its runs/ folder) and predict `cfg`'s curve.

    Returns (prediction, the fit). The band combines the fit's bootstrap and the scatter of the ladder's
    smoothed curves about it (seed and data-order noise included)."""
    ladder_dir = Path(ladder_dir)
    runs = ladder_dir / "runs"
    if not runs.is_dir():
        raise TenxError(
            f"{ladder_dir}: not a ladder directory (no runs/ folder); run `tenx ladder --out {ladder_dir}` first"
        )
    curves = read_curves(runs)
    fit = fit_curves(curves, law, bootstrap=bootstrap)
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
    }
    target = {"config": config_name, "steps": steps, "tokens_per_step": tps, "world_size": world_size}
    return _to_prediction(cp, _window(steps, 48), source, target), fit


def predict_from_run(
    run_dir: str | Path, *, law: str = EXTRAPOLATION_LAW, bootstrap: int = 20
) -> tuple[Prediction, Any]:
    """Extrapolate a run from its curve so far to its last step (its config's schedule)."""
    from tenx.scaling.curve import curve_from_run

    curve = curve_from_run(run_dir)
    steps_so_far = int(curve.steps.max()) if len(curve.steps) else 0
    cp, fit = extrapolate_run(curve, law, bootstrap=bootstrap)
    source = {"kind": "self", "run_dir": str(run_dir), "upto_step": steps_so_far}
    target = {"steps": curve.schedule.steps, "tokens_per_step": curve.config.get("tokens_per_step")}
    return _to_prediction(cp, _window(steps_so_far or curve.schedule.steps, 24), source, target), fit


def write_outputs(
    prediction: Prediction, out_dir: str | Path, metrics: str | Path | None = None, title: str = ""
) -> dict[str, Path]:
    """prediction.json and prediction.png in `out_dir` (the plot shows `metrics` if given)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = write_prediction(out_dir / PREDICTION, prediction)
    png = plot_prediction(prediction, out_dir / PREDICTION_PNG, metrics, title)
    return {"prediction": path, "plot": png}


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
    level = round(100 * prediction.level)
    return (
        f"predicted training loss at step {f['step']}: {f['loss']:.4f} nats/token "
        f"({level}% band {f['lower']:.4f} .. {f['upper']:.4f}), smoothed over {prediction.window} steps\n{where}"
    )


def default_out(run_dir: str | Path | None, ladder_dir: str | Path | None, config: str) -> Path:
    """Where `tenx predict` writes without -o: the run's own directory, or LADDER_DIR/predictions/NAME."""
    if run_dir is not None:
        return Path(run_dir)
    assert ladder_dir is not None
    return Path(ladder_dir) / "predictions" / (Path(config).stem or "target")


def run_predict(
    *,
    ladder_dir: str | Path | None = None,
    config: str | None = None,
    overrides: list[str] | None = None,
    run_dir: str | Path | None = None,
    law: str | None = None,
    world_size: int = 1,
    bootstrap: int = 30,
    out: str | Path | None = None,
) -> dict[str, Any]:
    """What `tenx predict` does: predict (from a ladder for `config`, or a run from its own curve), write
    prediction.json and prediction.png, and return {"prediction", "paths", "text"}."""
    from tenx.train.config import load_run_config, resolve_config_path

    if (ladder_dir is None) == (run_dir is None):
        raise ConfigError("tenx predict: give either --from LADDER_DIR (with --config) or --run RUN_DIR")
    if world_size < 1:
        raise ConfigError(f"--world-size: must be >= 1, got {world_size}")
    if bootstrap < 0:
        raise ConfigError(f"--bootstrap: must be >= 0, got {bootstrap}")
    if run_dir is not None:
        if config or overrides:
            raise ConfigError("tenx predict --run: the run's own config.toml is used; drop --config/--set")
        prediction, _ = predict_from_run(run_dir, law=law or EXTRAPOLATION_LAW, bootstrap=bootstrap)
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
        )
        metrics, title = None, f"{config}: predicted from {ladder_dir}"
    paths = write_outputs(
        prediction, Path(out) if out else default_out(run_dir, ladder_dir, config or ""), metrics, title
    )
    text = f"{format_prediction(prediction)}\nprediction: {paths['prediction']}\nplot: {paths['plot']}"
    return {"prediction": prediction, "paths": paths, "text": text}
