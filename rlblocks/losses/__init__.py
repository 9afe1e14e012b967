"""rlblocks.losses: advantages, policy losses, KL, aggregation, mismatch correction, off-policy masks, distillation.

Pure, typed functions on ``[B, T]`` tensors with a mask (conventions in each module's docstring): per-token losses
plus 0-dim metrics, aggregation with explicit global normalisers, fp32 accumulation, NaN-safe padding, no host
syncs (every function compiles with ``torch.compile(fullgraph=True)``).
"""

from __future__ import annotations

from .advantages import (
    discounted_returns,
    gae,
    gdpo_advantages,
    grpo_advantages,
    opo_advantages,
    passk_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
    rloo_advantages,
    whiten,
)
from .aggregation import AGG_MODES, aggregate
from .distill import distill_advantages
from .kl import AdaptiveKLController, FixedKLController, kl_estimate
from .masks import overlong_penalty, top_entropy_mask, zero_variance_groups
from .mismatch import (
    geometric_sequence_mask,
    icepop_correction,
    mismatch_metrics,
    off_policy_sequence_mask,
    outlier_sequence_mask,
    rollout_correction,
)
from .policy import (
    cispo_loss,
    decoupled_ppo_loss,
    dppo_loss,
    dppo_mask,
    gmpo_loss,
    gspo_loss,
    pg_loss,
    ppo_clip_loss,
    sapo_loss,
    value_loss,
)

__all__ = [
    "AGG_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "aggregate",
    "cispo_loss",
    "decoupled_ppo_loss",
    "discounted_returns",
    "distill_advantages",
    "dppo_loss",
    "dppo_mask",
    "gae",
    "gdpo_advantages",
    "geometric_sequence_mask",
    "gmpo_loss",
    "grpo_advantages",
    "gspo_loss",
    "icepop_correction",
    "kl_estimate",
    "mismatch_metrics",
    "off_policy_sequence_mask",
    "opo_advantages",
    "outlier_sequence_mask",
    "overlong_penalty",
    "passk_advantages",
    "pg_loss",
    "ppo_clip_loss",
    "reinforce_pp_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
    "rollout_correction",
    "sapo_loss",
    "top_entropy_mask",
    "value_loss",
    "whiten",
    "zero_variance_groups",
]
