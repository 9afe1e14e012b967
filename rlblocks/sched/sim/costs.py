"""Cost models of the simulator: a decode step, a (re-)prefill, a trainer step, a weight push, and the device
(:class:`Hardware`) that bundles them, with GPU-like and CPU-like presets (:func:`gpu_like`, :func:`cpu_like`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

from rlblocks._checks import check_bool, check_int, check_real
from rlblocks.errors import ArgumentError

__all__ = [
    "DecodeCost",
    "Hardware",
    "ModelSpec",
    "PrefillCost",
    "SyncCost",
    "TrainCost",
    "cpu_like",
    "gpu_like",
]



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
    """Seconds to (re-)prefill sequences of context lengths ``n_i`` together (the engine decodes nothing meanwhile).

    Unpadded (``padded=False``, the default: an engine that packs any mix of lengths into one forward, or that runs
    one forward per distinct length)::

        prefill = overhead_s + per_length_s·|{n_i}| + per_token_s·Σ n_i + per_token_sq_s·Σ n_i²

    the quadratic term being causal attention over each sequence, ``|{n_i}|`` the number of distinct lengths, whose
    ``per_length_s`` is the cost of one more forward for an engine that batches only equal lengths. GPU engines
    (vLLM, SGLang) prefill any mix of lengths in one variable-length forward: ``gpu_like`` sets ``per_length_s`` to 0
    and charges the re-prefill of interrupted requests (their KV recomputed under new weights) at prefill speed.

    Padded (``padded=True``: the reference ``TorchEngine``): the sequences, sorted by length, go into left-padded
    forwards of at most ``token_budget`` padded tokens (rows × longest; 0: no limit), and sequences with identical
    tokens (the samples of one group before their first token) are computed once. Each forward ``f`` costs::

        overhead_s + per_token_s·rows_f·max_f + per_token_sq_s·rows_f·max_f²

    so padding is paid in full: re-prefilling requests of lengths spread over the response range after a weight
    update (prompt + output so far, up to (η + 1)·B groups in flight) costs every row the longest one's length.
    ``per_length_s`` must be 0 then.
    """

    overhead_s: float = 0.0
    per_token_s: float = 0.0
    per_token_sq_s: float = 0.0
    per_length_s: float = 0.0
    padded: bool = False
    token_budget: int = 0

    def __post_init__(self) -> None:
        for f in ("overhead_s", "per_token_s", "per_token_sq_s", "per_length_s"):
            check_real(f, getattr(self, f), finite=True, ge=0)
        check_bool("padded", self.padded)
        check_int("token_budget", self.token_budget, minimum=0)
        if self.padded and self.per_length_s:
            raise ArgumentError(f"per_length_s: a padded prefill pays per forward (overhead_s) and per padded token, "
                                f"not per distinct length; expected 0, got {self.per_length_s}")

    def forwards(self, contexts: Sequence[int]) -> list[tuple[int, int]]:
        """``(rows, longest)`` of each forward of a padded prefill of ``contexts`` (identical sequences already
        merged by the caller): sorted by length, a new forward whenever one more row would exceed ``token_budget``
        padded tokens."""
        out: list[tuple[int, int]] = []
        rows = longest = 0
        for n in sorted(contexts):
            if rows and self.token_budget and (rows + 1) * n > self.token_budget:
                out.append((rows, longest))
                rows = 0
            rows, longest = rows + 1, n
        if rows:
            out.append((rows, longest))
        return out

    def seconds(self, contexts: Sequence[int], keys: Sequence[object] | None = None) -> float:
        """Seconds of one prefill of ``contexts``. ``keys`` (padded only, one per context): contexts with equal keys
        hold identical tokens and are computed once (the simulator gives a group's fresh prompts one key)."""
        if not contexts:
            return 0.0
        if not self.padded:
            return (self.overhead_s + self.per_length_s * len(set(contexts)) + self.per_token_s * sum(contexts)
                    + self.per_token_sq_s * sum(n * n for n in contexts))
        if keys is not None:
            if len(keys) != len(contexts):
                raise ArgumentError(f"keys: expected one per context ({len(contexts)}), got {len(keys)}")
            contexts = list({k: n for k, n in zip(keys, contexts)}.values())
        return sum(self.overhead_s + self.per_token_s * r * m + self.per_token_sq_s * r * m * m
                   for r, m in self.forwards(contexts))


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
