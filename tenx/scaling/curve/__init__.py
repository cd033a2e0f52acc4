"""Loss-curve laws that account for the learning-rate schedule: fit runs' whole training curves, predict
the curve of another schedule, length or model size with a band, and extrapolate a run from its start.

`tenx fit` (tenx/scaling/fit/) fits final losses L(N, D); a final loss says nothing about the path, and a
run of a different schedule or length ends elsewhere. Here the loss at every step is a function of the
progress made (the area under the learning rate, relative to the run's peak, in tokens) minus what the
learning rate's decay has bought so far (Tissue et al. 2024; Luo et al. 2025's multi-power law), with a
schedule-blind power law in tokens as the baseline. evaluate.py measures them on real tenx runs; the
stored run set is tests/data/curves (its README says how it was made and what each law scored).

Modules, each importing only those listed after it: evaluate (the measurements: cross-schedule,
leave-largest-out, self-extrapolation), predict (whole curves with bands, self-extrapolation), fitting
(smoothing, the robust multi-start fit, bootstrap, CurveFit; and tenx.scaling.fit.solver for
single-threaded BLAS), laws (the laws and size terms as columns of linear coefficients), schedule
(schedules from an OptimConfig or a metrics lr column, progress variables, curves from run directories).
"""

from tenx.scaling.curve.backtest import (
    benchmark,
    curve_error,
    curves_by_budget,
    protocol,
    self_extrapolation_error,
    split_error,
)
from tenx.scaling.curve.curve_laws import (
    DEFAULT_LAW,
    DEFAULT_PRIORS,
    EXTRAPOLATION_LAW,
    LAWS,
    SIZE_LAWS,
    Law,
    design,
)
from tenx.scaling.curve.extrapolate import (
    PRIOR_SD,
    CurvePrediction,
    extrapolate_run,
    predict_curve,
    prior_from,
    shape_prior,
)
from tenx.scaling.curve.fitting import CurveFit, fit_curves, fit_from_params, log_predict
from tenx.scaling.curve.schedule import (
    PARAMS_UNIT,
    PROGRESS_UNIT,
    SCHEDULES,
    Curve,
    Schedule,
    curve_from_records,
    curve_from_run,
    read_curves,
    schedule_from_config,
    schedule_from_lr,
)

__all__ = [
    "DEFAULT_LAW",
    "DEFAULT_PRIORS",
    "EXTRAPOLATION_LAW",
    "LAWS",
    "PARAMS_UNIT",
    "PRIOR_SD",
    "PROGRESS_UNIT",
    "SCHEDULES",
    "SIZE_LAWS",
    "Curve",
    "CurveFit",
    "CurvePrediction",
    "Law",
    "Schedule",
    "benchmark",
    "curves_by_budget",
    "curve_error",
    "curve_from_records",
    "curve_from_run",
    "design",
    "extrapolate_run",
    "fit_curves",
    "fit_from_params",
    "log_predict",
    "predict_curve",
    "prior_from",
    "protocol",
    "read_curves",
    "schedule_from_config",
    "schedule_from_lr",
    "self_extrapolation_error",
    "shape_prior",
    "split_error",
]
