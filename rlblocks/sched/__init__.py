"""Staleness-bounded scheduling: admission control, a fresh-only queue, partial rollouts, dynamic sampling, packing
and prefix trees.

- :class:`StalenessController` — AReaL's admission rule ``capacity(v)`` with per-rank limits divided by dp once.
- :class:`StalenessQueue` — oldest-first queue that re-checks staleness at consumption and never drops silently.
- :class:`PartialRolloutBuffer` / :class:`PartialRollout` — aborted partial generations, whole groups, resumed first.
- :class:`DynamicSampler` — DAPO/SLIME over-sampling with a group filter (default: non-zero reward variance).
- :func:`pack_sequences`, :func:`token_budget_microbatches`, :func:`balance_partitions`, :func:`inverse_permutation`,
  :func:`pad_to_packed`, :func:`packed_to_pad` — batching helpers.
- :func:`build_prefix_tree` / :func:`response_prefix_tree` (:class:`PrefixTree`) — sequences as one prefix trie in
  packed rows with its ancestor mask, the layout of a prefix-shared forward (``rlblocks.kernels.prefix_share``).

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
from .prefix_tree import PrefixTree, build_prefix_tree, response_prefix_tree
from .queue import StalenessQueue

__all__ = [
    "DynamicSampler",
    "GenerationLike",
    "PartialRollout",
    "PartialRolloutBuffer",
    "PrefixTree",
    "StalenessController",
    "StalenessQueue",
    "balance_partitions",
    "build_prefix_tree",
    "inverse_permutation",
    "nonzero_reward_variance",
    "pack_sequences",
    "packed_to_pad",
    "pad_to_packed",
    "response_prefix_tree",
    "token_budget_microbatches",
]
