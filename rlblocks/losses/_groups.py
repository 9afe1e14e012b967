"""Sync-free group statistics over arbitrary integer group ids.

``torch.unique(return_inverse=True)`` has a data-dependent output size. It happens to trace under
``torch.compile(fullgraph=True)`` with some backends, but only through dynamic-shape support. We use a
formulation whose shapes are all ``[n]`` instead: a stable sort of the ids, a cumulative sum of "new id" flags
gives each sample a dense group index in ``[0, n)``, and per-group sums are ``index_add`` into an ``[n]`` buffer
(slots past the number of groups stay empty). Cost O(n log n), memory O(n), no host sync.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor


def dense_group_index(group_ids: Int[Tensor, " n"]) -> Int[Tensor, " n"]:
    """Map arbitrary (non-contiguous, unsorted, ragged) integer ids to dense indices in ``[0, n)``."""
    n = group_ids.shape[0]
    sorted_ids, order = torch.sort(group_ids, stable=True)
    new = torch.ones(n, dtype=torch.long, device=group_ids.device)
    if n > 1:
        new[1:] = (sorted_ids[1:] != sorted_ids[:-1]).long()
    seg = torch.cumsum(new, 0) - 1
    return torch.empty_like(seg).scatter_(0, order, seg)


def group_sum(x: Float[Tensor, " n"], index: Int[Tensor, " n"]) -> Float[Tensor, " n"]:
    """Per-sample sum of ``x`` over the sample's group (broadcast back to the samples)."""
    total = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device).index_add(0, index, x)
    return total[index]


def group_reduce(x: Float[Tensor, " n"], index: Int[Tensor, " n"], reduce: str) -> Float[Tensor, " n"]:
    """Per-sample ``amax``/``amin`` of ``x`` over the sample's group (broadcast back to the samples)."""
    fill = float("-inf") if reduce == "amax" else float("inf")
    out = torch.full((x.shape[0],), fill, dtype=x.dtype, device=x.device)
    out = out.scatter_reduce(0, index, x, reduce=reduce, include_self=True)
    return out[index]


def group_count(index: Int[Tensor, " n"], dtype: torch.dtype) -> Float[Tensor, " n"]:
    return group_sum(torch.ones(index.shape[0], dtype=dtype, device=index.device), index)


def group_mean_std(
    x: Float[Tensor, " n"], index: Int[Tensor, " n"]
) -> tuple[Float[Tensor, " n"], Float[Tensor, " n"], Float[Tensor, " n"]]:
    """Two-pass group mean and unbiased (Bessel) std, plus the group size, each broadcast to the samples.

    Call with float64 ``x``: the two-pass form in fp64 is what keeps a group like ``[1.0, 1.00001]`` exact
    (a one-pass ``E[x²] − E[x]²`` in fp32 cancels catastrophically). Singleton groups get std 0.
    """
    count = group_count(index, x.dtype)
    mean = group_sum(x, index) / count
    centred = x - mean
    var = group_sum(centred * centred, index) / (count - 1).clamp(min=1)
    return mean, var.sqrt(), count


def poison_nonfinite_groups(
    adv: Float[Tensor, "n *F"], values: Float[Tensor, "n *F"], index: Int[Tensor, " n"]
) -> Float[Tensor, "n *F"]:
    """``adv`` with every sample of a group that holds a non-finite ``values`` entry set to NaN.

    Group estimators compare a sample with its group, so one NaN or infinite reward leaves no sample of that group
    a meaningful advantage. Without this, ``where(count > 1, adv, 0)`` (singletons), ``r == r_max`` (pass@k) or a
    ``Σw > 0`` fallback (OPO) would turn the NaN into a plausible 0 and the broken reward would vanish. Other groups
    are untouched. Works per column for ``[n, F]`` values.
    """
    bad = (~torch.isfinite(values)).to(values.dtype)
    n = values.shape[0]
    count = torch.zeros((n, *values.shape[1:]), dtype=values.dtype, device=values.device).index_add(0, index, bad)
    return torch.where(count[index] > 0, torch.full_like(adv, float("nan")), adv)


def segment_index(mask: Bool[Tensor, "B T"], turn_ids: Int[Tensor, "B T"] | None) -> Int[Tensor, "B T"]:
    """Dense index in ``[0, B·T)`` of each token's segment: the pair (row, turn).

    With ``turn_ids``, a segment is every valid token of one row with one turn id (wherever they sit). Without,
    a segment is a maximal run of consecutive valid tokens of a row (ROLL's convention: the model's turns of a
    multi-turn trajectory are separated by masked environment tokens). Ids are dense within each row and offset
    by ``row·T``, so every shape is static and nothing syncs. Masked positions get an index too (a segment of
    their own, or their turn's); callers mask them out of every sum.
    """
    b, t = mask.shape
    if turn_ids is None:
        prev = torch.zeros_like(mask)
        prev[:, 1:] = mask[:, :-1]
        local = torch.cumsum((mask & ~prev).long(), dim=-1)  # 0 before the first run, then 1, 2, ...
    else:
        sorted_ids, order = torch.sort(turn_ids, dim=-1, stable=True)
        new = torch.ones_like(sorted_ids, dtype=torch.long)
        if t > 1:
            new[:, 1:] = (sorted_ids[:, 1:] != sorted_ids[:, :-1]).long()
        local = torch.empty_like(new).scatter_(1, order, torch.cumsum(new, dim=-1) - 1)
    row = torch.arange(b, device=mask.device)[:, None] * t
    return (row + local.clamp(max=t - 1)).reshape(b, t)
