"""`tenx plan choose` (tenx/plan/allocate.py), `tenx plan --measure` (tenx/plan/calibrate.py) and the step's
peak memory against every tensor PyTorch allocates (tenx/plan/estimate.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from tenx.errors import ConfigError
from tenx.model.transformer import Transformer, lm_loss
from tenx.plan.allocate import choose, load_fit
from tenx.plan.estimate import load_cluster, memory_per_rank
from tenx.train.config import load_run_config, resolve_config_path

CHINCHILLA = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}  # Hoffmann et al. 2022


def write_fit(path, law="chinchilla", params=None):
    path.write_text(json.dumps({"fit": {"law": law, "form": "E + A/N^alpha + B/D^beta", "params": params}}))
    return path


def test_choose_ranks_sizes_and_strategies_by_predicted_loss_with_the_memory_check(tmp_path):
    fit = load_fit(write_fit(tmp_path / "fit.json", params=dict(reversed(list(CHINCHILLA.items())))))
    assert list(fit.params) == ["E", "A", "B", "alpha", "beta"]  # the law's order, whatever the file's
    run = load_run_config(resolve_config_path("gpt2-d12"))
    cluster = load_cluster("h100-node")
    result = choose(run, cluster, fit, 1e21, vocab=50257)
    rows, n_star = result["choices"], result["compute_optimal"]["N"]
    fitting = [r for r in rows if r["fits"]]
    assert fitting and len(fitting) < len(rows)  # some sizes need sharding: DDP's 16 bytes/param do not fit
    assert all(r["memory_gb"] <= cluster.node.memory_gb * cluster.cluster.memory_usable for r in fitting)
    assert not any(r["fits"] and r["strategy"] == "ddp" and 16 * r["N"] > 80e9 for r in rows)
    best = fitting[0]
    assert n_star / 2 < best["N"] < 2 * n_star  # the fit's compute-optimal size wins
    assert best["loss"] == pytest.approx(min(r["loss"] for r in fitting), rel=1e-3)
    for r in fitting:
        assert r["loss"] == pytest.approx(fit.predict(N=r["N"], D=r["D"]))
        assert r["days"] == pytest.approx(r["D"] / r["tokens_per_day"])
    # a wall-clock limit cuts D to what the cluster trains in it, and the loss rises
    short = choose(run, cluster, fit, 1e21, vocab=50257, days=0.5)["choices"]
    assert all(r["D"] <= r["tokens_per_day"] * 0.5 * (1 + 1e-9) for r in short if r["fits"])
    assert short[0]["loss"] > best["loss"]


def test_a_bad_fit_file_is_named_with_its_field(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_fit(tmp_path / "none.json")
    with pytest.raises(ConfigError, match="fit.law is 'compute'"):
        load_fit(write_fit(tmp_path / "c.json", law="compute", params={"E": 1, "A": 1, "alpha": 0.1}))
    with pytest.raises(ConfigError, match=r"c2.json: fit.params must hold numbers"):
        load_fit(write_fit(tmp_path / "c2.json", params={**CHINCHILLA, "beta": "x"}))
    with pytest.raises(ConfigError, match="positive"):
        load_fit(write_fit(tmp_path / "c3.json", params={**CHINCHILLA, "alpha": -1.0}))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json: not a readable JSON"):
        load_fit(tmp_path / "bad.json")


def test_choose_command_writes_its_ranking(tmp_path):
    fit = write_fit(tmp_path / "fit.json", params=CHINCHILLA)
    out = subprocess.run(
        [sys.executable, "-m", "tenx", "plan", "choose", "--config", "gpt2-d12", "--cluster", "gpu-1024",
         "--fit", str(fit), "--budget", "1e22", "--vocab", "50257", "--json", str(tmp_path / "c.json")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    result = json.loads((tmp_path / "c.json").read_text())
    assert result["budget"] == 1e22 and result["choices"][0]["fits"]
    assert f"{result['choices'][0]['N']:.3g}" in out.stdout.splitlines()[2]


class LiveTensors(TorchDispatchMode):
    """Bytes of every storage an operator creates while alive, and their peak (PyTorch's own allocations)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))

        def track(t):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._free, key)
            return t

        tree_map(track, out)
        return out


