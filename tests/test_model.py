"""Model: parameter and FLOP counts against a hand count; every component variant runs and trains."""

import dataclasses
import itertools

import pytest
import torch

from tenx.errors import ConfigError
from tenx.model import ModelConfig, Transformer, count_params, flops_per_token, lm_loss
from tenx.model.config import round_up


def tiny_gpt2() -> ModelConfig:
    return ModelConfig(family="gpt2", depth=2, d_model=64, head_dim=32, seq_len=64).resolved(257)


def test_hand_count_gpt2_params_and_flops():
    cfg = tiny_gpt2()
    assert (cfg.vocab_size, cfg.n_heads, cfg.d_ff) == (320, 2, 256)
    # Per block: 2 LayerNorms (w+b) 2*128, q 64*64+64, kv 64*128+128, out 64*64+64, up 64*256+256, down 256*64+64.
    block = 2 * 128 + 4160 + 8320 + 4160 + 16640 + 16448
    assert block == 49984
    expected = 320 * 64 + 64 * 64 + 2 * block + 128  # tied head adds nothing
    assert count_params(cfg).total == expected == 124672
    assert sum(p.numel() for p in Transformer(cfg).parameters()) == expected
    # Matmul weights per token: blocks 2*(4096+8192+4096+16384+16384) + head 64*320 = 118784.
    # Forward = 2*118784 + attention 2 layers * (QK^T + AV) = 2*2*2*64*64 = 32768; training = 3x.
    assert flops_per_token(cfg) == 3 * (2 * 118784 + 32768) == 811008


def test_hand_count_llama_gqa():
    cfg = ModelConfig(family="llama", depth=1, d_model=128, head_dim=32, n_kv_heads=2, seq_len=16).resolved(
        300
    )
    # d_ff = round_up(8*128/3 = 341) = 384; no biases; RMSNorm weights only; untied head.
    assert cfg.d_ff == 384 and cfg.vocab_size == 320
    block = 128 + 128 * 128 + 128 * 2 * 2 * 32 + 128 * 128 + 128 * 2 * 384 + 384 * 128 + 128
    assert count_params(cfg).total == 320 * 128 + block + 128 + 320 * 128
    assert sum(p.numel() for p in Transformer(cfg).parameters()) == count_params(cfg).total


@pytest.mark.parametrize(
    "family,qk_norm,n_kv_heads,tie",
    list(itertools.product(["gpt2", "llama"], [False, True], [None, 1], [True, False])),
)
def test_variants_count_and_backward(family, qk_norm, n_kv_heads, tie):
    cfg = ModelConfig(
        family=family,
        depth=2,
        head_dim=32,
        qk_norm=qk_norm,
        n_kv_heads=n_kv_heads,
        tie_embeddings=tie,
        seq_len=16,
        z_loss=1e-4,
    ).resolved(100)
    model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg).total
    tokens = torch.randint(0, 100, (2, 16))
    loss, ce = lm_loss(model(tokens)[:, :-1], tokens[:, 1:], cfg.z_loss)
    assert loss.item() > ce.item() > 0
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_initial_loss_is_near_uniform():
    cfg = tiny_gpt2()
    torch.manual_seed(0)
    tokens, targets = torch.randint(0, 257, (4, 64)), torch.randint(0, 257, (4, 64))
    _, ce = lm_loss(Transformer(cfg)(tokens), targets)
    assert abs(ce.item() - torch.log(torch.tensor(320.0)).item()) < 0.1


def test_causality():
    cfg = ModelConfig(family="llama", depth=2, head_dim=32, seq_len=32).resolved(100)
    model = Transformer(cfg).eval()
    a = torch.randint(0, 100, (1, 32))
    b = a.clone()
    b[0, 20:] = (b[0, 20:] + 1) % 100
    with torch.no_grad():
        la, lb = model(a), model(b)
    assert torch.equal(la[0, :20], lb[0, :20])
    assert not torch.equal(la[0, 20:], lb[0, 20:])


def test_depth_derives_hardware_friendly_sizes():
    sizes = {}
    for depth in (1, 2, 6, 12, 24):
        cfg = ModelConfig(family="llama", depth=depth).resolved(8192)
        assert cfg.d_model % 64 == 0 and cfg.d_ff % 64 == 0 and cfg.vocab_size % 64 == 0
        sizes[depth] = count_params(cfg).total
    assert sizes[1] < sizes[2] < sizes[6] < sizes[12] < sizes[24]
    assert ModelConfig(family="gpt2", depth=1, vocab_size=257).resolved().vocab_size == 320
    small = ModelConfig(family="gpt2", depth=1, head_dim=32).resolved(257)
    assert count_params(small).total < 150_000  # ~0.1M with a byte vocabulary
    assert count_params(ModelConfig(family="llama", depth=24).resolved(32000)).total > 0.7e9
    assert round_up(257) == 320 and round_up(320) == 320


