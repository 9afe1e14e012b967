"""Delta weight sync: send only the elements whose bit pattern changed since the last sent version.

Comparison is dtype-blind: each tensor is viewed as the integer type of its element size (uint8 / int16 / int32 /
int64) and compared bit for bit, so NaN payloads, -0.0 vs +0.0 and subnormals are all seen as changes and carried
exactly. Round trips are bit-exact for every dtype. Per tensor, the positions of the changed elements use whichever
encoding is smallest (``none``, ``gap16``, ``idx32``, ``bitmap``, ``dense``), followed by the new bit patterns; each
tensor record carries the CRC-32 of the new tensor and of the state the delta applies to, the packet its
``version`` and ``base_version`` (``None`` for a full packet, which resets the chain), and
:meth:`DeltaPacket.to_bytes` ends with a CRC-32 of every preceding byte. zstd payload compression is optional.

:meth:`DeltaDecoder.apply` validates the whole packet (chain position, names, shapes, dtypes, encodings, index
ranges, value sizes, base checksums) before it writes anything, then writes in place and checks every touched
tensor's new CRC; on a mismatch it restores the old values, so a refused packet leaves the weights unchanged.
Byte order is the host's (little-endian on every supported platform).

Speed: a few passes over the model bytes and none per element in Python (the kernels are in
:mod:`rlblocks.sync._bits`; a GPU snapshot compares on the GPU). The packet format byte by byte and the cost of
each encoding: ``docs/sync.md`` (Delta packets).

One file: the packet (:class:`DeltaPacket`), its encoder and its decoder share the encodings and the chain rule,
and each side is tested against the other; splitting them would put one format's reading and writing in two places.
"""

from __future__ import annotations

import ctypes
import json
import math
import struct
import sys
import warnings
from collections.abc import Iterable, Mapping
from concurrent.futures import as_completed
from dataclasses import dataclass, field

import torch
from jaxtyping import UInt8
from torch import Tensor

from rlblocks._checks import check_bool, check_version
from rlblocks.errors import ArgumentError, DeltaError
from rlblocks.sync._bits import (
    _NP_INT,
    INT_VIEW,
    ApplyBatch,
    NativeDelta,
    changed_indices,
    crc32_bytes,
    crc32_tensor,
    delta_batch_prepare,
    delta_batch_results,
    delta_batch_run,
    gap16_apply,
    gap16_apply_prepare,
    gap16_apply_run,
    gap16_check,
    gap16_check_many,
    int_view,
    masked_put,
    masked_take,
    native_available,
    native_delta,
    num_threads,
    pack_bits,
    parallel_map,
    sampled_density,
    sync_pool,
    unpack_bits,
)
from rlblocks.sync.buckets import dtype_from_name, dtype_name

_ESC = 0xFFFF
_MAGIC = b"RLBD"
_FORMAT = 1
_FLAG_ZSTD = 1
_ENCODINGS = ("none", "gap16", "idx32", "idx64", "bitmap", "dense")

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("rlblocks.sync.delta assumes a little-endian host")



# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------


def _u8(t: Tensor) -> Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _to_cpu_u8_bytes(t: Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    n = t.numel() * t.element_size()
    return ctypes.string_at(t.data_ptr(), n) if n else b""


def _snapshot(t: Tensor, device: torch.device | None) -> Tensor:
    """The encoder's copy of ``t``: on ``device`` if given, else on the CPU, page-locked when CUDA is present
    (so device-to-host copies into it are fast and asynchronous)."""
    if device is not None and device.type != "cpu":
        return t.detach().to(device, copy=True).contiguous()
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=torch.cuda.is_available())
    out.copy_(t.detach())
    return out


def _encode_gap16(gaps: Tensor, nwide: int) -> Tensor:
    # The int16 cast keeps the low 16 bits (two's complement), i.e. the uint16 word; gaps are >= 1 and clamped to
    # the escape 0xFFFF, whose true value follows in the int64 list.
    out = gaps.clamp(max=_ESC).to(torch.int16).view(torch.uint8)
    if nwide:
        out = torch.cat([out, gaps.index_select(0, (gaps >= _ESC).nonzero().squeeze(1)).view(torch.uint8)])
    return out


def _decode_gap16(pos: Tensor, k: int, nwide: int) -> Tensor:
    if pos.numel() != 2 * k + 8 * nwide:
        raise DeltaError(f"gap16 positions: expected {2 * k + 8 * nwide} bytes, got {pos.numel()}")
    words = pos[: 2 * k].clone().view(torch.int16).to(torch.int64) & 0xFFFF
    esc = words == _ESC
    found = int(torch.count_nonzero(esc))
    if found != nwide:
        raise DeltaError(f"gap16 positions: expected {nwide} escapes, found {found}")
    if nwide:
        words.index_copy_(0, esc.nonzero().squeeze(1), pos[2 * k :].clone().view(torch.int64))
    if k and int(words.min()) < 1:  # every gap >= 1 <=> strictly increasing positions, the first one >= 0
        raise DeltaError("gap16 positions: are not strictly increasing")
    return torch.cumsum(words, 0) - 1


def _encode_bitmap(idx: Tensor, n: int) -> Tensor:
    """One bit per element (LSB first) from ascending indices; bits of one byte are distinct, so adding = or-ing."""
    out = torch.zeros(math.ceil(n / 8), dtype=torch.int32, device=idx.device)
    out.index_add_(0, idx >> 3, torch.bitwise_left_shift(1, idx & 7).to(torch.int32))
    return out.to(torch.uint8)


def _decode_bitmap(pos: Tensor, n: int) -> Tensor:
    """Boolean mask of the changed elements (padding bits must be clear)."""
    if pos.numel() != math.ceil(n / 8):
        raise DeltaError(f"bitmap positions: expected {math.ceil(n / 8)} bytes, got {pos.numel()}")
    if n % 8 and int(pos[-1]) >> (n % 8):
        raise DeltaError("bitmap positions: padding bits are set")
    return unpack_bits(pos, n)


