"""TorchEngine's token draw (``sample_tokens``) against a second implementation in numpy: greedy rows take the
argmax of the raw logits, sampled rows the inverse-CDF draw of the counter-based uniform over the processed
distribution (float64 running sum), each with its processed log-prob."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlblocks.rollout import SamplingParams
from rlblocks.rollout.engines.torch_sampling import _uniform, processed_logprobs, sample_tokens


def _seq(sp: SamplingParams, seed: int, n_tokens: int):
    return SimpleNamespace(request=SimpleNamespace(sampling=sp), seed=seed, tokens=list(range(n_tokens)))


def _reference(seq, logits_row: torch.Tensor) -> tuple[int, float]:
    sp = seq.request.sampling
    if sp.temperature == 0:
        tok = int(np.argmax(logits_row.numpy()))
        return tok, float(torch.log_softmax(logits_row.float(), -1)[tok])
    logp = processed_logprobs(logits_row[None].float(), torch.tensor([sp.temperature]), torch.tensor([sp.top_k]),
                              torch.tensor([sp.top_p]))[0]
    cdf = np.cumsum(np.exp(logp.numpy().astype(np.float64)))
    target = _uniform(seq.seed, len(seq.tokens)) * cdf[-1]
    tok = int(np.searchsorted(cdf, target, side="right"))
    return tok, float(logp[tok])


@pytest.mark.parametrize("all_greedy", [False, True])
def test_draw_matches_numpy_reference(all_greedy):
    g = torch.Generator().manual_seed(0)
    vocab = 3000
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7),
              SamplingParams(temperature=1.0, top_k=50), SamplingParams(temperature=1.3, top_p=0.9),
              SamplingParams(temperature=1.0, top_k=200, top_p=0.8)]
    if all_greedy:
        params = [SamplingParams(temperature=0.0)] * 3
    checked = 0
    for rep in range(20):
        logits = torch.randn(len(params), vocab, generator=g) * (1 + 3 * torch.rand(len(params), 1, generator=g))
        seqs = [_seq(sp, seed=100 * rep + i, n_tokens=5 + rep) for i, sp in enumerate(params)]
        got = sample_tokens(seqs, logits)
        for i, (seq, tok, lp) in enumerate(got):
            assert seq is seqs[i]
            want_tok, want_lp = _reference(seq, logits[i])
            assert tok == want_tok, (rep, i)
            assert lp == pytest.approx(want_lp, abs=1e-6) and np.isfinite(lp)
            checked += 1
    assert checked == 20 * len(params)


def test_temperature_one_is_the_same_as_dividing():
    """Rows at T = 1 skip the division: the processed log-probs equal those computed with it, bit for bit."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 500, generator=g) * 5
    t = torch.tensor([1.0, 1.0, 0.0, 1.0])  # T = 0 (greedy) reports the untempered distribution: divides by 1
    k, p = torch.full((4,), -1), torch.ones(4)
    want = torch.log_softmax(logits / torch.ones(4, 1), -1)
    assert torch.equal(processed_logprobs(logits, t, k, p), want)
    t2 = torch.tensor([1.0, 0.5, 0.0, 2.0])
    want2 = torch.log_softmax(logits / torch.tensor([[1.0], [0.5], [1.0], [2.0]]), -1)
    assert torch.equal(processed_logprobs(logits, t2, k, p), want2)
