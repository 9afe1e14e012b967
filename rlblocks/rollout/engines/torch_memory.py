"""Memory of :class:`~rlblocks.rollout.engines.TorchEngine`: KV caches (per sequence, the left-padded decode
batch, the prefix cache of aborted requests) and the placement a level-2 sleep restores parameters to."""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    import asyncio

    from rlblocks.rollout.types import GenerationRequest

__all__ = ["KV", "PrefixCache"]

KV = list[tuple[Tensor, Tensor]]  # per layer: keys, values, each [B, H_kv, T, D]


@dataclass(eq=False)
class _Seq:
    """One request's state in the TorchEngine: its tokens so far, outputs, and the KV it owns while outside the
    decode batch."""

    request: GenerationRequest
    future: asyncio.Future
    seed: int
    tokens: list[int]  # prompt + output so far
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    kv: KV | None = None  # own KV of tokens[:n_cached] when not a row of the decode batch; [1, H, n_cached, D]
    n_cached: int = 0
    routed: list[Tensor] = field(default_factory=list)  # record_routing: rows of the positions fed, in order
    done: bool = False

    @property
    def rid(self) -> str:
        return self.request.request_id


class _Batch:
    """The decode batch: per layer one preallocated K and V buffer ``[rows_cap, H_kv, cols_cap, D]``.

    Rows ``[0, n)`` are the sequences ``seqs`` (row ``b`` is ``seqs[b]``); columns ``[start, end)`` are the cached
    positions, left-padded: row ``b``'s real tokens are the columns ``[start + pads[b], end)`` and its padding is
    zero (masked out by the decode step's attention mask). A decode step writes every row's new key and value at
    column ``end`` (in place, through the cache of :meth:`cache`), so no step re-allocates the cache; the buffers grow
    geometrically (doubling, capped at ``max_len`` columns) when a step or a joining sequence needs more room.
    A sequence leaves in O(1) rows of copying: the last row moves into its slot (:meth:`remove`). Columns that
    every row pads are dropped by advancing ``start`` (:meth:`trim`), without copying."""

    def __init__(self, kv: KV, pads: list[int], seqs: list[_Seq], max_len: int) -> None:
        n, width = int(kv[0][0].shape[0]), int(kv[0][0].shape[-2])
        self.max_len = max(int(max_len), width + 1)
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.seqs: list[_Seq] = []
        self.pads: list[int] = []
        self.row_of: dict[_Seq, int] = {}
        cols = self._grown(width + 1)
        for k, v in kv:  # empty window: _alloc only shapes the buffers
            self.keys.append(k.new_zeros((max(n, 4), k.shape[1], cols, k.shape[3])))
            self.values.append(v.new_zeros((max(n, 4), v.shape[1], cols, v.shape[3])))
        self.start, self.end = 0, width
        self._write_rows(0, kv, 0, pads)
        self._extend(seqs, pads)

    # ---------------------------------------------------------------- geometry
    @property
    def n(self) -> int:
        return len(self.seqs)

    @property
    def width(self) -> int:
        return self.end - self.start

    def _grown(self, need: int) -> int:
        return max(need, min(2 * need, self.max_len))

    def _alloc(self, rows: int, cols: int, shift: int = 0) -> None:
        """Fresh zero buffers of ``rows x cols``; the live window moves to columns ``[shift, shift + width)``."""
        keys, values = [], []
        for k, v in zip(self.keys, self.values):
            nk = k.new_zeros((rows, k.shape[1], cols, k.shape[3]))
            nv = v.new_zeros((rows, v.shape[1], cols, v.shape[3]))
            nk[: self.n, :, shift : shift + self.width] = k[: self.n, :, self.start : self.end]
            nv[: self.n, :, shift : shift + self.width] = v[: self.n, :, self.start : self.end]
            keys.append(nk)
            values.append(nv)
        self.start, self.end = 0, shift + self.width
        self.keys, self.values = keys, values

    @property
    def rows_cap(self) -> int:
        return int(self.keys[0].shape[0])

    @property
    def cols_cap(self) -> int:
        return int(self.keys[0].shape[-2])

    def reserve(self, extra_cols: int) -> None:
        """Room for ``extra_cols`` more columns on the right (before a step writes them)."""
        if self.end + extra_cols > self.cols_cap:
            self._alloc(self.rows_cap, self._grown(self.width + extra_cols))

    def trim(self) -> None:
        """Drop the columns every row pads (no copy: the window starts later)."""
        if self.pads:
            cut = min(self.pads)
            if cut:
                self.start += cut
                self.pads = [p - cut for p in self.pads]

    # ---------------------------------------------------------------- rows
    def _write_rows(self, row0: int, kv: KV, col0: int, pads: list[int]) -> None:
        """Rows ``row0...`` get ``kv`` at columns ``[col0, col0 + m)``; their padding (before ``col0``, and the first
        ``pads[i]`` columns of ``kv``'s row ``i``, which hold the keys of pad tokens) is zeroed."""
        rows, m = int(kv[0][0].shape[0]), int(kv[0][0].shape[-2])
        for layer, (k, v) in enumerate(kv):
            for buf, src in ((self.keys[layer], k), (self.values[layer], v)):
                buf[row0 : row0 + rows, :, self.start : col0].zero_()
                buf[row0 : row0 + rows, :, col0 : col0 + m] = src
                for i, p in enumerate(pads):
                    if p:
                        buf[row0 + i, :, col0 : col0 + p].zero_()

    def _extend(self, seqs: list[_Seq], pads: list[int]) -> None:
        for s, p in zip(seqs, pads):
            self.row_of[s] = len(self.seqs)
            self.seqs.append(s)
            self.pads.append(p)

    def add(self, kv: KV, pads: list[int], seqs: list[_Seq]) -> None:
        """Let ``seqs`` join: ``kv`` is theirs, ``[k, H, m, D]`` per layer, left-padded by ``pads``."""
        k0 = kv[0][0]
        rows, m = int(k0.shape[0]), int(k0.shape[-2])
        rows_cap = self.rows_cap if self.n + rows <= self.rows_cap else max(self.n + rows, 2 * self.rows_cap)
        if m > self.width:  # the window widens to the left: in place if there is room, else a re-allocation
            extra = m - self.width
            if self.start >= extra and rows_cap == self.rows_cap:
                self.start -= extra
                for bk, bv in zip(self.keys, self.values):
                    bk[: self.n, :, self.start : self.start + extra].zero_()
                    bv[: self.n, :, self.start : self.start + extra].zero_()
            else:
                self._alloc(rows_cap, self._grown(m + 1), shift=extra)
            self.pads = [p + extra for p in self.pads]
        elif rows_cap != self.rows_cap:
            self._alloc(rows_cap, self.cols_cap)
        lead = self.width - m
        self._write_rows(self.n, kv, self.end - m, pads)
        self._extend(seqs, [lead + p for p in pads])

    @torch.inference_mode()  # the buffers are inference tensors; this runs on the event loop, outside the step
    def remove(self, gone: list[_Seq]) -> None:
        """Let ``gone`` (members) leave: the last live rows move into their slots, so the rows stay ``[0, n)``."""
        holes = sorted((self.row_of.pop(s) for s in gone if s in self.row_of), reverse=True)
        for b in holes:
            last = self.n - 1
            if b != last:
                for bk, bv in zip(self.keys, self.values):
                    bk[b, :, self.start : self.end] = bk[last, :, self.start : self.end]
                    bv[b, :, self.start : self.end] = bv[last, :, self.start : self.end]
                moved = self.seqs[last]
                self.seqs[b], self.pads[b] = moved, self.pads[last]
                self.row_of[moved] = b
            self.seqs.pop()
            self.pads.pop()

    def row_kv(self, b: int) -> KV:
        """Views of row ``b``'s real tokens, ``[1, H, t, D]`` per layer (copy them to keep them)."""
        c = self.start + self.pads[b]
        return [(k[b : b + 1, :, c : self.end], v[b : b + 1, :, c : self.end]) for k, v in zip(self.keys, self.values)]

    def cache(self):
        """An HF cache whose layers write a step's keys and values into the buffers at column ``end``."""
        from transformers import DynamicCache

        cache = DynamicCache()
        layer_cls = _buffer_layer_cls()
        cache.layers = [layer_cls(self, layer) for layer in range(len(self.keys))]
        return cache


@functools.cache
def _buffer_layer_cls() -> type:
    """:class:`_BufferLayer`'s class, built on first use (importing transformers only then)."""
    from transformers.cache_utils import DynamicLayer

    class _BufferLayer(DynamicLayer):
        """One layer of :meth:`_Batch.cache`: ``update`` writes in place and returns views of the live window."""

        def __init__(self, batch: _Batch, layer: int) -> None:
            super().__init__()
            self.batch, self.layer = batch, layer
            k, v = batch.keys[layer], batch.values[layer]
            self.dtype, self.device, self.is_initialized = k.dtype, k.device, True
            self.keys, self.values = k[: batch.n, :, batch.start : batch.end], v[: batch.n, :, batch.start : batch.end]

        def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
            b, q = self.batch, int(key_states.shape[-2])
            k, v = b.keys[self.layer], b.values[self.layer]
            k[: b.n, :, b.end : b.end + q] = key_states
            v[: b.n, :, b.end : b.end + q] = value_states
            self.keys, self.values = k[: b.n, :, b.start : b.end + q], v[: b.n, :, b.start : b.end + q]
            return self.keys, self.values

    return _BufferLayer


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

