"""`tenx plan`: the memory, communication and time estimates (tenx/plan/estimate.py)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from tenx.cli import build_parser, main
from tenx.errors import ConfigError
from tenx.model.flops import count_params
from tenx.model.transformer import Transformer, lm_loss
from tenx.plan.estimate import (
    Vocab,
    communication_per_step,
    estimate,
    load_cluster,
    memory_per_rank,
    plan_vocab,
)
from tenx.train.config import load_run_config, resolve_config_path
from tenx.train.optim import build_optimizer


@pytest.mark.parametrize("name, vocab", [("tiny", 257), ("quickstart", 4096)])
def test_parameter_gradient_and_optimizer_bytes_are_exact(name, vocab):
    cfg = load_run_config(resolve_config_path(name)).model.resolved(vocab)
    model = Transformer(cfg)
    params = sum(p.numel() for p in model.parameters())
    assert count_params(cfg).total == params
    x = torch.randint(0, vocab, (2, cfg.seq_len))
    lm_loss(model(x), x)[0].backward()
    optimizer = build_optimizer(model, load_run_config(resolve_config_path(name)).optim, torch.device("cpu"))
    optimizer.step()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    moments = sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for k, v in state.items()
        if k != "step"
    )
    m = memory_per_rank(cfg, 2, "ddp", 1)
    assert m["parameters"] == 4 * params and m["gradients"] == grads and m["optimizer"] == moments


@pytest.mark.parametrize(
    "name, vocab, overrides",
    [("tiny", 257, []), ("quickstart", 4096, []), ("gpt2-d12", 8192, ["model.seq_len=256"])],
)
def test_activation_estimate_matches_what_autograd_saves(name, vocab, overrides):
    """PyTorch's own tracking on CPU: the bytes of every tensor autograd saves for backward (not parameters).
    The estimate is per token, so gpt2-d12 is checked at a quarter of its context (4x faster)."""
    cfg = load_run_config(resolve_config_path(name), overrides).model.resolved(vocab)
    model = Transformer(cfg)
    weights = {p.data_ptr() for p in model.parameters()}
    saved: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in weights:
            saved[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
        return t

    x = torch.randint(0, vocab, (2, cfg.seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lm_loss(model(x), x)
    m = memory_per_rank(cfg, 2, "ddp", 1)
    ratio = (m["activations"] + m["logits"]) / sum(saved.values())
    assert 0.9 < ratio < 1.1, ratio


def test_sharding_divides_the_states_and_ring_traffic_is_counted():
    cfg = load_run_config(resolve_config_path("gpt2-d12")).model.resolved(50257)
    ddp, fsdp = memory_per_rank(cfg, 4, "ddp", 8), memory_per_rank(cfg, 4, "fsdp", 8)
    hsdp = memory_per_rank(cfg, 4, "hsdp", 64, shard_group=8)
    assert fsdp["optimizer"] == pytest.approx(ddp["optimizer"] / 8)
    assert hsdp["optimizer"] == pytest.approx(ddp["optimizer"] / 8)
    assert fsdp["activations"] == ddp["activations"] and fsdp["gathered"] > 0 == ddp["gathered"]
    recompute = memory_per_rank(cfg, 4, "ddp", 8, activation_checkpointing=True)
    assert recompute["activations"] < ddp["activations"] / 5
    params = count_params(cfg).total
    comm = communication_per_step(params, "ddp", 8, 100.0)
    assert comm["bytes"] == pytest.approx(2 * 7 / 8 * 4 * params)
    assert comm["seconds"] == pytest.approx(comm["bytes"] / 100e9)
    assert communication_per_step(params, "ddp", 1, 100.0)["bytes"] == 0


def test_shipped_clusters_plan_a_run():
    run = load_run_config(resolve_config_path("llama-1b"))
    for name in ("cpu", "h100-node", "gpu-1024", "gpu-16384"):
        cluster = load_cluster(name)
        plan = estimate(run, cluster, vocab=32000, strategy="fsdp")
        assert plan.step_s >= plan.compute_s > 0 and 0 < plan.mfu <= cluster.cluster.compute_efficiency
        assert (plan.step_s > plan.compute_s) == (plan.ranks > 1)  # communication only with peers
        assert plan.tokens_per_day == pytest.approx(plan.tokens_per_step * 86400 / plan.step_s)
    assert not estimate(
        run, load_cluster("cpu"), vocab=32000
    ).fits  # a 1B model does not fit 24 GB with AdamW
    semi = estimate(run, load_cluster("gpu-1024"), vocab=32000, replica_groups=4, diloco_every=100)
    x = semi.cross_cluster
    assert x["diloco_bytes_per_step"] == pytest.approx(x["sync_bytes_per_step"] / 100)
    with pytest.raises(Exception, match="no such file or shipped cluster"):
        load_cluster("nowhere")


def test_collectives_are_counted_and_cost_their_latency():
    from tenx.plan.estimate import collectives_per_step

    run = load_run_config(resolve_config_path("tiny"))
    cfg = run.model.resolved(257)
    params = count_params(cfg).total
    assert collectives_per_step(cfg, params, "ddp", 1, 1) == 0
    assert collectives_per_step(cfg, params, "ddp", 2, 1) == 1 + 2  # one bucket, the loss, the stop signal
    assert collectives_per_step(cfg, params, "fsdp", 2, 1) == 2 * 3 + 3 + 2  # 2 blocks and the root
    cluster = load_cluster("cpu")
    slow = load_cluster("cpu")
    slow.cluster.collective_latency_s = 0.01
    a = estimate(run, cluster, vocab=257, ranks=2)
    b = estimate(run, slow, vocab=257, ranks=2)
    assert b.step_s - a.step_s == pytest.approx(0.01 * 3)


def plan_parsers() -> dict[str, argparse.ArgumentParser]:
    """The parsers of `tenx plan` and its subcommands, flags added (as the CLI builds them)."""
    plan = _subparsers(build_parser())["plan"]
    plan.format_help()  # adds the deferred flags
    return {"plan": plan, **{f"plan {k}": v for k, v in _subparsers(plan).items()}}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--config", "tiny", "--cluster", "cpu", "--ranks", "-3"],
        ["plan", "--config", "tiny", "--cluster", "cpu", "--ranks", "0"],
        ["plan", "--config", "tiny", "--cluster", "cpu", "--vocab", "0"],
        ["plan", "--config", "tiny", "--cluster", "cpu", "--replica-groups", "0"],
        ["plan", "--config", "tiny", "--cluster", "cpu", "--diloco-every", "-1"],
        ["plan", "--config", "tiny", "--cluster", "cpu", "--measure", "--steps", "0"],
        ["plan", "shapes", "--config", "tiny", "--repeat", "0"],
        ["plan", "shapes", "--config", "tiny", "--max-tokens", "-1"],
        ["plan", "shapes", "--config", "tiny", "--threads", "0"],
        ["plan", "shapes", "--config", "tiny", "--vocab", "-5"],
        ["plan", "failures", "--gpus", "1e4,-5"],
        ["plan", "failures", "--gpus", "nan"],
        ["plan", "failures", "--save-cost-s", "0"],
        ["plan", "failures", "--restart-s", "-1"],
        ["plan", "failures", "--detect-s", "-1"],
        ["plan", "failures", "--groups", "0"],
        ["plan", "failures", "--min-group-gpus", "0"],
        ["plan", "failures", "--sync-s", "-600"],
        ["plan", "failures", "--days", "0"],
        ["plan", "failures", "--replicas", "1"],
        ["plan", "failures", "--seed", "-1"],
        ["plan", "choose", "--config", "t", "--cluster", "c", "--fit", "f", "--budget", "0"],
        ["plan", "choose", "--config", "t", "--cluster", "c", "--fit", "f", "--budget", "inf"],
        [
            "plan",
            "choose",
            "--config",
            "t",
            "--cluster",
            "c",
            "--fit",
            "f",
            "--budget",
            "1e21",
            "--days",
            "0",
        ],
        ["plan", "choose", "--config", "t", "--cluster", "c", "--fit", "f", "--budget", "1e21", "--top", "0"],
    ],
    ids=lambda argv: " ".join(argv[1:2] + argv[-2:]),
)
def test_a_number_out_of_range_is_refused_naming_its_flag(argv, capsys):
    """`--ranks -3` printed negative tokens per day and memory, `--ranks 0` meant every accelerator: every
    numeric flag of `tenx plan` and its subcommands is checked before any work, and the error names it."""
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(argv)
    assert stop.value.code == 2
    flag = argv[-2] if argv[-2].startswith("--") else argv[-3]
    assert f"argument {flag}: " in capsys.readouterr().err


def test_estimate_refuses_nonpositive_ranks_and_groups():
    run, cluster = load_run_config(resolve_config_path("tiny")), load_cluster("cpu")
    for kwargs in ({"ranks": 0}, {"ranks": -3}, {"replica_groups": 0}, {"diloco_every": -1}, {"vocab": 0}):
        with pytest.raises(ConfigError, match=f"{next(iter(kwargs))} must be >= "):
            estimate(run, cluster, **{"vocab": 257, **kwargs})
    assert estimate(run, load_cluster("h100-node"), vocab=257).ranks == 8  # None: every accelerator


def test_the_vocabulary_is_the_configs_or_said_to_be_assumed(tiny_data, tmp_path, capsys):
    """Unprepared data made `tenx plan --config quickstart` plan a 20.6M model for a 2.9M one, silently."""
    unprepared = ["--set", f'data.dir="{tmp_path / "none"}"']
    assert main(["plan", "--config", "quickstart", "--cluster", "cpu", *unprepared]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "vocabulary 50,257 ASSUMED (GPT-2's): no --vocab, no model.vocab_size, and data.dir "
    )
    assert "give the real one with --vocab N" in out
    quickstart = load_run_config(resolve_config_path("quickstart")).model.resolved(4096)
    record = tmp_path / "plan.json"
    argv = ["plan", "--config", "quickstart", "--cluster", "cpu", *unprepared, "--vocab", "4096"]
    assert main([*argv, "--json", str(record)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("vocabulary 4,096 (from --vocab)") and "ASSUMED" not in out
    assert f"parameters {count_params(quickstart).total:,};" in out and count_params(quickstart).total < 3e6
    saved = json.loads(record.read_text())
    assert (saved["vocab"], saved["vocab_source"], saved["vocab_assumed"]) == (4096, "--vocab", False)
    # prepared data: its manifest's vocabulary (bytes: 257); an explicit model.vocab_size wins over both
    assert main(["plan", "--config", "tiny", "--cluster", "cpu", "--set", f'data.dir="{tiny_data}"']) == 0
    assert capsys.readouterr().out.startswith(f"vocabulary 257 (from the manifest of {tiny_data})")
    run = load_run_config(resolve_config_path("tiny"), ["model.vocab_size=1000", *unprepared[1:]])
    assert plan_vocab(run) == Vocab(1000, "model.vocab_size")
    with pytest.raises(ConfigError, match="--vocab 500 disagrees with the config's model.vocab_size=1000"):
        plan_vocab(run, 500)


NO_DEFAULT = {"--config", "--cluster", "--set", "--json", "--fit", "--budget", "--measure", "--no-sim"}
"""Flags of `tenx plan` that have no default to show: required ones, outputs, switches that are off."""


def test_every_plan_flag_with_a_default_shows_it_in_help():
    """`--help` lacked defaults: 0 and 0.0 were never shown (--detect-s, --diloco-every), nor the defaults
    a None stands for (shapes --threads, --vocab; choose --days)."""
    for name, parser in plan_parsers().items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            flag = max(action.option_strings, key=len, default="")
            if not flag or flag == "--help" or flag in NO_DEFAULT or action.default is False:
                continue
            text = formatter._get_help_string(action) or ""
            assert "default" in text.lower(), f"{name} {flag}: {text!r}"
    help_text = plan_parsers()["plan failures"].format_help()
    assert "(default: 0.0)" in " ".join(help_text.split())  # --detect-s
