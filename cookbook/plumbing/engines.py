"""Rollout engines for the loops: ``--engine torch|vllm|sglang``, ``--max-model-len``, response budgets."""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from rlblocks.errors import ArgumentError


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
                sglang_url: str = "", max_batch_size: int = 1024, batch_invariant: bool = False):
    """A rollout engine for ``--engine torch|vllm|sglang`` (create it inside the event loop that drives it).

    ``max_model_len`` (prompt + response) sizes the engines' KV cache; it must not exceed the model's positions.
    ``max_batch_size`` and ``batch_invariant`` (every sequence in its own forward: a sequence's tokens do not depend
    on which other requests share a step) apply to the TorchEngine.
    """
    if kind == "torch":
        from rlblocks.rollout.engines import TorchEngine

        return TorchEngine.from_pretrained(path, device=device, max_batch_size=max_batch_size,
                                           max_model_len=max_model_len, batch_invariant=batch_invariant)
    if kind == "vllm":
        from rlblocks.rollout.engines import VLLMEngine

        args: dict[str, Any] = {"max_model_len": max_model_len}
        if not torch.cuda.is_available():
            # REAL MODEL: 64 MiB of KV cache holds the tiny demo model's sequences; on CPU give a real model its
            # share of memory (GPU vLLM sizes the cache from gpu_memory_utilization instead).
            args.update(enforce_eager=True, kv_cache_memory_bytes=64 << 20)
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
