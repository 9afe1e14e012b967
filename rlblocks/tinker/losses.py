"""Tinker's built-in ``loss_fn`` values, each mapped onto ``rlblocks.losses``, and the checks of their inputs.

Conventions of the Tinker API (its loss docs and ``tinker.types``), kept here exactly:

- Each datum is one sequence of ``N = model_input.length`` positions; every ``loss_fn_inputs`` tensor has ``N``
  rows; position ``i`` scores ``target_tokens[i]`` given ``model_input[: i + 1]``. ``target_logprobs`` is the
  learner's ``log p_θ(target_tokens[i] | prefix)`` (untempered, from ``rlblocks.kernels``); ``sampling_logprobs``
  is the datum's ``logprobs`` input (the sampler's); ``A`` its ``advantages``.
- **Reduction: a sum** over every position of every datum (no mean, no length normalisation), and
  ``forward_backward`` calls before an ``optim_step`` add their gradients. ``loss:sum`` reports that sum.
- **Sign**: the loss is minimised; every RL objective enters as its negative.
- **Clip thresholds** are Tinker's absolute ratio bounds (``loss_fn_config``, defaults 0.8 / 1.2);
  ``rlblocks.losses`` takes offsets from 1: ``eps_low = 1 − clip_low_threshold``, ``eps_high = clip_high_threshold
  − 1``.

Mapping (``r = exp(target_logprobs − sampling_logprobs)``): ``cross_entropy`` → ``pg_loss`` with the weights as
advantages (``[N, K]`` targets flattened); ``importance_sampling`` → ``ppo_clip_loss`` with bounds that never bind;
``ppo`` → ``ppo_clip_loss``; ``cispo`` → ``cispo_loss``; ``dro`` → ``pg_loss`` + ``β·kl_estimate(kind="k2")``;
``gspo`` → ``gspo_loss`` over ``sequence_ratio_mask``. ``stable_reinforce`` is refused unless the operator maps it
(:func:`resolve_loss_fn`); ``custom`` is refused (the SDK runs ``forward_backward_custom`` client-side). Numerics:
``rlblocks.losses`` in float32 (float64 for float64 inputs), the sum in that dtype.

Each formula next to Tinker's, and the edge cases (log-ratio clamp, GSPO's mask, per-token thresholds):
``docs/tinker.md`` (Losses).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from jaxtyping import Bool, Float
from torch import Tensor

from rlblocks.errors import RequestError
from rlblocks.losses import cispo_loss, gspo_loss, kl_estimate, pg_loss, ppo_clip_loss

__all__ = ["LOSS_FNS", "STABLE_REINFORCE_TARGETS", "LossSpec", "check_loss_config", "check_loss_inputs",
           "mapped_metric", "nonfinite_inputs", "resolve_loss_fn", "tinker_loss"]

_NEVER_BINDS = 2.0**-40
"""``1 − eps_low`` for a lower clip that never binds: below e⁻²⁰, the smallest ratio after the ±20 log-ratio clamp."""

_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
_RL_INPUTS = ("target_tokens", "logprobs", "advantages")


@dataclass(frozen=True)
class LossSpec:
    """The ``loss_fn_inputs`` a built-in loss reads and the ``loss_fn_config`` keys it takes (with defaults)."""

    inputs: tuple[str, ...]
    config: Mapping[str, float] = field(default_factory=dict)
    topk_targets: bool = False  # target_tokens / weights may be [N, K]


LOSS_FNS: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(("target_tokens", "weights"), topk_targets=True),
    "importance_sampling": LossSpec(_RL_INPUTS),
    "ppo": LossSpec(_RL_INPUTS, _CLIP),
    "cispo": LossSpec(_RL_INPUTS, _CLIP),
    "dro": LossSpec(_RL_INPUTS, {"beta": 0.05}),
    "gspo": LossSpec((*_RL_INPUTS, "sequence_ratio_mask"), _CLIP),
}

_REFUSED = {
    "stable_reinforce": "its objective uses stability information recorded by the hosted sampler that Tinker's "
    "documentation does not define, so this server cannot reproduce it; train with importance_sampling, ppo, "
    "cispo, dro or gspo",
    "custom": "server-side custom losses are not served; forward_backward_custom runs the loss client-side "
    "(this server tells the SDK so through /client/config)",
}


STABLE_REINFORCE_TARGETS = ("ppo", "cispo", "importance_sampling")
"""The documented objectives ``stable_reinforce`` may be mapped to (``--stable-reinforce-as``): each reads the same
``loss_fn_inputs`` (``target_tokens``, ``logprobs``, ``advantages``) that the cookbook builds for it."""


def resolve_loss_fn(loss_fn: str, stable_reinforce_as: str | None = None) -> str:
    """The objective a request's ``loss_fn`` runs: itself, or for ``stable_reinforce`` the operator's mapping
    (``stable_reinforce_as``, one of :data:`STABLE_REINFORCE_TARGETS`); without a mapping ``stable_reinforce`` is
    refused with a ``RequestError`` that says how the operator can map it."""
    if loss_fn == "stable_reinforce" and stable_reinforce_as is not None:
        return stable_reinforce_as
    if loss_fn == "stable_reinforce":
        raise RequestError(f"loss_fn: 'stable_reinforce' is not supported: {_REFUSED[loss_fn]}; or the server's "
                           "operator can map it to a documented objective with --stable-reinforce-as "
                           f"{'|'.join(STABLE_REINFORCE_TARGETS)}")
    return loss_fn


def mapped_metric(stable_reinforce_as: str) -> str:
    """The metric key that announces the ``stable_reinforce`` mapping (value 1.0 where it applied, else 0.0).
    One ``:`` and a reduction the SDK knows (``max``), as the SDK's metric merging requires."""
    return f"loss_fn_mapped/stable_reinforce->{stable_reinforce_as}:max"