@pytest.mark.parametrize("name, micro_batch", [("tiny", 8), ("tiny", 32), ("gpt2-d12", 1)])
def test_step_peak_matches_the_tensors_pytorch_allocates(name, micro_batch):
    """A statistics step as the trainer takes it (forward, loss, backward, the statistics' copy of the
    parameters, fused AdamW) from the second step on, when the optimizer moments exist: the estimate's peak
    within 15% (gpt2-d12's is at the update, tiny's in the loss's backward)."""
    torch.manual_seed(0)
    cfg = load_run_config(resolve_config_path(name), ["model.seq_len=128"]).model.resolved(4096)
    model = Transformer(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x = torch.randint(0, 4096, (micro_batch, cfg.seq_len))
    tracker = LiveTensors()
    with tracker:
        for _ in range(2):
            tracker.peak = tracker.now
            logits = model(x)  # the trainer holds the logits through the backward
            lm_loss(logits, x)[0].backward()
            before = [p.detach().clone() for p in model.parameters()]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del before, logits
    params = sum(p.numel() * 4 for p in model.parameters())  # created before tracking
    predicted = memory_per_rank(cfg, micro_batch, "ddp", 1, statistics=True)["total"]
    assert math.isclose(predicted, tracker.peak + params, rel_tol=0.15), (predicted, tracker.peak + params)


def test_measure_fits_the_factors_and_the_next_plan_uses_them(tiny_data, tmp_path):
    env = {**os.environ, "TENX_CACHE_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "tenx", "plan", "--config", "tiny", "--set", f'data.dir="{tiny_data}"']

    def within_10_percent_after_the_fit() -> tuple[bool, str]:
        out = subprocess.run(
            [*cmd, "--cluster", "cpu", "--measure", "--steps", "4"],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        ).stdout
        ratios = [line.split() for line in out.splitlines() if line.startswith("micro-batch")]
        # after the fit (two points, two unknowns each; a bound can clip one, e.g. memory that did not grow)
        return len(ratios) == 2 and all(0.9 <= float(r[i]) <= 1.1 for r in ratios for i in (-4, -1)), out

    # Peak RSS is noisy: in about one full-suite run in three (2 cores, tests before it in the process
    # tree), the larger micro-batch measured less memory than the smaller one, which no two-factor fit can
    # match. Measure again once before calling the fit wrong; a real misfit fails both times.
    ok, out = within_10_percent_after_the_fit()
    if not ok:
        ok, out = within_10_percent_after_the_fit()
    assert ok, out
    saved = json.loads((tmp_path / "plan-calibration.json").read_text())["cpu-2core"]
    assert 0 < saved["compute_efficiency"] <= 1 and saved["runtime_gb"] > 0
    again = subprocess.run([*cmd, "--cluster", "cpu"], capture_output=True, text=True, env=env, check=True)
    assert "measured on this machine" in again.stdout
    plain = subprocess.run(
        [*cmd, "--cluster", "cpu", "--no-calibration"], capture_output=True, text=True, env=env, check=True
    )
    assert "measured on this machine" not in plain.stdout and plain.stdout != again.stdout
    # factors are kept with the device they were measured on, and never applied to another one's plans
    assert saved["measured_on"].startswith("cpu: ")
    path = tmp_path / "plan-calibration.json"
    forged = json.loads(path.read_text())
    forged["cpu-2core"]["measured_on"] = "NVIDIA H100 80GB HBM3"
    path.write_text(json.dumps(forged))
    other = subprocess.run([*cmd, "--cluster", "cpu"], capture_output=True, text=True, env=env, check=True)
    assert "were measured on NVIDIA H100 80GB HBM3, not on this machine's cpu: " in other.stdout
    assert "not applied" in other.stdout and other.stdout.endswith(plain.stdout)


def test_a_measured_run_that_fails_is_one_error_line_naming_its_cause(tmp_path, capsys):
    """`tenx plan --measure` whose measured run fails (no prepared data) exits 2 with that run's error, no
    traceback."""
    from tenx.cli import main

    argv = ["plan", "--config", "tiny", "--cluster", "cpu", "--set", f"data.dir={tmp_path / 'none'}"]
    assert main([*argv, "--measure", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "tenx: error: --measure: the measured run of tiny failed (exit 1): " in err
    assert "does not exist" in err and "Traceback" not in err
