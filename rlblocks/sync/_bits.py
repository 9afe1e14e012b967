"""Bit-level kernels of delta sync, written to run at memory speed: CRC-32, changed-element search, parallel chunks.

- **CRC-32** is zlib's (polynomial 0xEDB88320 reflected, init and final xor 0xFFFFFFFF), so packets stay readable by
  anything that speaks zlib; ISA-L's ``isal_zlib.crc32`` computes the same values faster and is used when
  installed. Large buffers are split into chunks whose CRCs are computed in parallel threads (both release the GIL)
  and joined with :func:`crc32_combine`, zlib's ``crc32_combine`` algorithm, written here because the stdlib does
  not expose it.
- **Changed elements** (:func:`changed_indices`): both tensors are viewed as int64 words, the words compared in one
  vectorised pass, only the changed words gathered and their lanes compared in a second, small pass; no
  per-element pass in Python and no full-length boolean mask per element. Chunks run on a thread pool, each also
  computing the CRC of its part of the new tensor while it is still in cache.
- **Native delta** (:func:`native_delta`, :func:`native_delta_batch`, :func:`gap16_check`, :func:`gap16_apply`;
  CPU, with ``numba`` and ISA-L's CRC; ``RLBLOCKS_SYNC_NATIVE=0`` turns them off, with identical packets and
  weights): the encoder's pass (compare, gap16 positions, values, snapshot update, CRC of the new bytes) and the
  decoder's (check the positions; CRC before, write, CRC after) as compiled loops in
  :mod:`rlblocks.sync._native`, many tensors per call, each piece of a tensor checksummed while it is in cache.

How each kernel works and what it costs: ``docs/sync.md`` (Delta packets, Kernels).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from jaxtyping import Int64, Shaped, UInt16
from torch import Tensor

from rlblocks.errors import ArgumentError

try:  # optional: faster index search (see nonzero_1d); torch alone works too
    import numpy as _np
except ImportError:  # pragma: no cover
    _np = None

try:  # ISA-L: the same CRC-32, ~4x faster than zlib 1.2/1.3 on x86 with PCLMUL
    from isal.isal_zlib import crc32 as _crc32_bytes
except ImportError:  # pragma: no cover - exercised where isal is not installed
    _crc32_bytes = zlib.crc32

CRC_BACKEND = "isal" if _crc32_bytes is not zlib.crc32 else "zlib"
"""Which implementation :func:`crc32_bytes` uses (the values are identical)."""

CHUNK_BYTES = 8 << 20
"""Bytes of one tensor processed per task: large enough to amortise ~10 torch calls, small enough for caches."""

_POLY = 0xEDB88320
T = TypeVar("T")
_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0


def num_threads() -> int:
    """Worker threads for chunked work: ``RLBLOCKS_SYNC_THREADS`` if set, else ``torch.get_num_threads()``."""
    env = os.environ.get("RLBLOCKS_SYNC_THREADS")
    return max(1, int(env)) if env else max(1, torch.get_num_threads())


def sync_pool(threads: int) -> ThreadPoolExecutor:
    """The shared pool of ``threads`` workers (re-made when another size is asked for)."""
    global _POOL, _POOL_SIZE
    if _POOL is None or _POOL_SIZE != threads:
        if _POOL is not None:
            _POOL.shutdown(wait=False)
        # Each worker runs its torch kernels single-threaded (torch.set_num_threads is per thread under OpenMP):
        # the chunks are the parallelism, and an intra-op parallel region inside a chunk would wait on a core
        # that another worker (or another process) holds.
        _POOL = ThreadPoolExecutor(threads, thread_name_prefix="rlblocks-sync", initializer=torch.set_num_threads,
                                   initargs=(1,))
        _POOL_SIZE = threads
    return _POOL


def parallel_map(fn: Callable[[int], T], n: int, *, threads: int | None = None) -> list[T]:
    """``[fn(i) for i in range(n)]``, run on a shared thread pool when ``n > 1`` and more than one thread is wanted.

    Results are in index order. An exception in any task is raised here (after every task has finished, so no
    task is still writing into a caller's tensor when the caller handles the error).
    """
    threads = num_threads() if threads is None else threads
    if n <= 1 or threads <= 1:
        return [fn(i) for i in range(n)]
    pool = sync_pool(threads)
    futures = [pool.submit(fn, i) for i in range(n)]
    errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e
    return [f.result() for f in futures]


# ----------------------------------------------------------------------------------------------------------------
# CRC-32
# ----------------------------------------------------------------------------------------------------------------


def crc32_bytes(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """zlib's CRC-32 of ``data`` (continuing from ``value``), with the fastest installed implementation."""
    return _crc32_bytes(data, value) & 0xFFFFFFFF


def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


_POW2: list[list[int]] = []  # _POW2[k]: the operator advancing a CRC register over 2**k zero bytes


def _zero_bytes_operators(k: int) -> list[list[int]]:
    if not _POW2:
        op = [_POLY] + [1 << i for i in range(31)]  # one zero bit (reflected polynomial)
        for _ in range(3):
            op = _gf2_square(op)  # 2, 4, 8 zero bits
        _POW2.append(op)
    while len(_POW2) <= k:
        _POW2.append(_gf2_square(_POW2[-1]))
    return _POW2


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` from ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and ``len2 = len(B)`` (as zlib's).

    ``crc1`` is advanced over ``len2`` zero bytes, then xor-ed with ``crc2`` (CRC-32 is affine over GF(2), and
    the init/final xors cancel). Advancing uses the 32x32 GF(2) operators for ``2**k`` zero bytes (built once by
    squaring the one-zero-bit operator), one per set bit of ``len2``: at most ~40 matrix-vector products.
    """
    if len2 <= 0:
        return crc1
    ops = _zero_bytes_operators(len2.bit_length())
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _gf2_times(ops[k], crc1)
        len2 >>= 1
        k += 1
    return (crc1 ^ crc2) & 0xFFFFFFFF


def _memview(t: Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (the caller keeps the tensor alive while it is used)."""
    flat = t.reshape(-1).view(torch.uint8)
    if _np is not None:  # cheaper than building a ctypes array type of this size
        return memoryview(flat.detach().numpy())
    return memoryview((ctypes.c_char * flat.numel()).from_address(flat.data_ptr())).cast("B")


def crc32_tensor(t: Tensor, *, threads: int | None = None) -> int:
    """CRC-32 of ``t``'s bytes in memory order (``zlib.crc32`` of the same bytes).

    CPU tensors are read in place (chunks of :data:`CHUNK_BYTES` in parallel, combined with
    :func:`crc32_combine`); other devices are copied to the host first, chunk by chunk through a page-locked
    buffer, so that host memory holds one chunk, not a copy of the tensor.
    """
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return 0
    flat = t.reshape(-1).view(torch.uint8)
    if flat.device.type != "cpu":
        staging = torch.empty(min(nbytes, CHUNK_BYTES), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        crc = 0
        for lo in range(0, nbytes, CHUNK_BYTES):
            part = staging[: min(CHUNK_BYTES, nbytes - lo)]
            part.copy_(flat[lo : lo + part.numel()])
            crc = crc32_bytes(_memview(part), crc)
        return crc
    mv = _memview(flat)
    n_chunks = -(-nbytes // CHUNK_BYTES)
    if n_chunks == 1:
        return crc32_bytes(mv)
    crcs = parallel_map(lambda i: crc32_bytes(mv[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES]), n_chunks, threads=threads)
    return combine_chunk_crcs(crcs, nbytes, CHUNK_BYTES)


def combine_chunk_crcs(crcs: Sequence[int], nbytes: int, chunk_bytes: int) -> int:
    """CRC-32 of a buffer of ``nbytes`` from the CRCs of its consecutive ``chunk_bytes`` chunks (last one shorter)."""
    crc = crcs[0]
    for i, c in enumerate(crcs[1:], start=1):
        crc = crc32_combine(crc, c, min(chunk_bytes, nbytes - i * chunk_bytes))
    return crc


# ----------------------------------------------------------------------------------------------------------------
# changed elements
# ----------------------------------------------------------------------------------------------------------------

INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def int_view(t: Tensor) -> Tensor:
    """Flat integer view of a contiguous tensor's bits, same element size (no copy)."""
    return t.reshape(-1).view(INT_VIEW[t.element_size()])


def nonzero_1d(mask: Tensor) -> Tensor:
    """Ascending int64 indices of the True entries of a 1-D bool tensor.

    On the CPU numpy's ``flatnonzero`` is used when numpy is installed: measured 4-6x faster than
    ``torch.nonzero`` here (11 vs 70 ms for 4M entries), and the index search is the slowest step of a delta.
    """
    if mask.device.type == "cpu" and _np is not None:
        return torch.from_numpy(_np.flatnonzero(mask.numpy()))
    return mask.nonzero().squeeze(1)


def _word_split(old: Tensor, new: Tensor) -> int:
    """Number of leading elements that can be compared as int64 words (0 when the pointers are not 8-aligned)."""
    es = old.element_size()
    if old.data_ptr() % 8 or new.data_ptr() % 8:
        return 0
    return (old.numel() * es // 8) * 8 // es


def changed_indices(
    old: Shaped[Tensor, " N"],
    new: Shaped[Tensor, " N"],
    *,
    update: bool = False,
    with_crc: bool = False,
    threads: int | None = None,
) -> tuple[Int64[Tensor, " K"], Shaped[Tensor, " K"], int | None]:
    """Positions where the bit patterns of two flat contiguous tensors (same dtype, same device) differ.

    Returns ``(idx, values, crc)``: ``idx`` ascending int64 element indices, ``values = new[idx]`` (the new bit
    patterns, dtype of ``new``), and, with ``with_crc`` (CPU only), the CRC-32 of ``new``'s bytes (else None).
    ``update=True`` also writes the changed elements into ``old`` (``old[idx] = values``: afterwards ``old`` equals
    ``new`` bit for bit).

    Comparison is of integer views, so NaN payloads, -0.0 vs +0.0 and subnormals count as changes. Elements are
    compared as int64 words first; only the changed words' lanes are compared element by element. CPU work is
    split in chunks of :data:`CHUNK_BYTES` over a thread pool; on other devices the same torch calls run on the
    device, one chunk after another.
    """
    if old.dtype != new.dtype or old.shape != new.shape or old.dim() != 1:
        raise ArgumentError(f"changed_indices: expected two flat tensors of one dtype, got {old.shape} {new.shape}")
    es = old.element_size()
    n = old.numel()
    oi, ni = old.view(INT_VIEW[es]), new.view(INT_VIEW[es])
    split = _word_split(old, new)
    lanes = 8 // es
    cpu = old.device.type == "cpu"
    chunk_elems = max(lanes, CHUNK_BYTES // es // lanes * lanes)
    n_chunks = max(1, -(-n // chunk_elems))
    nbytes = n * es

    def one(c: int) -> tuple[Tensor, Tensor, int | None]:
        lo, hi = c * chunk_elems, min(n, (c + 1) * chunk_elems)
        parts = []
        w_hi = min(hi, split)
        if w_hi > lo:  # word part: [lo, w_hi) compared 8 bytes at a time
            ow = oi[lo:w_hi].view(torch.int64)
            nw = ni[lo:w_hi].view(torch.int64)
            words = nonzero_1d(torch.ne(ow, nw))
            if words.numel():
                if lanes == 1:
                    parts.append(words + lo)
                else:  # only the changed words, lane by lane
                    o_l = torch.gather(ow, 0, words).view(INT_VIEW[es])
                    n_l = torch.gather(nw, 0, words).view(INT_VIEW[es])
                    flat = nonzero_1d(torch.ne(o_l, n_l))  # position in [changed words x lanes]
                    shift = lanes.bit_length() - 1  # lanes is 2, 4 or 8: shifts and masks, no integer division
                    idx = torch.gather(words, 0, flat >> shift).bitwise_left_shift_(shift)
                    idx.bitwise_or_(flat & (lanes - 1))
                    parts.append(idx.add_(lo) if lo else idx)
        e_lo = max(lo, split)
        if hi > e_lo:  # tail (or unaligned tensors): element by element
            parts.append(nonzero_1d(torch.ne(oi[e_lo:hi], ni[e_lo:hi])) + e_lo)
        idx = parts[0] if len(parts) == 1 else torch.cat(parts) if parts else oi.new_empty(0, dtype=torch.int64)
        vals = torch.gather(ni, 0, idx)
        if update and idx.numel():
            oi.scatter_(0, idx, vals)  # indices are distinct: scatter is exact (and the fastest write here)
        crc = None
        if with_crc and cpu and hi > lo:
            crc = crc32_bytes(_memview(new[lo:hi]))
        return idx, vals, crc

    res = parallel_map(one, n_chunks, threads=threads if cpu else 1)
    idx = torch.cat([r[0] for r in res]) if len(res) > 1 else res[0][0]
    vals = torch.cat([r[1] for r in res]) if len(res) > 1 else res[0][1]
    crc = None
    if with_crc:
        if not cpu:
            crc = crc32_tensor(new)
        elif nbytes == 0:
            crc = 0
        else:
            crc = combine_chunk_crcs([r[2] for r in res], nbytes, chunk_elems * es)
    return idx, vals.view(new.dtype), crc


# ----------------------------------------------------------------------------------------------------------------
# many changes: one boolean mask instead of indices
# ----------------------------------------------------------------------------------------------------------------


def sampled_density(old: Shaped[Tensor, " N"], new: Shaped[Tensor, " N"], *, samples: int = 1024) -> float:
    """Fraction of changed elements among ``samples`` evenly spaced ones: a cheap predictor of the density that
    only chooses between two exact code paths (it never affects what is encoded)."""
    n = old.numel()
    if n == 0:
        return 0.0
    step = max(1, n // samples)
    oi, ni = int_view(old)[::step], int_view(new)[::step]
    return float(torch.count_nonzero(torch.ne(oi, ni))) / oi.numel()


def pack_bits(mask: Tensor) -> Tensor:
    """One bit per element, LSB first (``ceil(n / 8)`` bytes): numpy's ``packbits`` when available."""
    n = mask.numel()
    if mask.device.type == "cpu" and _np is not None:
        return torch.from_numpy(_np.packbits(mask.numpy(), bitorder="little"))
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
    return (padded.view(-1, 8) * weights).sum(1, dtype=torch.uint8)


def unpack_bits(bits: Tensor, n: int) -> Tensor:
    """Inverse of :func:`pack_bits`: a bool mask of ``n`` elements (padding bits are the caller's to check)."""
    if bits.device.type == "cpu" and _np is not None:
        return torch.from_numpy(_np.unpackbits(bits.numpy(), count=n, bitorder="little").view(_np.bool_))
    out = ((bits.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8, device=bits.device)) & 1).bool().reshape(-1)
    return out[:n]


def masked_take(t: Tensor, mask: Tensor) -> Tensor:
    """``t[mask]`` for a flat tensor. On the CPU numpy's ``compress``: measured 8x ``masked_select`` and 4x
    boolean indexing for a random half-set mask (both branch on every element)."""
    if t.device.type == "cpu" and _np is not None:
        return torch.from_numpy(_np.compress(mask.numpy(), t.detach().numpy()))
    return t.masked_select(mask)


def masked_put(t: Tensor, mask: Tensor, values: Tensor) -> None:
    """``t[mask] = values`` in place for a flat tensor (values in order of the True entries): the index search of
    :func:`nonzero_1d` then a scatter (measured 3x numpy's boolean assignment, 6x ``masked_scatter_``)."""
    if t.device.type == "cpu":
        t.scatter_(0, nonzero_1d(mask), values)
    else:
        t.masked_scatter_(mask, values)


# ----------------------------------------------------------------------------------------------------------------
# native delta (numba): compare, gap16 positions, values and the snapshot update in one pass
# ----------------------------------------------------------------------------------------------------------------

ESC = 0xFFFF
"""gap16 escape: a gap of at least this travels in the int64 list after the uint16 gaps."""

SUB_BYTES = 256 << 10
"""The native loops' CRC step: each piece of this many bytes is checksummed right after it was compared or written,
while it is still in the core's cache (the loops would otherwise read every tensor twice from memory)."""

_HAVE_NATIVE: bool | None = None
_CRC_FN = 0  # address of ISA-L's crc32_gzip_refl(uint32 crc, const uint8 *buf, uint64 len): zlib's CRC-32, chained
_NATIVE = None  # the module of compiled loops, imported on first use
_SCRATCH = threading.local()  # per worker thread: the loop's output buffers, reused across chunks and calls
_NP_INT = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _find_crc_fn() -> int:
    """The address of ISA-L's ``crc32_gzip_refl`` in the ``isal`` package's extension (exported there), or 0."""
    try:
        import isal.isal_zlib as iz

        fn = ctypes.CDLL(iz.__file__).crc32_gzip_refl
    except (ImportError, OSError, AttributeError):
        return 0
    return int(ctypes.cast(fn, ctypes.c_void_p).value or 0)


def native_available() -> bool:
    """Whether the compiled loops run (:func:`native_delta`, :func:`gap16_apply`): ``numba``, numpy and ISA-L's
    CRC (``isal``) present, ``RLBLOCKS_SYNC_NATIVE`` not ``0`` (read at each call, so that both paths can be
    compared in one process). Otherwise the torch path gives the same packets and weights."""
    global _HAVE_NATIVE, _CRC_FN
    if os.environ.get("RLBLOCKS_SYNC_NATIVE", "1") == "0" or _np is None:
        return False
    if _HAVE_NATIVE is None:
        _CRC_FN = _find_crc_fn() if importlib.util.find_spec("numba") is not None else 0
        _HAVE_NATIVE = _CRC_FN != 0
    return _HAVE_NATIVE


def _native():
    """:mod:`rlblocks.sync._native`, the compiled loops (imported, hence numba loaded, on first use only)."""
    global _NATIVE
    if _NATIVE is None:
        from rlblocks.sync import _native as mod

        _NATIVE = mod
    return _NATIVE


def _sub_words() -> int:
    """:data:`SUB_BYTES` in int64 words, a multiple of the encoder's 64-word groups."""
    return max(64, SUB_BYTES // 8 // 64 * 64)


def gap16_check(gaps: UInt16[_np.ndarray, " K"], wide: Int64[_np.ndarray, " W"], n: int) -> tuple[int, bool, bool]:
    """Checks a gap16 position list for a tensor of ``n`` elements in one pass: returns ``(escapes, increasing,
    in_range)``, the number of escaped gaps (0xFFFF) met, whether every gap is >= 1 (positions strictly
    increasing, the first >= 0) and whether the last position is < ``n``. Gaps are the uint16 list, ``wide`` the
    true values of the escaped ones in order (a missing one counts as 1)."""
    esc, bad, over = _native().check(gaps, wide, n)
    return int(esc), not bad, not over


def gap16_apply(
    target: Shaped[_np.ndarray, " N"],
    gaps: UInt16[_np.ndarray, " K"],
    wide: Int64[_np.ndarray, " W"],
    values: Shaped[_np.ndarray, " K"],
    saved: Shaped[_np.ndarray, " K"] | None = None,
    *,
    with_crc: bool = False,
) -> tuple[int, int] | None:
    """``target[p_q] = values[q]`` at the positions ``p_q = sum(gaps[:q + 1]) - 1`` (escaped gaps from ``wide``),
    in place, in one pass; with ``saved`` the old ``target[p_q]`` are kept there first (to undo: apply them back).
    With ``with_crc`` returns ``(crc_before, crc_after)``, the CRC-32 of ``target``'s bytes before and after the
    writes, each piece of :data:`SUB_BYTES` checksummed around its own writes while it is in cache. ``target``,
    ``values`` and ``saved`` are integer views of one element size. Every position is checked before its write;
    an invalid list raises ``ValueError``, having written nothing where ``saved`` is given (the writes made are
    undone from it) and where the list passed :func:`gap16_check` first (it then finds nothing). Only where
    :func:`native_available`."""
    keep = saved is not None
    sub = max(1, SUB_BYTES // target.itemsize)
    before, after, ok = _native().apply(target, gaps, wide, values, saved if keep else values, keep,
                                        _CRC_FN if with_crc else 0, sub)
    if not ok:
        raise ValueError(f"gap16_apply: the position list is not valid for {target.shape[0]} elements "
                         "(see gap16_check)")
    return (int(before), int(after)) if with_crc else None


def _addr(a) -> int:
    return a.ctypes.data if a.size else 0


def _i64(xs) -> _np.ndarray:
    return _np.array(list(xs), _np.int64)


def gap16_check_many(lists: Sequence[tuple]) -> list[tuple[int, bool, bool]]:
    """:func:`gap16_check` of many ``(gaps, wide, n)`` in one compiled call (no Python between them). ``wide``
    must be 8-byte aligned and ``gaps`` 2-byte aligned."""
    if not lists:
        return []
    out = _np.zeros((len(lists), 3), _np.int64)
    gaps, wide, ns = zip(*lists)
    _native().check_batch(_i64(map(_addr, gaps)), _i64(g.size for g in gaps), _i64(map(_addr, wide)),
                          _i64(w.size for w in wide), _i64(ns), out)
    return [(int(e), not b, not o) for e, b, o in out]


def gap16_apply_many(
    records: Sequence[tuple], *, keep: bool, with_crc: bool
) -> tuple[list[tuple[int, int] | None], list]:
    """:func:`gap16_apply` of many ``(target, gaps, wide, values)`` of one element size in one compiled call.
    Returns the ``(crc_before, crc_after)`` of each (None without ``with_crc``; None too for a record whose
    position list is invalid: with ``keep`` its target is left unchanged, without it the lists must have passed
    :func:`gap16_check_many`) and, with ``keep``, each one's saved old values (else Nones). The two steps are
    also separate (:func:`gap16_apply_prepare`, :func:`gap16_apply_run`), so that only the compiled call need
    run on a worker thread."""
    return gap16_apply_run(gap16_apply_prepare(records, keep=keep), with_crc=with_crc)


@dataclass
class ApplyBatch:
    """A batch of gap16 records as the compiled call takes them (``records`` keeps the arrays alive)."""

    records: Sequence[tuple]
    args: tuple
    saved: list
    keep: bool


def gap16_apply_prepare(records: Sequence[tuple], *, keep: bool, addrs: Sequence[tuple] | None = None) -> ApplyBatch:
    """The addresses and sizes of ``records`` and, with ``keep``, the arrays their old values go to (views of one
    buffer; see :func:`gap16_apply_many`): Python work, on any thread. ``addrs``: each record's
    ``(target, gaps, wide, values)`` addresses where the caller has them (0 for an empty array), else taken here
    (numpy's address lookup is the slow part of this step)."""
    if not records:
        return ApplyBatch(records, (), [], keep)
    targets, gaps, wide, values = zip(*records)
    like = targets[0][:0]
    a = _np.array(addrs if addrs is not None else [tuple(map(_addr, r)) for r in records], _np.int64).reshape(-1, 4)
    ks = _i64(g.size for g in gaps)
    vaddrs = a[:, 3].copy()
    if keep:
        offs = _np.zeros(len(records), _np.int64)
        offs[1:] = _np.cumsum(ks)[:-1]
        buf = _np.empty(max(1, int(ks.sum())), like.dtype)
        saved = [buf[o : o + k] for o, k in zip(offs.tolist(), ks.tolist())]
        saddrs = buf.ctypes.data + offs * like.itemsize
    else:
        saved, saddrs = list(values), vaddrs  # read-only without keep: the values' own addresses
    args = (a[:, 0].copy(), _i64(t.size for t in targets), like, a[:, 1].copy(), ks, a[:, 2].copy(),
            _i64(w.size for w in wide), vaddrs, saddrs, keep)
    return ApplyBatch(records, args, saved, keep)


def gap16_apply_run(batch: ApplyBatch, *, with_crc: bool) -> tuple[list[tuple[int, int] | None], list]:
    """The compiled call over a prepared batch; returns what :func:`gap16_apply_many` returns."""
    if not batch.records:
        return [], []
    out = _np.zeros((len(batch.records), 3), _np.int64)
    _native().apply_batch(*batch.args, _CRC_FN if with_crc else 0, max(1, SUB_BYTES // batch.args[2].itemsize), out)
    crcs = [(int(b), int(a)) if with_crc and ok else None for b, a, ok in out]
    return crcs, batch.saved if batch.keep else [None] * len(batch.records)


def _scratch(n: int, es: int, nwide: int | None = None) -> tuple:
    """This thread's output buffers for ``n`` elements of size ``es`` (``nwide`` escaped gaps at most): reused
    across calls, so that only the pages a call writes are ever touched (a sparse delta writes few)."""
    nwide = n // ESC + 2 if nwide is None else nwide
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None:
        bufs = _SCRATCH.bufs = {}
    cur = bufs.get(es)
    if cur is None or cur[0].shape[0] < n or cur[2].shape[0] < nwide:
        n = max(n, 0 if cur is None else cur[0].shape[0])
        nwide = max(nwide, 0 if cur is None else cur[2].shape[0])
        cur = bufs[es] = (_np.empty(n, _np.uint16), _np.empty(n, _NP_INT[es]), _np.empty(nwide, _np.int64))
    return cur


def native_delta_batch(
    pairs: Sequence[tuple[Tensor, Tensor]], *, update: bool = False, with_crc: bool = False
) -> list[NativeDelta | None]:
    """:func:`native_delta` of many (old, new) pairs of flat, contiguous, 8-byte aligned CPU tensors of one
    element size, in one compiled call on this thread (no per-tensor Python between them: a model's hundreds
    of small tensors cost the loop's time, not the interpreter's). A pair whose sampled density says a mask
    would be smaller gets None and is left unchanged (see ``delta_batch``); the caller encodes it otherwise.
    The three steps are also separate (:func:`delta_batch_prepare`, :func:`delta_batch_run`,
    :func:`delta_batch_results`), so that only the compiled call need run on a worker thread."""
    batch = delta_batch_prepare(pairs)
    return delta_batch_results(batch, delta_batch_run(batch, update=update, with_crc=with_crc))


@dataclass
class DeltaBatch:
    """A batch's inputs as the compiled call takes them: the tensors' addresses and sizes (``pairs`` keeps the
    tensors alive while the call may run)."""

    pairs: Sequence[tuple[Tensor, Tensor]]
    olds: Any
    news: Any
    ns: Any
    es: int


def delta_batch_prepare(pairs: Sequence[tuple[Tensor, Tensor]]) -> DeltaBatch:
    """The addresses and sizes of ``pairs`` (see :func:`native_delta_batch`; contiguous tensors of any shape):
    Python work, on any thread."""
    es = pairs[0][0].element_size() if pairs else 1
    return DeltaBatch(pairs, _i64(o.data_ptr() for o, _ in pairs), _i64(n.data_ptr() for _, n in pairs),
                      _np.array([o.numel() for o, _ in pairs], _np.int64), es)


def delta_batch_run(batch: DeltaBatch, *, update: bool, with_crc: bool) -> tuple:
    """The compiled call over ``batch`` into this thread's scratch buffers, then one copy of each output's used
    prefix: ``(out, offs, woffs, gaps, vals, wide, with_crc)`` (``out[t] = (count, escapes, last, crc,
    dense)``; tensor ``t``'s outputs start at ``offs[t]`` / ``woffs[t]``)."""
    ns = batch.ns
    offs = _np.zeros(len(ns), _np.int64)  # written by the loop: each tensor's outputs follow the previous one's
    woffs = _np.zeros(len(ns), _np.int64)
    out = _np.zeros((len(ns), 5), _np.int64)
    if not len(ns):
        return out, offs, woffs, None, None, None, with_crc
    gaps, vals, wide = _scratch(int(ns.sum()), batch.es, int((ns // ESC + 2).sum()))
    _native().delta_batch(batch.olds, batch.news, ns, vals[:0], gaps, vals, wide, offs, woffs, update,
                          _CRC_FN if with_crc else 0, _sub_words(), out)
    k_all, w_all = int(out[:, 0].sum()), int(out[:, 1].sum())
    return out, offs, woffs, gaps[:k_all].copy(), vals[:k_all].copy(), wide[:w_all].copy(), with_crc


def delta_batch_results(batch: DeltaBatch, ran: tuple) -> list[NativeDelta | None]:
    """Each pair's :class:`NativeDelta` (views of the copied outputs; None: left for the mask path)."""
    out, offs, woffs, gaps, vals, wide, with_crc = ran
    if gaps is None:
        return []
    g_all, v_all, w_all = torch.from_numpy(gaps), torch.from_numpy(vals), torch.from_numpy(wide)
    res: list[NativeDelta | None] = []
    for (k, w, _last, crc, dense), n, lo, wlo in zip(out.tolist(), batch.ns.tolist(), offs.tolist(), woffs.tolist()):
        res.append(None if dense else NativeDelta(n, k, g_all[lo : lo + k], w_all[wlo : wlo + w], v_all[lo : lo + k],
                                                  crc if with_crc else None))
    return res


@dataclass
class NativeDelta:
    """What :func:`native_delta` found: ``count`` changed elements of ``numel``; their ``gap16`` positions
    (``gaps`` uint16 and ``wide`` int64, exactly the bytes of the ``gap16`` encoding of :mod:`rlblocks.sync.delta`),
    their new bit patterns ``values`` (the tensor's integer view dtype) and the CRC-32 of the new tensor (or None)."""

    numel: int
    count: int
    gaps: Tensor
    wide: Tensor
    values: Tensor
    crc: int | None

    @property
    def nwide(self) -> int:
        return int(self.wide.numel())

    def gap16_bytes(self) -> Tensor:
        """The ``gap16`` record's positions: the uint16 gaps, then the escaped gaps' int64 values."""
        parts = [self.gaps.view(torch.uint8)] + ([self.wide.view(torch.uint8)] if self.nwide else [])
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def indices(self) -> Int64[Tensor, " K"]:
        """Ascending int64 positions of the changed elements (from the gaps)."""
        g = self.gaps.to(torch.int64)
        if self.nwide:
            g.index_copy_(0, (g == ESC).nonzero().squeeze(1), self.wide)
        return torch.cumsum(g, 0) - 1


def native_delta(
    old: Shaped[Tensor, " N"],
    new: Shaped[Tensor, " N"],
    *,
    update: bool = False,
    with_crc: bool = False,
    threads: int | None = None,
) -> NativeDelta | None:
    """The changed elements of two flat contiguous CPU tensors of one dtype as gap16 positions and new values, in
    one compiled pass per chunk (see "Native delta" in the module docstring); ``update`` writes them into ``old``.

    Returns None where the native loop does not apply (numba not installed or turned off, not on the CPU, a tensor
    not 8-byte aligned): the caller then takes the torch path (:func:`changed_indices`), which gives the same
    result.
    """
    if old.dtype != new.dtype or old.shape != new.shape or old.dim() != 1:
        raise ArgumentError(f"native_delta: expected two flat tensors of one dtype, got {old.shape} {new.shape}")
    if not native_available() or old.device.type != "cpu" or new.device.type != "cpu":
        return None
    if old.data_ptr() % 8 or new.data_ptr() % 8 or not (old.is_contiguous() and new.is_contiguous()):
        return None
    es, n = old.element_size(), old.numel()
    lanes = 8 // es
    oi, ni = old.view(INT_VIEW[es]), new.view(INT_VIEW[es])
    chunk = max(lanes, CHUNK_BYTES // es // lanes * lanes)
    n_chunks = max(1, -(-n // chunk))
    kern = _native().delta_chunk
    sub = _sub_words()

    def one(c: int) -> tuple:
        lo, hi = c * chunk, min(n, (c + 1) * chunk)
        if hi <= lo:
            return 0, 0, -1, -1, None, None, None, 0 if with_crc else None
        ol, nl = oi[lo:hi].numpy(), ni[lo:hi].numpy()
        nw = (hi - lo) // lanes * lanes
        gaps, vals, wide = _scratch(chunk, es)
        k, w, last, crc = kern(ol[:nw].view(_np.int64), nl[:nw].view(_np.int64), ol, nl, gaps, vals, wide, update,
                               _CRC_FN if with_crc else 0, sub)
        first = -1 if not k else int(gaps[0]) - 1 if gaps[0] < ESC else int(wide[0]) - 1
        crc = int(crc) if with_crc else None
        return k, w, first, last, gaps[:k].copy(), vals[:k].copy(), wide[:w].copy(), crc

    res = parallel_map(one, n_chunks, threads=threads)
    gap_parts, val_parts, wide_parts = [], [], []
    prev = -1  # absolute position of the last change so far
    for c, (k, _w, first, last, gaps, vals, wide, _crc) in enumerate(res):
        if not k:
            continue
        lo = c * chunk
        true0 = lo + first - prev
        if first + 1 >= ESC:  # the loop listed its own first gap (relative to lo - 1) as escaped: replaced below
            wide = wide[1:]
        if true0 >= ESC:
            gaps[0] = ESC
            wide = _np.concatenate([_np.array([true0], _np.int64), wide])
        else:
            gaps[0] = true0
        gap_parts.append(gaps)
        val_parts.append(vals)
        if wide.shape[0]:
            wide_parts.append(wide)
        prev = lo + last
    count = sum(r[0] for r in res)

    def cat(parts: list, dtype) -> Tensor:
        return torch.from_numpy(_np.concatenate(parts) if len(parts) > 1 else parts[0] if parts
                                else _np.empty(0, dtype))

    crc = None
    if with_crc:
        crc = 0 if n == 0 else combine_chunk_crcs([r[7] for r in res], n * es, chunk * es)
    return NativeDelta(n, count, cat(gap_parts, _np.uint16), cat(wide_parts, _np.int64),
                       cat(val_parts, _NP_INT[es]), crc)
