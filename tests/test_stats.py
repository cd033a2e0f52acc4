"""Statistics inside the model (tenx/monitor/internals.py, tenx/train/callbacks/stats.py): every documented key
is logged at the stats steps only, and each figure equals the same quantity computed another way."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tenx.data.manifest import read_manifest
from tenx.model.config import ModelConfig
from tenx.model.transformer import Attention, apply_rope, max_attention_logit, rope_tables
from tenx.monitor.internals import activation_moments, layer_index, layer_of, logit_stats, rms_and_max
from tenx.monitor.metrics_file import read_metrics
from tenx.monitor.source_loss import MAX_SOURCES, OTHER, document_source, loss_by_source
from tenx.train.callbacks.stats import ModelStats
from tenx.train.config import CONFIG_DIR
from tenx.train.hooks import Callback
from tenx.train.run import default_callbacks, train

# tiny.toml: gpt2 family (tied embeddings, so no `head` layer), depth 2
LAYERS = ("0", "1", "embed", "norm")


def _stats(record: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in record.items() if k.startswith("stats/")}


# ----- the pure functions ------------------------------------------------------------------------------
def test_parameter_names_map_to_layers():
    assert layer_of("blocks.11.attn.qkv_proj.weight") == "11"
    assert layer_of("tok_emb.weight") == layer_of("pos_emb.weight") == "embed"
    assert layer_of("lm_head.weight") == "head"
    assert layer_of("final_norm.bias") == "norm"
    assert layer_of("module._orig_mod.blocks.3.mlp.up_proj.bias") == "3"  # DDP and compile wrappers
    names = [
        "tok_emb.weight",
        "blocks.10.a",
        "blocks.2.b",
        "final_norm.weight",
        "lm_head.weight",
        "blocks.2.c",
    ]
    layers, index = layer_index(names)
    assert layers == ["2", "10", "embed", "norm", "head"]  # blocks in numeric order, then the rest
    assert [layers[i] for i in index] == ["embed", "10", "2", "norm", "head", "2"]


def test_entropy_of_uniform_and_of_certain_distributions():
    vocab = 320
    logit_max, entropy = logit_stats(torch.zeros(2, 5, vocab)).tolist()
    assert entropy == pytest.approx(math.log(vocab), rel=1e-6) and logit_max == 0.0
    certain = torch.full((3, vocab), -1e4)
    certain[:, 7] = 50.0
    assert logit_stats(certain).tolist() == pytest.approx([50.0, 0.0], abs=1e-6)
    two_way = torch.full((1, vocab), -1e4)
    two_way[0, :2] = 3.0
    assert logit_stats(two_way)[1].item() == pytest.approx(math.log(2), rel=1e-6)


def test_activation_rms_and_max():
    x = torch.tensor([[3.0, -4.0], [0.0, 0.0]])
    rms, peak = rms_and_max(activation_moments(x).tolist())
    assert rms == pytest.approx(math.sqrt(25 / 4)) and peak == 4.0


@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_logit_max_equals_brute_force(qk_norm):
    """The recorded maximum is the max of q·k^T/sqrt(E) over causal positions, with the very q and k
    attention uses (checked by rebuilding the layer's output from them), in blocks or all at once."""
    torch.manual_seed(0)
    cfg = ModelConfig(family="llama", d_model=64, head_dim=16, n_kv_heads=2, qk_norm=qk_norm, seq_len=24)
    cfg = cfg.resolved(256)
    attn = Attention(cfg)
    B, T, H, K, E = 3, 24, 4, 2, 16
    x = torch.randn(B, T, 64) * 3
    rope = rope_tables(T, E, cfg.rope_theta)
    attn.record_logit_max = True
    y = attn(x, rope)
    # brute force: every logit, causal mask, max
    q, k, v = attn.qkv_proj(x).view(B, T, H + 2 * K, E).split([H, K, K], dim=2)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    k, v = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(E)
    logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    rebuilt = attn.out_proj((logits.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1))
    torch.testing.assert_close(rebuilt, y, rtol=1e-5, atol=1e-5)  # the q and k attention used
    expected = logits.amax().item()
    assert attn.logit_max is not None and attn.logit_max.item() == pytest.approx(expected, rel=1e-5)
    assert max_attention_logit(q, k[:, ::2], max_elements=B * H * T * 5).item() == pytest.approx(
        expected, rel=1e-5
    )  # five query rows at a time
    attn.record_logit_max, attn.logit_max = False, None
    attn(x, rope)
    assert attn.logit_max is None  # nothing recorded when the flag is off


def test_attention_logit_max_ignores_future_keys():
    q, k = torch.ones(1, 1, 4, 2), torch.ones(1, 1, 4, 2)
    k[0, 0, 3] = 10.0  # a large key that only the last query may see ...
    q[0, 0, 3] = 0.0  # ... and that query is orthogonal to everything
    assert max_attention_logit(q, k).item() == pytest.approx(2 / math.sqrt(2))
    assert max_attention_logit(q, k, max_elements=1).item() == pytest.approx(2 / math.sqrt(2))


# ----- in training --------------------------------------------------------------------------------------
class _HandMade(Callback):
    """The parameters before and after each optimizer step, grouped by name prefix by hand."""

    def __init__(self) -> None:
        self.param_norm: dict[int, dict[str, float]] = {}
        self.update_norm: dict[int, dict[str, float]] = {}
        self._before: dict[str, torch.Tensor] = {}

    @staticmethod
    def _group(name: str) -> str:
        if name.startswith("blocks."):
            return name.split(".")[1]
        return {"tok_emb": "embed", "pos_emb": "embed", "final_norm": "norm", "lm_head": "head"}[
            name.split(".")[0]
        ]

    def pre_optim_step(self, trainer: Any) -> None:
        self._before = {n: p.detach().clone().double() for n, p in trainer.raw_model.named_parameters()}

    def on_step_end(self, trainer: Any, metrics: dict[str, Any]) -> None:
        step = metrics["step"]
        norms: dict[str, float] = {}
        updates: dict[str, float] = {}
        for n, p in trainer.raw_model.named_parameters():
            g = self._group(n)
            norms[g] = norms.get(g, 0.0) + self._before[n].square().sum().item()
            updates[g] = updates.get(g, 0.0) + (p.detach().double() - self._before[n]).square().sum().item()
        self.param_norm[step] = {g: math.sqrt(v) for g, v in norms.items()}
        self.update_norm[step] = {g: math.sqrt(v) for g, v in updates.items()}


def test_every_key_is_logged_and_agrees_with_hand_computation(tiny_config, tiny_data, tmp_path):
    hand = _HandMade()
    cfg = tiny_config(tiny_data, "train.steps=4", "checkpoint.every=0", "monitor.stats_every=1")
    train(cfg, tmp_path / "run", extra_callbacks=[hand])
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    expected = {f"stats/{n}/{layer}" for n in ("grad_norm", "param_norm", "update_ratio") for layer in LAYERS}
    expected |= {f"stats/{n}/{i}" for n in ("act_rms", "act_max", "attn_logit_max") for i in (0, 1)}
    expected |= {
        "stats/logit_max",
        "stats/logit_entropy",
        "stats/step_time_s/rank0",
        "stats/memory_gib/rank0",
        "stats/loss_source/email",  # the validation split of the tiny corpus holds `email/` files only
    }
    for r in records:
        stats = _stats(r)
        assert set(stats) == expected
        assert all(isinstance(v, float) and math.isfinite(v) for v in stats.values()), stats
        # the per-layer gradient norms make up the global one the trainer clips with
        total = math.sqrt(sum(stats[f"stats/grad_norm/{layer}"] ** 2 for layer in LAYERS))
        assert total == pytest.approx(r["grad_norm"], rel=1e-5)
        for layer in LAYERS:
            param = hand.param_norm[r["step"]][layer]
            assert stats[f"stats/param_norm/{layer}"] == pytest.approx(param, rel=1e-5)
            ratio = hand.update_norm[r["step"]][layer] / param
            assert stats[f"stats/update_ratio/{layer}"] == pytest.approx(ratio, rel=1e-4)
            assert ratio > 0
        assert 0 < stats["stats/step_time_s/rank0"] < 60 and stats["stats/memory_gib/rank0"] > 0
        assert 0 < stats["stats/act_rms/0"] <= stats["stats/act_max/0"]
        assert 0 < stats["stats/logit_entropy"] <= math.log(cfg.model.resolved(320).vocab_size or 0)
    # the first step's norms are the initialisation's: LayerNorm weights of ones, N(0, 0.02) matrices
    first = _stats(records[0])
    assert first["stats/param_norm/norm"] == pytest.approx(math.sqrt(64), rel=1e-6)
    # a fresh model predicts nearly uniformly over the padded vocabulary of 320
    assert first["stats/logit_entropy"] == pytest.approx(math.log(320), abs=0.05)


# ----- the loss per data source -------------------------------------------------------------------------
def test_a_document_s_source_is_the_first_folder_of_its_id():
    assert document_source("email/mime/text.py") == "email" and document_source("json/__init__.py") == "json"
    assert document_source("README.md") == "." and document_source("data.jsonl:12") == "."
    assert document_source("/wiki/12") == "wiki"  # a record's id field, not a path in the source


def test_loss_by_source_is_each_source_s_mean_cross_entropy():
    torch.manual_seed(0)
    logits, targets = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    index = torch.tensor([[0, 0, 1, -1, 2], [1, 1, 0, 0, -1]])
    got = loss_by_source(logits, targets, index, 4)
    nll = F.cross_entropy(logits.flatten(0, 1).double(), targets.flatten(), reduction="none")
    for source in range(3):
        mask = index.flatten() == source
        assert got[source].item() == pytest.approx(nll[mask].mean().item(), rel=1e-6)
    assert math.isnan(got[3].item())  # a source without tokens; the tokens of index -1 count nowhere


class _SourceLossByHand(Callback):
    """The probe batch's loss per source, found from the prepared split's own files: the micro-batch of
    windows spread evenly over the validation split (tenx.data.loader.sequential_windows), each target's
    document by a search of the shards' document offsets, the model run at the stats step's pre_optim_step."""

    def __init__(self, data_dir: Path, every: int) -> None:
        self.data_dir, self.every = data_dir, every
        self.expected: dict[int, dict[str, float]] = {}
        self._step = 0

    def on_step_start(self, trainer: Any) -> None:
        self._step = trainer.step + 1

    @torch.no_grad()
    def pre_optim_step(self, trainer: Any) -> None:
        if self._step % self.every:
            return
        split = read_manifest(self.data_dir)["splits"]["val"]
        tokens, starts = [], []
        for shard in split["shards"]:
            offset = sum(len(t) for t in tokens)
            tokens.append(np.fromfile(self.data_dir / shard["file"], dtype="<u2").astype(np.int64))
            starts.append(offset + np.fromfile(self.data_dir / shard["index_file"], dtype="<i8"))
        stream, doc_starts = np.concatenate(tokens), np.concatenate(starts)
        T, B = trainer.model_cfg.seq_len, trainer.loader.micro_batch
        windows = np.unique(np.linspace(0, (len(stream) - 1) // T - 1, B).round().astype(np.int64))
        rows = torch.from_numpy(np.stack([stream[w * T : w * T + T + 1] for w in windows]))
        logits = trainer.raw_model(rows[:, :-1]).double()
        nll = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="none").numpy()
        offsets = (windows[:, None] * T + 1 + np.arange(T)[None, :]).flatten()
        documents = np.searchsorted(doc_starts, offsets, side="right") - 1
        sources = np.array([split["documents"][d].split("/")[0] for d in documents])
        self.expected[self._step] = {s: float(nll[sources == s].mean()) for s in sorted(set(sources))}


def test_the_loss_per_data_source_of_validation_data_is_logged_with_the_statistics(
    tiny_config, two_source_data, tmp_path
):
    hand = _SourceLossByHand(two_source_data, every=15)
    sets = ("train.steps=30", "train.eval_every=0", "checkpoint.every=0", "monitor.stats_every=15")
    train(tiny_config(two_source_data, *sets), tmp_path / "run", extra_callbacks=[hand])
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    logged = {
        r["step"]: {k.split("/")[2]: v for k, v in r.items() if k.startswith("stats/loss_source/")}
        for r in records
    }
    assert {step: sorted(v) for step, v in logged.items() if v} == {
        15: ["digits", "letters"],
        30: ["digits", "letters"],
    }
    for step in (15, 30):
        assert logged[step] == pytest.approx(hand.expected[step], rel=1e-5)
    # ten digits are easier to predict than 26 letters, once the model has learnt which follow which
    assert logged[30]["digits"] + 0.3 < logged[30]["letters"] < logged[15]["letters"]


def test_many_sources_are_the_largest_few_by_name_and_the_rest_together(tmp_path):
    import random

    from tenx.data.loader import TokenStream
    from tenx.data.prepare.pipeline import PrepareConfig, prepare
    from tenx.monitor.source_loss import token_sources

    rng = random.Random(0)
    corpus = tmp_path / "corpus"
    for i in range(MAX_SOURCES + 3):  # source i: i + 1 files of 600 random letters
        (corpus / f"s{i:02d}").mkdir(parents=True)
        for j in range(i + 1):
            (corpus / f"s{i:02d}" / f"{j}.txt").write_text("".join(rng.choices("abcdefgh ", k=600)))
    out = tmp_path / "data"
    prepare(
        PrepareConfig(source=str(corpus), out=str(out), tokenizer="bytes", val_ratio=0.0, heldout_ratio=0.0),
        progress=False,
    )
    stream = TokenStream(out, "train")
    names, index = token_sources(stream, np.arange(len(stream)))
    kept = [f"s{i:02d}" for i in range(4, MAX_SOURCES + 3)]  # the MAX_SOURCES - 1 largest, by name
    assert names == [*kept, OTHER]
    split = read_manifest(out)["splits"]["train"]
    (shard,) = split["shards"]
    lengths = np.diff(np.append(np.fromfile(out / shard["index_file"], dtype="<i8"), shard["tokens"]))
    source = np.repeat([d.split("/")[0] for d in split["documents"]], lengths)
    assert [names[i] for i in index] == [s if s in kept else OTHER for s in source]


def test_stats_only_at_their_interval_and_training_unchanged(tiny_config, tiny_data, tmp_path):
    base = ("train.steps=6", "checkpoint.every=0", "train.eval_every=0")
    train(tiny_config(tiny_data, *base, "monitor.stats_every=0"), tmp_path / "off")
    train(tiny_config(tiny_data, *base, "monitor.stats_every=3"), tmp_path / "every3")
    off = read_metrics(tmp_path / "off" / "metrics.jsonl")
    on = read_metrics(tmp_path / "every3" / "metrics.jsonl")
    assert not any(_stats(r) for r in off)
    assert [r["step"] for r in on if _stats(r)] == [3, 6]
    # the probe forward draws no random numbers and changes nothing: the same losses, bit for bit
    assert [r["loss"] for r in on] == [r["loss"] for r in off]
    assert [r["grad_norm"] for r in on] == [r["grad_norm"] for r in off]


def test_callback_is_installed_by_config(tiny_config, tiny_data):
    on = default_callbacks(tiny_config(tiny_data, "monitor.stats_every=7"), rank=1)
    assert [cb.every for cb in on if isinstance(cb, ModelStats)] == [7]  # on every rank, not only 0
    off = default_callbacks(tiny_config(tiny_data, "monitor.stats_every=0"))
    assert not any(isinstance(cb, ModelStats) for cb in off)


def test_stats_under_activation_checkpointing_and_llama(tiny_config, tiny_data, tmp_path):
    """llama: untied head, RoPE, grouped KV heads; recomputed blocks do not disturb the figures."""
    cfg = tiny_config(
        tiny_data,
        "model.family='llama'",
        "model.n_kv_heads=1",
        "train.steps=2",
        "checkpoint.every=0",
        "monitor.stats_every=2",
        "parallel.activation_checkpointing=true",
    )
    train(cfg, tmp_path / "run")
    stats = _stats(read_metrics(tmp_path / "run" / "metrics.jsonl")[-1])
    for layer in ("0", "1", "embed", "norm", "head"):
        assert stats[f"stats/update_ratio/{layer}"] > 0
    assert all(math.isfinite(v) for v in stats.values())


# ----- several ranks ------------------------------------------------------------------------------------
_SETS = (
    "log.progress=false",
    "train.steps=4",
    "optim.warmup_steps=1",
    "train.global_batch=16",
    "train.micro_batch=8",
    "train.eval_every=0",
    "checkpoint.every=0",
    "checkpoint.at_end=false",
    "monitor.stats_every=2",
)


def _torchrun(data: Path, run_dir: Path, *extra: str) -> list[dict[str, Any]]:
    """`tenx train` of tiny.toml with _SETS in 2 processes over gloo; the metrics rank 0 wrote."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    sets = [f'data.dir="{data}"', *_SETS, *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "tenx"]
    cmd += ["train", "--config", str(CONFIG_DIR / "tiny.toml"), "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_ranks_show_each_step_time_and_the_straggler(tiny_data, tmp_path):
    """2 processes over gloo (DDP): each rank's step time is logged, and a rank made slow at a stats step
    shows it, while its peer, which waits for it inside the gradient reduction, does not."""
    records = _torchrun(tiny_data, tmp_path / "ddp", "faults.inject=['slow@step=4,rank=1,seconds=1.5']")
    assert [r["step"] for r in records if "stats/logit_max" in r] == [2, 4]
    at2, at4 = (next(r for r in records if r["step"] == s) for s in (2, 4))
    assert 0 < at2["stats/step_time_s/rank0"] < 1.0 and 0 < at2["stats/step_time_s/rank1"] < 1.0
    assert at4["stats/step_time_s/rank1"] >= 1.5
    assert at4["stats/step_time_s/rank0"] < 1.0
    assert at4["step_time_s"] > 1.0  # the trainer's step time of rank 0 holds the wait
    assert at4["stats/memory_gib/rank0"] > 0 and at4["stats/memory_gib/rank1"] > 0


@pytest.mark.slow
def test_fsdp_norms_sum_the_shards(tiny_config, tiny_data, tmp_path):
    """Under FSDP each rank holds a shard: the per-layer norms summed over ranks equal one process's."""
    fsdp = _torchrun(tiny_data, tmp_path / "fsdp", "parallel.strategy='fsdp'")
    one_cfg = tiny_config(tiny_data, *_SETS[1:])
    train(one_cfg, tmp_path / "one")
    one = read_metrics(tmp_path / "one" / "metrics.jsonl")
    for step in (2, 4):
        a, b = (next(r for r in rs if r["step"] == step) for rs in (fsdp, one))
        assert math.sqrt(sum(a[f"stats/grad_norm/{layer}"] ** 2 for layer in LAYERS)) == pytest.approx(
            a["grad_norm"], rel=1e-5
        )
        per_layer = ("stats/grad_norm/", "stats/param_norm/", "stats/update_ratio/")
        keys = [k for k in b if k.startswith((*per_layer, "stats/loss_source/"))]
        assert len(keys) == 3 * len(LAYERS) + 1  # and the validation split's one source, `email`
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-4), key
        assert "stats/step_time_s/rank1" in a and "stats/step_time_s/rank1" not in b


@pytest.mark.slow
def test_compiled_training_is_not_recompiled_or_changed_by_stats(tiny_config, tiny_data, tmp_path):
    """The probe calls the model eagerly and the flags are off whenever the compiled forward runs."""
    import torch._dynamo.utils

    runs = {}
    for every in (0, 2):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        cfg = tiny_config(
            tiny_data,
            "train.steps=6",
            "checkpoint.every=0",
            "train.compile=true",
            f"monitor.stats_every={every}",
        )
        train(cfg, tmp_path / f"every{every}")
        records = read_metrics(tmp_path / f"every{every}" / "metrics.jsonl")
        runs[every] = (torch._dynamo.utils.counters["stats"]["unique_graphs"], records)
    assert runs[2][0] == runs[0][0]  # no graph more with statistics on
    assert [r["loss"] for r in runs[2][1]] == [r["loss"] for r in runs[0][1]]
    assert [r["step"] for r in runs[2][1] if _stats(r)] == [2, 4, 6]
