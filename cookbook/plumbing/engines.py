"""Rollout engines for the loops: ``--engine torch|vllm|sglang``, ``--max-model-len``, ``--engine-dtype``,
``--kv-cache-mb`` (:class:`EngineFlags`, resolved by :func:`check_engine_flags`), response budgets.

The engine samples in the trainer's dtype unless ``--engine-dtype`` says otherwise. When it does (or when the
rollout weights are block-FP8, ``--rollout-dtype fp8``), the rollout log-probs differ from the trainer's by more
than float rounding, and the default ``--correction auto`` turns the train/rollout mismatch correction on
(``tis``, ρ = π_old/π_rollout truncated at ``--correction-cap``); ``--correction none`` keeps it off on purpose.
"""

from __future__ import annotations

import math
import os
import random
import sys
from dataclasses import dataclass
from typing import Any

import torch

from rlblocks.errors import ArgumentError

from .flags import opt

TRAINER_DTYPE = torch.float32  # the dtype plumbing's load_hf gives every loop's policy
ENGINE_DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_AUTO_SEQUENCES = 64  # --kv-cache-mb 0 on CPU: room for this many sequences of --max-model-len ...
KV_AUTO_MIN_MB, KV_AUTO_MAX_MB = 64, 4096  # ... within these bounds and a quarter of the machine's memory


@dataclass
class EngineFlags:
    """The rollout-engine flags of the loops that take ``--engine`` (a loop's ``Config`` inherits them)."""

    engine_dtype: str = opt("auto", "dtype the rollout engine computes in; auto: the trainer's (float32). Another "
                                    "dtype samples from a slightly different policy: --correction auto then turns "
                                    "the train/rollout correction on (tis). With --engine sglang it declares the "
                                    "server's dtype", ENGINE_DTYPES)
    kv_cache_mb: int = opt(0, "vLLM KV cache in MiB; 0: on CPU, room for 64 sequences of --max-model-len (64 MiB "
                              "to 4 GiB, at most a quarter of the memory), on GPU vLLM's gpu_memory_utilization. A "
                              "cache too small for a step's samples makes vLLM queue them")


def resolve_engine_dtype(cfg: Any, trainer_dtype: torch.dtype = TRAINER_DTYPE) -> torch.dtype | None:
    """The dtype ``make_engine`` starts the engine in: ``--engine-dtype``, ``auto`` = ``trainer_dtype``. ``None``
    for block-FP8 rollout weights left on ``auto`` (the engine's FP8 kernels pick their activation dtype)."""
    if cfg.engine_dtype != "auto":
        return getattr(torch, cfg.engine_dtype)
    return None if getattr(cfg, "rollout_dtype", "model") == "fp8" else trainer_dtype


def check_engine_flags(cfg: Any, trainer_dtype: torch.dtype = TRAINER_DTYPE) -> None:
    """Check ``--engine-dtype``/``--kv-cache-mb`` and resolve ``--correction auto`` in place: ``tis`` when the engine
    samples from other numbers than the trainer computes with (``--engine-dtype`` other than the trainer's, or
    ``--rollout-dtype fp8``), else ``none``. A loop whose step applies no correction (``--distill-from``) refuses
    such an engine instead. Announces an automatic ``tis`` on stderr (once per job: rank 0). Raises
    :class:`ArgumentError` naming the flag."""
    if cfg.engine_dtype not in ENGINE_DTYPES:
        raise ArgumentError(f"--engine-dtype: expected one of {ENGINE_DTYPES}, got {cfg.engine_dtype!r}")
    if cfg.kv_cache_mb < 0:
        raise ArgumentError(f"--kv-cache-mb: expected 0 (sized from --max-model-len) or more MiB, got "
                            f"{cfg.kv_cache_mb}")
    if cfg.kv_cache_mb and cfg.engine != "vllm":
        raise ArgumentError(f"--kv-cache-mb: sizes vLLM's KV cache, got --engine {cfg.engine}")
    fp8 = getattr(cfg, "rollout_dtype", "model") == "fp8"
    dtype = resolve_engine_dtype(cfg, trainer_dtype)
    differs = fp8 or dtype != trainer_dtype
    why = "block-FP8 rollout weights" if fp8 else f"--engine-dtype {cfg.engine_dtype}"
    if cfg.correction != "auto":
        return
    if differs and getattr(cfg, "distill_from", ""):
        raise ArgumentError(f"--engine-dtype: the engine samples with {why}, the trainer computes in "
                            f"{str(trainer_dtype).removeprefix('torch.')}, and the distillation step applies no "
                            "train/rollout correction; use --engine-dtype auto")
    cfg.correction = "tis" if differs else "none"
    if differs and os.environ.get("RANK", "0") == "0":
        print(f"--correction auto: tis (the engine samples with {why}, the trainer computes in "
              f"{str(trainer_dtype).removeprefix('torch.')})", file=sys.stderr, flush=True)