@pytest.mark.parametrize("z_loss", [0.0, 1e-3])
@pytest.mark.parametrize("chunk_elements", [45 * 64 - 1, 7 * 64])  # one chunk; several, the last short
def test_linear_cross_entropy_equals_the_plain_loss_and_its_gradients(monkeypatch, z_loss, chunk_elements):
    """The chunked output layer + loss gives lm_loss's values and gradients (float64: to rounding)."""
    from tenx.model import transformer

    monkeypatch.setattr(transformer, "CHUNK_ELEMENTS", chunk_elements)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(45, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(64, 16, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 64, (45,), generator=g)
    loss, ce = transformer.linear_cross_entropy(x, w, t, z_loss, torch.float64)
    (loss * 3.0).backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    ref_loss, ref_ce = lm_loss((x @ w.t())[None], t[None], z_loss, torch.float64)
    (ref_loss * 3.0).backward()
    assert torch.allclose(loss, ref_loss, rtol=1e-12) and torch.allclose(ce, ref_ce, rtol=1e-12)
    assert torch.allclose(gx, x.grad, rtol=1e-10, atol=1e-14)
    assert torch.allclose(gw, w.grad, rtol=1e-10, atol=1e-14)
    assert not ce.requires_grad and loss.requires_grad
    with torch.no_grad():  # evaluation: no gradients are made
        assert torch.allclose(transformer.linear_cross_entropy(x, w, t, z_loss, torch.float64)[1], ref_ce)


@pytest.mark.parametrize("chunked", [False, True])
def test_model_loss_with_targets_matches_logits_then_loss_in_bf16_autocast(monkeypatch, chunked):
    """forward(tokens, targets) under bf16 autocast: the loss of forward(tokens)'s logits, to bf16 rounding,
    and the same parameter gradients to a bf16 tolerance (tied embeddings: both paths of the weight)."""
    from tenx.model import transformer

    if chunked:
        monkeypatch.setattr(transformer, "CHUNK_ELEMENTS", 5 * 256)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(family="gpt2", depth=2, seq_len=32, z_loss=1e-4).resolved(256))
    tokens = torch.randint(0, 256, (2, 33))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, ce = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
    ref_loss, ref_ce = lm_loss(logits, tokens[:, 1:], 1e-4)
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-3 and abs(ce.item() - ref_ce.item()) < 1e-3
    for name, p in model.named_parameters():
        assert torch.allclose(fused[name], p.grad, rtol=0.05, atol=2e-4), name


@pytest.mark.parametrize("z_loss", [0.0, 1e-4])
def test_bf16_token_loss_is_the_fp32_loss_to_bf16_rounding_and_only_for_bf16_logits(z_loss):
    """train.loss_precision 'bf16': lm_loss's per-token cross-entropy from bf16 logits, its mean in fp32,
    within 1e-3 (relative) of the fp32 loss and its logit gradient within 1% of the largest entry; fp32
    logits take the fp32 path bit for bit whatever token_dtype says."""
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 64, 512)).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 512, (2, 64))
    loss, ce = lm_loss(logits, targets, z_loss, torch.float32, torch.bfloat16)
    assert loss.dtype == ce.dtype == torch.float32
    (grad,) = torch.autograd.grad(loss, logits)
    ref_logits = logits.detach().float().requires_grad_()
    ref_loss, ref_ce = lm_loss(ref_logits, targets, z_loss)
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_logits)
    assert abs(loss.item() / ref_loss.item() - 1) < 1e-3 and abs(ce.item() / ref_ce.item() - 1) < 1e-3
    assert (grad.float() - ref_grad).abs().max() < 0.01 * ref_grad.abs().max()
    assert not torch.equal(loss, ref_loss)  # the bf16 path ran: its rounding shows
    fp32 = logits.detach().float()
    assert torch.equal(
        lm_loss(fp32, targets, z_loss, torch.float32, torch.bfloat16)[0], lm_loss(fp32, targets, z_loss)[0]
    )


def test_dropout_only_while_training_and_none_drawn_without_it():
    torch.manual_seed(0)
    cfg = ModelConfig(depth=2, d_model=64, head_dim=16, seq_len=16, dropout=0.2).resolved(50)
    model = Transformer(cfg)
    tokens = torch.randint(0, 50, (2, 16))
    model.train()
    assert not torch.equal(model(tokens), model(tokens))  # a new mask each call
    model.eval()
    plain = Transformer(dataclasses.replace(cfg, dropout=0.0))
    plain.load_state_dict(model.state_dict())
    plain.eval()
    assert torch.equal(model(tokens), plain(tokens))
    plain.train()  # without dropout, training draws no random numbers: the generator is untouched
    state = torch.get_rng_state()
    plain(tokens)
    assert torch.equal(torch.get_rng_state(), state)
    with pytest.raises(ConfigError, match="model.dropout"):
        ModelConfig(dropout=1.0).validate()
