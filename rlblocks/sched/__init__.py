"""Staleness-bounded scheduling: admission control, a fresh-only queue, partial rollouts, dynamic sampling, packing.

- :class:`StalenessController` — AReaL's admission rule ``capacity(v)`` with per-rank limits divided by dp once.
- :class:`StalenessQueue` — oldest-first queue that re-checks staleness at consumption and never drops silently.
- :class:`PartialRolloutBuffer` / :class:`PartialRollout` — aborted partial generations, whole groups, resumed first.
- :class:`DynamicSampler` — DAPO/SLIME over-sampling with a group filter (default: non-zero reward variance).
- :func:`pack_sequences`, :func:`token_budget_microbatches`, :func:`balance_partitions`, :func:`inverse_permutation`,
  :func:`pad_to_packed`, :func:`packed_to_pad` — batching helpers.

Only the standard library, torch, jaxtyping and ``rlblocks.losses`` (the zero-variance rule) are imported; no
rollout engine. The simulator is ``rlblocks.sched.sim`` (imported on its own). The exceptions (``QueueFull``,
``QueueClosed``, ``InsufficientGroupsError``) are in ``rlblocks.errors``.
"""

from __future__ import annotations

from .admission import StalenessController
from .dynamic_sampling import DynamicSampler, nonzero_reward_variance
from .packing import (
    balance_partitions,
    inverse_permutation,
    pack_sequences,
    packed_to_pad,
    pad_to_packed,
    token_budget_microbatches,
)
from .partial import GenerationLike, PartialRollout, PartialRolloutBuffer
from .queue import StalenessQueue

__all__ = [
    "DynamicSampler",
    "GenerationLike",
    "PartialRollout",
    "PartialRolloutBuffer",
    "StalenessController",
    "StalenessQueue",
    "balance_partitions",
    "inverse_permutation",
    "nonzero_reward_variance",
    "pack_sequences",
    "packed_to_pad",
    "pad_to_packed",
    "token_budget_microbatches",
]
