"""Float64 references for the kernel tests: every reference materialises the logits and uses plain torch ops."""

from __future__ import annotations

import types

import pytest
import torch

IGNORE = -100


def ref_token_logprobs(logits, labels, temperature=1.0, ignore_index=IGNORE):
    """(logp, entropy) in float64 from materialised logits; 0 at ignored positions."""
    valid = labels != ignore_index
    z = torch.where(valid.unsqueeze(-1), logits.double(), 0.0) / temperature
    lsm = torch.log_softmax(z, dim=-1)
    lp = lsm.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    ent = -(lsm.exp() * lsm).sum(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)


def ref_linear(hidden, weight, labels, temperature=1.0, ignore_index=IGNORE):
    valid = labels != ignore_index
    h = torch.where(valid.unsqueeze(-1), hidden.double(), 0.0)
    return ref_token_logprobs(h @ weight.double().T, labels, temperature, ignore_index)


def ref_vocab_kl(student, teacher, valid, kind, beta=0.5, temperature=1.0):
    s = torch.where(valid.unsqueeze(-1), student.double(), 0.0) / temperature
    t = torch.where(valid.unsqueeze(-1), teacher.double(), 0.0) / temperature
    lq, lp = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    q, p = lq.exp(), lp.exp()
    if kind == "forward":
        out = (p * (lp - lq)).sum(-1)
    elif kind == "reverse":
        out = (q * (lq - lp)).sum(-1)
    else:
        m = beta * p + (1 - beta) * q
        # m = 0 only where p = q = 0: those terms are 0 either way (tested as == 0, so a NaN m stays NaN)
        lm = torch.where(m == 0, 1.0, m).log()
        out = beta * (p * (lp - lm)).sum(-1) + (1 - beta) * (q * (lq - lm)).sum(-1)
    return torch.where(valid, out, 0.0)


def ref_processed(z: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """float64 log-probs of vLLM's processed distribution per row (``z`` already divided by the temperature)."""
    z = z.double()
    v = z.shape[-1]
    use_k = (k > 0) & (k < v)
    kk = torch.where(use_k, k, v).clamp(1, v)
    kth = z.sort(-1, descending=True).values.gather(-1, (kk - 1).unsqueeze(-1))
    z = torch.where(use_k.unsqueeze(-1) & (z < kth), float("-inf"), z)
    srt, idx = z.sort(-1)  # ascending, as vLLM's apply_top_k_top_p
    cum = srt.softmax(-1).cumsum(-1)
    drop = (cum <= 1 - p.double().unsqueeze(-1)) & (p < 1).unsqueeze(-1)
    drop[:, -1] = False
    z = z.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float("-inf"))
    return z.log_softmax(-1)


def ref_outputs(lsm: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor):
    """(logp with −inf outside, entropy, outside) from processed float64 log-probs; 0 at ignored rows. Both
    outputs are differentiable w.r.t. the logits that produced ``lsm`` (no 0·(−inf) in the graph)."""
    lp = lsm.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    pr = lsm.exp()
    ent = -(pr * torch.where(pr > 0, lsm, 0.0)).sum(-1)
    outside = valid & torch.isneginf(lp)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0), outside


def make_labels(shape, vocab, frac_ignored=0.2, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, vocab, shape, generator=g)
    drop = torch.rand(shape, generator=g) < frac_ignored
    y[drop] = IGNORE
    # make sure both kinds of rows exist
    y.view(-1)[0] = IGNORE
    y.view(-1)[-1] = vocab - 1
    return y


def assert_close(got, want, atol, what):
    """max |got − want| <= atol · max(1, max |want|): absolute for O(1) values, relative to the largest reference
    value when that exceeds 1 (fp32 sums of hundreds of rows of O(10) gradients carry ~1e-6 relative rounding)."""
    err = (got.double() - want.double()).abs().max().item()
    scale = max(1.0, want.double().abs().max().item())
    assert err <= atol * scale, f"{what}: max abs error {err:.3g} > {atol:.3g} x scale {scale:.3g}"


@pytest.fixture
def ref():
    return types.SimpleNamespace(
        token_logprobs=ref_token_logprobs,
        linear=ref_linear,
        vocab_kl=ref_vocab_kl,
        processed=ref_processed,
        processed_outputs=ref_outputs,
        make_labels=make_labels,
        assert_close=assert_close,
        IGNORE=IGNORE,
    )


@pytest.fixture
def small_chunks(monkeypatch):
    """Shrink the torch path's chunk budget and the Triton gradient block so that several chunks are exercised."""
    from rlblocks.kernels import _common

    monkeypatch.setattr(_common, "TORCH_CHUNK_BYTES", 64 * 1024)
    monkeypatch.setattr(_common, "TRITON_GRAD_CHUNK_BYTES", 16 * 1024)