def kv_cache_bytes(path: str, dtype: torch.dtype, max_model_len: int, kv_cache_mb: int = 0) -> int:
    """vLLM's ``kv_cache_memory_bytes`` for ``--kv-cache-mb``: the flag's MiB, or (0) room for
    ``KV_AUTO_SEQUENCES`` sequences of ``max_model_len`` tokens at ``2 · layers · kv_heads · head_dim`` elements of
    ``dtype`` per token (the checkpoint's HF config), clamped to [64 MiB, min(4 GiB, memory / 4)]."""
    if kv_cache_mb > 0:
        return kv_cache_mb << 20
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    per_token = 2 * cfg.num_hidden_layers * (getattr(cfg, "num_key_value_heads", None) or heads) * head_dim
    want = per_token * torch.empty((), dtype=dtype).element_size() * max_model_len * KV_AUTO_SEQUENCES
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    top = min(KV_AUTO_MAX_MB << 20, memory // 4)
    return int(max(KV_AUTO_MIN_MB << 20, min(want, top)))


def model_max_len(path: str) -> int:
    """The positions of the checkpoint at ``path`` (``max_position_embeddings`` of its HF config)."""
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(path).max_position_embeddings)


def check_max_model_len(value: int) -> None:
    """``--max-model-len`` before anything is loaded: 0 (the model's positions) or more."""
    if value < 0:
        raise ArgumentError(f"--max-model-len: expected 0 (the model's positions) or more, got {value}")


def resolve_max_model_len(requested: int, path: str) -> int:
    """``--max-model-len``: 0 means the model's own positions; a larger value than those is refused."""
    positions = model_max_len(path)
    if requested < 0 or requested > positions:
        raise ArgumentError(f"--max-model-len: expected 0 (the model's {positions} positions) or 1..{positions} "
                            f"for {path}, got {requested}")
    return requested or positions


def make_engine(kind: str, path: str, device: torch.device, *, max_model_len: int, max_staleness: int = 1,
                sglang_url: str = "", max_batch_size: int = 1024, batch_invariant: bool = False,
                dtype: torch.dtype | None = TRAINER_DTYPE, kv_cache_mb: int = 0, inline_steps: bool = False):
    """A rollout engine for ``--engine torch|vllm|sglang`` (create it inside the event loop that drives it).

    ``max_model_len`` (prompt + response) sizes the engines' KV cache; it must not exceed the model's positions.
    ``dtype`` (:func:`resolve_engine_dtype`) is the dtype the engine computes in; ``None``: the engine's own choice
    (vLLM's ``"auto"``). ``kv_cache_mb`` (``--kv-cache-mb``) sizes vLLM's KV cache (:func:`kv_cache_bytes`).
    ``max_batch_size`` and ``batch_invariant`` (every sequence in its own forward: a sequence's tokens do not depend
    on which other requests share a step) apply to the TorchEngine, and ``inline_steps`` (its steps on the event
    loop's thread: a sync loop on a CPU that trains on the thread driving the loop keeps one OpenMP team). An SGLang
    server keeps the dtype and cache it was started with.
    """
    if kind == "torch":
        from rlblocks.rollout.engines import TorchEngine

        return TorchEngine.from_pretrained(path, device=device, max_batch_size=max_batch_size,
                                           max_model_len=max_model_len, batch_invariant=batch_invariant,
                                           dtype=dtype or TRAINER_DTYPE, inline_steps=inline_steps)
    if kind == "vllm":
        from rlblocks.rollout.engines import VLLMEngine

        args: dict[str, Any] = {"max_model_len": max_model_len}
        if dtype is not None:
            args["dtype"] = str(dtype).removeprefix("torch.")  # without it vLLM on CPU computes in bfloat16
        if kv_cache_mb or not torch.cuda.is_available():
            # GPU vLLM sizes the cache from gpu_memory_utilization unless --kv-cache-mb is given
            args["kv_cache_memory_bytes"] = kv_cache_bytes(path, dtype or torch.bfloat16, max_model_len, kv_cache_mb)
        if not torch.cuda.is_available():
            args["enforce_eager"] = True
        return VLLMEngine.from_pretrained(path, max_staleness=max_staleness, **args)
    if kind == "sglang":
        from rlblocks.rollout.engines import SGLangEngine

        return SGLangEngine(sglang_url)
    raise ArgumentError(f"--engine: expected torch|vllm|sglang, got {kind!r}")


def length_budget(max_new_tokens: int, length_tail: float, room: int, rng: random.Random) -> int:
    """Response budget of one prompt group: ``max_new_tokens``, or (benchmark) a lognormal length with median
    ``length_tail`` and σ = ln(10)/2.326 = 0.99 (p99/p50 = 10); never more than ``room`` (= max_model_len − the
    prompt's length), so a sample always fits the engine."""
    n = max_new_tokens
    if length_tail > 0:
        n = max(max_new_tokens, round(rng.lognormvariate(math.log(length_tail), 0.99)))
    return max(1, min(n, room))


def until_eos(ids: list[int], eos: int) -> list[int]:
    """``ids`` up to and including the first ``eos`` (the engines may only stop there, but a benchmark without
    stop tokens keeps generating)."""
    return ids[: ids.index(eos) + 1] if eos in ids else ids