# ----------------------------------------------------------------------------------------------------------------
# packet
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class DeltaTensor:
    """One tensor's record in a :class:`DeltaPacket` (see the module docstring for the encodings).

    ``positions`` and ``values`` are 1-D ``uint8`` CPU tensors; ``count`` is the number of changed elements
    (``numel`` for ``dense``); ``nwide`` the number of escaped gaps (``gap16`` only).
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    encoding: str
    count: int
    positions: UInt8[Tensor, "P"]
    values: UInt8[Tensor, "V"]
    crc: int
    base_crc: int | None = None
    nwide: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class DeltaPacket:
    """A set of per-tensor deltas taking weights from ``base_version`` to ``version``.

    ``base_version is None`` marks a *full* packet (every tensor ``dense``), which any decoder accepts and which
    restarts the chain. ``compression`` is ``"zstd"`` or ``"none"`` (applied to the payload by :meth:`to_bytes`).
    """

    version: int
    base_version: int | None
    tensors: list[DeltaTensor]
    compression: str = "none"
    _wire: bytes | None = field(default=None, repr=False, compare=False)

    @property
    def is_full(self) -> bool:
        return self.base_version is None

    @property
    def changed(self) -> int:
        """Changed elements over all tensors (``numel`` of every tensor for a full packet)."""
        return sum(t.count for t in self.tensors)

    def to_bytes(self) -> bytes:
        """Serialise: ``b"RLBD" | u8 format | u8 flags | u32 header_len | JSON header | pad | payload | u32 crc32``.

        The payload is every tensor's positions then values, each padded to 8 bytes (so they can be viewed as
        wider integers in place), optionally zstd-compressed as a whole; the trailing CRC-32 covers every byte
        before it. ``len(packet.to_bytes())`` is the wire size.
        """
        if self._wire is not None:
            return self._wire
        recs, chunks, off = [], [], 0
        for t in self.tensors:
            rec = {
                "name": t.name,
                "dtype": dtype_name(t.dtype),
                "shape": list(t.shape),
                "enc": t.encoding,
                "count": t.count,
                "nwide": t.nwide,
                "crc": t.crc,
                "base_crc": t.base_crc,
            }
            for key, seg in (("pos", t.positions), ("val", t.values)):
                seg = _u8(seg)
                n = seg.numel()
                pad = (-n) % 8
                rec[key] = [off, n]
                chunks.append(seg)
                if pad:
                    chunks.append(torch.zeros(pad, dtype=torch.uint8))
                off += n + pad
            recs.append(rec)
        payload = _to_cpu_u8_bytes(torch.cat(chunks)) if chunks else b""
        flags = 0
        if self.compression == "zstd":
            zstd = _zstd("compression='zstd'")
            comp = zstd.ZstdCompressor(level=3).compress(payload)
            if len(comp) < len(payload):
                payload, flags = comp, _FLAG_ZSTD
        header = json.dumps(
            {"version": self.version, "base_version": self.base_version, "payload_bytes": off, "tensors": recs},
            separators=(",", ":"),
        ).encode()
        header += b" " * ((-(len(header) + 10)) % 8)  # payload starts 8-byte aligned
        body = _MAGIC + struct.pack("<BBI", _FORMAT, flags, len(header)) + header + payload
        return body + struct.pack("<I", crc32_bytes(body))

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> DeltaPacket:
        """Parse :meth:`to_bytes` output; raises :class:`DeltaError` on any corruption (checksum first)."""
        data = bytes(data)
        if len(data) < 14:
            raise DeltaError(f"packet: {len(data)} bytes is shorter than the smallest packet")
        body, (crc,) = memoryview(data)[:-4], struct.unpack("<I", data[-4:])  # a view: no copy of the body
        if crc32_bytes(body) != crc:
            raise DeltaError("packet: checksum mismatch (corrupted or truncated bytes); refused")
        if body[:4] != _MAGIC:
            raise DeltaError(f"packet: bad magic {body[:4]!r}")
        fmt, flags, hlen = struct.unpack("<BBI", body[4:10])
        if fmt != _FORMAT:
            raise DeltaError(f"packet: format {fmt} is not supported (expected {_FORMAT})")
        try:
            h = json.loads(bytes(body[10 : 10 + hlen]).decode())
            raw = body[10 + hlen :]
            if flags & _FLAG_ZSTD:
                raw = _zstd("a zstd-compressed packet").ZstdDecompressor().decompress(
                    raw, max_output_size=int(h["payload_bytes"])
                )
            if len(raw) != int(h["payload_bytes"]):
                raise DeltaError(f"packet: payload is {len(raw)} bytes, header says {h['payload_bytes']}")
            payload = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            tensors = []
            for r in h["tensors"]:
                (po, pn), (vo, vn) = r["pos"], r["val"]
                if min(po, pn, vo, vn) < 0 or po + pn > len(raw) or vo + vn > len(raw):
                    raise DeltaError(f"packet: segments of {r['name']!r} lie outside the payload")
                tensors.append(
                    DeltaTensor(
                        name=str(r["name"]),
                        dtype=dtype_from_name(r["dtype"]),
                        shape=tuple(int(s) for s in r["shape"]),
                        encoding=str(r["enc"]),
                        count=int(r["count"]),
                        positions=payload[po : po + pn],
                        values=payload[vo : vo + vn],
                        crc=int(r["crc"]),
                        base_crc=None if r["base_crc"] is None else int(r["base_crc"]),
                        nwide=int(r["nwide"]),
                    )
                )
            base = h["base_version"]
            return cls(
                int(h["version"]),
                None if base is None else int(base),
                tensors,
                "zstd" if flags & _FLAG_ZSTD else "none",
                _wire=data,
            )
        except DeltaError:
            raise
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise DeltaError(f"packet: malformed header ({e})") from e


def _zstd(what: str):
    try:
        import zstandard
    except ImportError:
        raise DeltaError(f"{what} needs the 'zstandard' package (pip install zstandard)") from None
    return zstandard


def _zstd_available() -> bool:
    try:
        import zstandard  # noqa: F401
    except ImportError:
        return False
    return True


# ----------------------------------------------------------------------------------------------------------------
# encoder / decoder
# ----------------------------------------------------------------------------------------------------------------


def _named(named_tensors: Iterable[tuple[str, Tensor]] | Mapping[str, Tensor], arg: str) -> dict[str, Tensor]:
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    out: dict[str, Tensor] = {}
    for name, t in items:
        if not isinstance(t, Tensor):
            raise ArgumentError(f"{arg}[{name!r}]: expected a torch.Tensor, got {type(t).__name__}")
        if t.element_size() not in INT_VIEW:
            raise ArgumentError(f"{arg}[{name!r}]: dtype {t.dtype} has an unsupported element size")
        if name in out:
            raise ArgumentError(f"{arg}: duplicate name {name!r}")
        out[name] = t
    return out


def _check_same_layout(ref: Mapping[str, Tensor], got: Mapping[str, Tensor], arg: str) -> None:
    missing = [n for n in ref if n not in got]
    extra = [n for n in got if n not in ref]
    if missing or extra:
        raise ArgumentError(f"{arg}: names differ from the snapshot (missing {missing[:3]}, unexpected {extra[:3]})")
    for n, t in got.items():
        r = ref[n]
        if t.shape != r.shape or t.dtype != r.dtype:
            raise ArgumentError(f"{arg}[{n!r}]: expected {list(r.shape)} {r.dtype}, got {list(t.shape)} {t.dtype}")


class DeltaEncoder:
    """Keeps the last-sent state and turns new weights into :class:`DeltaPacket` s.

    ``DeltaEncoder(named_tensors, version=0)`` snapshots the state the receiver is assumed to hold as ``version``
    (a CPU copy, page-locked when CUDA is present); ``base_crc`` checks in the decoder catch a wrong assumption.
    ``compress``: ``False`` (default), ``True`` (zstd; needs ``zstandard``) or ``"auto"`` (zstd if installed).

    A delta is never larger than a full packet (a tensor whose positions would cost more than its unchanged values
    travels ``dense``), but when nearly every element changes it is not smaller either, and it still depends on the
    receiver holding the exact base. :meth:`encode` says so: when the delta's payload is not smaller than a full
    packet's, ``full_fallback=True`` sends a full packet (``base_version=None``: accepted whatever the receiver
    holds) instead, and ``False`` (default) sends the delta and emits a ``RuntimeWarning``. Either case is counted
    in :meth:`stats` (``not_smaller``, ``full_fallbacks``). Sizes compared are uncompressed payload bytes.

    ``device``: where the snapshot lives (default: CPU, page-locked when CUDA is present). ``device="cuda"`` keeps
    it on the GPU (one more model copy in GPU memory) so that the comparison runs there.
    """

    def __init__(
        self,
        named_tensors: Iterable[tuple[str, Tensor]] | Mapping[str, Tensor],
        *,
        version: int = 0,
        compress: bool | str = False,
        full_fallback: bool = False,
        device: torch.device | str | None = None,
    ):
        if not (isinstance(compress, bool) or compress == "auto"):  # 1 == True, but 1 is no flag
            raise ArgumentError(f"compress: expected False, True or 'auto', got {compress!r}")
        if not isinstance(full_fallback, bool):
            raise ArgumentError(f"full_fallback: expected a bool, got {full_fallback!r}")
        self.full_fallback = full_fallback
        self._stats = {"deltas": 0, "fulls": 0, "not_smaller": 0, "full_fallbacks": 0}
        if compress is True:
            _zstd("compress=True")
        self.compression = "zstd" if compress is True or (compress == "auto" and _zstd_available()) else "none"
        self.version = check_version("version", version)
        self.device = None if device is None else torch.device(device)
        self._snap = {n: _snapshot(t, self.device) for n, t in _named(named_tensors, "named_tensors").items()}
        self._crc = {n: crc32_tensor(t) for n, t in self._snap.items()}

    def stats(self) -> dict[str, int]:
        """Counters since construction: ``deltas`` and ``fulls`` returned, ``not_smaller`` (deltas whose payload
        was not smaller than a full packet's), ``full_fallbacks`` (of those, sent as a full packet instead)."""
        return dict(self._stats)

    def full(
        self,
        named_tensors: Iterable[tuple[str, Tensor]] | Mapping[str, Tensor],
        *,
        version: int,
        allow_rollback: bool = False,
    ) -> DeltaPacket:
        """A full packet (every tensor dense, ``base_version=None``) for ``version``; the snapshot becomes it.

        ``version`` must be greater than the last encoded one (a decoder refuses an older full packet too);
        ``allow_rollback=True`` allows going back on purpose.
        """
        version = check_version("version", version)
        allow_rollback = check_bool("allow_rollback", allow_rollback)
        if version <= self.version and not allow_rollback:
            raise ArgumentError(
                f"version: expected > {self.version} (the last encoded version), got {version}; "
                "pass allow_rollback=True to go back on purpose"
            )
        named = _named(named_tensors, "named_tensors")
        _check_same_layout(self._snap, named, "named_tensors")
        for n, t in named.items():
            self._snap[n].copy_(t.detach())
            self._crc[n] = crc32_tensor(self._snap[n])
        self.version = version
        self._stats["fulls"] += 1
        return self._full_from_snapshot()

    def _full_from_snapshot(self) -> DeltaPacket:
        out = [
            DeltaTensor(n, snap.dtype, tuple(snap.shape), "dense", snap.numel(), _empty(), _u8(snap).cpu().clone(),
                        self._crc[n], None)
            for n, snap in self._snap.items()
        ]
        return DeltaPacket(self.version, None, out, self.compression)

    def encode(
        self, named_tensors: Iterable[tuple[str, Tensor]] | Mapping[str, Tensor], *, version: int
    ) -> DeltaPacket:
        """Delta from the snapshot (``base_version = self.version``) to ``named_tensors`` as ``version``.

        ``version`` must be greater than the current one. Names, shapes and dtypes must equal the snapshot's.
        The snapshot is updated in place (only the changed elements are written). When the delta is not smaller
        than a full packet, see the class docstring (``full_fallback``).
        """
        version = check_version("version", version)
        if version <= self.version:
            raise ArgumentError(f"version: expected > {self.version} (the last encoded version), got {version}")
        named = _named(named_tensors, "named_tensors")
        _check_same_layout(self._snap, named, "named_tensors")
        out = self._encode_all(list(named.items()))
        base, self.version = self.version, version
        delta_bytes = sum(_pad8(t.positions.numel()) + _pad8(t.values.numel()) for t in out)
        full_bytes = sum(_pad8(t.numel * t.dtype.itemsize) for t in out)
        if out and delta_bytes >= full_bytes:
            self._stats["not_smaller"] += 1
            if self.full_fallback:
                self._stats["full_fallbacks"] += 1
                self._stats["fulls"] += 1
                return self._full_from_snapshot()
            warnings.warn(
                f"DeltaEncoder: the delta to version {version} carries {delta_bytes} payload bytes, not fewer than a "
                f"full packet ({full_bytes}); DeltaEncoder(..., full_fallback=True) sends a full packet instead",
                RuntimeWarning,
                stacklevel=2,  # the caller of encode
            )
        self._stats["deltas"] += 1
        return DeltaPacket(version, base, out, self.compression)

    def _encode_all(self, items: list[tuple[str, Tensor]]) -> list[DeltaTensor]:
        """Records for ``items``, in order.

        With a CPU snapshot and the compiled loops (:func:`~rlblocks.sync._bits.native_available`), the tensors
        go in batches (:func:`_batches`), one compiled call per batch and the batches in parallel on the sync
        pool: most of a model's tensors are smaller than one chunk, and one Python call per tensor would cost more
        than its comparison. A tensor holding more than 1 / (2 * threads) of the bytes (or not
        8-byte aligned) is encoded on its own, its chunks in parallel. Without the compiled loops, one task per
        tensor on the pool. On other snapshot devices, one tensor after another."""
        threads = num_threads()
        if self.device is not None and self.device.type != "cpu":
            return [self._encode_one(n, t) for n, t in items]
        size = {i: self._snap[n].numel() * self._snap[n].element_size() for i, (n, _) in enumerate(items)}
        total = sum(size.values())
        out: list[DeltaTensor | None] = [None] * len(items)
        native = native_available()
        rest = []
        staged: set[int] = set()  # tensors that need a staging copy (another device, not contiguous)
        for i, (name, t) in enumerate(items):
            snap = self._snap[name]
            staged_fresh = t.device != snap.device or not t.is_contiguous()  # a new allocation: aligned
            if staged_fresh:
                staged.add(i)
            if 2 * threads * size[i] > total or (native and (snap.data_ptr() % 8 or
                                                              (not staged_fresh and t.data_ptr() % 8))):
                out[i] = self._encode_one(name, t)
            elif size[i]:
                rest.append(i)
            else:
                out[i] = self._encode_one(name, t, threads=1)
        if not native:
            rest.sort(key=lambda i: -size[i])
            done = parallel_map(lambda j: self._encode_one(*items[rest[j]], threads=1), len(rest), threads=threads)
            for i, rec in zip(rest, done):
                out[i] = rec
            return out  # type: ignore[return-value]
        groups: list[list[int]] = []
        for es in sorted({self._snap[items[i][0]].element_size() for i in rest}):
            groups += _batches([i for i in rest if self._snap[items[i][0]].element_size() == es], size, threads)

        # The workers run only the compiled calls (and the mask path of tensors they find dense); this thread
        # prepares each batch before handing it over and builds the records of each finished batch while the
        # others still run, so no worker waits on the interpreter between its batches.
        def prepare(g: int):  # contiguous tensors: the compiled call reads them through their addresses
            names = [items[i][0] for i in groups[g]]
            news = [self._staged(n, items[i][1]) if i in staged else items[i][1] for n, i in zip(names, groups[g])]
            return names, news, delta_batch_prepare([(self._snap[n], x) for n, x in zip(names, news)])

        def run(g: int, prepared) -> tuple:
            names, news, b = prepared if prepared is not None else prepare(g)  # staged on the worker (CUDA weights)
            ran = delta_batch_run(b, update=True, with_crc=True)
            dense = {j: self._encode_one(names[j], news[j], threads=1) for j in range(len(names)) if ran[0][j, 4]}
            return names, b, ran, dense

        def records(g: int, done: tuple) -> None:
            names, b, ran, dense = done
            for j, (i, nat) in enumerate(zip(groups[g], delta_batch_results(b, ran))):
                n = names[j]
                out[i] = dense[j] if nat is None else self._record(n, self._snap[n], self._crc[n], nat.count,
                                                                   nat.nwide, nat.crc, nat)

        if threads <= 1 or len(groups) <= 1:
            for g in range(len(groups)):
                records(g, run(g, None))
            return out  # type: ignore[return-value]
        # prepared before any is handed over: a worker woken while this thread still ran Python would wait on it
        prepared = [None if staged.intersection(groups[g]) else prepare(g) for g in range(len(groups))]
        pool = sync_pool(threads)
        futures = {pool.submit(run, g, p): g for g, p in enumerate(prepared)}
        error: BaseException | None = None
        for fut in as_completed(futures):  # every batch is waited for before an error is raised
            if error is None and fut.exception() is None:
                records(futures[fut], fut.result())
            elif error is None:
                error = fut.exception()
        if error is not None:
            raise error
        return out  # type: ignore[return-value]

    def _staged(self, name: str, t: Tensor) -> Tensor:
        """``t`` contiguous on the snapshot's device (CUDA weights, CPU snapshot: one copy into page-locked
        memory)."""
        snap = self._snap[name]
        new = t.detach()
        if new.device != snap.device:
            staged = torch.empty_like(snap, pin_memory=snap.is_pinned())
            staged.copy_(new)
            new = staged
        return new.contiguous()

    def _encode_one(self, name: str, t: Tensor, threads: int | None = None) -> DeltaTensor:
        """One tensor's record; ``threads`` for its chunked passes (1 inside a task of the sync pool)."""
        snap = self._snap[name]
        new = self._staged(name, t)
        n = snap.numel()
        base_crc = self._crc[name]
        if n >= 4096 and 16 * sampled_density(_flat(snap), _flat(new)) > 1:
            rec = self._encode_many(name, snap, new, base_crc, threads)
            if rec is not None:
                return rec
        # One compiled pass over old and new where numba is installed (gap16 positions, values, snapshot update
        # and CRC at once: rlblocks.sync._bits.native_delta); else the torch pass (int64 words, threaded chunks):
        # changed indices, their new values, the snapshot brought up to date, and the CRC of the new contents.
        # Both give the same record, byte for byte.
        nat = native_delta(_flat(snap), _flat(new), update=True, with_crc=True, threads=threads)
        if nat is not None:
            return self._record(name, snap, base_crc, nat.count, nat.nwide, nat.crc, nat)
        idx, vals, crc = changed_indices(_flat(snap), _flat(new), update=True, with_crc=True, threads=threads)
        k = idx.numel()
        gaps = torch.diff(idx, prepend=idx.new_full((1,), -1))
        wide = int(torch.count_nonzero(gaps >= _ESC))
        return self._record(name, snap, base_crc, k, wide, crc, (idx, vals, gaps))

    def _record(self, name: str, snap: Tensor, base_crc: int, k: int, wide: int, crc: int, found) -> DeltaTensor:
        """The smallest record for ``k`` changes (``wide`` escaped gaps), from a :class:`NativeDelta` or the torch
        path's ``(idx, vals, gaps)``; the snapshot already holds the new contents (CRC ``crc``)."""
        n, esize = snap.numel(), snap.element_size()
        if k == 0:
            return DeltaTensor(name, snap.dtype, tuple(snap.shape), "none", 0, _empty(), _empty(), base_crc, base_crc)
        idx_enc = "idx32" if n <= 2**31 - 1 else "idx64"
        costs = {
            "gap16": 2 * k + 8 * wide,
            idx_enc: (4 if idx_enc == "idx32" else 8) * k,
            "bitmap": math.ceil(n / 8),
            "dense": (n - k) * esize,
        }
        enc = min(costs, key=costs.__getitem__)
        native = isinstance(found, NativeDelta)
        if enc == "dense":
            values, positions, k = _u8(snap).clone(), _empty(), n
        elif native and enc == "gap16":
            values, positions = found.values.view(torch.uint8), found.gap16_bytes()
        else:
            idx, vals, gaps = (found.indices(), found.values, None) if native else found
            values = vals.reshape(-1).view(torch.uint8)
            if enc == "bitmap":
                positions = _encode_bitmap(idx, n)
            elif enc == "gap16":
                positions = _encode_gap16(gaps, wide)
            elif enc == "idx32":
                positions = idx.to(torch.int32).view(torch.uint8)
            else:
                positions = idx.view(torch.uint8)
        self._crc[name] = crc
        return DeltaTensor(name, snap.dtype, tuple(snap.shape), enc, k, positions.cpu(), values.cpu(), crc, base_crc,
                           wide if enc == "gap16" else 0)


    def _encode_many(
        self, name: str, snap: Tensor, new: Tensor, base_crc: int, threads: int | None
    ) -> DeltaTensor | None:
        """Many changes (a bitmap or dense record will win): one element mask instead of indices. Gives the same
        record as the index path, or None when an index encoding could still win (the caller then takes that)."""
        n, esize = snap.numel(), snap.element_size()
        so, nw = int_view(snap), int_view(new)
        mask = torch.ne(so, nw)
        k = int(torch.count_nonzero(mask))
        bitmap_cost = math.ceil(n / 8)
        if 2 * k <= bitmap_cost:  # gap16 (2k + 8w) or idx32 (4k) may tie or win: their costs need the indices
            return None
        crc = crc32_tensor(new, threads=threads)
        if (n - k) * esize < bitmap_cost:  # the same choice as min() over the costs (bitmap first on a tie)
            so.copy_(nw)
            self._crc[name] = crc
            return DeltaTensor(name, snap.dtype, tuple(snap.shape), "dense", n, _empty(), _u8(snap).cpu().clone(),
                               crc, base_crc)
        values = masked_take(nw, mask).view(torch.uint8)
        positions = pack_bits(mask)
        so.copy_(nw)
        self._crc[name] = crc
        return DeltaTensor(name, snap.dtype, tuple(snap.shape), "bitmap", k, positions.cpu(), values.cpu(), crc,
                           base_crc)


def _flat(t: Tensor) -> Tensor:
    return t.reshape(-1)


def _empty() -> Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _pad8(n: int) -> int:
    return n + (-n) % 8


_BATCH_BYTES = 128 << 20
"""At most this many tensor bytes per compiled call of the encoder and decoder (unless one tensor is larger): it
bounds the encoder's scratch (one uint16 gap and one value per element of a batch, of which a sparse delta touches
only its changes)."""


def _batches(idx: list[int], size: dict[int, int], threads: int) -> list[list[int]]:
    """``idx`` in batches balanced by ``size``, largest first each into the lightest batch: ``2 * threads`` of
    them (two per sync thread: a thread that finishes early takes another), more where a batch would exceed
    :data:`_BATCH_BYTES`, each batch in ascending order."""
    if not idx:
        return []
    total = sum(size[i] for i in idx)
    loads = [0] * min(len(idx), max(2 * threads, -(-total // _BATCH_BYTES)))
    parts: list[list[int]] = [[] for _ in loads]
    for i in sorted(idx, key=lambda i: -size[i]):
        j = loads.index(min(loads))
        parts[j].append(i)
        loads[j] += size[i]
    return [sorted(p) for p in parts if p]


def _not_the_base(name: str, ours: int, base: int) -> DeltaError:
    return DeltaError(f"packet[{name!r}]: our tensor (CRC {ours:#010x}) is not this delta's base (CRC {base:#010x}); "
                      "refused, weights unchanged")


def _wrong_result(name: str, got: int, want: int) -> DeltaError:
    return DeltaError(f"packet: {name!r} has CRC {got:#010x} after applying, expected {want:#010x}; all writes undone")


@dataclass
class _Gap16:
    """A gap16 record as numpy views for the compiled loops: uint16 gaps, int64 escaped gaps, values, the
    length ``n`` of its tensor and the tensor's integer view (``target``)."""

    gaps: object
    wide: object
    values: object
    n: int
    target: object = None
    addrs: tuple = ()  # (target, gaps, wide, values) addresses, 0 for an empty array


def _gap16_plan(rec: DeltaTensor, n: int, esize: int, target, target_addr: int) -> _Gap16:
    """A gap16 record's lists as aligned numpy views, sizes checked, for ``target`` (``n`` elements); the
    positions themselves are checked by the compiled loops (:func:`_gap16_error` names the fault: the same checks
    and messages as :func:`_decode_gap16`, without building the int64 positions). Every record of a packet comes
    through here on one thread, so the cheapest calls are used: numpy slices (torch's cost ~5x more) and torch's
    address lookup (numpy's costs ~20x more)."""
    k, nwide = rec.count, rec.nwide
    if rec.positions.numel() != 2 * k + 8 * nwide:
        raise DeltaError(f"gap16 positions: expected {2 * k + 8 * nwide} bytes, got {rec.positions.numel()}")
    raw = rec.positions.numpy()
    p_addr, v_addr = rec.positions.data_ptr(), rec.values.data_ptr()  # torch's address lookup: 20x numpy's
    gaps = raw[: 2 * k].view("uint16") if p_addr % 2 == 0 else raw[: 2 * k].copy().view("uint16")
    wide = raw[2 * k :].copy().view("int64")
    vals = rec.values.numpy()
    values = (vals if v_addr % esize == 0 else vals.copy()).view(_NP_INT[esize])
    addrs = (target_addr, p_addr if p_addr % 2 == 0 else gaps.ctypes.data, wide.ctypes.data if nwide else 0,
             v_addr if v_addr % esize == 0 else values.ctypes.data)
    return _Gap16(gaps, wide, values, n, target, addrs)


def _gap16_error(rec: DeltaTensor, escapes: int, increasing: bool, in_range: bool, n: int) -> DeltaError | None:
    """The error of a gap16 record whose check (``gap16_check``) gave these results, or None."""
    if escapes != rec.nwide:
        return DeltaError(f"gap16 positions: expected {rec.nwide} escapes, found {escapes}")
    if not increasing:
        return DeltaError("gap16 positions: are not strictly increasing")
    if not in_range:
        return DeltaError(f"packet[{rec.name!r}]: positions out of range [0, {n})")
    return None


class DeltaDecoder:
    """Applies :class:`DeltaPacket` s in place to ``named_tensors`` (e.g. ``model.state_dict()``), in chain order.

    ``version`` is the version the tensors hold now. Tensors must be contiguous; they may live on any device
    (positions and values are moved there). After a successful :meth:`apply`, ``self.version`` is the packet's.
    """

    def __init__(self, named_tensors: Iterable[tuple[str, Tensor]] | Mapping[str, Tensor], *, version: int = 0):
        self.tensors = _named(named_tensors, "named_tensors")
        for n, t in self.tensors.items():
            if not t.is_contiguous():
                raise ArgumentError(f"named_tensors[{n!r}]: expected a contiguous tensor (updated in place)")
        self.version = check_version("version", version)
        self._crc: dict[str, int] = {}
        self._views: dict[str, tuple[int, int, object]] = {}  # name: (address, numel, integer numpy view)
        if native_available():  # made once here rather than in the first apply
            for n, t in self.tensors.items():
                if t.device.type == "cpu":
                    self._view(n, t)

    def apply(self, packet: DeltaPacket, *, verify: bool = True, allow_rollback: bool = False) -> int:
        """Apply ``packet`` in place; returns the new version. Raises :class:`DeltaError`, weights unchanged, if:

        * it is a delta whose ``base_version`` is not ``self.version`` (out of order, replayed or skipped);
        * it is a full packet whose ``version`` is not greater than ``self.version`` (an old full packet would roll
          the weights back), unless ``allow_rollback=True``;
        * its tensors differ from ours in name, shape or dtype, or a record is malformed (encoding, counts,
          indices out of range or not strictly increasing, value sizes);
        * a ``base_crc`` differs from the CRC of our tensor (our state is not the delta's base);
        * ``verify`` and a tensor's CRC after writing differs from ``crc`` (the writes are undone).

        A newer full packet is accepted at any point and restarts the chain at its ``version``.

        ``verify=True`` (default) computes the base CRC from each tensor's *current contents*, so a local edit of
        the weights since the last apply (or a wrong initial state) is refused, and checks every written tensor's
        CRC afterwards. ``verify=False`` skips both passes over the tensors: the base is then checked against the
        CRC this decoder recorded when it last wrote the tensor (it catches a packet meant for another base, not
        edits made behind the decoder's back); the packet's own checksums still hold.
        """
        if not isinstance(packet, DeltaPacket):
            raise ArgumentError(f"packet: expected a DeltaPacket, got {type(packet).__name__}")
        verify = check_bool("verify", verify)  # a truthy "no" would verify; a falsy 0 would skip the CRCs
        allow_rollback = check_bool("allow_rollback", allow_rollback)
        if packet.is_full and packet.version <= self.version and not allow_rollback:
            raise DeltaError(
                f"packet: full packet of version {packet.version} is not newer than the current version "
                f"{self.version}; refused, weights unchanged (allow_rollback=True goes back on purpose)"
            )
        if not packet.is_full and packet.base_version != self.version:
            raise DeltaError(
                f"packet: base_version {packet.base_version} does not match the current version {self.version} "
                f"(packet version {packet.version}); refused, weights unchanged"
            )
        if not packet.is_full and packet.version <= packet.base_version:
            raise DeltaError(f"packet: version {packet.version} is not after base_version {packet.base_version}")
        names = [t.name for t in packet.tensors]
        if sorted(names) != sorted(self.tensors) or len(set(names)) != len(names):
            missing = sorted(set(self.tensors) - set(names))[:3]
            extra = sorted(set(names) - set(self.tensors))[:3]
            raise DeltaError(f"packet: tensor names differ (missing {missing}, unexpected {extra}); refused")
        recs = packet.tensors
        # CPU tensors: records are checked and written in parallel on the sync pool (each task's own passes on one
        # thread; gap16 records in batches, one compiled call per batch), errors taken in packet order; elsewhere
        # one after another.
        pooled = num_threads() > 1 and len(recs) > 1 and all(t.device.type == "cpu" for t in self.tensors.values())
        threads, inner = (num_threads(), 1) if pooled else (1, None)

        def validate(i: int) -> tuple[object, BaseException | None]:
            try:
                return self._validate(recs[i], packet.is_full, verify, inner), None
            except BaseException as e:
                return None, e

        # Records whose check is a few Python lines (gap16 for the compiled loops, which check its positions and
        # its base CRC as they write) are checked here: on the pool they would only contend for the interpreter
        # (and a worker back from a compiled call would wait for it); those with a pass over a tensor (a CRC, a
        # bitmap, indices) go to the pool.
        native = native_available()
        heavy = [i for i, r in enumerate(recs) if not self._light_check(r, packet.is_full, verify, native)]
        on_pool = dict(zip(heavy, parallel_map(lambda j: validate(heavy[j]), len(heavy), threads=threads)))
        checked = [on_pool[i] if i in on_pool else validate(i) for i in range(len(recs))]
        plans = [p for p, _ in checked]
        errors: list[BaseException | None] = [e for _, e in checked]
        gap16 = {i for i, p in enumerate(plans) if isinstance(p, _Gap16)}
        batches = self._gap16_batches(recs, sorted(gap16), threads)
        if not verify or any(e is not None for e in errors):
            # gap16 positions are checked as they are written, and with verify an invalid list's writes are
            # undone from the saved old values; without verify nothing is saved, so they are checked first (and
            # beside another record's fault, so that the first fault in packet order is the one reported)
            found = parallel_map(lambda b: gap16_check_many([(plans[i].gaps, plans[i].wide, plans[i].n)
                                                             for i in batches[b]]), len(batches), threads=threads)
            for part, res in zip(batches, found):
                for i, (escapes, increasing, in_range) in zip(part, res):
                    errors[i] = errors[i] or _gap16_error(recs[i], escapes, increasing, in_range, plans[i].n)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        tasks = [[i] for i in range(len(recs)) if i not in gap16] + batches
        # the compiled calls' inputs are prepared here, before any task starts: a worker that needed the
        # interpreter while this thread ran Python would wait for it (the switch interval, 5 ms)
        prepared = {j: self._prepare_gap16(plans, part, verify) for j, part in enumerate(tasks) if part[0] in gap16}

        def write(j: int) -> tuple[list, list[tuple[int, int, BaseException]]]:
            undo: list = []
            # (-1: invalid positions / 0: not the base / 1: other, record, error)
            failed: list[tuple[int, int, BaseException]] = []
            part = tasks[j]
            try:
                if part[0] in gap16:
                    self._write_gap16(recs, plans, part, verify, undo, failed, prepared[j])
                else:
                    self._write(recs[part[0]], plans[part[0]], packet.is_full, verify, undo, inner)
            except BaseException as e:  # every task finishes; the caller undoes all of them, then raises
                failed.append((1, part[0], e))
            return undo, failed

        return self._finish(packet, parallel_map(write, len(tasks), threads=threads), errors)

    def _finish(self, packet: DeltaPacket, done: list[tuple[list, list]], errors: list) -> int:
        """After every write task: undo them all and raise if a record was faulty or a write failed, else record
        the new CRCs and version. A record's own faults come first (its positions included, found as they were
        written), in packet order, as if found before any write; then a packet that was never for these weights,
        before any failed write; each kind in packet order."""
        failed = [f for _, fs in done for f in fs]
        for kind, i, e in failed:
            if kind < 0:
                errors[i] = errors[i] or e
        first = next((e for e in errors if e is not None), None)
        if first is not None or failed:
            for undo, _ in reversed(done):
                for restore in reversed(undo):
                    restore()
            raise first if first is not None else min(failed, key=lambda f: f[:2])[2]
        for rec in packet.tensors:
            self._crc[rec.name] = rec.crc
        self.version = packet.version
        return self.version

    @staticmethod
    def _prepare_gap16(plans: list, part: list[int], verify: bool) -> ApplyBatch:
        """The compiled call's inputs for the gap16 records ``part`` (old values kept with ``verify``)."""
        return gap16_apply_prepare([(plans[i].target, plans[i].gaps, plans[i].wide, plans[i].values) for i in part],
                                   keep=verify, addrs=[plans[i].addrs for i in part])

    def _gap16_batches(self, recs: list[DeltaTensor], idx: list[int], threads: int) -> list[list[int]]:
        """The gap16 records ``idx`` (written by the compiled loops) in batches of one element size
        (:func:`_batches`, by tensor bytes: each record's work is its tensor's CRCs and its writes)."""
        size = {i: self.tensors[recs[i].name].numel() * recs[i].dtype.itemsize for i in idx}
        out: list[list[int]] = []
        for es in sorted({recs[i].dtype.itemsize for i in idx}):
            out += _batches([i for i in idx if recs[i].dtype.itemsize == es], size, threads)
        return out

    def _write_gap16(self, recs: list[DeltaTensor], plans: list, part: list[int], verify: bool, undo: list,
                     failed: list, prepared: ApplyBatch) -> None:
        """Writes a batch of gap16 records in one compiled call (its inputs ``prepared`` by the caller);
        with ``verify`` each tensor's CRC is taken piece by piece before and after its writes (while the piece is in
        cache: one read of the tensor from memory), the old values are kept for undo, and invalid positions (their
        writes undone already) and a base or result mismatch are listed in ``failed``."""
        targets = [plans[i].target for i in part]
        crcs, saved = gap16_apply_run(prepared, with_crc=verify)
        if not verify:
            return
        for t, i, old, found in zip(targets, part, saved, crcs):
            p, rec = plans[i], recs[i]
            if found is None:  # an invalid position list: its writes were undone as it stopped
                escapes, increasing, in_range = gap16_check(p.gaps, p.wide, p.n)
                failed.append((-1, i, _gap16_error(rec, escapes, increasing, in_range, p.n)
                               or DeltaError(f"packet[{rec.name!r}]: gap16 positions invalid")))
                continue
            before, after = found
            undo.append(lambda t=t, p=p, old=old: gap16_apply(t, p.gaps, p.wide, old))
            if before != rec.base_crc:
                failed.append((0, i, _not_the_base(rec.name, before, rec.base_crc)))
            elif after != rec.crc:
                failed.append((1, i, _wrong_result(rec.name, after, rec.crc)))

    def _write(self, rec: DeltaTensor, plan, full: bool, verify: bool, undo: list, threads: int | None) -> None:
        """Writes one validated record (not gap16 on the CPU: :meth:`_write_gap16`) into its tensor, appending to
        ``undo`` a callable per write that restores the old contents; with ``verify`` (deltas) checks the CRC
        after writing."""
        if rec.encoding == "none":
            return
        t = self.tensors[rec.name]
        target = int_view(t.detach())
        vals = rec.values.clone().view(target.dtype).to(target.device)
        if rec.encoding == "dense":
            if not full and verify:
                old = target.clone()
                undo.append(lambda: target.copy_(old))
            target.copy_(vals)
        elif rec.encoding == "bitmap":
            mask = plan.to(target.device)
            if verify:  # old values are kept only while a later CRC failure could need them
                old = masked_take(target, mask)
                undo.append(lambda: masked_put(target, mask, old))
            masked_put(target, mask, vals)
        else:  # gather / scatter: the fastest CPU index kernels (indices validated distinct)
            idx = plan.to(target.device)
            if verify:
                old = torch.gather(target, 0, idx)
                undo.append(lambda: target.scatter_(0, idx, old))
            target.scatter_(0, idx, vals)
        if verify and not full:
            got = crc32_tensor(t, threads=threads)
            if got != rec.crc:
                raise _wrong_result(rec.name, got, rec.crc)

    def _view(self, name: str, t: Tensor) -> tuple[object, int]:
        """``t``'s flat integer numpy view and its address, the view kept between packets while ``t`` keeps its
        address and size (a parameter whose ``.data`` was replaced gets a new one)."""
        addr, n = t.data_ptr(), t.numel()
        got = self._views.get(name)
        if got is None or got[0] != addr or got[1] != n:
            got = self._views[name] = (addr, n, int_view(t.detach()).numpy())
        return got[2], addr

    def _light_check(self, rec: DeltaTensor, full: bool, verify: bool, native: bool) -> bool:
        """Whether :meth:`_validate` of ``rec`` makes no pass over a tensor: a gap16 record for the compiled loops
        (its base CRC is taken as it is written), or a record whose base CRC is not recomputed (``verify`` off,
        or a full packet) and whose positions need no decoding."""
        if rec.encoding == "gap16" and native and self.tensors[rec.name].device.type == "cpu":
            return True
        return rec.encoding == "none" and (full or not verify)

    def _validate(self, rec: DeltaTensor, full: bool, verify: bool, threads: int | None):
        """Checks one record against our tensor without writing; returns what :meth:`_write` needs: None, the
        bitmap mask, the int64 indices, or a :class:`_Gap16` (gap16 on the CPU with the compiled loops: its
        positions checked and decoded as they are written, its base CRC checked there; without ``verify``, its
        positions checked in one pass first)."""
        t = self.tensors[rec.name]
        where = f"packet[{rec.name!r}]"
        if not t.is_contiguous():  # made so in place since (a transpose_): its elements are not where positions say
            raise DeltaError(f"{where}: our tensor is no longer contiguous; refused")
        if rec.dtype != t.dtype or tuple(rec.shape) != tuple(t.shape):
            raise DeltaError(f"{where}: {list(rec.shape)} {rec.dtype} does not match ours {list(t.shape)} {t.dtype}")
        if rec.encoding not in _ENCODINGS or (full and rec.encoding != "dense"):
            raise DeltaError(f"{where}: encoding {rec.encoding!r} not allowed here")
        n, esize = t.numel(), t.element_size()
        if not full:
            if rec.base_crc is None:
                raise DeltaError(f"{where}: a delta record must carry base_crc")
        native = rec.encoding == "gap16" and t.device.type == "cpu" and native_available()
        if not full and not (native and verify):
            mine = crc32_tensor(t, threads=threads) if verify else self._crc.get(rec.name)
            if mine is not None and mine != rec.base_crc:
                raise _not_the_base(rec.name, mine, rec.base_crc)
        k = rec.count
        pos = rec.positions
        idx = None
        if rec.encoding == "none":
            if k or pos.numel() or rec.values.numel() or rec.crc != rec.base_crc:
                raise DeltaError(f"{where}: 'none' record must be empty and keep its CRC")
            return None
        if rec.encoding == "dense":
            if k != n or rec.values.numel() != n * esize or pos.numel():
                raise DeltaError(f"{where}: dense record must carry {n * esize} value bytes, got {rec.values.numel()}")
            if crc32_tensor(rec.values, threads=threads) != rec.crc:
                raise DeltaError(f"{where}: values fail their CRC; refused")
            return None
        if not 0 < k <= n or rec.values.numel() != k * esize:
            raise DeltaError(f"{where}: count {k} / value bytes {rec.values.numel()} inconsistent with {n} elements")
        if rec.encoding == "gap16" and native:
            return _gap16_plan(rec, n, esize, *self._view(rec.name, t))
        if rec.encoding == "gap16":
            idx = _decode_gap16(pos, k, rec.nwide)
        elif rec.encoding in ("idx32", "idx64"):
            w = 4 if rec.encoding == "idx32" else 8
            if pos.numel() != w * k:
                raise DeltaError(f"{where}: expected {w * k} index bytes, got {pos.numel()}")
            idx = pos.clone().view(torch.int32 if w == 4 else torch.int64).to(torch.int64)
        else:
            mask = _decode_bitmap(pos, n)
            marked = int(torch.count_nonzero(mask))
            if marked != k:
                raise DeltaError(f"{where}: bitmap marks {marked} elements, count says {k}")
            return mask
        if idx.numel() != k or (k and (int(idx[0]) < 0 or int(idx[-1]) >= n)):
            raise DeltaError(f"{where}: positions out of range [0, {n})")
        if rec.encoding != "gap16" and k > 1 and not bool((idx[1:] > idx[:-1]).all()):  # gap16: checked on gaps
            raise DeltaError(f"{where}: positions are not strictly increasing")
        return idx