def check_loss_config(loss_fn: str, config: Mapping[str, object] | None) -> dict[str, float]:
    """``loss_fn`` and its ``loss_fn_config`` with defaults filled in; raises ``RequestError`` naming the field."""
    if loss_fn in _REFUSED:
        raise RequestError(f"loss_fn: {loss_fn!r} is not supported: {_REFUSED[loss_fn]}")
    spec = LOSS_FNS.get(loss_fn)
    if spec is None:
        raise RequestError(f"loss_fn: expected one of {sorted(LOSS_FNS)}, got {loss_fn!r}")
    out = dict(spec.config)
    for k, v in (config or {}).items():
        if k not in spec.config:
            known = sorted(spec.config) or "none"
            raise RequestError(f"loss_fn_config[{k!r}]: not a parameter of loss_fn {loss_fn!r} (it takes {known})")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise RequestError(f"loss_fn_config[{k!r}]: expected a finite number, got {v!r}")
        out[k] = float(v)
    if "clip_low_threshold" in out:
        lo, hi = out["clip_low_threshold"], out["clip_high_threshold"]
        if not 0.0 <= lo <= 1.0:
            raise RequestError(f"loss_fn_config['clip_low_threshold']: expected a ratio bound in [0, 1], got {lo}")
        if not hi >= 1.0:
            raise RequestError(f"loss_fn_config['clip_high_threshold']: expected a ratio bound >= 1, got {hi}")
    if out.get("beta", 0.0) < 0:
        raise RequestError(f"loss_fn_config['beta']: expected a value >= 0, got {out['beta']}")
    return out


def _is_float(t) -> bool:
    return t.dtype.is_floating_point if isinstance(t, Tensor) else t.dtype.kind == "f"


def nonfinite_inputs(inputs: Mapping[str, Tensor | np.ndarray]) -> list[tuple[str, int, float]]:
    """The float ``loss_fn_inputs`` fields of one datum that hold NaN or ±inf: ``(name, first flat position, its
    value)`` each, in field order."""
    out = []
    for name, t in inputs.items():
        if not _is_float(t):
            continue
        arr = np.asarray(t)
        bad = ~np.isfinite(arr)
        if bool(bad.any()):
            j = int(np.flatnonzero(bad)[0])
            out.append((name, j, float(arr.reshape(-1)[j])))
    return out


def check_loss_inputs(loss_fn: str, where: str, n: int, inputs: Mapping[str, Tensor | np.ndarray], *,
                      check_finite: bool = True) -> None:
    """Check one datum's ``loss_fn_inputs`` (torch tensors or numpy arrays) for ``loss_fn`` (``n`` = its model
    input length); ``where`` prefixes the field names in the message (e.g. ``"data[3]"``). Float fields must be
    finite (a NaN advantage would make every adapter weight NaN at the next step) unless ``check_finite`` is
    false (the caller then reports them itself, see :func:`nonfinite_inputs`)."""
    spec = LOSS_FNS[loss_fn]
    for name in inputs:
        if name not in spec.inputs:
            hint = (" (per-token clip thresholds are not supported: pass clip_low_threshold / clip_high_threshold "
                    "in loss_fn_config)") if name.startswith("clip_") else ""
            raise RequestError(f"{where}.loss_fn_inputs[{name!r}]: not an input of loss_fn {loss_fn!r} "
                               f"(expected {list(spec.inputs)}){hint}")
    for name in spec.inputs:
        if name not in inputs:
            raise RequestError(f"{where}.loss_fn_inputs[{name!r}]: missing; loss_fn {loss_fn!r} needs "
                               f"{list(spec.inputs)}")
    tgt = inputs["target_tokens"]
    if _is_float(tgt):
        raise RequestError(f"{where}.loss_fn_inputs['target_tokens']: expected int64 token ids, got float32")
    ok_ndim = (1, 2) if spec.topk_targets else (1,)
    if tgt.ndim not in ok_ndim or tgt.shape[0] != n:
        want = f"[{n}]" + (f" or [{n}, K]" if spec.topk_targets else "")
        raise RequestError(f"{where}.loss_fn_inputs['target_tokens']: expected shape {want} (one row per model "
                           f"input token), got {list(tgt.shape)}")
    for name in spec.inputs:
        if name == "target_tokens":
            continue
        t = inputs[name]
        want = list(tgt.shape) if name == "weights" else [n]
        if list(t.shape) != want:
            raise RequestError(f"{where}.loss_fn_inputs[{name!r}]: expected shape {want} (that of target_tokens), "
                               f"got {list(t.shape)}")
        if not _is_float(t):
            raise RequestError(f"{where}.loss_fn_inputs[{name!r}]: expected float32 values, got int64")
    if check_finite and (bad := nonfinite_inputs({k: inputs[k] for k in spec.inputs})):
        name, j, v = bad[0]
        raise RequestError(f"{where}.loss_fn_inputs[{name!r}][{j}]: expected a finite number, got {v}")
    if loss_fn == "gspo":
        outside = np.asarray((inputs["sequence_ratio_mask"] == 0) & (inputs["advantages"] != 0))
        if bool(outside.any()):
            i = int(np.flatnonzero(outside)[0])
            raise RequestError(f"{where}.loss_fn_inputs['advantages'][{i}]: nonzero outside sequence_ratio_mask; "
                               "gspo takes its loss over the masked tokens, so put the advantages there (or mark "
                               "position in sequence_ratio_mask)")


