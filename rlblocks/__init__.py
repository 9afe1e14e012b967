"""rlblocks: small, independent blocks for RL post-training of LLMs.

Sub-packages (import the one you need; none is imported here, so ``import rlblocks`` stays light):

- ``rlblocks.losses``  advantage estimators, policy losses, KL estimators, aggregation, mismatch correction
- ``rlblocks.kernels`` fused log-prob / entropy / KL ops (Triton on CUDA, chunked torch on CPU)
- ``rlblocks.rollout`` rollout engines with interrupt/resume and per-token policy versions, agents, the gateway
- ``rlblocks.sync``    weight movement: buckets, broadcast, delta, LoRA, resharding
- ``rlblocks.sched``   staleness-bounded admission and queue, partial rollouts, dynamic sampling, packing, prefix
  trees; the simulator ``rlblocks.sched.sim``
- ``rlblocks.reward``  verifiers and reward models as bounded async services
- ``rlblocks.sandbox`` untrusted code in a separate process inside a bubblewrap sandbox
- ``rlblocks.tinker``  the Tinker training API served from these blocks (``python -m rlblocks.tinker``)
- ``rlblocks.checkpoint`` run checkpoints that survive a crash (atomic writes of files and directories, checked on
  load, RNG states)

Every exception raised on purpose derives from ``rlblocks.RLBlocksError`` (see ``rlblocks.errors``).
"""

from __future__ import annotations

from .errors import RLBlocksError

__version__ = "0.1.0"
__all__ = ["RLBlocksError", "__version__"]
