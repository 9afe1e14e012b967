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
  costs ``overhead + host·b + max(weights + kv·C, flops·b + attn·C)`` seconds (:class:`DecodeCost`: the larger of
  the memory time and the compute time, a roofline). Sequences join at step boundaries after a (re-)prefill that
  blocks the engine (:class:`PrefillCost`, linear + quadratic in the context) and produces their next token. The KV
  cache holds ``kv_capacity_tokens``; when it overflows, the most recently admitted sequence is preempted and later
  re-prefilled (vLLM's recompute preemption). Between events the batch is fixed, so runs of decode steps are summed
  in closed form (arithmetic series), not stepped one by one.
- weight updates: the trainer's push costs ``latency + bytes·per_byte`` (:class:`SyncCost`); engines pause for it.
  In-flight samples then resume in place from their tokens so far (partial rollout, as ``resumable_generate`` does;
  KV is rebuilt by a re-prefill of prompt + output) or restart from the prompt (their tokens are discarded, counted).
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
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import sys
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any, Literal

from rlblocks._checks import check_bool, check_int, check_optional_int, check_real
from rlblocks.errors import ArgumentError, SimulationStalled

from .admission import StalenessController
from .dynamic_sampling import DynamicSampler
from .partial import PartialRollout, PartialRolloutBuffer
from .queue import StalenessQueue

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

Mode = Literal["sync-colocated", "sync-disaggregated", "async"]
MODES = ("sync-colocated", "sync-disaggregated", "async")
_LENGTH_KINDS = ("fixed", "empirical", "cycle", "lognormal")
Z99 = 2.3263478740408408  # standard normal 99th percentile: p99 / median = exp(Z99 * sigma) for a lognormal


# ================================================================================================ lengths
@dataclass(frozen=True)
class Lengths:
    """A distribution of token counts (response or prompt lengths).

    Build with :meth:`lognormal`, :meth:`empirical`, :meth:`cycle` or :meth:`fixed`; :meth:`sample` draws one
    integer in ``[minimum, maximum]``. A lognormal is truncated by clamping (like a ``max_new_tokens`` budget: a
    sample that would run longer stops at the budget with ``finish_reason="length"``).
    """

    kind: str
    median: float = 0.0
    sigma: float = 0.0
    minimum: int = 1
    maximum: int = 1
    values: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in _LENGTH_KINDS:
            raise ArgumentError(f"kind: expected one of {_LENGTH_KINDS} (build with Lengths.lognormal(), .empirical(), "
                                f".cycle() or .fixed()), got {self.kind!r}")
        lo = check_int("minimum", self.minimum, minimum=1)
        check_int("maximum", self.maximum, minimum=lo)
        if self.kind in ("empirical", "cycle") and not self.values:
            raise ArgumentError("values: expected at least one length, got none")

    @classmethod
    def lognormal(cls, median: float, p99: float, *, maximum: int, minimum: int = 1) -> Lengths:
        """Lognormal with the given median and 99th percentile (``sigma = ln(p99 / median) / z_0.99``), clamped to
        ``[minimum, maximum]``. E.g. median 2048, p99 32768: ``sigma = 1.19``, mean ≈ 4.1k before the clamp."""
        median = check_real("median", median, finite=True, gt=0)
        p99 = check_real("p99", p99, finite=True, gt=0)
        if p99 < median:
            raise ArgumentError(f"p99: expected >= median ({median}), got {p99}")
        minimum = check_int("minimum", minimum, minimum=1)
        maximum = check_int("maximum", maximum, minimum=minimum)
        return cls("lognormal", median=median, sigma=math.log(p99 / median) / Z99, minimum=minimum, maximum=maximum)

    @classmethod
    def empirical(cls, values: Sequence[int]) -> Lengths:
        """Draw uniformly from observed lengths (e.g. the response lengths of a previous run)."""
        if isinstance(values, (str, bytes)):
            raise ArgumentError(f"values: expected a sequence of int lengths, got {type(values).__name__}")
        vals = tuple(check_int(f"values[{i}]", v, minimum=1) for i, v in enumerate(values))
        if not vals:
            raise ArgumentError("values: expected at least one length, got none")
        return cls("empirical", minimum=min(vals), maximum=max(vals), values=vals)

    @classmethod
    def cycle(cls, values: Sequence[int]) -> Lengths:
        """Replay ``values`` in order: the ``i``-th draw is ``values[i % len(values)]`` (a trace, or a case small
        enough to check by hand). Draws are numbered per sample (group by group), or per group when lengths are
        drawn per group."""
        e = cls.empirical(values)
        return replace(e, kind="cycle")

    @classmethod
    def fixed(cls, n: int) -> Lengths:
        n = check_int("n", n, minimum=1)
        return cls("fixed", minimum=n, maximum=n)

    def sample(self, rng: random.Random, index: int = 0) -> int:
        """One draw; ``index`` numbers the draw (only :meth:`cycle` uses it)."""
        if self.kind == "fixed":
            return self.minimum
        if self.kind == "cycle":
            return self.values[index % len(self.values)]
        if self.kind == "empirical":
            return self.values[rng.randrange(len(self.values))]
        x = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return min(self.maximum, max(self.minimum, x))

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed {self.minimum}"
        if self.kind in ("empirical", "cycle"):
            s = sorted(self.values)
            return f"empirical n={len(s)} median {s[len(s) // 2]} p99 {s[min(len(s) - 1, int(0.99 * len(s)))]}"
        return (f"lognormal median {self.median:g} p99 {self.median * math.exp(Z99 * self.sigma):.0f} "
                f"in [{self.minimum}, {self.maximum}]")


# ================================================================================================ costs
@dataclass(frozen=True)
class DecodeCost:
    """Seconds of one decode step of an engine holding ``b`` sequences whose contexts sum to ``C`` tokens::

        step(b, C) = overhead_s + host_per_seq_s·b + max(weights_s + kv_per_token_s·C,
                                                        compute_per_seq_s·b + compute_per_token_s·C)

    The ``max`` is a roofline: memory time (read every weight once per step, plus each sequence's KV cache) against
    compute time (``2·params`` FLOPs per sequence plus attention FLOPs per context token). On a GPU the memory term
    wins up to a batch size of roughly ``weights_s / compute_per_seq_s`` (then decode is compute-bound); on a CPU
    with a small model everything is compute or host overhead and the memory terms are 0.
    """

    overhead_s: float = 0.0
    host_per_seq_s: float = 0.0
    weights_s: float = 0.0
    kv_per_token_s: float = 0.0
    compute_per_seq_s: float = 0.0
    compute_per_token_s: float = 0.0

    def __post_init__(self) -> None:
        for f in ("overhead_s", "host_per_seq_s", "weights_s", "kv_per_token_s", "compute_per_seq_s",
                  "compute_per_token_s"):
            check_real(f, getattr(self, f), finite=True, ge=0)

    def step_s(self, b: int, ctx: float) -> float:
        memory = self.weights_s + self.kv_per_token_s * ctx
        compute = self.compute_per_seq_s * b + self.compute_per_token_s * ctx
        return self.overhead_s + self.host_per_seq_s * b + max(memory, compute)

    def run_s(self, b: int, c0: int, k: int) -> tuple[float, float]:
        """``(seconds, compute-bound seconds)`` of ``k`` consecutive steps starting at total context ``c0``, the
        context growing by ``b`` per step (step ``j`` attends to ``c0 + j·b`` tokens). Closed form: the two roofline
        lines cross at most once in ``j``, so the sum splits into two arithmetic series."""
        if k <= 0:
            return 0.0, 0.0
        fixed = (self.overhead_s + self.host_per_seq_s * b) * k
        m0, m1 = self.weights_s + self.kv_per_token_s * c0, self.kv_per_token_s * b  # memory time at step j
        q0, q1 = self.compute_per_seq_s * b + self.compute_per_token_s * c0, self.compute_per_token_s * b
        # d(j) = memory - compute is linear in j: find the steps where compute is the larger term.
        d0, d1 = m0 - q0, m1 - q1
        if d1 == 0:
            n_comp = k if d0 < 0 else 0
            first_comp = 0
        else:
            root = -d0 / d1  # d(root) = 0
            if d1 > 0:  # memory grows faster: compute wins for j < root
                n_comp = min(k, max(0, math.ceil(root)))
                first_comp = 0
            else:  # compute grows faster: compute wins for j > root
                first_comp = min(k, max(0, math.floor(root) + 1))
                n_comp = k - first_comp

        def series(a0: float, a1: float, j0: int, n: int) -> float:  # sum_{j=j0}^{j0+n-1} (a0 + a1 j)
            return n * a0 + a1 * (n * j0 + n * (n - 1) / 2) if n > 0 else 0.0

        comp = series(q0, q1, first_comp, n_comp)
        if first_comp == 0:
            mem = series(m0, m1, n_comp, k - n_comp)
        else:
            mem = series(m0, m1, 0, first_comp)
        return fixed + comp + mem, comp


@dataclass(frozen=True)
class PrefillCost:
    """Seconds to (re-)prefill sequences of context lengths ``n_i`` together (the engine decodes nothing meanwhile)::

        prefill = overhead_s + per_token_s·Σ n_i + per_token_sq_s·Σ n_i²

    the quadratic term being causal attention over each sequence.
    """

    overhead_s: float = 0.0
    per_token_s: float = 0.0
    per_token_sq_s: float = 0.0

    def __post_init__(self) -> None:
        for f in ("overhead_s", "per_token_s", "per_token_sq_s"):
            check_real(f, getattr(self, f), finite=True, ge=0)

    def seconds(self, contexts: Sequence[int]) -> float:
        return self.overhead_s + self.per_token_s * sum(contexts) + self.per_token_sq_s * sum(n * n for n in contexts)


@dataclass(frozen=True)
class TrainCost:
    """Seconds of one optimizer step on ONE device; a pool of ``d`` devices divides the variable part by ``d``::

        train = overhead_s + (per_token_s·T + per_token_sq_s·Σ n_i² + per_seq_s·S) / d

    with ``T`` the tokens processed (prompt + response; with ``padded=True``, ``S · max n_i``, i.e. a right-padded
    batch as :func:`rlblocks.rollout.build_batch` builds it), ``n_i`` each sequence's length and ``S`` the number
    of sequences.
    """

    overhead_s: float = 0.0
    per_token_s: float = 0.0
    per_token_sq_s: float = 0.0
    per_seq_s: float = 0.0
    padded: bool = False

    def __post_init__(self) -> None:
        for f in ("overhead_s", "per_token_s", "per_token_sq_s", "per_seq_s"):
            check_real(f, getattr(self, f), finite=True, ge=0)
        check_bool("padded", self.padded)

    def seconds(self, lengths: Sequence[int], devices: int) -> float:
        s = len(lengths)
        tokens = s * max(lengths, default=0) if self.padded else sum(lengths)
        sq = sum(n * n for n in lengths)
        return self.overhead_s + (self.per_token_s * tokens + self.per_token_sq_s * sq + self.per_seq_s * s) / devices


@dataclass(frozen=True)
class SyncCost:
    """Seconds to move the weights to the engines and swap them in: ``latency_s + weight_bytes · per_byte_s``."""

    latency_s: float = 0.0
    per_byte_s: float = 0.0

    def __post_init__(self) -> None:
        check_real("latency_s", self.latency_s, finite=True, ge=0)
        check_real("per_byte_s", self.per_byte_s, finite=True, ge=0)

    def seconds(self, weight_bytes: float) -> float:
        return self.latency_s + weight_bytes * self.per_byte_s


@dataclass(frozen=True)
class Hardware:
    """Cost model of one kind of device running one model (one engine spans ``devices_per_engine`` devices).

    ``sync`` is the disaggregated weight push (trainer to engines over the network); ``sync_colocated`` the
    in-place update of a colocated engine. ``kv_capacity_tokens`` and ``max_batch`` are per engine.

    ``host_contention`` ``c`` models devices that share one host, like processes on a small CPU machine that also
    runs other work: while ``n`` devices are busy at once, each progresses at ``1 / (1 + c·(n − 1))`` of its
    speed alone (processor sharing: with ``L`` other runnable processes saturating the cores, ``c = 1 / (1 + L)``).
    The costs are those of ONE busy device. ``c = 0`` (the default, and right for GPUs): devices are independent.
    """

    name: str
    decode: DecodeCost
    prefill: PrefillCost
    train: TrainCost
    sync: SyncCost
    sync_colocated: SyncCost
    weight_bytes: float
    kv_capacity_tokens: int
    max_batch: int
    devices_per_engine: int = 1
    host_contention: float = 0.0
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name, kind in (("decode", DecodeCost), ("prefill", PrefillCost), ("train", TrainCost), ("sync", SyncCost),
                           ("sync_colocated", SyncCost)):
            if not isinstance(getattr(self, name), kind):
                raise ArgumentError(f"{name}: expected a {kind.__name__}, got {type(getattr(self, name)).__name__}")
        check_real("weight_bytes", self.weight_bytes, finite=True, ge=0)
        check_real("host_contention", self.host_contention, finite=True, ge=0)
        check_int("kv_capacity_tokens", self.kv_capacity_tokens, minimum=1)
        check_int("max_batch", self.max_batch, minimum=1)
        check_int("devices_per_engine", self.devices_per_engine, minimum=1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Hardware:
        """Inverse of :meth:`to_dict` (e.g. a calibration written by ``benchmarks/sim/measure_cpu_costs.py``).
        A missing or unknown key is an :class:`~rlblocks.errors.ArgumentError` naming it."""
        if not isinstance(d, dict):
            raise ArgumentError(f"d: expected a dict (Hardware.to_dict()), got {type(d).__name__}")
        d = dict(d)
        parts = {}
        for key, kind in (("decode", DecodeCost), ("prefill", PrefillCost), ("train", TrainCost), ("sync", SyncCost),
                          ("sync_colocated", SyncCost)):
            if not isinstance(d.get(key), dict):
                raise ArgumentError(f"d[{key!r}]: expected a dict of {kind.__name__} fields, got {d.get(key)!r:.60}")
            sub = d.pop(key)
            unknown = sorted(set(sub) - {f.name for f in fields(kind)})
            if unknown:
                raise ArgumentError(f"d[{key!r}]: unknown {kind.__name__} fields {unknown}")
            parts[key] = kind(**sub)
        parts["notes"] = tuple(d.pop("notes", ()))
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        missing = sorted({f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
                         - set(d) - set(parts))
        if unknown or missing:
            raise ArgumentError(f"d: unknown Hardware fields {unknown}, missing {missing}")
        return cls(**parts, **d)


@dataclass(frozen=True)
class ModelSpec:
    """A dense decoder: parameter count and the shapes that size the KV cache and attention FLOPs."""

    name: str
    params: float
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    bytes_per_param: int = 2

    def __post_init__(self) -> None:
        check_real("params", self.params, finite=True, gt=0)
        for name in ("layers", "heads", "kv_heads", "head_dim", "bytes_per_param"):
            check_int(name, getattr(self, name), minimum=1)

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param  # K and V, every layer

    @property
    def attn_flops_per_token_pair(self) -> float:
        return 4 * self.layers * self.heads * self.head_dim  # QK^T and AV, 2 FLOPs per multiply-add

    @classmethod
    def preset(cls, name: str) -> ModelSpec:
        """Shapes from the models' published ``config.json`` (Qwen2.5 family on the Hugging Face hub)."""
        presets = {
            "1.5b": cls("Qwen2.5-1.5B", 1.54e9, 28, 12, 2, 128),
            "7b": cls("Qwen2.5-7B", 7.62e9, 28, 28, 4, 128),
            "14b": cls("Qwen2.5-14B", 14.7e9, 48, 40, 8, 128),
            "32b": cls("Qwen2.5-32B", 32.8e9, 64, 40, 8, 128),
        }
        key = name.lower().removesuffix("-qwen2.5")
        if key not in presets:
            raise ArgumentError(f"model: expected one of {sorted(presets)}, got {name!r}")
        return presets[key]


def gpu_like(
    model: ModelSpec | str = "7b",
    *,
    devices_per_engine: int = 1,
    peak_flops: float = 989e12,
    hbm_bytes_per_s: float = 3.35e12,
    memory_bytes: float = 80e9,
    bandwidth_efficiency: float = 0.7,
    decode_flops_efficiency: float = 0.5,
    prefill_flops_efficiency: float = 0.6,
    train_mfu: float = 0.4,
    step_overhead_s: float = 2e-3,
    network_bytes_per_s: float = 25e9,
    sync_latency_s: float = 2.0,
    max_batch: int = 256,
    gpu_memory_utilization: float = 0.9,
) -> Hardware:
    """A GPU-like cost model (defaults: an H100/H800-class GPU running a Qwen2.5 model in bf16).

    Sources of the defaults:

    - ``peak_flops`` 989 TFLOP/s dense BF16, ``hbm_bytes_per_s`` 3.35 TB/s, ``memory_bytes`` 80 GB: NVIDIA's H100 SXM
      datasheet (the H800 AReaL ran on has the same compute and memory, lower NVLink bandwidth).
    - Decode is memory-bound while ``weights / bandwidth > 2·params·b / flops``: with these numbers up to
      ``b ≈ bytes_per_param·flops·eff_c / (2·bandwidth·eff_b)`` ≈ 211 sequences for bf16, and reading each
      sequence's KV cache (``2·layers·kv_heads·head_dim·2`` bytes per token: 57 KB for Qwen2.5-7B) keeps long-context
      decode memory-bound at any batch size — the roofline argument of Williams et al. (2009) applied to decoding as
      in Pope et al., "Efficiently Scaling Transformer Inference" (2022).
    - Achieved fractions of peak (ASSUMPTIONS, typical of published serving/training reports, change them to your
      measurements): ``bandwidth_efficiency`` 0.7 of HBM bandwidth in decode, ``decode_flops_efficiency`` 0.5,
      ``prefill_flops_efficiency`` 0.6, ``train_mfu`` 0.4 (Megatron-LM and PaLM report 40–50 % MFU at scale).
    - Training costs ``8·params`` FLOPs per token: forward + backward ``6·params`` (Kaplan et al., 2020) plus one
      forward to recompute π_old/π_prox log-probs (AReaL's decoupled PPO), and attention ``3 · 2·layers·heads·d·n``
      per token of a length-``n`` sequence; sequences are packed (AReaL and verl pack, no padding).
    - ``max_batch`` 256 and ``gpu_memory_utilization`` 0.9: vLLM's ``max_num_seqs`` and memory defaults; KV capacity
      = ``utilization · memory · devices − weights`` minus 5 % for activations, divided by the KV bytes per token.
    - Weight sync: NCCL broadcast at ``network_bytes_per_s`` 25 GB/s effective (one 200–400 Gb/s InfiniBand link)
      plus ``sync_latency_s`` 2 s to pause, load, flush caches and resume (ASSUMPTIONS: measure your own).
      Colocated: an in-device copy at HBM speed plus 0.5 s.
    """
    if not isinstance(model, (str, ModelSpec)):
        raise ArgumentError(f"model: expected a preset name or a ModelSpec, got {type(model).__name__}")
    m = ModelSpec.preset(model) if isinstance(model, str) else model
    tp = check_int("devices_per_engine", devices_per_engine, minimum=1)
    for name, v in (("peak_flops", peak_flops), ("hbm_bytes_per_s", hbm_bytes_per_s), ("memory_bytes", memory_bytes),
                    ("network_bytes_per_s", network_bytes_per_s)):
        check_real(name, v, finite=True, gt=0)
    for name, v in (("bandwidth_efficiency", bandwidth_efficiency), ("decode_flops_efficiency",
                    decode_flops_efficiency), ("prefill_flops_efficiency", prefill_flops_efficiency),
                    ("train_mfu", train_mfu), ("gpu_memory_utilization", gpu_memory_utilization)):
        if check_real(name, v, finite=True, gt=0) > 1:
            raise ArgumentError(f"{name}: expected a fraction in (0, 1], got {v!r}")
    check_real("step_overhead_s", step_overhead_s, finite=True, ge=0)
    check_real("sync_latency_s", sync_latency_s, finite=True, ge=0)
    flops_d, flops_p, flops_t = peak_flops * decode_flops_efficiency, peak_flops * prefill_flops_efficiency, \
        peak_flops * train_mfu
    bw = hbm_bytes_per_s * bandwidth_efficiency * tp
    kv_cap = int((gpu_memory_utilization * memory_bytes * tp * 0.95 - m.weight_bytes) / m.kv_bytes_per_token)
    if kv_cap < 1:
        raise ArgumentError(f"devices_per_engine: {tp} device(s) cannot hold {m.name}'s weights; use more")
    decode = DecodeCost(
        overhead_s=step_overhead_s,
        weights_s=m.weight_bytes / bw,
        kv_per_token_s=m.kv_bytes_per_token / bw,
        compute_per_seq_s=2 * m.params / (flops_d * tp),
        compute_per_token_s=m.attn_flops_per_token_pair / (flops_d * tp),
    )
    prefill = PrefillCost(overhead_s=step_overhead_s, per_token_s=2 * m.params / (flops_p * tp),
                          per_token_sq_s=m.attn_flops_per_token_pair / 2 / (flops_p * tp))
    train = TrainCost(overhead_s=1.0, per_token_s=8 * m.params / flops_t,
                      per_token_sq_s=3 * m.attn_flops_per_token_pair / 2 / flops_t)
    return Hardware(
        name=f"gpu-like {m.name} tp={tp}",
        decode=decode, prefill=prefill, train=train,
        sync=SyncCost(latency_s=sync_latency_s, per_byte_s=1 / network_bytes_per_s),
        sync_colocated=SyncCost(latency_s=0.5, per_byte_s=1 / hbm_bytes_per_s),
        weight_bytes=m.weight_bytes, kv_capacity_tokens=kv_cap, max_batch=max_batch, devices_per_engine=tp,
        notes=(f"decode memory-bound below b ≈ {decode.weights_s / decode.compute_per_seq_s:.0f} at short context",),
    )


def cpu_like() -> Hardware:
    """A CPU-like cost model: decode is compute and host-overhead bound (cost grows with the batch, no weight-read
    floor), so a shrinking batch wastes little — the opposite of a GPU. The numbers are the order of magnitude
    measured for the cookbook's tiny model with one torch thread per process on a 2-core x86 CPU
    (``benchmarks/sim/measure_cpu_costs.py`` measures your machine and writes a :class:`Hardware` JSON to use
    instead)."""
    return Hardware(
        name="cpu-like (tiny model, 1 thread)",
        decode=DecodeCost(overhead_s=1.5e-3, host_per_seq_s=2e-5, compute_per_seq_s=1e-5, compute_per_token_s=1e-7),
        prefill=PrefillCost(overhead_s=1e-3, per_token_s=5e-6),
        train=TrainCost(overhead_s=0.05, per_token_s=6e-5, padded=True),
        sync=SyncCost(latency_s=0.01),
        sync_colocated=SyncCost(latency_s=0.005),
        weight_bytes=0.0, kv_capacity_tokens=1 << 30, max_batch=1024,
    )


# ================================================================================================ configuration
@dataclass(frozen=True)
class Workload:
    """What is generated: ``batch_groups`` prompt groups of ``group_size`` samples per optimizer step.

    ``lengths`` are response lengths (per sample, or one per group with ``per_group_length=True`` as when a group
    shares a budget); ``prompt_lengths`` likewise. A group's rewards are all equal with probability
    ``zero_variance_p`` (what dynamic sampling filters). Every draw comes from a generator seeded by ``(seed, group
    index)``, so two schedules simulated with the same workload see exactly the same groups in the same order.
    """

    lengths: Lengths
    prompt_lengths: Lengths = field(default_factory=lambda: Lengths.fixed(256))
    batch_groups: int = 64
    group_size: int = 8
    per_group_length: bool = False
    zero_variance_p: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("lengths", "prompt_lengths"):
            if not isinstance(getattr(self, name), Lengths):
                raise ArgumentError(f"{name}: expected a Lengths (Lengths.lognormal(), .fixed(), ...), got "
                                    f"{type(getattr(self, name)).__name__}")
        check_bool("per_group_length", self.per_group_length)
        check_int("seed", self.seed)
        check_int("batch_groups", self.batch_groups, minimum=1)
        check_int("group_size", self.group_size, minimum=1)
        p = check_real("zero_variance_p", self.zero_variance_p, finite=True, ge=0)
        if p > 1:
            raise ArgumentError(f"zero_variance_p: expected a probability in [0, 1], got {p}")


@dataclass(frozen=True)
class Schedule:
    """How the loop runs.

    Args:
        mode: ``"sync-colocated"``, ``"sync-disaggregated"`` or ``"async"``.
        max_staleness: η for ``"async"`` (0 = synchronous on the disaggregated layout); ignored by the sync modes.
        partial_rollout: resume interrupted samples from their tokens so far (True) or restart them from the prompt
            (False, their tokens discarded). Interruptions: weight updates (async) and dynamic-sampling aborts (sync).
        dynamic_sampling: filter zero-variance groups with a :class:`DynamicSampler` (``over_sampling``,
            ``max_rounds``).
        max_concurrent: groups in flight (AReaL's ``max_concurrent_rollouts``); default ``(η + 1) · B``, which the
            staleness bound reaches first.
        steps: optimizer steps to simulate; ``warmup_steps`` are left out of the steady-state throughput.
    """

    mode: Mode = "async"
    max_staleness: int = 1
    partial_rollout: bool = True
    dynamic_sampling: bool = False
    over_sampling: float = 1.0
    max_rounds: int | None = 4
    max_concurrent: int | None = None
    steps: int = 10
    warmup_steps: int = 2

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ArgumentError(f"mode: expected one of {MODES}, got {self.mode!r}")
        check_int("max_staleness", self.max_staleness, minimum=0)
        check_bool("partial_rollout", self.partial_rollout)
        check_bool("dynamic_sampling", self.dynamic_sampling)  # "no" is truthy: it would have filtered groups
        over = check_real("over_sampling", self.over_sampling, finite=True, gt=0)
        if over < 1:
            raise ArgumentError(f"over_sampling: expected a factor >= 1, got {self.over_sampling!r}")
        check_optional_int("max_rounds", self.max_rounds, minimum=1)
        check_optional_int("max_concurrent", self.max_concurrent, minimum=1)
        check_int("steps", self.steps, minimum=1)
        w = check_int("warmup_steps", self.warmup_steps, minimum=0)
        if w >= self.steps:
            raise ArgumentError(f"warmup_steps: expected < steps ({self.steps}), got {w}")


@dataclass
class SimResult:
    """What a simulation measured (all times virtual seconds). ``samples``: ``generated == trained + dropped +
    left``, ``dropped`` broken down in ``dropped_by_reason``."""

    mode: str
    max_staleness: int
    partial_rollout: bool
    dynamic_sampling: bool
    rollout_devices: int
    train_devices: int
    steps: int
    wall_s: float
    step_end_s: list[float]
    trained_tokens: int
    tokens_per_s: float
    steady_tokens_per_s: float
    utilisation: dict[str, float]
    staleness_histogram: dict[int, int]
    samples: dict[str, int]
    dropped_by_reason: dict[str, int]
    tokens: dict[str, int]
    preemptions: int
    queue: dict[str, Any]
    controller: dict[str, int] | None
    buffer: dict[str, int] | None
    sampler_filled: int

    def summary(self) -> str:
        u = self.utilisation
        hist = " ".join(f"{k}:{v / max(1, sum(self.staleness_histogram.values())):.2f}"
                        for k, v in sorted(self.staleness_histogram.items()))
        return (f"{self.mode:<19} η={self.max_staleness} partial={int(self.partial_rollout)} "
                f"ds={int(self.dynamic_sampling)}: {self.steady_tokens_per_s:,.0f} trained tok/s, "
                f"rollout busy {u['rollout_busy']:.2f} (compute-bound {u['rollout_compute']:.2f}), "
                f"train busy {u['train_busy']:.2f}, staleness {{{hist}}}, dropped {self.samples['dropped']}")


# ================================================================================================ engine model
_NEW, _WAITING, _PREFILL, _ACTIVE, _DONE, _ABORTED = range(6)


class _Sample:
    __slots__ = (
        "engine",
        "finished_once",
        "gen",
        "group",
        "join_gen",
        "join_id",
        "join_steps",
        "k",
        "prompt",
        "spans",
        "state",
        "target",
    )

    def __init__(self, group: _Group, k: int, prompt: int, target: int) -> None:
        self.group, self.k, self.prompt, self.target = group, k, prompt, target
        self.gen = 0  # output tokens materialised
        self.spans: list[list[int]] = []  # [version, count] runs of output tokens
        self.state = _NEW
        self.join_steps = self.join_gen = self.join_id = 0
        self.finished_once = False
        self.engine: _Engine | None = None

    def add_tokens(self, version: int, n: int) -> None:
        if n <= 0:
            return
        if self.spans and self.spans[-1][0] == version:
            self.spans[-1][1] += n
        else:
            self.spans.append([version, n])
        self.gen += n

    def oldest(self) -> int | None:
        return min(v for v, _ in self.spans) if self.spans else None


class _Group:
    __slots__ = ("gid", "n_done", "reason", "rewards", "samples", "state")

    def __init__(self, gid: int) -> None:
        self.gid = gid
        self.samples: list[_Sample] = []
        self.n_done = 0
        self.rewards: list[float] = []
        self.state = "new"  # new | running | done | queued | batch | trained | dropped | buffered
        self.reason = ""

    def version(self) -> int:
        vs = [s.oldest() for s in self.samples if s.spans]
        return min(v for v in vs if v is not None) if vs else 0


class _Engine:
    """One continuous-batching engine on the virtual clock (see the module docstring)."""

    def __init__(self, sim: _Sim, idx: int) -> None:
        self.sim, self.idx = sim, idx
        hw = sim.hw
        self.dc, self.pc = hw.decode, hw.prefill
        self.kv_cap, self.max_batch = hw.kv_capacity_tokens, hw.max_batch
        self.version = 0
        self.t = 0.0  # the engine's clock: time of its last step boundary
        self.steps = 0  # decode steps done (a global counter; active samples' tokens are implicit in it)
        self.active: dict[int, _Sample] = {}  # join_id -> sample
        self.finish_heap: list[tuple[int, int]] = []  # (end_step, join_id)
        self.S = 0  # sum over active of (prompt + join_gen - join_steps): context = S + b·steps
        self.waiting: deque[_Sample] = deque()
        self._phase = "idle"  # idle | decode | prefill | paused
        self._busy_since: float | None = None  # (work clock) start of the current busy interval
        self.weight = hw.devices_per_engine  # devices of the host this engine keeps busy
        self.seg: tuple[float, int, int, int] | None = None  # decode segment: (t0, b, c0, k)
        self.prefilling: list[_Sample] = []
        self.token = 0  # invalidates scheduled events
        self.join_counter = itertools.count()
        self.busy = self.compute = self.batch_time = 0.0  # busy: real seconds; compute, batch_time: work clock
        self.busy_work = 0.0
        self.prefill_tokens = self.decode_tokens = self.preemptions = 0

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        busy = value in ("decode", "prefill")
        if busy != (self._busy_since is not None):
            if busy:
                self._busy_since = self.sim.now
                self._busy_real_since = self.sim.real_now()
            else:
                self.busy_work += self.sim.now - self._busy_since
                self.busy += self.sim.real_now() - self._busy_real_since
                self._busy_since = None
            self.sim.busy_change(self.weight if busy else -self.weight)
        self._phase = value

    # ------------------------------------------------------------------ helpers
    @property
    def load(self) -> int:
        return len(self.active) + len(self.waiting) + len(self.prefilling)

    def context(self) -> int:
        return self.S + len(self.active) * self.steps

    def _materialise(self, s: _Sample) -> None:
        s.add_tokens(self.version, s.join_gen + (self.steps - s.join_steps) - s.gen)

    def _remove_active(self, s: _Sample) -> None:
        del self.active[s.join_id]
        self.S -= s.prompt + s.join_gen - s.join_steps

    def _schedule(self, when: float) -> None:
        self.token += 1
        self.sim.at(when, self._on_event, self.token)

    # ------------------------------------------------------------------ entry points
    def submit(self, samples: Sequence[_Sample], *, front: bool = False) -> None:
        for s in samples:
            s.state, s.engine = _WAITING, self
        if front:
            self.waiting.extendleft(reversed(samples))
        else:
            self.waiting.extend(samples)
        self._touch()

    def _touch(self) -> None:
        """New work arrived: start now if idle, or stop the current decode run at its next step boundary."""
        now = self.sim.now
        if self.phase == "idle":
            # Plan in a zero-delay event, so that everything submitted at this instant is prefilled together.
            self.t = max(self.t, now)
            self._schedule(now)
        elif self.phase == "decode":
            t0, b, c0, k = self.seg
            done = self._steps_by(now - t0, b, c0, k, finish_partial=True)
            if done < k:
                self.seg = (t0, b, c0, done)
                dt, _ = self.dc.run_s(b, c0, done)
                self._schedule(t0 + dt)

    def _steps_by(self, budget: float, b: int, c0: int, k: int, *, finish_partial: bool) -> int:
        """Steps of the run completed within ``budget`` seconds (``finish_partial``: plus the one in progress)."""
        lo, hi = 0, k
        while lo < hi:  # largest j with run_s(j) <= budget
            mid = (lo + hi + 1) // 2
            if self.dc.run_s(b, c0, mid)[0] <= budget:
                lo = mid
            else:
                hi = mid - 1
        if finish_partial and lo < k and self.dc.run_s(b, c0, lo)[0] < budget:
            lo += 1
        return max(lo, 1) if finish_partial and k > 0 else lo

    def _on_event(self, token: int) -> None:
        if token != self.token:
            return
        now = self.sim.now
        if self.phase == "decode":
            self._end_decode(now, self.seg[3])
        elif self.phase == "prefill":
            self._end_prefill(now)
        self._plan()

    def _end_decode(self, now: float, k: int) -> None:
        t0, b, c0, _ = self.seg
        dt, comp = self.dc.run_s(b, c0, k)
        self.compute += comp
        self.batch_time += dt * b
        self.decode_tokens += b * k
        self.steps += k
        self.t = t0 + dt
        self.seg = None
        self.phase = "idle"
        while self.finish_heap and self.finish_heap[0][0] <= self.steps:
            _, jid = heapq.heappop(self.finish_heap)
            s = self.active.get(jid)
            if s is None:
                continue  # removed earlier (aborted or preempted): stale heap entry
            self._materialise(s)
            self._remove_active(s)
            s.state = _DONE
            self.sim.on_sample_done(s)
        # KV overflow before the next step: preempt the most recently admitted sequences (vLLM recompute).
        while self.active and self.context() + len(self.active) > self.kv_cap:
            jid = max(self.active)
            s = self.active[jid]
            self._materialise(s)
            self._remove_active(s)
            s.state = _WAITING
            self.waiting.appendleft(s)
            self.preemptions += 1

    def _end_prefill(self, now: float) -> None:
        self.t = now
        self.phase = "idle"
        batch, self.prefilling = self.prefilling, []
        for s in batch:
            s.add_tokens(self.version, 1)  # a prefill yields the next token
            if s.gen >= s.target:
                s.state = _DONE
                self.sim.on_sample_done(s)
                continue
            s.state = _ACTIVE
            s.join_id = next(self.join_counter)
            s.join_steps, s.join_gen = self.steps, s.gen
            self.active[s.join_id] = s
            self.S += s.prompt + s.join_gen - s.join_steps
            heapq.heappush(self.finish_heap, (self.steps + s.target - s.gen, s.join_id))

    def _plan(self) -> None:
        """At a step boundary (``self.t``): admit waiting samples (a prefill), else run decode to the next event."""
        if self.phase != "idle":
            return
        admit: list[_Sample] = []
        ctx = self.context()
        b = len(self.active)
        while self.waiting and b + len(admit) < self.max_batch:
            s = self.waiting[0]
            need = s.prompt + s.gen
            if ctx + need + b + len(admit) + 1 > self.kv_cap and (b or admit):
                break
            admit.append(self.waiting.popleft())
            ctx += need
        if admit:
            contexts = [s.prompt + s.gen for s in admit]
            for s in admit:
                s.state = _PREFILL
            self.prefilling = admit
            dt = self.pc.seconds(contexts)
            self.compute += dt
            self.prefill_tokens += sum(contexts)
            self.phase = "prefill"
            self._prefill_end = self.t + dt
            self._schedule(self.t + dt)
            return
        if not self.active:
            return
        b = len(self.active)
        c0 = self.context()
        k = self.finish_heap[0][0] - self.steps
        k_cap = (self.kv_cap - c0) // b  # KV after step j+1 holds c0 + (j+1)·b tokens
        k = max(1, min(k, k_cap))
        dt, _ = self.dc.run_s(b, c0, k)
        self.phase = "decode"
        self.seg = (self.t, b, c0, k)
        self._schedule(self.t + dt)

    def pause(self) -> None:
        """Stop at ``now``: the step in progress is abandoned (its tokens never produced), a prefill is undone."""
        now = self.sim.now
        if self.phase == "decode":
            t0, b, c0, k = self.seg
            done = self._steps_by(now - t0, b, c0, k, finish_partial=False)
            ran, _ = self.dc.run_s(b, c0, done)
            self.seg = (t0, b, c0, done)
            self._end_decode(now, done)  # the device stays busy until now: the abandoned step was computed
            self.sim.wasted_s += now - (t0 + ran)
        elif self.phase == "prefill":
            self.compute -= self._prefill_end - now
            for s in reversed(self.prefilling):
                s.state = _WAITING
                self.waiting.appendleft(s)
            self.prefilling = []
        self.token += 1
        self.t = max(self.t, now)
        self.phase = "paused"

    def swap_weights(self, version: int, *, partial: bool) -> None:
        """While paused: the KV cache is invalid under new weights. Every in-flight sample goes back to the head of
        the waiting queue (in admission order) for a re-prefill of its prompt + tokens so far (``partial``), or
        restarts from the prompt with its tokens discarded."""
        back = [self.active[j] for j in sorted(self.active)]
        for s in back:
            self._materialise(s)
            self._remove_active(s)
            s.state = _WAITING
        self.finish_heap.clear()
        self.waiting.extendleft(reversed(back))
        if not partial:
            for s in self.waiting:
                self.sim.tokens_discarded += s.gen
                s.gen, s.spans = 0, []
        self.version = version

    def resume(self) -> None:
        self.phase = "idle"
        self.t = max(self.t, self.sim.now)
        self._schedule(self.sim.now)

    def abort(self, samples: Sequence[_Sample]) -> None:
        """Take these samples out (dynamic sampling reached its target); their tokens so far are materialised."""
        if self.phase == "decode":  # cut the run at the last completed step boundary so tokens are exact
            now = self.sim.now
            t0, b, c0, k = self.seg
            done = self._steps_by(now - t0, b, c0, k, finish_partial=False)
            self.seg = (t0, b, c0, done)
            self._end_decode(now, done)
            self.sim.wasted_s += now - self.t
            self.t = now
        for s in samples:
            if s.state == _ACTIVE:
                self._materialise(s)
                self._remove_active(s)
            elif s.state == _WAITING:
                self.waiting.remove(s)
            elif s.state == _PREFILL:
                self.prefilling.remove(s)
            s.state = _ABORTED
        if self.phase in ("idle", "decode"):
            self.phase = "idle"
            self.t = max(self.t, self.sim.now)
            self._schedule(self.sim.now)


# ================================================================================================ the loops
class _Sim:
    def __init__(self, hw: Hardware, work: Workload, sched: Schedule, rollout_devices: int, train_devices: int,
                 ) -> None:
        self.hw, self.work, self.sched = hw, work, sched
        # Two clocks. ``now`` is work time: a busy device does one second of its work per second of it, so every
        # cost composes exactly. Real time runs 1 + c·(n − 1) times faster while n devices are busy (shared host,
        # see Hardware.host_contention); every reported time is real. With c = 0 the two are the same.
        self.now = 0.0
        self._contention = hw.host_contention
        self._n_busy = 0
        self._real = self._last = 0.0
        self._events: list[tuple[float, int, Callable, tuple]] = []
        self._seq = itertools.count()
        colocated = sched.mode == "sync-colocated"
        pool = rollout_devices + train_devices if colocated else rollout_devices
        if pool % hw.devices_per_engine:
            raise ArgumentError(f"rollout_devices: expected a multiple of devices_per_engine="
                                f"{hw.devices_per_engine}, got {pool}")
        self.engines = [_Engine(self, i) for i in range(pool // hw.devices_per_engine)]
        self.rollout_devices, self.train_devices = rollout_devices, train_devices
        self.train_pool = rollout_devices + train_devices if colocated else train_devices
        self.B, self.K = work.batch_groups, work.group_size
        self.groups: list[_Group] = []
        self.step = 0
        self.step_end: list[float] = []
        self.trained_tokens_per_step: list[int] = []
        self.age_hist: Counter[int] = Counter()
        self._train_since: float | None = None
        self._train_phase = "train"
        self._train_real = {"train": 0.0, "sync": 0.0}
        self.tokens_discarded = 0
        self.wasted_s = 0.0
        self.dropped: Counter[str] = Counter()
        self.generated = 0
        self.done = False
        eta = sched.max_staleness if sched.mode == "async" else 0
        self.eta = eta
        # Synchronous loops with dynamic sampling and partial rollout resume aborted groups one version later, so
        # their queue (like their buffer) accepts one version of age; everything else is exactly η.
        resumes = sched.mode != "async" and sched.dynamic_sampling and sched.partial_rollout
        self.queue = StalenessQueue(max_staleness=max(eta, 1) if resumes else eta, on_stale=self._on_stale)
        self._aborting = False
        self.sampler = None
        if sched.dynamic_sampling:
            self.sampler = DynamicSampler(target_groups=self.B, over_sampling=sched.over_sampling,
                                          max_rounds=sched.max_rounds, keep_when_insufficient=True)
        self.ctrl = None
        self.buffer = None
        self.filled_total = 0
        # the rewards of a filled group are not informative; they are trained anyway (counted)
        if sched.mode == "async":
            conc = sched.max_concurrent if sched.max_concurrent is not None else (eta + 1) * self.B
            self.ctrl = StalenessController(batch_size=self.B, max_staleness=eta, max_concurrent=conc)
            self._freed = False
            self.batch: list[_Group] = []
            self.trainer_phase = "wait"  # wait | train | sync
        elif sched.dynamic_sampling and sched.partial_rollout:
            # Aborted groups resume next step: their tokens are then one version old, so the buffer keeps them for
            # one version (a group aborted twice is dropped rather than trained two versions off-policy).
            self.buffer = PartialRolloutBuffer(group_size=self.K, max_staleness=max(1, eta),
                                               on_drop=self._on_buffer_drop)

    # ------------------------------------------------------------------ clocks
    def real_now(self) -> float:
        return self._real + (self.now - self._last) * (1.0 + self._contention * max(0, self._n_busy - 1))

    def busy_change(self, delta: int) -> None:
        """A device (``delta`` > 0) became busy or (< 0) idle at ``now``."""
        self._real = self.real_now()
        self._last = self.now
        self._n_busy += delta

    def _trainer(self, busy: bool, phase: str = "") -> None:
        """The training pool starts (``phase`` "train" or "sync") or stops working."""
        rn = self.real_now()
        if self._train_since is not None:
            self._train_real[self._train_phase] += rn - self._train_since
            self._train_since = None
            self.busy_change(-self.train_pool)
        if busy:
            self.busy_change(self.train_pool)
            self._train_since, self._train_phase = self.real_now(), phase

    # ------------------------------------------------------------------ event loop
    def at(self, when: float, fn: Callable, *args: Any) -> None:
        heapq.heappush(self._events, (when, next(self._seq), fn, args))

    def run(self) -> None:
        if self.sched.mode == "async":
            self._admit()
        else:
            self._sync_start_step()
        while self._events and not self.done:
            when, _, fn, args = heapq.heappop(self._events)
            self.now = when
            fn(*args)

    # ------------------------------------------------------------------ groups
    def _new_group(self) -> _Group:
        gid = len(self.groups)
        g = _Group(gid)
        rng = random.Random(self.work.seed * 1_000_003 + gid)
        glen = self.work.lengths.sample(rng, gid)
        gprompt = self.work.prompt_lengths.sample(rng, gid)
        for k in range(self.K):
            target = glen if self.work.per_group_length else self.work.lengths.sample(rng, gid * self.K + k)
            prompt = gprompt
            if prompt + target > self.hw.kv_capacity_tokens:
                raise ArgumentError(f"lengths: a sequence of {prompt + target} tokens exceeds the engine's KV capacity "
                                    f"({self.hw.kv_capacity_tokens} tokens); lower the maximum length or use more "
                                    "devices per engine")
            g.samples.append(_Sample(g, k, prompt, target))
        zero_var = rng.random() < self.work.zero_variance_p
        g.rewards = [1.0] * self.K if zero_var else [float((k + gid) % 2) for k in range(self.K)]
        if self.K == 1:
            g.rewards = [1.0]
        self.groups.append(g)
        return g

    def _dispatch(self, g: _Group, *, front: bool = False) -> None:
        """Send a group's unfinished samples to the least-loaded engine (ties: lowest index)."""
        g.state = "running"
        todo = [s for s in g.samples if s.state != _DONE]
        eng = min(self.engines, key=lambda e: (e.load, e.idx))
        eng.submit(todo, front=front)

    def on_sample_done(self, s: _Sample) -> None:
        if not s.finished_once:
            s.finished_once = True
            self.generated += 1
        g = s.group
        g.n_done += 1
        if g.n_done == self.K and not self._aborting:
            g.state = "done"
            if self.sched.mode == "async":
                self._async_group_done(g)
            else:
                self._sync_group_done(g)

    def _drop(self, g: _Group, reason: str) -> None:
        g.state, g.reason = "dropped", reason
        self.dropped[reason] += sum(1 for s in g.samples if s.finished_once)

    # ------------------------------------------------------------------ training
    def _train_seconds(self, batch: list[_Group]) -> float:
        lengths = [s.prompt + s.target for g in batch for s in g.samples]
        return self.hw.train.seconds(lengths, self.train_pool)

    def _record_training(self, batch: list[_Group]) -> None:
        tokens = 0
        for g in batch:
            g.state = "trained"
            for s in g.samples:
                for v, n in s.spans:
                    self.age_hist[self.step - v] += n
                tokens += s.gen
        self.trained_tokens_per_step.append(tokens)

    def _sync_seconds(self) -> float:
        cost = self.hw.sync_colocated if self.sched.mode == "sync-colocated" else self.hw.sync
        return cost.seconds(self.hw.weight_bytes)

    # ------------------------------------------------------------------ synchronous loops
    def _sync_start_step(self) -> None:
        self.batch = []
        if self.sampler is None:
            for _ in range(self.B):
                self._dispatch(self._new_group())
            return
        self.sampler.reset()
        self.in_flight: list[_Group] = []
        if self.buffer is not None:
            resumed = self.buffer.pop_groups(n=max(1, len(self.buffer)), current_version=self.step)
            for samples in resumed:
                g = self.groups[samples[0].group_id]
                self._check_resumed(g, samples)
                self.sampler.on_submit()
                self.in_flight.append(g)
                self._dispatch(g, front=True)
        self._sync_top_up()

    def _check_resumed(self, g: _Group, samples: list[PartialRollout]) -> None:
        # The buffer hands back what was put in: each sample's tokens so far and finished flag.
        for p, s in zip(samples, g.samples):
            if len(p.output_ids) != s.gen or p.finished != (s.state == _DONE):
                raise RuntimeError(f"partial rollout of group {g.gid} changed in the buffer")

    def _sync_top_up(self) -> None:
        for _ in range(self.sampler.num_to_submit()):
            g = self._new_group()
            self.sampler.on_submit()
            self.in_flight.append(g)
            self._dispatch(g)

    def _sync_group_done(self, g: _Group) -> None:
        if self.sampler is None:
            self.batch.append(g)
            if len(self.batch) == self.B:
                self._sync_train()
            return
        self.in_flight.remove(g)
        kept = self.sampler.add_group(g.gid, g.rewards)
        if kept:
            self.batch.append(g)
            if g.gid in self.sampler.filled_groups:
                self.filled_total += 1
        else:
            self._drop(g, "surplus" if g.gid in self.sampler.surplus_groups else "filtered")
        if self.sampler.done:
            self._sync_abort_in_flight()
            self._sync_train()
        else:
            self._sync_top_up()

    def _sync_abort_in_flight(self) -> None:
        """The sampler is done: abort every group still in flight (into the partial-rollout buffer, or discarded).
        A group whose last samples finish at the very step boundary of the abort completed: it is offered to the
        sampler like any other (surplus or filtered, since the batch is full)."""
        aborted, self.in_flight = self.in_flight, []
        self._aborting = True  # completions seen while cutting the engines are handled below, not re-entrantly
        try:
            for a in aborted:
                by_engine: dict[int, tuple[_Engine, list[_Sample]]] = {}
                for smp in a.samples:
                    if smp.state != _DONE and smp.engine is not None:
                        by_engine.setdefault(smp.engine.idx, (smp.engine, []))[1].append(smp)
                for eng, samples in by_engine.values():
                    eng.abort(samples)
        finally:
            self._aborting = False
        still = []
        for a in aborted:
            if all(smp.state == _DONE for smp in a.samples):
                a.state = "done"
                self.sampler.add_group(a.gid, a.rewards)
                self._drop(a, "surplus" if a.gid in self.sampler.surplus_groups else "filtered")
            else:
                still.append(a)
        if still:
            self.sampler.on_abort(len(still))
        for a in still:
            if self.buffer is not None:
                a.state = "buffered"
                a.n_done = sum(1 for smp in a.samples if smp.state == _DONE)
                self.buffer.put_group([self._to_partial(a, smp) for smp in a.samples])
            else:
                for smp in a.samples:
                    if smp.state != _DONE:
                        self.tokens_discarded += smp.gen
                self._drop(a, "aborted")

    def _to_partial(self, g: _Group, s: _Sample) -> PartialRollout:
        done = s.state == _DONE
        if not done:
            s.state = _NEW
        versions = [v for v, n in s.spans for _ in range(n)]
        return PartialRollout(group_id=g.gid, prompt_ids=[0] * s.prompt, output_ids=[0] * s.gen,
                              output_logprobs=[0.0] * s.gen, output_versions=versions,
                              remaining_tokens=0 if done else s.target - s.gen, finished=done,
                              request_id=f"{g.gid}/{s.k}")

    def _on_buffer_drop(self, gid: Any, samples: list[PartialRollout]) -> None:
        self._drop(self.groups[gid], "stale-partial")

    def _sync_train(self) -> None:
        for g in self.batch:
            g.state = "queued"
            self.queue.put(g.gid, g.version())
        got = self.queue.get_batch(len(self.batch), current_version=self.step, timeout=0)
        batch = [self.groups[i] for i in got]
        dt = self._train_seconds(batch)
        self._trainer(True, "train")
        self.at(self.now + dt, self._sync_after_train, batch)

    def _sync_after_train(self, batch: list[_Group]) -> None:
        self._record_training(batch)
        dt = self._sync_seconds()
        self._trainer(True, "sync")
        self.at(self.now + dt, self._sync_after_push)

    def _sync_after_push(self) -> None:
        self._trainer(False)
        self.step += 1
        self.step_end.append(self.real_now())
        for e in self.engines:
            e.version = self.step
        if self.step >= self.sched.steps:
            self.done = True
            return
        self._sync_start_step()

    # ------------------------------------------------------------------ bounded-async loop
    def _admit(self) -> None:
        v = self.engines[0].version
        while self.ctrl.try_submit(v):
            if self.sampler is not None:
                self.sampler.on_submit()
            self._dispatch(self._new_group())

    def _async_group_done(self, g: _Group) -> None:
        if self.sampler is not None:
            kept = self.sampler.add_group(g.gid, g.rewards)
            if kept and g.gid in self.sampler.filled_groups:
                self.filled_total += 1
            if self.sampler.done:
                self.sampler.reset()
            if not kept:
                self.ctrl.on_reject()
                self._drop(g, "filtered")
                self._admit()
                return
        self.ctrl.on_accept()
        g.state = "queued"
        self.queue.put(g.gid, g.version())
        self._admit()
        self._trainer_try()

    def _on_stale(self, gid: int, version: int) -> None:
        self._drop(self.groups[gid], "stale")
        if self.ctrl is not None:
            self.ctrl.on_discard()  # accepted, then dropped: its slot is free again
            self._freed = True

    def _trainer_try(self) -> None:
        if self.trainer_phase != "wait" or self.done:
            return
        got = self.queue.get_batch(self.B - len(self.batch), current_version=self.step, timeout=0)
        for gid in got:
            self.groups[gid].state = "batch"
        self.batch += [self.groups[i] for i in got]
        if self._freed:  # stale groups were dropped: their admission slots are free
            self._freed = False
            self._admit()
        if len(self.batch) < self.B:
            return
        batch, self.batch = self.batch, []
        dt = self._train_seconds(batch)
        self._trainer(True, "train")
        self.trainer_phase = "train"
        self.at(self.now + dt, self._async_after_train, batch)

    def _async_after_train(self, batch: list[_Group]) -> None:
        self._record_training(batch)
        dt = self._sync_seconds()
        self._trainer(True, "sync")
        self.trainer_phase = "sync"
        for e in self.engines:
            e.pause()
        self.at(self.now + dt, self._async_after_push)

    def _async_after_push(self) -> None:
        self._trainer(False)
        self.step += 1
        self.step_end.append(self.real_now())
        for e in self.engines:
            e.swap_weights(self.step, partial=self.sched.partial_rollout)
        if self.step >= self.sched.steps:
            self.done = True
            return
        for e in self.engines:
            e.resume()
        self.trainer_phase = "wait"
        self._admit()
        self._trainer_try()

    # ------------------------------------------------------------------ result
    def result(self) -> SimResult:
        sched = self.sched
        wall = self.step_end[-1] if self.step_end else self.real_now()
        trained = sum(self.trained_tokens_per_step)
        w = sched.warmup_steps
        t0 = self.step_end[w - 1] if w > 0 else 0.0
        steady = sum(self.trained_tokens_per_step[w:]) / (wall - t0) if wall > t0 else 0.0
        n_eng = len(self.engines)
        busy = comp = busy_work = batch_time = 0.0
        for e in self.engines:
            b, bw = e.busy, e.busy_work
            if e._busy_since is not None:  # still working when the last step ended
                b += self.real_now() - e._busy_real_since
                bw += self.now - e._busy_since
            busy += b
            busy_work += bw
            comp += e.compute * (b / bw) if bw > 0 else 0.0
            batch_time += e.batch_time
        train_real = dict(self._train_real)
        if self._train_since is not None:
            train_real[self._train_phase] += self.real_now() - self._train_since
        util = {"rollout_busy": busy / (n_eng * wall) if wall else 0.0,
                "rollout_compute": comp / (n_eng * wall) if wall else 0.0,
                "rollout_mean_batch": batch_time / busy_work if busy_work else 0.0,
                "train_busy": train_real["train"] / wall if wall else 0.0,
                "sync": train_real["sync"] / wall if wall else 0.0}
        if sched.mode == "sync-colocated":  # one pool: it generates, then it trains
            util["pool_busy"] = util["rollout_busy"] + util["train_busy"]
        trained_samples = sum(1 for g in self.groups if g.state == "trained" for s in g.samples if s.finished_once)
        dropped = sum(self.dropped.values())
        left = sum(1 for g in self.groups if g.state not in ("trained", "dropped") for s in g.samples
                   if s.finished_once)
        return SimResult(
            mode=sched.mode, max_staleness=self.eta, partial_rollout=sched.partial_rollout,
            dynamic_sampling=sched.dynamic_sampling, rollout_devices=self.rollout_devices,
            train_devices=self.train_devices, steps=self.step, wall_s=wall, step_end_s=list(self.step_end),
            trained_tokens=trained, tokens_per_s=trained / wall if wall else 0.0, steady_tokens_per_s=steady,
            utilisation=util, staleness_histogram=dict(sorted(self.age_hist.items())),
            samples={"generated": self.generated, "trained": trained_samples, "dropped": dropped, "left": left},
            dropped_by_reason=dict(self.dropped),
            tokens={"decoded": sum(e.decode_tokens for e in self.engines),
                    "prefilled": sum(e.prefill_tokens for e in self.engines), "discarded": self.tokens_discarded},
            preemptions=sum(e.preemptions for e in self.engines),
            queue=self.queue.stats(), controller=self.ctrl.stats() if self.ctrl else None,
            buffer=self.buffer.stats() if self.buffer else None, sampler_filled=self.filled_total,
        )


def simulate(
    hardware: Hardware,
    workload: Workload,
    schedule: Schedule,
    *,
    rollout_devices: int,
    train_devices: int,
) -> SimResult:
    """Run one simulation to ``schedule.steps`` optimizer steps and report what it measured.

    ``rollout_devices`` generate and ``train_devices`` train (``"sync-colocated"`` uses all of them for both, in
    turn, and accepts ``train_devices=0``). Deterministic: the same arguments give the same result.
    """
    if not isinstance(hardware, Hardware):
        raise ArgumentError(f"hardware: expected a Hardware (gpu_like(), cpu_like()), got {type(hardware).__name__}")
    if not isinstance(workload, Workload):
        raise ArgumentError(f"workload: expected a Workload, got {type(workload).__name__}")
    if not isinstance(schedule, Schedule):
        raise ArgumentError(f"schedule: expected a Schedule, got {type(schedule).__name__}")
    check_int("rollout_devices", rollout_devices, minimum=1)
    # A colocated pool is rollout_devices + train_devices devices doing both, so 0 + n is a valid split there.
    check_int("train_devices", train_devices, minimum=0 if schedule.mode == "sync-colocated" else 1)
    sim = _Sim(hardware, workload, schedule, rollout_devices, train_devices)
    sim.run()
    if not sim.done:
        states = Counter(g.state for g in sim.groups)
        raise SimulationStalled(
            f"the simulated loop stalled after {sim.step} of {schedule.steps} steps: nothing left to run "
            f"(groups by state {dict(states)}; controller {sim.ctrl.stats() if sim.ctrl else None})"
        )
    return sim.result()


# ================================================================================================ sizing CLI
def _ints(flag: str, words: list[str]) -> list[int]:
    try:
        return [int(w) for w in words]
    except ValueError:
        raise ArgumentError(f"{flag}: expected integers, got {' '.join(words)[:80]!r}") from None


def _size(args: argparse.Namespace) -> None:
    hw = gpu_like(args.model, devices_per_engine=args.tp) if args.hardware == "gpu" else cpu_like()
    if args.hardware_json:
        with open(args.hardware_json) as f:
            hw = Hardware.from_dict(json.load(f))
    if args.lengths_file:
        with open(args.lengths_file) as f:
            lengths = Lengths.empirical(_ints("--lengths-file", f.read().split()))
    else:
        lengths = Lengths.lognormal(args.median, args.p99, maximum=args.max_len)
    work = Workload(lengths=lengths, prompt_lengths=Lengths.fixed(args.prompt_len), batch_groups=args.batch,
                    group_size=args.group_size, zero_variance_p=args.zero_variance_p, seed=args.seed)
    total = args.devices
    tp = hw.devices_per_engine
    if args.splits:
        splits = _ints("--splits", args.splits.split(","))
    else:  # eighths of the devices, rounded to whole engines
        splits = sorted({max(tp, min(total - 1, round(total * i / 8 / tp) * tp)) for i in range(1, 8)})
    for r in splits:
        if not 0 < r < total or r % tp:
            raise ArgumentError(f"splits: expected rollout device counts in (0, {total}) that are multiples of "
                                f"--tp={tp}, got {r}")
    etas = _ints("--etas", args.etas.split(","))
    print(f"{hw.name}; {total} devices; B={args.batch} groups × K={args.group_size}; lengths {lengths.describe()}; "
          f"{args.steps} steps ({args.warmup} warm-up)", flush=True)
    base = Schedule(steps=args.steps, warmup_steps=args.warmup, dynamic_sampling=args.dynamic_sampling)
    colo = simulate(hw, work, replace(base, mode="sync-colocated"), rollout_devices=total // 2,
                    train_devices=total - total // 2)
    rows = [("sync-colocated", total, total, None, colo)]
    print(f"  {'sync-colocated':<19} all {total} devices: {colo.steady_tokens_per_s:>12,.0f} tok/s", flush=True)
    best = None
    for partial in ([True, False] if args.both_partial else [True]):
        for eta in etas:
            for r in splits:
                res = simulate(hw, work, replace(base, mode="async", max_staleness=eta, partial_rollout=partial),
                               rollout_devices=r, train_devices=total - r)
                rows.append(("async", r, total - r, eta, res))
                gain = res.steady_tokens_per_s / colo.steady_tokens_per_s
                print(f"  async η={eta} partial={int(partial)} rollout {r:>4} / train {total - r:>4}: "
                      f"{res.steady_tokens_per_s:>12,.0f} tok/s  ({gain:.2f}× colocated, rollout busy "
                      f"{res.utilisation['rollout_busy']:.2f}, train busy {res.utilisation['train_busy']:.2f}, "
                      f"dropped {res.samples['dropped']})", flush=True)
                if best is None or res.steady_tokens_per_s > best[-1].steady_tokens_per_s:
                    best = ("async", r, total - r, eta, res)
    _, r, t, eta, res = best
    print(f"best: η={eta}, {r} rollout + {t} training devices, partial rollout={res.partial_rollout}: "
          f"{res.steady_tokens_per_s:,.0f} trained tok/s = {res.steady_tokens_per_s / colo.steady_tokens_per_s:.2f}× "
          f"synchronous colocated; staleness histogram {res.staleness_histogram}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"mode": m, "rollout": a, "train": b, "eta": e, **asdict(x)} for m, a, b, e, x in rows], f,
                      indent=1, default=str)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m rlblocks.sched.sim",
        description="Size an RL deployment: simulate synchronous colocated RL and bounded-async RL for every "
                    "rollout/training split and staleness bound η, print trained tokens/s, and the best η and split.",
        epilog="Costs are a model (see rlblocks.sched.sim.gpu_like for the defaults and their sources); measure "
               "yours and pass --hardware-json. Example: python -m rlblocks.sched.sim --model 7b --devices 128 "
               "--median 2048 --p99 32768",
    )
    ap.add_argument("--model", default="7b", help="preset shapes: 1.5b, 7b, 14b, 32b (Qwen2.5)")
    ap.add_argument("--hardware", choices=("gpu", "cpu"), default="gpu", help="gpu-like or cpu-like cost model")
    ap.add_argument("--hardware-json", default="",
                    help="a Hardware JSON (e.g. written by benchmarks/sim/measure_cpu_costs.py)")
    ap.add_argument("--tp", type=int, default=1, help="devices per rollout engine (tensor parallel)")
    ap.add_argument("--devices", type=int, default=128, help="total devices to split between rollout and training")
    ap.add_argument("--splits", default="", help="rollout device counts to try (default: eighths of --devices)")
    ap.add_argument("--etas", default="0,1,2,4", help="staleness bounds to try")
    ap.add_argument("--both-partial", action="store_true", help="also try without partial rollout")
    ap.add_argument("--dynamic-sampling", action="store_true", help="filter zero-variance groups (max_rounds 4)")
    ap.add_argument("--zero-variance-p", type=float, default=0.0, help="probability that a group's rewards are equal")
    ap.add_argument("--median", type=float, default=2048, help="median response length (tokens)")
    ap.add_argument("--p99", type=float, default=32768, help="99th percentile response length")
    ap.add_argument("--max-len", type=int, default=32768, help="response budget (lengths are clamped to it)")
    ap.add_argument("--lengths-file", default="", help="whitespace-separated observed lengths (replaces the lognormal)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=256, help="prompt groups per optimizer step (B)")
    ap.add_argument("--group-size", type=int, default=8, help="samples per prompt (K)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="", help="write every simulated configuration here")
    args = ap.parse_args(argv)
    try:
        _size(args)
    except ArgumentError as e:
        ap.error(str(e))


if __name__ == "__main__":
    main(sys.argv[1:])
