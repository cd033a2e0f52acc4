"""`tenx plan shapes`: the GEMM list matches the model, FLOPs are 2*M*K*N, candidates are valid, a tiny run."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tenx.cli import build_parser
from tenx.errors import ConfigError
from tenx.model.config import ModelConfig
from tenx.model.transformer import Transformer
from tenx.plan import shapes
from tenx.plan.cli import cmd_shapes


@pytest.fixture(autouse=True)
def one_thread():
    """Timings on shared cores: one thread avoids OpenMP threads waiting on a busy core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    model = Transformer(cfg)
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            out[name.rsplit(".", 1)[-1]] = tuple(m.weight.shape)
    return out


@pytest.mark.parametrize(
    "raw",
    [
        ModelConfig(family="gpt2", depth=2, d_model=64, head_dim=32, seq_len=16),
        ModelConfig(family="llama", depth=2, seq_len=16),
        ModelConfig(family="llama", depth=1, d_model=128, n_heads=4, n_kv_heads=2, seq_len=8),
    ],
)
def test_gemm_weights_match_the_models_linear_layers(raw: ModelConfig) -> None:
    cfg = raw.resolved(100)
    gemms = shapes.gemm_shapes(cfg, micro_batch=3)
    linear = _linear_shapes(cfg)
    by_name = {g.name: g for g in gemms if g.weight is not None}
    assert set(by_name) == set(linear)
    for name, g in by_name.items():
        assert g.weight == linear[name], name
        # the GEMM multiplies (M, K) activations by the (N, K) weight: K is in, N is out
        assert (g.n, g.k) == linear[name]
        assert g.m == 3 * cfg.seq_len
        assert g.count == (1 if name == "lm_head" else cfg.depth)


def test_attention_gemms_and_flops() -> None:
    cfg = ModelConfig(family="gpt2", depth=3, d_model=128, head_dim=32, seq_len=16).resolved(100)
    g = {x.name: x for x in shapes.gemm_shapes(cfg, micro_batch=2)}
    assert g["attn_scores"].key == (2 * 4, 16, 32, 16)
    assert g["attn_values"].key == (2 * 4, 16, 16, 32)
    assert g["attn_scores"].flops == 2 * 8 * 16 * 32 * 16
    assert g["lm_head"].flops == 2 * 32 * 128 * 128  # vocab 100 padded to 128
    assert g["up_proj"].flops == 2 * 32 * 128 * 512


def test_candidates_are_valid_distinct_configs() -> None:
    raw = ModelConfig(family="llama", depth=4, seq_len=32)
    base = raw.resolved(4000)
    found = shapes.candidates(raw, 4000)
    names = [what for what, _ in found]
    assert len(names) == len(set(names))
    assert f"vocab {base.vocab_size} -> 4096" in names  # 4000 -> 4032 (64) -> 4096 (128)
    assert any(n.startswith("head_dim 64 -> 128") for n in names)
    assert "d_model 256 -> 320" in names and "d_model 256 -> 128" in names
    assert "d_ff 704 -> 768" in names and "d_ff 704 -> 640" in names
    for what, cfg in found:
        cfg.validate()
        r = cfg.resolved(4000)
        assert r != base, what
        Transformer(r)  # builds


def test_benchmark_report_keys_and_consistency() -> None:
    raw = ModelConfig(family="gpt2", depth=1, d_model=64, head_dim=32, seq_len=16)
    result = shapes.benchmark_shapes(raw, 2, "cpu", torch.float32, repeat=2, vocab=100)
    keys = {"gemms", "candidates", "step_gemm_time_s", "step_gemm_flops", "params", "best", "best_per_flop"}
    assert keys <= set(result)
    assert [r["name"] for r in result["gemms"]] == [
        "qkv_proj",
        "attn_scores",
        "attn_values",
        "out_proj",
        "up_proj",
        "down_proj",
        "lm_head",
    ]
    assert sum(r["share"] for r in result["gemms"]) == pytest.approx(1.0)
    for r in result["gemms"]:
        assert r["flops"] == 2 * r["batch"] * r["m"] * r["k"] * r["n"]
        assert r["flops_per_s"] == pytest.approx(r["flops"] / r["time_s"])
    assert result["params"] == sum(p.numel() for p in Transformer(raw.resolved(100)).parameters())
    for c in result["candidates"]:
        assert {
            "change",
            "gemms",
            "ratio",
            "time_per_flop_ratio",
            "time_per_param_ratio",
            "spread",
            "faster",
        } <= set(c)
        assert not (c["faster"] and c["slower"])
    touched = {c["change"]: c["gemms"] for c in result["candidates"]}
    assert touched["vocab 128 -> 256"] == ["lm_head"]
    assert touched["d_ff 256 -> 320"] == ["up_proj", "down_proj"]
    assert touched["head_dim 32 -> 64"] == ["attn_scores", "attn_values"]
    assert len(touched["d_model 64 -> 128"]) == 7
    text = shapes.format_shapes(result)
    assert ("No nearby shape" in text) == (result["best"] is None) and (result["best"] or "") in text


