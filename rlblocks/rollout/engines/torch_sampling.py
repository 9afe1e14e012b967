"""Sampling of :class:`~rlblocks.rollout.engines.TorchEngine`: the processed distribution and the token draw.

- **Processed logprobs.** ``output_logprobs[i] = log_softmax(process(logits / T))[token]`` where ``process`` keeps
  the top-k logits (ties at the k-th value are kept), then the smallest set of most probable tokens whose
  probability mass reaches top-p (the most probable token is always kept); everything else is ``-inf``. Computed
  in fp32 from fp32 logits. Greedy (``temperature == 0``) takes the argmax of the raw logits and reports the
  untempered, unfiltered log-softmax.
- **Seeds.** Sampling is by inverse CDF (float64) with a *counter-based* uniform number: the token at absolute
  position ``p`` (index in prompt + output) uses ``u = splitmix64(seed, p) / 2**63``, a stateless generator (as
  Philox is), rather than a stateful per-request ``torch.Generator``. The draw therefore depends only on
  (seed, position), not on how many tokens this call produced, so a seeded request interrupted and re-submitted
  with the same seed draws the same numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from jaxtyping import Float, Int
from torch import Tensor

if TYPE_CHECKING:
    from .torch_memory import _Seq

__all__ = ["processed_logprobs", "sample_tokens"]

_MASK64 = (1 << 63) - 1


def _mix_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed from (request seed, absolute token position) (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK64


def _uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, position): counter-based, like Philox."""
    return (_mix_seed(seed, position) >> 10) * 2.0**-53


def processed_logprobs(
    logits: Float[Tensor, "B V"],
    temperature: Float[Tensor, " B"],
    top_k: Int[Tensor, " B"],
    top_p: Float[Tensor, " B"],
) -> Float[Tensor, "B V"]:
    """Log-probabilities of the sampling distribution actually used, per row; ``-inf`` outside its support.

    ``x = logits / T`` (rows with ``T == 0`` use ``T = 1``: greedy reports the untempered distribution); top-k keeps
    ``x >= kth largest`` (ties kept; ``k <= 0`` or ``k >= V`` disables it); top-p then sorts the survivors, and
    drops a token when the probability mass strictly before it is already ``>= top_p`` (``top_p == 1`` disables it;
    the most probable token is always kept); ``log_softmax`` renormalises. fp32 in, fp32 out.
    """
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    x = logits.float()
    if not bool((t == 1).all()):  # x / 1 is x, bit for bit: skip a pass over the logits at T = 1
        x = x / t.unsqueeze(-1)
    vocab = x.shape[-1]
    use_k = (top_k > 0) & (top_k < vocab)
    if bool(use_k.any()):
        k = torch.where(use_k, top_k, torch.full_like(top_k, vocab)).clamp(1, vocab)
        sorted_x = torch.sort(x, dim=-1, descending=True).values
        kth = sorted_x.gather(-1, (k - 1).unsqueeze(-1))
        x = torch.where(use_k.unsqueeze(-1) & (x < kth), torch.full_like(x, float("-inf")), x)
    use_p = top_p < 1.0
    if bool(use_p.any()):
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = (mass_before >= top_p.unsqueeze(-1)) & use_p.unsqueeze(-1)
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.log_softmax(x, dim=-1)



def sample_tokens(seqs: list[_Seq], logits: Float[Tensor, "B V"]) -> list[tuple[_Seq, int, float]]:
    """Pick one token per row of ``logits`` for ``seqs`` (greedy argmax, or the inverse-CDF draw of the
    counter-based uniform from the processed distribution); each with its processed logprob."""
    dev = logits.device
    sp = [s.request.sampling for s in seqs]
    temp = torch.tensor([p.temperature for p in sp], dtype=torch.float32, device=dev)
    greedy = temp == 0
    top_k = torch.tensor([-1 if p.temperature == 0 else p.top_k for p in sp], dtype=torch.long, device=dev)
    top_p = torch.tensor([1.0 if p.temperature == 0 else p.top_p for p in sp], dtype=torch.float32, device=dev)
    logp = processed_logprobs(logits, temp, top_k, top_p)
    # each argmax is a full pass over the vocabulary: taken only for the rows that need it
    tokens = logits.argmax(dim=-1) if bool(greedy.any()) else None
    if not bool(greedy.all()):
        u = torch.tensor([_uniform(s.seed, len(s.tokens)) for s in seqs], dtype=torch.float64)
        # exp and the running sum in place in one float64 copy: the same values as cumsum(exp(.)), fewer passes
        cdf = logp.to(torch.float64, copy=True)
        cdf.exp_()
        cdf.cumsum_(dim=-1)
        target = (u.to(dev) * cdf[:, -1]).unsqueeze(-1)
        drawn = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_max(logits.shape[-1] - 1)
        # never return a token outside the support (only reachable through float rounding at the very top)
        inside = torch.isfinite(logp.gather(-1, drawn.unsqueeze(-1)).squeeze(-1))
        if not bool(inside.all()):
            drawn = torch.where(inside, drawn, logp.argmax(dim=-1))
        tokens = drawn if tokens is None else torch.where(greedy, tokens, drawn)
    lps = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return list(zip(seqs, tokens.tolist(), lps.tolist()))