def tinker_loss(
    loss_fn: str,
    config: Mapping[str, float],
    logp: Float[Tensor, "B T"] | Float[Tensor, "B T K"],
    inputs: Mapping[str, Tensor],
    mask: Bool[Tensor, "B T"],
) -> tuple[Float[Tensor, ""], Float[Tensor, "B T"] | Float[Tensor, "B T K"]]:
    """Tinker's ``loss_fn`` on a padded batch: ``(loss, per_token_loss)`` with ``loss = per_token_loss.sum()``.

    ``logp`` is the learner's ``target_logprobs`` (with grad), ``[B, T]`` (``[B, T, K]`` for top-K
    ``cross_entropy``); ``inputs`` the datums' ``loss_fn_inputs`` right-padded to ``[B, T]`` (``[B, T, K]``);
    ``mask`` marks the real positions (padding: anything, never read into the loss). ``config`` is the output of
    :func:`check_loss_config`. The mapping of each loss onto ``rlblocks.losses`` is in the module docstring; the
    per-token loss is exactly 0 at padding.
    """
    m = mask
    if logp.dim() == 3:  # top-K cross-entropy: every (position, candidate) pair is one token of the sum
        b, t, k = logp.shape
        m = mask[..., None].expand(b, t, k).reshape(b, t * k)
        per, _ = pg_loss(logp.reshape(b, t * k), None, inputs["weights"].reshape(b, t * k).to(logp.dtype), m)
        per = per.reshape(b, t, k)
        return per.sum(), per
    if loss_fn == "cross_entropy":
        per, _ = pg_loss(logp, None, inputs["weights"].to(logp.dtype), m)
        return per.sum(), per
    q = inputs["logprobs"].to(logp.dtype)
    adv = inputs["advantages"].to(logp.dtype)
    if loss_fn == "importance_sampling":
        per, _ = ppo_clip_loss(logp, q, adv, m, eps_low=1.0 - _NEVER_BINDS, eps_high=math.inf)
    elif loss_fn == "ppo":
        per, _ = ppo_clip_loss(logp, q, adv, m, eps_low=_eps_low(config, strict=True), eps_high=_eps_high(config))
    elif loss_fn == "cispo":
        per, _ = cispo_loss(logp, q, adv, m, eps_low=_eps_low(config, strict=False), eps_high=_eps_high(config))
    elif loss_fn == "dro":
        pg, _ = pg_loss(logp, None, adv, m)
        per = pg + config["beta"] * kl_estimate(logp, q, kind="k2", mask=m)
    elif loss_fn == "gspo":
        in_ratio = m & (inputs["sequence_ratio_mask"] != 0)
        per, _ = gspo_loss(logp, q, adv, in_ratio, eps_low=_eps_low(config, strict=True), eps_high=_eps_high(config))
    else:
        raise RequestError(f"loss_fn: expected one of {sorted(LOSS_FNS)}, got {loss_fn!r}")
    return per.sum(), per


def _eps_low(config: Mapping[str, float], *, strict: bool) -> float:
    # ppo/gspo need eps_low < 1; a threshold of 0 (no lower clip) is the same as one below every reachable ratio
    eps = 1.0 - config["clip_low_threshold"]
    return min(eps, 1.0 - _NEVER_BINDS) if strict else eps


def _eps_high(config: Mapping[str, float]) -> float:
    return config["clip_high_threshold"] - 1.0

