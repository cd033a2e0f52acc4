"""`tenx plan`: the memory, communication and time estimates (tenx/plan/estimate.py)."""

from __future__ import annotations

import pytest
import torch

from tenx.model.flops import count_params
from tenx.model.transformer import Transformer, lm_loss
from tenx.plan.estimate import communication_per_step, estimate, load_cluster, memory_per_rank
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


@pytest.mark.parametrize("name, vocab", [("tiny", 257), ("quickstart", 4096), ("gpt2-d12", 8192)])
def test_activation_estimate_matches_what_autograd_saves(name, vocab):
    """PyTorch's own tracking on CPU: the bytes of every tensor autograd saves for backward (not parameters)."""
    cfg = load_run_config(resolve_config_path(name)).model.resolved(vocab)
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
