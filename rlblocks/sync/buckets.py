"""Buckets: many named tensors packed into one flat ``uint8`` buffer plus metadata.

Wire format
-----------
A bucket is ``buffer`` (a 1-D ``torch.uint8`` tensor) and ``metas``, one :class:`TensorMeta`
``{name, shape, dtype, offset}`` per tensor, in buffer order. Tensor ``i`` occupies the bytes
``buffer[offset_i : offset_i + numel_i * itemsize_i]`` in its native (little-endian) bit pattern, so a
round trip is bit-exact for every dtype (NaN payloads and -0.0 included).

* Offsets are multiples of :data:`ALIGN` (64 bytes), so every tensor can be returned as a *view* of the
  buffer (``view(dtype)`` needs the byte offset to be a multiple of the element size) and starts on a cache line.
* The buffer ends exactly at the end of its last tensor (no trailing padding).
* Layout is greedy and deterministic: a tensor goes into the current bucket if its aligned end fits in
  ``bucket_bytes``; otherwise the bucket is closed and a new one started. A tensor larger than ``bucket_bytes``
  travels alone in a bucket of its own. No tensor is ever dropped or split.
* Because the layout is a pure function of ``[(name, shape, dtype)]`` and ``bucket_bytes``
  (:func:`plan_buckets`), a receiver that knows the manifest can rebuild every bucket's metadata itself;
  :meth:`Bucket.metadata_bytes` serialises it anyway (JSON, dtype names spelled out, e.g. ``"bfloat16"``) so
  that it can travel ahead of the buffer.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from jaxtyping import UInt8
from torch import Tensor

from rlblocks._checks import check_int, check_optional_int
from rlblocks.errors import ArgumentError

ALIGN = 64
"""Byte alignment of every tensor inside a bucket buffer."""

_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)
_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Explicit, stable name of ``dtype`` used on the wire (``torch.bfloat16 -> "bfloat16"``)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ArgumentError(f"dtype: expected one of {sorted(_DTYPES)}, got {dtype}") from None


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ArgumentError(f"dtype: expected one of {sorted(_DTYPES)}, got {name!r}") from None


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _dim(x: object, where: str) -> int:
    """A dimension or offset read from metadata: a non-negative Python int (bools, floats and strings refused)."""
    if isinstance(x, bool) or not isinstance(x, int) or x < 0:
        raise ArgumentError(f"{where}: expected a non-negative int, got {x!r}")
    return x


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives in a bucket: ``name``, ``shape``, ``dtype`` and byte ``offset`` in the buffer.

    Checked on construction: ``name`` a string, every dimension and the offset non-negative ints (``2.0``, ``True``,
    ``"3"`` and ``-1`` are refused rather than truncated or reinterpreted), ``dtype`` one with a wire name.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ArgumentError(f"metadata: tensor name: expected a str, got {self.name!r}")
        if not isinstance(self.shape, (tuple, list)):
            raise ArgumentError(f"metadata[{self.name!r}].shape: expected a list of ints, got {self.shape!r}")
        shape = tuple(_dim(s, f"metadata[{self.name!r}].shape") for s in self.shape)
        object.__setattr__(self, "shape", shape)
        _dim(self.offset, f"metadata[{self.name!r}].offset")
        if not isinstance(self.dtype, torch.dtype):
            raise ArgumentError(f"metadata[{self.name!r}].dtype: expected a torch.dtype, got {self.dtype!r}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def to_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": dtype_name(self.dtype), "offset": self.offset}

    @classmethod
    def from_dict(cls, d: dict) -> TensorMeta:
        if not isinstance(d, dict) or not {"name", "shape", "dtype", "offset"} <= d.keys():
            raise ArgumentError(f"metadata: expected keys name, shape, dtype, offset, got {d!r:.200}")
        if not isinstance(d["dtype"], str):
            raise ArgumentError(f"metadata[{d['name']!r}].dtype: expected a dtype name, got {d['dtype']!r}")
        return cls(d["name"], d["shape"], dtype_from_name(d["dtype"]), d["offset"])


def check_layout(metas: Sequence[TensorMeta], nbytes: int, *, where: str = "metadata") -> None:
    """Refuse a bucket layout that cannot have come from :func:`plan_buckets`-style packing.

    Names unique; each tensor's offset a multiple of its element size (so it can be viewed in place) and its bytes
    inside ``[0, nbytes)``; no two tensors' byte ranges overlap (a write through one view would change another).
    Empty tensors occupy no bytes and never overlap.
    """
    seen: set[str] = set()
    spans = []
    for m in metas:
        if m.name in seen:
            raise ArgumentError(f"{where}: duplicate tensor name {m.name!r}")
        seen.add(m.name)
        if m.offset % m.dtype.itemsize or m.offset + m.nbytes > nbytes:
            raise ArgumentError(f"{where}: tensor {m.name!r} at offset {m.offset} does not fit a {nbytes}-byte buffer")
        if m.nbytes:
            spans.append((m.offset, m.offset + m.nbytes, m.name))
    spans.sort()
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):  # an overlap always shows between neighbours
        if start < end:
            raise ArgumentError(f"{where}: tensors {a!r} and {b!r} overlap (bytes {start}..{end})")


def tensor_spec(name: str, t: Tensor) -> TensorMeta:
    """``TensorMeta`` of ``t`` with offset 0 (the manifest entry used before layout)."""
    if not isinstance(t, Tensor):
        raise ArgumentError(f"named_tensors[{name!r}]: expected a torch.Tensor, got {type(t).__name__}")
    return TensorMeta(name, tuple(int(s) for s in t.shape), t.dtype, 0)


def plan_buckets(
    specs: Iterable[TensorMeta], *, bucket_bytes: int, direct_bytes: int | None = None
) -> list[list[TensorMeta]]:
    """Deterministic bucket layout of ``specs`` (their offsets are ignored): one list of placed metas per bucket.

    Greedy in order; offsets aligned to :data:`ALIGN`; a tensor with ``nbytes > bucket_bytes`` gets its own bucket.

    ``direct_bytes``: a tensor of at least this many bytes gets a bucket of its own *where it comes*, so that a
    sender can transmit the tensor itself without packing it; the smaller tensors around it keep filling the
    current shared bucket, which is emitted when the next one would overflow it (and at the end). Buckets are then
    not in manifest order, but every tensor still appears exactly once, and the layout is still a pure function of
    the specs and the two sizes (what a receiver derives from a manifest).
    """
    bucket_bytes = check_int("bucket_bytes", bucket_bytes, minimum=1)
    direct_bytes = check_optional_int("direct_bytes", direct_bytes, minimum=1)
    out: list[list[TensorMeta]] = []
    cur: list[TensorMeta] = []
    end = 0
    for s in specs:
        if direct_bytes is not None and s.nbytes >= direct_bytes:
            out.append([TensorMeta(s.name, s.shape, s.dtype, 0)])
            continue
        start = _align(end)
        if cur and start + s.nbytes > bucket_bytes:
            out.append(cur)
            cur, start = [], 0
        cur.append(TensorMeta(s.name, s.shape, s.dtype, start))
        end = start + s.nbytes
    if cur:
        out.append(cur)
    return out


def bucket_nbytes(metas: Sequence[TensorMeta]) -> int:
    """Buffer size of a bucket: end of its last tensor."""
    return max((m.offset + m.nbytes for m in metas), default=0)


@dataclass
class Bucket:
    """A flat ``uint8`` buffer holding several tensors, and where each one lives (see the module docstring)."""

    buffer: UInt8[Tensor, "N"]
    metas: list[TensorMeta]

    def metadata_bytes(self) -> bytes:
        """JSON ``{"nbytes": N, "tensors": [{name, shape, dtype, offset}, ...]}`` encoded as UTF-8."""
        return metadata_to_bytes(self.metas, nbytes=int(self.buffer.numel()))

    @classmethod
    def from_metadata(cls, meta: bytes, buffer: UInt8[Tensor, "N"]) -> Bucket:
        """Rebuild a bucket from :meth:`metadata_bytes` and its received buffer (checked against each other)."""
        nbytes, metas = metadata_from_bytes(meta)
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != nbytes:
            raise ArgumentError(
                f"buffer: expected a 1-D uint8 tensor of {nbytes} bytes, got {buffer.dtype} shape {list(buffer.shape)}"
            )
        return cls(buffer, metas)


def metadata_to_bytes(metas: Sequence[TensorMeta], *, nbytes: int | None = None) -> bytes:
    """Serialise bucket metadata (JSON, explicit dtype names). ``nbytes`` defaults to :func:`bucket_nbytes`."""
    n = bucket_nbytes(metas) if nbytes is None else nbytes
    return json.dumps({"nbytes": n, "tensors": [m.to_dict() for m in metas]}, separators=(",", ":")).encode()


def metadata_from_bytes(data: bytes) -> tuple[int, list[TensorMeta]]:
    """Inverse of :func:`metadata_to_bytes`: ``(nbytes, metas)``, checked by :func:`check_layout`."""
    try:
        d = json.loads(bytes(data).decode())
        nbytes, items = d["nbytes"], d["tensors"]
    except (ValueError, KeyError, TypeError) as e:
        raise ArgumentError(f"metadata: not valid bucket metadata ({e})") from e
    _dim(nbytes, "metadata.nbytes")
    if not isinstance(items, list):
        raise ArgumentError(f"metadata.tensors: expected a list, got {type(items).__name__}")
    metas = [TensorMeta.from_dict(x) for x in items]
    check_layout(metas, nbytes)
    return nbytes, metas


def pack_into(buffer: UInt8[Tensor, "N"], metas: Sequence[TensorMeta], tensors: Sequence[Tensor]) -> None:
    """Copy ``tensors`` into ``buffer`` at the places given by ``metas`` (any device, any strides)."""
    for m, t in zip(metas, tensors, strict=True):
        if m.nbytes:
            buffer[m.offset : m.offset + m.nbytes].view(m.dtype).view(m.shape).copy_(t)


def pack_buckets(
    named_tensors: Iterable[tuple[str, Tensor]],
    *,
    bucket_bytes: int,
    device: torch.device | str | None = None,
) -> Iterator[Bucket]:
    """Pack ``(name, tensor)`` pairs into buckets of at most ``bucket_bytes`` (except an oversize tensor, alone).

    Streams: at most one bucket's tensors are referenced at a time, so a generator such as ``full_tensors(model)``
    is consumed lazily. Each bucket gets a fresh buffer on ``device`` (default: the device of its first tensor).
    Names must be unique; every tensor appears exactly once, bit for bit.

    ``bucket_bytes`` and ``device`` are checked at the call, not at the first ``next()``: ``bucket_bytes`` a genuine
    int ``>= 1`` (``True`` or ``2.0`` raise ``ArgumentError``), ``device`` something ``torch.device`` reads.
    """
    bucket_bytes = check_int("bucket_bytes", bucket_bytes, minimum=1)
    if device is not None:
        try:
            device = torch.device(device)
        except (TypeError, RuntimeError, ValueError) as e:
            raise ArgumentError(f"device: expected a torch.device or a device string, got {device!r} ({e})") from None
    return _pack_buckets(named_tensors, bucket_bytes, device)


def _pack_buckets(named_tensors: Iterable[tuple[str, Tensor]], bucket_bytes: int,
                  device: torch.device | None) -> Iterator[Bucket]:
    seen: set[str] = set()
    cur_meta: list[TensorMeta] = []
    cur_t: list[Tensor] = []
    end = 0

    def flush() -> Bucket:
        dev = device if device is not None else cur_t[0].device
        buf = torch.empty(bucket_nbytes(cur_meta), dtype=torch.uint8, device=dev)
        pack_into(buf, cur_meta, cur_t)
        return Bucket(buf, list(cur_meta))

    for i, item in enumerate(named_tensors):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ArgumentError(f"named_tensors[{i}]: expected a (name, tensor) pair, got {type(item).__name__}")
        name, t = item
        if not isinstance(name, str):
            raise ArgumentError(
                f"named_tensors: expected (str, Tensor) pairs, got a "
                f"name of type {type(name).__name__}"
            )
        if name in seen:
            raise ArgumentError(f"named_tensors: duplicate name {name!r}")
        seen.add(name)
        spec = tensor_spec(name, t)
        dtype_name(spec.dtype)  # refuse dtypes without a wire name early
        start = _align(end)
        if cur_meta and start + spec.nbytes > bucket_bytes:
            yield flush()
            cur_meta, cur_t, start = [], [], 0
        cur_meta.append(TensorMeta(name, spec.shape, spec.dtype, start))
        cur_t.append(t)
        end = start + spec.nbytes
    if cur_meta:
        yield flush()


def unpack_bucket(bucket: Bucket) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of ``bucket`` as views of its buffer (no copy).

    The views share memory with ``bucket.buffer``: copy them (``load_state_dict`` does) before reusing the buffer.
    """
    buf = bucket.buffer
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise ArgumentError(f"bucket.buffer: expected a 1-D uint8 tensor, got {buf.dtype} shape {list(buf.shape)}")
    check_layout(bucket.metas, buf.numel(), where="bucket.metas")
    for m in bucket.metas:
        yield m.name, buf[m.offset : m.offset + m.nbytes].view(m.dtype).view(m.shape)
