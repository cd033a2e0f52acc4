"""`tenx plan choose`: which (N, D, parallelism) to run for a compute budget on a cluster, from a fitted law.

For each model size of the base config's family (its depth varied, width and heads derived from depth as
the ladder does) and each data-parallel strategy (DDP, FSDP2, HSDP), the estimate of tenx/plan/estimate.py
checks memory (the largest micro-batch that fits, at most the config's) and gives the step time, hence
tokens per day. D is the budget divided by the model's training FLOPs per token (attention included), or
what fits in `--days` when that is less. The fit from `tenx fit` (an L(N, D) law: chinchilla or
data-constrained) predicts the final loss. Choices are ranked by predicted final loss (losses within 0.1%
of each other count as equal), then by wall-clock days: the best model the budget (and the days) buys, and
the fastest way to train it on this cluster. Sizes from N*/8 to 8 N* (N*: the fit's compute-optimal size)
a factor sqrt(2) apart are tried. With `--unique-tokens U` the data is limited to U unique tokens (repeated
D/U times): the fit must be data-constrained (L(N, D, U)), the sizes are centred on its optimum under that
limit (tenx.scaling.fit.data_limited_optimal), and each choice gives its epochs and its loss's interval (from
the bootstrap fits `tenx fit` writes in the report).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from tenx.errors import ConfigError

STRATEGIES = ("ddp", "fsdp", "hsdp")
SPAN = 8.0
"""Sizes between N*/SPAN and SPAN x N* (N*: the fit's compute-optimal size), a factor sqrt(2) apart."""
TIE = 1e-3
"""Predicted losses this close (relative; far below any fit's own uncertainty) rank as equal."""


def load_fit(path: str | Path) -> Any:
    """The L(N, D) law of a `tenx fit` report (its `fit` entry); errors name the file and the field."""
    import numpy as np

    from tenx.scaling.fit.laws import FitResult

    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--fit {path}: no such file; run `tenx fit LADDER_DIR` to write one") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"--fit {path}: not a readable JSON report ({e})") from None
    fit = report.get("fit") if isinstance(report, dict) else None
    if not isinstance(fit, dict):
        raise ConfigError(f"--fit {path}: no 'fit' object: is this a `tenx fit` report?")
    law, params = fit.get("law"), fit.get("params")
    if law not in ("chinchilla", "data-constrained"):
        raise ConfigError(
            f"--fit {path}: fit.law is {law!r}; choosing N and D needs an L(N, D) law "
            "(`tenx fit --law chinchilla`)"
        )
    names = ("E", "A", "B", "alpha", "beta")
    if not isinstance(params, dict) or not all(isinstance(params.get(k), (int, float)) for k in names):
        raise ConfigError(f"--fit {path}: fit.params must hold numbers {', '.join(names)}")
    if not all(math.isfinite(params[k]) and params[k] > 0 for k in names[1:]) or params["E"] < 0:
        raise ConfigError(f"--fit {path}: fit.params must be positive and finite, got {params}")
    if law == "data-constrained" and not isinstance(params.get("R_D_star"), (int, float)):
        raise ConfigError(f"--fit {path}: a data-constrained fit needs fit.params.R_D_star")
    order = names + (("R_D_star",) if law == "data-constrained" else ())  # the law's column order
    if law == "data-constrained" and "R_N_star" in params:  # fitted with the excess-parameters term
        if not isinstance(params["R_N_star"], (int, float)):
            raise ConfigError(f"--fit {path}: fit.params.R_N_star must be a number")
        order += ("R_N_star",)
    values = {k: float(params[k]) for k in order}
    samples = np.zeros((0, len(values)))
    if fit.get("samples") is not None:  # `tenx fit` writes its bootstrap fits: the intervals come from them
        try:
            samples = np.array(fit["samples"], dtype=float).reshape(-1, len(values))
        except (TypeError, ValueError):
            raise ConfigError(
                f"--fit {path}: fit.samples must be rows of {len(values)} numbers ({', '.join(order)})"
            ) from None
    level = fit.get("level", 0.95)
    if not isinstance(level, (int, float)) or not 0 < level < 1:
        raise ConfigError(f"--fit {path}: fit.level must be a number between 0 and 1, got {level!r}")
    return FitResult(law, str(fit.get("form", "")), values, {}, samples, 0, 0.0, float(level))


def load_fit_warnings(path: str | Path) -> list[str]:
    """The warnings the `tenx fit` report at `path` carries (`warnings`: fit_warnings, a parameter at its
    bound, too few runs, ...; `regime_warnings`: runs the law does not describe): the choices rest on that
    law, so `plan choose` repeats them. Read after load_fit accepted the file."""
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return []
    found = [*(report.get("warnings") or []), *(report.get("regime_warnings") or [])]
    return [w for w in found if isinstance(w, str)]


def choose(
    run: Any,
    cluster: Any,
    fit: Any,
    budget: float,
    *,
    vocab: int,
    days: float | None = None,
    strategies: tuple[str, ...] = STRATEGIES,
    max_depth: int = 128,
    unique_tokens: float | None = None,
) -> dict[str, Any]:
    """Every candidate (size, strategy) with its memory check, step time, days and predicted loss, best first.

    With `unique_tokens` U the data is limited to U unique tokens, repeated for D/U epochs: the fit must be
    data-constrained, sizes are centred on its optimum under the limit, each row gives its epochs and the
    interval of its predicted loss."""
    from tenx.model.flops import count_params, flops_per_token
    from tenx.plan.estimate import estimate
    from tenx.scaling.fit.frontier import compute_optimal, data_limited_optimal
    from tenx.scaling.ladder.rungs import shape_for_depth

    if not budget > 0 or not math.isfinite(budget):
        raise ConfigError(f"--budget must be a positive number of FLOPs, got {budget}")
    if days is not None and not days > 0:
        raise ConfigError(f"--days must be positive, got {days}")
    if unique_tokens is not None and not (unique_tokens > 0 and math.isfinite(unique_tokens)):
        raise ConfigError(f"--unique-tokens must be a positive number of tokens, got {unique_tokens}")
    if unique_tokens is not None and fit.law != "data-constrained":
        raise ConfigError(
            f"--unique-tokens needs a data-constrained fit (`tenx fit --law data-constrained`); "
            f"--fit is {fit.law}"
        )
    optimal = compute_optimal(fit, budget)
    limited = data_limited_optimal(fit, budget, unique_tokens) if unique_tokens is not None else None
    n_star = limited["N"] if limited is not None else optimal["N"]
    models = {depth: shape_for_depth(run.model, depth, vocab) for depth in range(1, max_depth + 1)}
    sizes = {depth: count_params(model).total for depth, model in models.items()}
    grid = [n_star * 2 ** (k / 2) for k in range(-6, 7)]  # N*/8 .. 8 N* in steps of sqrt(2)
    depths = sorted({min(sizes, key=lambda d: abs(math.log(sizes[d] / n))) for n in grid})
    rows: list[dict[str, Any]] = []
    for depth in depths:
        model, n = models[depth], sizes[depth]
        if not n_star / SPAN / 1.5 <= n <= SPAN * n_star * 1.5:
            continue
        per_token = flops_per_token(model)
        candidate = dataclasses.replace(run, model=model)
        for strategy in strategies:
            plan = estimate(candidate, cluster, vocab=vocab, strategy=strategy)
            row: dict[str, Any] = {"depth": depth, "d_model": model.d_model, "N": n, "strategy": strategy}
            micro = min(plan.largest_micro_batch, run.train.micro_batch)
            if micro == 0:
                rows.append({**row, "fits": False, "memory_gb": plan.memory_per_rank["total"] / 1e9})
                continue
            train = dataclasses.replace(run.train, micro_batch=micro, grad_accum=1)
            plan = estimate(
                dataclasses.replace(candidate, train=train), cluster, vocab=vocab, strategy=strategy
            )
            tokens = budget / per_token
            if days is not None:
                tokens = min(tokens, plan.tokens_per_day * days)
            rows.append(
                {
                    **row,
                    "fits": True,
                    "micro_batch": micro,
                    "memory_gb": plan.memory_per_rank["total"] / 1e9,
                    "D": tokens,
                    "tokens_per_param": tokens / n,
                    "mfu": plan.mfu,
                    "tokens_per_day": plan.tokens_per_day,
                    "days": tokens / plan.tokens_per_day,
                    "loss": float(fit.predict(N=n, D=tokens, U=unique_tokens)),
                }
            )
            if unique_tokens is not None:
                rows[-1]["epochs"] = tokens / unique_tokens
                rows[-1]["loss_interval"] = list(fit.predict_interval(N=n, D=tokens, U=unique_tokens))
    rows.sort(key=lambda r: (not r["fits"], _loss_bucket(r.get("loss")), r.get("days", math.inf)))
    out = {"budget": budget, "days_limit": days, "compute_optimal": optimal, "choices": rows}
    if limited is not None:
        out.update(unique_tokens=unique_tokens, data_limited_optimal=limited)
    return out


def _loss_bucket(loss: float | None) -> float:
    """Losses within TIE of each other rank as equal (then the fewer days win); inf for no loss."""
    return math.inf if loss is None else math.floor(math.log(loss) / math.log1p(TIE))


def format_choices(result: dict[str, Any], top: int = 12) -> str:
    """The ranking as a table (the best `top` that fit, then how many did not)."""
    opt = result["compute_optimal"]
    lines = [
        f"budget {result['budget']:.3g} FLOPs; the fit's compute-optimal point: N {opt['N']:.3g}, "
        f"D {opt['D']:.3g}, loss {opt['loss']:.4f}"
        + (f"; at most {result['days_limit']:g} days" if result["days_limit"] else ""),
    ]
    limited = result.get("data_limited_optimal")
    if limited is not None:
        lines.append(
            f"with {result['unique_tokens']:.3g} unique tokens: N {limited['N']:.3g} "
            f"{_interval(limited, 'N', '.3g')}, {limited['epochs']:.3g} epochs "
            f"{_interval(limited, 'epochs', '.3g')}, "
            f"loss {limited['loss']:.4f} {_interval(limited, 'loss', '.4f')}"
        )
    extra = f" {'epochs':>7} {'loss interval':>17}" if limited is not None else ""
    lines.append(
        f"{'rank':>4} {'depth':>5} {'d_model':>7} {'N':>9} {'strategy':>8} {'micro':>5} {'mem GB':>7} "
        f"{'D':>9} {'D/N':>6} {'MFU':>6} {'days':>8} {'loss':>7}" + extra
    )
    fitting = [r for r in result["choices"] if r["fits"]]
    for i, r in enumerate(fitting[:top], 1):
        tail = f" {r['epochs']:>7.3g} {_interval(r, 'loss', '.4f'):>17}" if limited is not None else ""
        lines.append(
            f"{i:>4} {r['depth']:>5} {r['d_model']:>7} {r['N']:>9.3g} {r['strategy']:>8} {r['micro_batch']:>5} "
            f"{r['memory_gb']:>7.2f} {r['D']:>9.3g} {r['tokens_per_param']:>6.1f} {100 * r['mfu']:>5.1f}% "
            f"{r['days']:>8.3g} {r['loss']:>7.4f}" + tail
        )
    skipped = len(result["choices"]) - len(fitting)
    if skipped:
        lines.append(f"({skipped} choices do not fit in memory even at micro-batch 1)")
    if not fitting:
        lines.append("no choice fits: shard more (fsdp), add accelerators, or a smaller budget")
    return "\n".join(lines)


def _interval(values: dict[str, Any], key: str, spec: str) -> str:
    """'[low, high]' of values[key + '_interval'], or '[no interval]' (a fit without bootstrap samples)."""
    low, high = values.get(f"{key}_interval") or (math.nan, math.nan)
    if not (math.isfinite(low) and math.isfinite(high)):
        return "[no interval]"
    return f"[{low:{spec}}, {high:{spec}}]"
