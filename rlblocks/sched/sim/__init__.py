"""A discrete-event simulation of synchronous and bounded-async RL on a virtual clock, driven by the real sched blocks.

What it answers: for a model, a device split, a response-length distribution and a staleness bound η, how many
trained tokens per second to expect, how busy each device pool is, how stale the trained tokens are and how many
samples are dropped — before renting the cluster. ``python -m rlblocks.sched.sim --help`` sizes a deployment.

It lives in the package (not under ``benchmarks/``) because it is something users import and run: the sizing CLI and
:func:`simulate` are public, it imports only the standard library and :mod:`rlblocks.sched`, and its tests run in CI.

What is simulated, and what is real
-----------------------------------
Real: the decisions. Admission is :class:`~rlblocks.sched.StalenessController` (AReaL's ``capacity(v)``), groups wait
in a :class:`~rlblocks.sched.StalenessQueue` keyed by their OLDEST token version and are re-checked at consumption,
dynamic sampling is a :class:`~rlblocks.sched.DynamicSampler` (``max_rounds`` bound), and groups aborted by dynamic
sampling in the synchronous loops go through a :class:`~rlblocks.sched.PartialRolloutBuffer` (``max_staleness``
drops) and are resumed first. Nothing of their logic is re-implemented here.

Modelled (on a virtual clock, costs from :class:`Hardware`):

- rollout engines with continuous batching: one decode step of ``b`` sequences whose contexts sum to ``C`` tokens
  costs ``overhead + host·b + max(weights + kv·C, flops·b + attn·C)`` seconds (:class:`DecodeCost`: the larger of the
  memory time and the compute time, a roofline). Sequences join at step boundaries after a (re-)prefill that blocks
  the engine (:class:`PrefillCost`: a cost per distinct length, linear + quadratic in the context) and produces their
  next token. The KV cache holds ``kv_capacity_tokens``; when it overflows, the most recently admitted sequence is
  preempted and later re-prefilled (vLLM's recompute preemption). Between events the batch is fixed, so runs of decode
  steps are summed in closed form (arithmetic series), not stepped one by one.
- weight updates: the trainer's push costs ``latency + bytes·per_byte`` (:class:`SyncCost`); engines pause for it.
  In-flight samples then resume in place from their tokens so far (partial rollout; KV is rebuilt by a re-prefill of
  prompt + output, the cost that grows with η: every update re-prefills every sample in flight) or restart from the
  prompt (their tokens are discarded, counted).
- the trainer: ``overhead + per_token·tokens + per_token_sq·Σ n² + per_seq·seqs`` per step (:class:`TrainCost`)
  divided over the training devices (ideal data parallelism), on packed or padded sequences.
- lengths: lognormal (median, p99, truncated at a maximum like ``max_new_tokens``) or an empirical list
  (:class:`Lengths`), per sample or per group; a group has equal rewards (zero variance) with probability
  ``zero_variance_p``.

Modes (:class:`Schedule`): ``"sync-colocated"`` (every device generates, then every device trains: verl's hybrid
loop), ``"sync-disaggregated"`` (rollout devices generate while training devices wait, then the reverse) and
``"async"`` (bounded staleness η: rollout runs continuously under admission control; η = 0 is synchronous RL on the
disaggregated layout and gives exactly the ``"sync-disaggregated"`` result).

Outputs (:class:`SimResult`): trained tokens/s (all steps, and steady state after warm-up), utilisation of each pool
(busy time, and the roofline "compute-bound" fraction of it), the token staleness histogram, samples generated /
trained / dropped (by reason) / left, with ``generated == trained + dropped + left``.

Conventions: a sample of ``L`` output tokens costs one prefill (which yields token 1) and ``L - 1`` decode steps; a
token's version is the engine's weight version when it was produced; a group's version is its oldest token's; the
age of a trained token is ``trainer_step - version`` (0 = on-policy). Time is in seconds of virtual time.

Layout: :mod:`.costs` (the cost models and the device presets), :mod:`.workload` (lengths, workload, schedule),
:mod:`.engine` (the engine model), :mod:`.loops` (the simulated loops and :func:`simulate`), ``__main__`` (the
sizing CLI, :func:`main`). :class:`~rlblocks.errors.SimulationStalled` is in :mod:`rlblocks.errors`.
"""

from __future__ import annotations

from rlblocks._lazy import lazy_exports
from rlblocks.errors import SimulationStalled  # noqa: F401  (what simulate() raises; its home is rlblocks.errors)

from .costs import DecodeCost, Hardware, ModelSpec, PrefillCost, SyncCost, TrainCost, cpu_like, gpu_like
from .loops import SimResult, _Sim, simulate  # noqa: F401  (_Sim: the loop itself, for white-box tests)
from .workload import Lengths, Schedule, Workload

__all__ = [
    "DecodeCost",
    "Hardware",
    "Lengths",
    "ModelSpec",
    "PrefillCost",
    "Schedule",
    "SimResult",
    "SyncCost",
    "TrainCost",
    "Workload",
    "cpu_like",
    "gpu_like",
    "simulate",
]


# The CLI is imported on first use: importing ``__main__`` here would make ``python -m rlblocks.sched.sim`` find it
# already in sys.modules and run it twice over (runpy's RuntimeWarning).
__getattr__, __dir__ = lazy_exports(__name__, globals(), {"main": ".__main__"})
