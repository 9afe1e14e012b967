"""Memory of :class:`~rlblocks.rollout.engines.TorchEngine`: KV caches (per sequence, the left-padded decode
batch, the prefix cache of aborted requests) and the placement a level-2 sleep restores parameters to."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .torch_engine import _Seq

__all__ = ["KV", "PrefixCache"]

KV = list[tuple[Tensor, Tensor]]  # per layer: keys, values, each [B, H_kv, T, D]


@dataclass
class _Batch:
    seqs: list[_Seq]
    keys: list[Tensor]  # per layer [B, H, T, D], left-padded
    values: list[Tensor]
    pads: list[int]

    @property
    def width(self) -> int:
        return int(self.keys[0].shape[-2])

    def row_kv(self, b: int) -> KV:
        p = self.pads[b]
        return [(k[b : b + 1, :, p:], v[b : b + 1, :, p:]) for k, v in zip(self.keys, self.values)]


def _left_pad_stack(kvs: list[KV]) -> tuple[list[Tensor], list[Tensor], list[int]]:
    """Stack per-sequence KV (each [1, H, t_i, D]) into [B, H, max t, D], left-padded with zeros (masked out)."""
    lengths = [int(kv[0][0].shape[-2]) for kv in kvs]
    width = max(lengths)
    keys, values = [], []
    for layer in range(len(kvs[0])):
        k0, v0 = kvs[0][layer]
        k = k0.new_zeros((len(kvs), k0.shape[1], width, k0.shape[3]))
        v = v0.new_zeros((len(kvs), v0.shape[1], width, v0.shape[3]))
        for b, kv in enumerate(kvs):
            k[b, :, width - lengths[b] :] = kv[layer][0][0]
            v[b, :, width - lengths[b] :] = kv[layer][1][0]
        keys.append(k)
        values.append(v)
    return keys, values, [width - t for t in lengths]


_ALIGN = 64  # bytes: a cache line, and the widest SIMD vector (AVX-512) a kernel may align its loads to


@dataclass(frozen=True)
class _Placement:
    """Where a level-2 sleep found a parameter: enough to re-allocate it so that kernels take the same path."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    misalign: int  # data_ptr() % _ALIGN

    @classmethod
    def of(cls, t: Tensor) -> _Placement:
        return cls(t.shape, t.stride(), t.dtype, t.data_ptr() % _ALIGN)

    def nan_tensor(self, device: torch.device) -> Tensor:
        """A NaN-filled tensor of this shape, strides and dtype whose first element is ``misalign`` bytes past a
        ``_ALIGN``-byte boundary (over-allocated by ``_ALIGN`` bytes to make room for the shift)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        span = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride)) if all(self.shape) else 0
        buf = torch.full((span + _ALIGN // itemsize,), float("nan"), dtype=self.dtype, device=device)
        shift = ((self.misalign - buf.data_ptr()) % _ALIGN) // itemsize
        return buf.as_strided(self.shape, self.stride, shift)


def _make_cache(kv: KV | None):
    """An HF ``DynamicCache`` holding ``kv`` without copying it (the model appends to it with ``torch.cat``)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    if kv is None:
        return cache
    try:
        from transformers.cache_utils import DynamicLayer

        for k, v in kv:
            layer = DynamicLayer()
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
            cache.layers.append(layer)
    except (ImportError, AttributeError, TypeError):  # other transformers versions: the copying constructor
        cache = DynamicCache(ddp_cache_data=kv)
    return cache


class PrefixCache:
    """KV caches of aborted requests, kept so that their resumption starts from the exact KV state (see the
    :class:`~rlblocks.rollout.engines.TorchEngine` docstring): keyed by the token ids the KV covers, valid only
    under the weight version it was computed with; least recently stored first out beyond ``size`` entries."""

    def __init__(self, size: int) -> None:
        self.size = int(size)
        self._entries: OrderedDict[tuple[int, ...], tuple[KV, int, Tensor | None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def take(self, tokens: list[int], version: int) -> tuple[int, KV, Tensor | None] | None:
        """Remove and return ``(n, kv, routed)`` of the longest entry of ``version`` whose key is a proper prefix of
        ``tokens`` (``n`` tokens), or ``None``."""
        best = None
        for key, (_kv, ver, _routed) in self._entries.items():
            n = len(key)
            if ver == version and n < len(tokens) and (best is None or n > len(best)):
                if tuple(tokens[:n]) == key:
                    best = key
        if best is None:
            return None
        kv, _, routed = self._entries.pop(best)
        return len(best), kv, routed

    def put(self, tokens: list[int], kv: KV, version: int, routed: Tensor | None) -> None:
        """Keep a copy of ``kv`` (covering ``tokens``) computed under ``version``."""
        if self.size == 0:
            return
        key = tuple(tokens)
        self._entries[key] = ([(k.clone(), v.clone()) for k, v in kv], version, routed)  # own memory
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

