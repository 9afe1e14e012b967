"""Advantage estimators: group-relative (GRPO, RLOO, OPO, pass@k, GDPO, REINFORCE++-baseline), ReMax, GAE,
discounted returns and masked whitening.

Conventions: sequence-level estimators take ``rewards [n]`` and arbitrary integer ``group_ids [n]``
(non-contiguous, unsorted, ragged groups) and return ``[n]``; the policy losses broadcast ``[B]`` advantages over
the tokens. Group statistics run in float64 with a two-pass variance, vectorised with a sort-based dense group
index (see ``rlblocks.losses._groups``): no Python loop over groups and no host sync, so every function here
compiles with ``torch.compile(fullgraph=True)``. Outputs are float32 (float64 for float64 inputs).

Non-finite rewards propagate, they never vanish: in the group estimators (GRPO, RLOO, OPO, pass@k, GDPO) a NaN or
±inf reward makes every advantage of *its group* NaN (a singleton included), and leaves the other groups untouched;
estimators that mix the whole batch (GRPO's ``std_scale="batch"``, GDPO's and REINFORCE++'s whitening, ``whiten``)
turn every output NaN. A NaN advantage makes the loss NaN, which the caller sees; a 0 would be trained on silently.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor

from rlblocks._checks import (
    as_bool_mask,
    check_bool,
    check_choice,
    check_floating,
    check_group_inputs,
    check_ndim,
    check_real,
    check_same_shape,
    shape_str,
)
from rlblocks.errors import ArgumentError
from rlblocks.losses._common import compute_dtype, safe
from rlblocks.losses._groups import (
    dense_group_index,
    group_count,
    group_mean_std,
    group_reduce,
    group_sum,
    poison_nonfinite_groups,
)

__all__ = [
    "discounted_returns",
    "gae",
    "gdpo_advantages",
    "grpo_advantages",
    "opo_advantages",
    "passk_advantages",
    "reinforce_pp_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
    "whiten",
]


def _out_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _unbiased_std(x: Tensor) -> Tensor:
    """Two-pass unbiased std of a 1-D tensor; 0 for fewer than two elements."""
    n = x.shape[0]
    mean = x.sum() / max(n, 1)
    return (((x - mean) ** 2).sum() / max(n - 1, 1)).sqrt()


def grpo_advantages(
    rewards: Shaped[Tensor, " n"],
    group_ids: Int[Tensor, " n"],
    *,
    std_scale: str = "group",
    eps: float = 1e-6,
) -> Float[Tensor, " n"]:
    """GRPO group-relative advantage ``A_i = (R_i − μ_g) / (σ + eps)``.

    - ``std_scale="group"``: σ = unbiased (Bessel, K−1) std of the rewards in the sample's group (GRPO).
    - ``std_scale="batch"``: σ = unbiased std of all *raw* rewards in the batch (TRL's ``scale_rewards="batch"``).
      AReaL instead uses the std of the group-centred rewards; divide ``grpo_advantages(..., std_scale="none")``
      by its std yourself for that variant.
    - ``std_scale="none"``: no division (Dr.GRPO).

    A singleton group gives 0 (NaN if its reward is not finite). ``eps`` differs across frameworks (verl/SLIME
    1e-6, TRL/ms-swift 1e-4, OpenRLHF 1e-9); with eps=1e-9 the low-variance group ``[1.0, 1.00001]`` gives ±0.707.
    Numerics: float64 two-pass mean/variance per group; output float32 (float64 for float64 rewards).
    """
    check_group_inputs(rewards, group_ids)
    check_choice("std_scale", std_scale, ("group", "batch", "none"))
    eps = check_real("eps", eps, ge=0.0)
    r = rewards.to(torch.float64)
    idx = dense_group_index(group_ids)
    mean, std, count = group_mean_std(r, idx)
    centred = r - mean
    if std_scale == "group":
        adv = centred / (std + eps)
    elif std_scale == "batch":
        adv = centred / (_unbiased_std(r) + eps)
    else:
        adv = centred
    adv = poison_nonfinite_groups(torch.where(count > 1, adv, torch.zeros_like(adv)), r, idx)
    return adv.to(_out_dtype(rewards))


def rloo_advantages(rewards: Shaped[Tensor, " n"], group_ids: Int[Tensor, " n"]) -> Float[Tensor, " n"]:
    """RLOO leave-one-out baseline: ``A_i = R_i − (Σ_g R − R_i) / (K − 1)`` with K the group size.

    Equals ``K/(K−1)·(R_i − μ_g)``. A singleton group gives 0; a group with a non-finite reward gives NaN.
    Numerics: float64 group sums.
    """
    check_group_inputs(rewards, group_ids)
    r = rewards.to(torch.float64)
    idx = dense_group_index(group_ids)
    count = group_count(idx, torch.float64)
    total = group_sum(r, idx)
    adv = r - (total - r) / (count - 1).clamp(min=1)  # the clamp only guards singletons, which are set to 0 next
    adv = poison_nonfinite_groups(torch.where(count > 1, adv, torch.zeros_like(adv)), r, idx)
    return adv.to(_out_dtype(rewards))


def opo_advantages(
    rewards: Shaped[Tensor, " n"], group_ids: Int[Tensor, " n"], lengths: Shaped[Tensor, " n"]
) -> Float[Tensor, " n"]:
    """OPO length-weighted baseline: ``A_i = R_i − Σ_g |y_j| R_j / Σ_g |y_j|``.

    ``lengths`` are response lengths (tokens, a real or integer tensor; not bool). A singleton group gives 0. If a
    group's lengths sum to 0 the baseline falls back to the plain group mean. A non-finite reward, or a length that
    is negative or not finite, gives its whole group NaN (no host sync; the fallback must not hide a NaN length,
    and a negative weight would move the baseline outside the group's rewards). Numerics: float64 group sums.
    """
    check_group_inputs(rewards, group_ids)
    if not isinstance(lengths, Tensor) or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise ArgumentError(
            f"lengths: expected a real tensor of shape [n], got {getattr(lengths, 'dtype', type(lengths).__name__)}"
        )
    check_ndim("lengths", lengths, 1, "[n]")
    check_same_shape("rewards", rewards, "lengths", lengths)
    r = rewards.to(torch.float64)
    w = lengths.to(torch.float64)
    w = torch.where(w >= 0, w, torch.full_like(w, float("nan")))  # a negative length is poisoned like a NaN one
    idx = dense_group_index(group_ids)
    count = group_count(idx, torch.float64)
    wsum = group_sum(w, idx)
    weighted = group_sum(w * r, idx) / torch.where(wsum > 0, wsum, torch.ones_like(wsum))
    baseline = torch.where(wsum > 0, weighted, group_sum(r, idx) / count)
    adv = torch.where(count > 1, r - baseline, torch.zeros_like(r))
    adv = poison_nonfinite_groups(poison_nonfinite_groups(adv, r, idx), w, idx)
    return adv.to(_out_dtype(rewards))


def passk_advantages(rewards: Shaped[Tensor, " n"], group_ids: Int[Tensor, " n"]) -> Float[Tensor, " n"]:
    """pass@k advantage (verl ``grpo_passk``): only the group's best sample gets ``r_max − r_second``, others 0.

    ``r_second`` is the second-largest reward counting duplicates, so a tie for the best gives 0 to everyone.
    A singleton group gives 0; a group with a non-finite reward gives NaN to all its samples (``r == r_max``
    is False everywhere once the max is NaN, so without that rule the NaN would read as "not the best").
    Numerics: float64.
    """
    check_group_inputs(rewards, group_ids)
    r = rewards.to(torch.float64)
    idx = dense_group_index(group_ids)
    count = group_count(idx, torch.float64)
    r_max = group_reduce(r, idx, "amax")
    is_max = r == r_max
    n_max = group_sum(is_max.to(torch.float64), idx)
    below = group_reduce(torch.where(is_max, torch.full_like(r, float("-inf")), r), idx, "amax")
    r_second = torch.where(n_max > 1, r_max, below)
    gap = torch.where(count > 1, r_max - r_second, torch.zeros_like(r))
    adv = poison_nonfinite_groups(torch.where(is_max & (count > 1), gap, torch.zeros_like(r)), r, idx)
    return adv.to(_out_dtype(rewards))


def gdpo_advantages(
    rewards: Shaped[Tensor, "n F"],
    group_ids: Int[Tensor, " n"],
    weights: Shaped[Tensor, " F"],
    *,
    eps: float = 1e-6,
) -> Float[Tensor, " n"]:
    """GDPO: normalise each reward function within the group, take the weighted sum, then whiten over the batch.

    ``Â_f = (R_f − μ_{g,f}) / (σ_{g,f} + eps)`` per reward function f (unbiased group std, singleton → 0);
    ``S = Σ_f w_f Â_f``; ``A = (S − mean(S)) / (std(S) + eps)`` with the unbiased batch std. A non-finite reward
    makes its group's Â NaN, and the batch whitening then spreads it to every sample. Numerics: float64 throughout.
    """
    check_group_inputs(rewards, group_ids, ndim=2)
    if not isinstance(weights, Tensor) or weights.dtype.is_complex:
        raise ArgumentError(f"weights: expected a real tensor of shape [F], got {type(weights).__name__}")
    check_ndim("weights", weights, 1, "[F]")
    if weights.shape[0] != rewards.shape[1]:
        raise ArgumentError(
            f"weights: expected shape [F] = [{rewards.shape[1]}] (from rewards {shape_str(rewards)}), "
            f"got {shape_str(weights)}"
        )
    eps = check_real("eps", eps, ge=0.0)
    r = rewards.to(torch.float64)
    idx = dense_group_index(group_ids)
    n, f = r.shape
    count = group_count(idx, torch.float64)[:, None]
    totals = torch.zeros(n, f, dtype=torch.float64, device=r.device).index_add(0, idx, r)
    mean = totals[idx] / count
    centred = r - mean
    var = torch.zeros(n, f, dtype=torch.float64, device=r.device).index_add(0, idx, centred * centred)[idx]
    std = (var / (count - 1).clamp(min=1)).sqrt()
    norm = poison_nonfinite_groups(torch.where(count > 1, centred / (std + eps), torch.zeros_like(centred)), r, idx)
    s = norm @ weights.to(torch.float64)
    adv = (s - s.mean()) / (_unbiased_std(s) + eps)
    return adv.to(_out_dtype(rewards))


def remax_advantages(rewards: Shaped[Tensor, " n"], greedy_rewards: Shaped[Tensor, " n"]) -> Float[Tensor, " n"]:
    """ReMax: ``A_i = R_i − R_greedy,i`` (the greedy decode of the same prompt is the baseline)."""
    for name, x in (("rewards", rewards), ("greedy_rewards", greedy_rewards)):
        if not isinstance(x, Tensor) or x.dtype.is_complex:
            raise ArgumentError(f"{name}: expected a real tensor of shape [n], got {type(x).__name__}")
        check_ndim(name, x, 1, "[n]")
    check_same_shape("rewards", rewards, "greedy_rewards", greedy_rewards)
    return (rewards.to(torch.float64) - greedy_rewards.to(torch.float64)).to(_out_dtype(rewards))


def whiten(
    x: Float[Tensor, "B T"], mask: Shaped[Tensor, "B T"], *, eps: float = 1e-8, shift_mean: bool = True
) -> Float[Tensor, "B T"]:
    """Masked whitening ``(x − μ)·rsqrt(σ² + eps)`` over the valid positions (all of them, not per row).

    σ² is the unbiased (n−1) variance of the valid entries (0 for fewer than two); with ``shift_mean=False``
    the mean is added back (scale only). Masked positions are 0 in the output and may hold NaN/inf in ``x``.
    This is a local (per-call) statistic: under data parallelism, all-reduce the sums yourself first.
    Numerics: float32 two-pass (float64 for float64 input).
    """
    check_floating("x", x)
    m = as_bool_mask(mask, x, like_name="x")
    eps = check_real("eps", eps, ge=0.0)
    check_bool("shift_mean", shift_mean)  # a truthy "no" would shift
    dt = compute_dtype(x)
    xs = safe(x, m, dt)
    n = m.sum().to(dt)
    mean = xs.sum() / n.clamp(min=1)
    centred = safe(xs - mean, m, dt)
    var = (centred * centred).sum() / (n - 1).clamp(min=1)
    out = centred * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return safe(out, m, dt)


def reinforce_pp_baseline_advantages(
    rewards: Shaped[Tensor, " n"],
    group_ids: Int[Tensor, " n"],
    mask: Shaped[Tensor, "n T"],
    *,
    eps: float = 1e-8,
) -> Float[Tensor, "n T"]:
    """REINFORCE++-baseline: ``(R_i − μ_g)`` broadcast over the valid tokens of sample i, then batch-whitened.

    The whitening is token-weighted (``whiten`` over all valid tokens of the batch), as in verl. Returns
    ``[n, T]`` with zeros at masked positions. Singleton groups centre to 0 before whitening.
    """
    check_group_inputs(rewards, group_ids)
    check_tensor_2d("mask", mask)
    if mask.shape[0] != rewards.shape[0]:
        raise ArgumentError(
            f"mask: expected shape [n, T] with n = {rewards.shape[0]} (from rewards {shape_str(rewards)}), "
            f"got {shape_str(mask)}"
        )
    r = rewards.to(torch.float64)
    idx = dense_group_index(group_ids)
    count = group_count(idx, torch.float64)
    centred = r - group_sum(r, idx) / count
    scores = centred[:, None].expand(mask.shape).contiguous()
    m = as_bool_mask(mask, scores, like_name="rewards broadcast to mask")
    return whiten(scores, m, eps=eps).to(_out_dtype(rewards))


def check_tensor_2d(name: str, x: object) -> None:
    if not isinstance(x, Tensor):
        raise ArgumentError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    check_ndim(name, x, 2, "[n, T]")


def _check_gae_inputs(rewards: Tensor, mask: Tensor, values: Tensor | None) -> Bool[Tensor, "B T"]:
    check_floating("rewards", rewards)
    check_ndim("rewards", rewards, 2, "[B, T]")
    if values is not None:
        check_floating("values", values)
        check_same_shape("rewards", rewards, "values", values)
    return as_bool_mask(mask, rewards, like_name="rewards")


def gae(
    rewards: Float[Tensor, "B T"],
    values: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Float[Tensor, "B T"], Float[Tensor, "B T"]]:
    """Generalised advantage estimation over the valid positions of each row. Returns ``(advantages, returns)``.

    ``δ_t = r_t + γ·V_{next} − V_t``, ``A_t = δ_t + γλ·A_{next}``, ``returns = A + V``, where "next" is the next
    *valid* position of the row (``V_next = 0`` and ``A_next = 0`` after the last one). Masked positions
    (observation / tool tokens, padding) are skipped: their rewards and values are never read (they may be NaN),
    they do not count as a discount step, and both outputs are 0 there. No whitening inside (use ``whiten``).
    Numerics: float32 recurrence (float64 for float64 input); a reverse loop over T columns (static length, no
    host sync; compiles with fullgraph but unrolls T steps).
    """
    m = _check_gae_inputs(rewards, mask, values)
    gamma = check_real("gamma", gamma, ge=0.0, le=1.0)
    lam = check_real("lam", lam, ge=0.0, le=1.0)
    dt = compute_dtype(rewards)
    r = safe(rewards, m, dt)
    v = safe(values, m, dt)
    b, t_len = r.shape
    next_v = torch.zeros(b, dtype=dt, device=r.device)
    next_a = torch.zeros(b, dtype=dt, device=r.device)
    zero = torch.zeros((), dtype=dt, device=r.device)
    advs = []
    for t in range(t_len - 1, -1, -1):
        mt = m[:, t]
        delta = r[:, t] + gamma * next_v - v[:, t]
        a = delta + gamma * lam * next_a
        next_a = torch.where(mt, a, next_a)
        next_v = torch.where(mt, v[:, t], next_v)
        advs.append(torch.where(mt, a, zero))
    adv = torch.stack(advs[::-1], dim=1) if t_len > 0 else torch.zeros_like(r)
    returns = torch.where(m, adv + v, zero)
    return adv, returns


def discounted_returns(
    rewards: Float[Tensor, "B T"], mask: Shaped[Tensor, "B T"], *, gamma: float = 1.0
) -> Float[Tensor, "B T"]:
    """Discounted return ``G_t = Σ_k γ^k r_{t+k}`` over the valid positions of each row (REINFORCE / REINFORCE++).

    Masked positions are skipped (not read, not a discount step) and are 0 in the output; equals ``gae`` with
    ``values = 0`` and ``lam = 1``. Follow with ``whiten`` for REINFORCE++. Numerics as ``gae``.
    """
    m = _check_gae_inputs(rewards, mask, None)
    gamma = check_real("gamma", gamma, ge=0.0, le=1.0)
    dt = compute_dtype(rewards)
    r = safe(rewards, m, dt)
    b, t_len = r.shape
    running = torch.zeros(b, dtype=dt, device=r.device)
    zero = torch.zeros((), dtype=dt, device=r.device)
    outs = []
    for t in range(t_len - 1, -1, -1):
        mt = m[:, t]
        running = torch.where(mt, r[:, t] + gamma * running, running)
        outs.append(torch.where(mt, running, zero))
    return torch.stack(outs[::-1], dim=1) if t_len > 0 else torch.zeros_like(r)