def test_micro_batch_cap_scales_times() -> None:
    raw = ModelConfig(family="gpt2", depth=1, d_model=64, head_dim=32, seq_len=16)
    result = shapes.benchmark_shapes(
        raw, 8, "cpu", torch.float32, repeat=2, vocab=100, max_tokens=32, with_candidates=False
    )
    assert result["bench_micro_batch"] == 2 and result["candidates"] == []
    assert result["gemms"][0]["m"] == 8 * 16  # reported at the full micro-batch


def test_repeat_below_two_is_refused() -> None:
    with pytest.raises(ConfigError, match="repeat"):
        shapes.benchmark_shapes(ModelConfig(depth=1, seq_len=8), 1, "cpu", repeat=1, vocab=100)


def test_cli_writes_json(tmp_path) -> None:
    parser = build_parser()
    out = tmp_path / "shapes.json"
    args = parser.parse_args(
        [
            "plan",
            "shapes",
            "--config",
            "tiny",
            "--set",
            "model.depth=1",
            "--set",
            "model.seq_len=16",
            "--set",
            "train.micro_batch=2",
            "--vocab",
            "200",
            "--device",
            "cpu",
            "--repeat",
            "2",
            "--json",
            str(out),
        ]
    )
    assert args.func is cmd_shapes
    assert args.func(args) == 0
    data = json.loads(out.read_text())
    assert data["config"] == "tiny" and data["model"]["vocab_size"] == 256 and data["model"]["depth"] == 1
    assert (data["vocab"], data["vocab_source"], data["vocab_assumed"]) == (200, "--vocab", False)
    assert data["gemms"][-1]["n"] == 256


def known_times(bonus_every: int | None):
    """A sampler of known GEMM times: FLOPs / (1 GFLOP/s x the narrower of K and N), 4x faster when N is a
    multiple of `bonus_every`; each shape's time varies by at most 0.4% round to round, as no real timer
    stays still, so a change counts only beyond that."""
    rounds: dict[tuple[int, int, int, int], int] = {}

    def sampler(key):
        batch, m, k, n = key
        rate = 1e9 * min(k, n) * (4 if bonus_every and n % bonus_every == 0 else 1)

        def sample() -> float:
            r = rounds[key] = rounds.get(key, -1) + 1
            return 2 * batch * m * k * n / rate * (1 + 0.002 * ((sum(key) + r) % 3))

        return sample

    return sampler


def test_a_shape_faster_per_flop_but_slower_per_step_is_not_called_faster() -> None:
    """`plan shapes` called a 7x slower step "the nearest faster shape": a wider model is faster per FLOP."""
    raw = ModelConfig(family="gpt2", depth=1, d_model=64, head_dim=32, seq_len=16)
    result = shapes.benchmark_shapes(raw, 2, "cpu", repeat=3, vocab=100, sampler=known_times(None))
    wide = {c["change"]: c for c in result["candidates"]}["d_model 64 -> 128"]
    assert wide["faster"] and not wide["step_faster"] and wide["step_time_ratio"] > 1.5
    assert result["best"] is None and result["best_per_flop"] == "d_model 64 -> 128"
    text = shapes.format_shapes(result)
    assert "No nearby shape makes the whole step measurably faster" in text
    assert "Faster per FLOP only: d_model 64 -> 128: its whole step takes x" in text and "(SLOWER)" in text


def test_a_faster_step_with_no_fewer_parameters_is_recommended() -> None:
    """Padding the vocabulary to a fast multiple (here 256) takes less time for more parameters: the pick."""
    raw = ModelConfig(family="gpt2", depth=1, d_model=64, head_dim=32, seq_len=16)
    result = shapes.benchmark_shapes(raw, 2, "cpu", repeat=3, vocab=100, sampler=known_times(256))
    padded = {c["change"]: c for c in result["candidates"]}["vocab 128 -> 256"]
    assert padded["faster"] and padded["step_faster"] and padded["params"] > result["params"]
    assert result["best"] == "vocab 128 -> 256"
    assert "Faster step, no fewer parameters: vocab 128 -> 256 (whole step x0." in shapes.format_shapes(
        result
    )


def test_cli_says_when_the_vocabulary_is_assumed(tmp_path, capsys) -> None:
    """`plan shapes --config tiny` on unprepared data timed a 50,304-wide output layer without a word."""
    parser = build_parser()
    out = tmp_path / "shapes.json"
    small = ["model.depth=1", "model.seq_len=16", "train.micro_batch=1", f'data.dir="{tmp_path / "none"}"']
    sets = [x for s in small for x in ("--set", s)]
    argv = ["plan", "shapes", "--config", "tiny", *sets, "--device", "cpu"]
    args = parser.parse_args([*argv, "--repeat", "2", "--json", str(out)])
    assert args.func(args) == 0
    assert capsys.readouterr().out.startswith("vocabulary 50,257 ASSUMED (GPT-2's)")
    data = json.loads(out.read_text())
    assert data["vocab_assumed"] and data["model"]["vocab_size"] == 50304
