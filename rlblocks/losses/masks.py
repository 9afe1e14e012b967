"""Masks of recent recipes that do not compare trainer and engine: high-entropy tokens, overlong penalty,
zero-variance groups (the one home of each rule; the train/rollout masks are in :mod:`rlblocks.losses.mismatch`).

All are detached, sync-free and compile with ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor

from rlblocks._checks import (
    as_bool_mask,
    check_floating,
    check_group_inputs,
    check_int,
    check_ndim,
    check_real,
)
from rlblocks.errors import ArgumentError
from rlblocks.losses._common import compute_dtype
from rlblocks.losses._groups import dense_group_index, group_reduce, poison_nonfinite_groups

__all__ = ["overlong_penalty", "top_entropy_mask", "zero_variance_groups"]




def top_entropy_mask(
    entropy: Float[Tensor, "B T"], mask: Shaped[Tensor, "B T"], *, quantile: float
) -> Bool[Tensor, "B T"]:
    """Keep the high-entropy "forking" tokens (Wang et al. 2025, "Beyond the 80/20 rule").

    ``keep = mask & (entropy ≥ q)`` with ``q`` the ``quantile``-quantile (linear interpolation, as
    ``torch.quantile``) of the entropies of the valid tokens of this call: ``quantile=0.8`` keeps the top 20%.
    Sync-free: invalid positions are sorted to the end as +inf and the quantile is gathered at a tensor index.
    The quantile is local to the call (per micro-batch); pass the whole batch for a batch-level threshold.

    A NaN entropy at a valid position is left out of the quantile and its token is *kept*: a NaN has no rank, and
    counting it would make the threshold NaN and drop every token; dropping just that token would hide the NaN
    (its log-probs are NaN too, and kept they make the loss NaN, where it shows). A mask cannot carry the NaN
    itself (it is bool) and raising would need a host sync, so keeping the token is how the NaN propagates.
    ±inf entropies rank normally; NaN/inf at masked positions is never read (those stay ``False``).

    An empty batch (``B = 0`` or ``T = 0``) gives an empty mask of the same shape, and a batch with no valid
    token gives all ``False``.
    """
    check_floating("entropy", entropy)
    check_ndim("entropy", entropy, 2, "[B, T]")
    m = as_bool_mask(mask, entropy, like_name="entropy")
    q = check_real("quantile", quantile, ge=0.0, le=1.0)
    if entropy.numel() == 0:  # a static shape: no token to rank, and nothing to gather the quantile from
        return m.clone()
    dt = compute_dtype(entropy)
    e = entropy.detach().to(dt)
    nan = torch.isnan(e)
    ranked = m & ~nan
    # +inf for the unranked positions: sorted after every ranked value (NaN would sort after +inf, also fine, but
    # a valid +inf entropy must stay a rankable value, so the unranked are excluded by count, not by value)
    flat = torch.where(ranked, e, torch.full_like(e, float("inf"))).reshape(-1)
    srt, _ = torch.sort(flat)
    n = ranked.sum()
    pos = q * (n - 1).clamp(min=0).to(dt)
    lo = pos.floor().long()
    hi = pos.ceil().long()
    v_lo = srt.gather(0, lo.reshape(1)).reshape(())
    v_hi = srt.gather(0, hi.reshape(1)).reshape(())
    frac = pos - lo.to(dt)
    # equal neighbours (incl. two +inf, where the interpolation would be inf − inf = NaN) need no interpolation
    thr = torch.where((hi == lo) | (v_hi == v_lo), v_lo, v_lo + frac * (v_hi - v_lo))
    return m & ((e >= thr) | nan)


def overlong_penalty(
    lengths: Shaped[Tensor, " n"], *, max_len: int, buffer: int, penalty: float = 1.0
) -> Float[Tensor, " n"]:
    """DAPO soft overlong punishment, to be added to the rewards. Returns ``[n]`` values in ``[−penalty, 0]``.

    ``0`` if ``|y| ≤ max_len − buffer``; ``−penalty·(|y| − (max_len − buffer)) / buffer`` inside the buffer;
    ``−penalty`` if ``|y| ≥ max_len``. Float32 (float64 for float64 lengths).

    ``max_len`` and ``buffer`` are token counts: genuine ints (numpy ints fine; a float or a bool raises
    ``ArgumentError``), ``max_len >= 1`` and ``1 <= buffer <= max_len``. A length is a count too, so a negative or
    NaN one gives NaN at its sample (read on the device: no host sync), not the 0 penalty of a short answer;
    ``+inf`` is longer than any budget and gives ``−penalty``.
    """
    if not isinstance(lengths, Tensor) or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise ArgumentError(f"lengths: expected a real tensor of shape [n], got {getattr(lengths, 'dtype', lengths)!r}")
    check_ndim("lengths", lengths, 1, "[n]")
    ml = check_int("max_len", max_len, minimum=1)
    buf = check_int("buffer", buffer, minimum=1, maximum=ml, what=f"an int in [1, max_len={ml}]")
    pen = check_real("penalty", penalty, ge=0.0, finite=True)  # an infinite one gives 0·inf = NaN in budget
    dt = torch.float64 if lengths.dtype == torch.float64 else torch.float32
    length = lengths.to(dt)
    excess = (length - (ml - buf)) / buf
    out = -pen * excess.clamp(0.0, 1.0)
    return torch.where(length >= 0, out, torch.full_like(out, float("nan")))


def zero_variance_groups(rewards: Shaped[Tensor, " n"], group_ids: Int[Tensor, " n"]) -> Bool[Tensor, " n"]:
    """``True`` for every sample whose group's rewards are all equal (including singleton groups).

    Such groups give zero GRPO advantage everywhere; DAPO's dynamic sampling drops them. Exact comparison of the
    group max and min (no variance threshold).

    A group holding a NaN or ±inf reward is never reported (``False``, even ``[inf, inf]`` or a singleton
    ``[nan]``): ``True`` tells a filter to discard the group, and the broken reward would vanish with it. Kept,
    the group's advantages are NaN (see ``grpo_advantages``) and the loss shows it. Raising instead would need a
    host sync; ``rlblocks.sched.DynamicSampler``'s Python-side filter raises on non-finite rewards.
    """
    check_group_inputs(rewards, group_ids)
    r = rewards.to(torch.float64)
    idx = dense_group_index(group_ids)
    equal = group_reduce(r, idx, "amax") == group_reduce(r, idx, "amin")
    nonfinite_group = torch.isnan(poison_nonfinite_groups(torch.zeros_like(r), r, idx))
    return equal & ~nonfinite_group

