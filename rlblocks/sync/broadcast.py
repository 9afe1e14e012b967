"""Full-weight broadcast between separately launched jobs (a trainer and one or more rollout engines).

Process group
-------------
:func:`init_sync_group` builds a process group that is *not* the default one and needs no shared torchrun world,
in the manner of vLLM's ``StatelessProcessGroup``: every member connects to a ``TCPStore`` served by rank 0
(``master_addr:master_port``), and a backend object (``ProcessGroupGloo``, or ``ProcessGroupNCCL`` on GPUs) is
constructed directly on a ``PrefixStore`` of it. ``torch.distributed.init_process_group`` is never called, so a
trainer that already lives in a torchrun world (and an engine with its own) can join such a group on the side.
Convention: the trainer is rank 0 and rollout job ``i`` with local rank ``j`` takes ``1 + offset_i + j``.

Handshake (``WeightSender.send`` / ``WeightReceiver.receive``)
--------------------------------------------------------------
1. ``src`` broadcasts a manifest: ``{version, bucket_bytes, tensors: [[name, shape, dtype], ...]}`` (JSON).
2. Every receiver checks it against what it expects (names, shapes and dtypes, e.g. taken from its own model) and
   posts a refusal reason in the store if it disagrees; then all ranks all-gather one status code each. Any
   refusal makes *every* rank raise :class:`SyncMismatchError` (the sender's message quotes the receivers' reasons)
   before a single weight byte moves.
3. Both sides derive the same bucket layout from the manifest (:func:`~rlblocks.sync.buckets.plan_buckets` with
   its ``bucket_bytes`` and ``direct_bytes``), so only raw ``uint8`` buffers follow, one broadcast per bucket.
4. After its last bucket each receiver all-gathers a final status, so ``send`` returns only once every receiver has
   consumed every tensor.

Every collective runs with the group timeout: a dead peer or a receiver that stops consuming makes the others raise
:class:`SyncError` within it instead of hanging.

One file: the sender and the receiver run the two halves of one handshake and derive the same bucket layout.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import AllgatherOptions, BroadcastOptions

from rlblocks._checks import check_bool, check_int, check_optional_int, check_version
from rlblocks.errors import ArgumentError, SyncError, SyncMismatchError
from rlblocks.sync.buckets import (
    Bucket,
    TensorMeta,
    bucket_nbytes,
    dtype_from_name,
    dtype_name,
    pack_into,
    plan_buckets,
    tensor_spec,
    unpack_bucket,
)


def tensor_to_bytes(t: Tensor) -> bytes:
    """Bytes of ``t``'s bit pattern (copied to CPU if needed). Uses the C buffer directly, no numpy."""
    t = t.detach().to("cpu").contiguous()
    n = t.numel() * t.element_size()
    return ctypes.string_at(t.data_ptr(), n) if n else b""


def bytes_to_tensor(data: bytes | bytearray | memoryview) -> Tensor:
    """A writable 1-D ``uint8`` CPU tensor holding a copy of ``data``."""
    if len(data) == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@dataclass
class SyncGroup:
    """A process group of its own between jobs (see :func:`init_sync_group`).

    ``backend`` is the raw c10d backend object; ``store`` the prefixed rendezvous store (also used to carry refusal
    reasons); ``device`` where communication buffers live (CPU for gloo, the current CUDA device for nccl).
    """

    rank: int
    world_size: int
    backend_name: str
    timeout: timedelta
    store: dist.Store
    backend: object
    device: torch.device
    _seq: int = field(default=0)
    _store_root: object = field(default=None, repr=False)  # keeps the TCPStore (rank 0: its server) alive

    def _fail(self, what: str, e: Exception) -> SyncError:
        return SyncError(
            f"sync group rank {self.rank}/{self.world_size}: {what} failed: a peer died, refused or did not answer "
            f"within the timeout ({self.timeout.total_seconds():.0f} s): {e}"
        )

    def next_seq(self) -> int:
        """Operation counter, advanced in lockstep on every rank (used to name store keys uniquely)."""
        self._seq += 1
        return self._seq

    def broadcast_async(self, tensor: Tensor, src: int) -> object:
        """Start an in-place broadcast of ``tensor`` from rank ``src``; pass the result to :meth:`wait`."""
        opts = BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = self.timeout
        try:
            return self.backend.broadcast([tensor], opts)
        except RuntimeError as e:
            raise self._fail(f"broadcast of {tensor.numel() * tensor.element_size()} bytes from rank {src}", e) from e

    def wait(self, work: object, what: str = "broadcast") -> None:
        """Wait for a collective started by :meth:`broadcast_async` (group timeout)."""
        try:
            work.wait()
        except RuntimeError as e:
            raise self._fail(what, e) from e

    def broadcast(self, tensor: Tensor, src: int) -> Tensor:
        """In-place broadcast of ``tensor`` from rank ``src`` (blocking, group timeout)."""
        what = f"broadcast of {tensor.numel() * tensor.element_size()} bytes from rank {src}"
        self.wait(self.broadcast_async(tensor, src), what)
        return tensor

    def broadcast_bytes(self, data: bytes | None, src: int) -> bytes:
        """Broadcast a byte string from ``src`` (``data`` is ignored elsewhere): its length first, then the bytes."""
        n = torch.tensor([len(data) if self.rank == src else 0], dtype=torch.int64, device=self.device)
        self.broadcast(n, src)
        size = int(n.item())
        if self.rank == src:
            buf = bytes_to_tensor(data).to(self.device)
        else:
            buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        if size:
            self.broadcast(buf, src)
        return data if self.rank == src else tensor_to_bytes(buf)

    def all_gather_int(self, value: int) -> list[int]:
        """Every rank's ``value`` (int64), in rank order."""
        inp = torch.tensor([value], dtype=torch.int64, device=self.device)
        out = [torch.empty_like(inp) for _ in range(self.world_size)]
        opts = AllgatherOptions()
        opts.timeout = self.timeout
        try:
            self.backend.allgather([out], [inp], opts).wait()
        except RuntimeError as e:
            raise self._fail("all-gather of status codes", e) from e
        return [int(o.item()) for o in out]

    def barrier(self) -> None:
        """Wait for every rank (an all-gather, so that it honours the group timeout)."""
        self.all_gather_int(0)

    def abort(self) -> None:
        """Tear the group down so that peers blocked in a collective fail at once instead of waiting the timeout."""
        for meth in ("abort", "shutdown"):
            fn = getattr(self.backend, meth, None)
            if fn is not None:
                try:
                    fn()
                    return
                except RuntimeError:
                    continue


def init_sync_group(
    *,
    master_addr: str,
    master_port: int,
    world_size: int,
    rank: int,
    backend: str = "gloo",
    timeout: float | timedelta = 60.0,
    group_name: str = "rlblocks-sync",
) -> SyncGroup:
    """Join (rank 0: create) a stateless process group of ``world_size`` members; the default group is untouched.

    Rank 0 serves the ``TCPStore`` at ``master_addr:master_port``; every rank, the server included, rendezvous
    through it under the prefix ``group_name``. ``timeout`` (seconds or ``timedelta``) bounds the rendezvous and
    every later collective. ``backend``: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors; each process must
    have selected its device with ``torch.cuda.set_device`` first).
    """
    if not isinstance(world_size, int) or world_size < 2:
        raise ArgumentError(f"world_size: expected an int >= 2, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ArgumentError(f"rank: expected an int in [0, {world_size}), got {rank!r}")
    if backend not in ("gloo", "nccl"):
        raise ArgumentError(f"backend: expected 'gloo' or 'nccl', got {backend!r}")
    if not isinstance(master_port, int) or not 0 < master_port < 65536:
        raise ArgumentError(f"master_port: expected an int in (0, 65536), got {master_port!r}")
    td = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    if td.total_seconds() <= 0:
        raise ArgumentError(f"timeout: expected a positive duration, got {timeout!r}")
    try:
        store = dist.TCPStore(master_addr, master_port, world_size, rank == 0, timeout=td)
    except (RuntimeError, OSError) as e:
        raise SyncError(f"rank {rank}: could not reach the rendezvous store at {master_addr}:{master_port}: {e}") from e
    pstore = dist.PrefixStore(f"{group_name}/", store)
    try:
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(pstore, rank, world_size, td)
            device = torch.device("cpu")
        else:
            if not torch.cuda.is_available() or not hasattr(dist, "ProcessGroupNCCL"):
                raise ArgumentError("backend: 'nccl' needs CUDA and a torch build with NCCL; use 'gloo' on CPU")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = td
            pg = dist.ProcessGroupNCCL(pstore, rank, world_size, opts)
            device = torch.device("cuda", torch.cuda.current_device())
    except RuntimeError as e:
        raise SyncError(f"rank {rank}: process group rendezvous failed within {td.total_seconds():.0f} s: {e}") from e
    group = SyncGroup(rank, world_size, backend, td, pstore, pg, device, _store_root=store)
    group.barrier()
    return group


# --------------------------------------------------------------------------------------------------------------
# Manifest and handshake
# --------------------------------------------------------------------------------------------------------------

_MAGIC = "rlblocks-weights-v1"


def _manifest_bytes(version: int, bucket_bytes: int, direct_bytes: int | None, specs: Sequence[TensorMeta]) -> bytes:
    tensors = [[s.name, list(s.shape), dtype_name(s.dtype)] for s in specs]
    return json.dumps(
        {"magic": _MAGIC, "version": version, "bucket_bytes": bucket_bytes, "direct_bytes": direct_bytes,
         "tensors": tensors},
        separators=(",", ":"),
    ).encode()


def _parse_manifest(data: bytes) -> tuple[int, int, int | None, list[TensorMeta]]:
    try:
        d = json.loads(data.decode())
        if d.get("magic") != _MAGIC:
            raise ArgumentError(f"magic {d.get('magic')!r}")
        # TensorMeta refuses negative, fractional or non-int dimensions (no truncation by int()).
        specs = [TensorMeta(n, s, dtype_from_name(dt), 0) for n, s, dt in d["tensors"]]
        names = {s.name for s in specs}
        if len(names) != len(specs):
            raise ArgumentError("duplicate tensor names")
        version, bucket_bytes, direct_bytes = d["version"], d["bucket_bytes"], d.get("direct_bytes")
        for key, value in (("version", version), ("bucket_bytes", bucket_bytes), ("direct_bytes", direct_bytes)):
            if key == "direct_bytes" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ArgumentError(f"{key} must be an int, got {value!r}")
        return version, bucket_bytes, direct_bytes, specs
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise SyncMismatchError(f"manifest: not a valid weight manifest ({e})") from e


def _as_specs(expected: object, arg: str) -> dict[str, TensorMeta]:
    if isinstance(expected, Mapping):
        items = list(expected.items())
    else:
        items = list(expected)
    out: dict[str, TensorMeta] = {}
    for item in items:
        if isinstance(item, TensorMeta):
            out[item.name] = item
        else:
            name, t = item
            out[name] = tensor_spec(name, t) if isinstance(t, Tensor) else TensorMeta(name, tuple(t[0]), t[1], 0)
    if len(out) != len(items):
        raise ArgumentError(f"{arg}: duplicate names")
    return out


def compare_specs(expected: Mapping[str, TensorMeta], got: Sequence[TensorMeta], *, limit: int = 6) -> list[str]:
    """Human-readable differences between what a receiver expects and a manifest (empty list: they agree)."""
    problems: list[str] = []
    got_names = {s.name for s in got}
    missing = [n for n in expected if n not in got_names]
    if missing:
        problems.append(f"{len(missing)} expected tensor(s) not sent, e.g. {missing[:3]}")
    extra = [s.name for s in got if s.name not in expected]
    if extra:
        problems.append(f"{len(extra)} sent tensor(s) not expected, e.g. {extra[:3]}")
    for s in got:
        e = expected.get(s.name)
        if e is None:
            continue
        if e.shape != s.shape or e.dtype != s.dtype:
            problems.append(
                f"{s.name!r}: expected shape {list(e.shape)} {dtype_name(e.dtype)}, "
                f"sent {list(s.shape)} {dtype_name(s.dtype)}"
            )
        if len(problems) >= limit:
            problems.append("...")
            break
    return problems


def _verdict(group: SyncGroup, seq: int, own_problem: str | None) -> None:
    """All-gather statuses; if anyone refused, raise SyncMismatchError on every rank with the reasons."""
    if own_problem is not None:
        group.store.set(f"refusal/{seq}/{group.rank}", own_problem.encode())
    codes = group.all_gather_int(0 if own_problem is None else 1)
    bad = [r for r, c in enumerate(codes) if c]
    if not bad:
        return
    reasons = []
    for r in bad:
        try:
            reasons.append(f"rank {r}: {group.store.get(f'refusal/{seq}/{r}').decode()}")
        except RuntimeError:
            reasons.append(f"rank {r}: (reason unavailable)")
    raise SyncMismatchError(
        f"sync group rank {group.rank}: weight transfer refused before any data moved; " + "; ".join(reasons)
    )


DIRECT_BYTES = {"gloo": 1 << 20, "nccl": 16 << 20}
"""``direct_bytes="auto"`` of :class:`WeightSender` per backend: from this size a contiguous tensor is sent as it is.

gloo (CPU): packing is a host memcpy that competes with the transfer threads for the same cores, and a 1 MiB
message already amortises a collective's latency (measured: sending 2-4 MiB tensors directly beat packing them
into 64 MB buckets, ``benchmarks/sync/bench_broadcast.py``). NCCL: packing is a device copy at HBM speed, far
faster than any link, while a collective costs ~10-50 us, so only large tensors are worth a collective of their own.
"""


class WeightSender:
    """Bucketed full-weight broadcast from rank ``src`` of a :class:`SyncGroup` (see the module docstring).

    ``bucket_bytes`` trades memory for fewer collectives (per-tensor broadcasts were ~12x slower in the field).

    Packing overlaps the wire: two staging buffers alternate, so bucket ``i + 1`` is packed while bucket ``i`` is
    in flight (:meth:`release_buffers` frees them). A tensor of at least ``direct_bytes`` travels in a bucket of
    its own (see :func:`~rlblocks.sync.buckets.plan_buckets`) and, when it is contiguous on the group's device, is
    broadcast straight from its own memory: no packing copy at all. Large tensors are most of a model's bytes, so
    the sender copies only the small ones (norms, biases), whose packed buckets are sent as they fill.
    ``direct_bytes="auto"`` (default) takes :data:`DIRECT_BYTES` of the group's backend; ``None`` packs everything
    (the greedy layout).
    """

    def __init__(
        self,
        group: SyncGroup,
        src: int = 0,
        *,
        bucket_bytes: int = 512 << 20,
        direct_bytes: int | str | None = "auto",
    ):
        if group.rank != src:
            raise ArgumentError(f"src: this process is rank {group.rank}, a WeightSender must run on rank src={src}")
        if direct_bytes == "auto":
            direct_bytes = DIRECT_BYTES.get(group.backend_name, 1 << 20)
        bucket_bytes = check_int("bucket_bytes", bucket_bytes, minimum=1)
        direct_bytes = check_optional_int("direct_bytes", direct_bytes, minimum=1)
        self.group, self.src, self.bucket_bytes, self.direct_bytes = group, src, bucket_bytes, direct_bytes
        self._buffers: list[Tensor | None] = [None, None]

    def _buffer(self, slot: int, nbytes: int, cap: int) -> Tensor:
        """One of two staging buffers of ``cap`` bytes (the largest bucket), kept across sends."""
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, cap), dtype=torch.uint8, device=self.group.device)
            self._buffers[slot] = buf
        return buf[:nbytes]

    def release_buffers(self) -> None:
        """Free the two staging buffers (they are re-allocated at the next send)."""
        self._buffers = [None, None]

    def send(
        self,
        named_tensors: Iterable[tuple[str, Tensor]] | Mapping[str, Tensor],
        *,
        version: int,
        manifest: Sequence[TensorMeta] | None = None,
    ) -> None:
        """Send every tensor to all other ranks as weight ``version``; returns once all receivers consumed them.

        Without ``manifest`` the (name, tensor) pairs are listed first (references only). To stream a generator
        that materialises tensors one at a time (e.g. ``full_tensors(model)``), pass ``manifest`` (name, shape and
        dtype of every tensor, in order): each streamed tensor is then checked against it as it is packed.
        Raises :class:`SyncMismatchError` if a receiver refuses, :class:`SyncError` if a peer dies or times out.
        """
        version = check_version("version", version)
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        if manifest is None:
            items = list(items)
            specs = [tensor_spec(n, t) for n, t in items]
        else:
            specs = [TensorMeta(m.name, tuple(m.shape), m.dtype, 0) for m in manifest]
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ArgumentError("named_tensors: duplicate names")
        g = self.group
        seq = g.next_seq()
        g.broadcast_bytes(_manifest_bytes(version, self.bucket_bytes, self.direct_bytes, specs), self.src)
        _verdict(g, seq, None)
        it = iter(items)
        plan = plan_buckets(specs, bucket_bytes=self.bucket_bytes, direct_bytes=self.direct_bytes)
        cap = max((bucket_nbytes(m) for m in plan if len(m) > 1), default=0)
        stash: dict[str, Tensor] = {}  # small tensors read ahead of their (later) shared bucket
        pos = 0

        def take(m: TensorMeta) -> Tensor:
            """The tensor of ``m``, reading the stream (checked against the manifest, in order) as far as needed."""
            nonlocal pos
            while m.name not in stash:
                want = specs[pos]
                try:
                    name, t = next(it)
                except StopIteration:
                    g.abort()
                    raise ArgumentError(f"named_tensors: ended before {want.name!r} of the manifest") from None
                if name != want.name or tuple(t.shape) != want.shape or t.dtype != want.dtype:
                    g.abort()
                    raise ArgumentError(
                        f"named_tensors: expected {want.name!r} {list(want.shape)} {dtype_name(want.dtype)} "
                        f"(manifest order), got {name!r} {list(t.shape)} {t.dtype}; the group was aborted"
                    )
                stash[name] = t
                pos += 1
            return stash.pop(m.name)

        pending = None  # the bucket in flight: packing the next one overlaps its transfer
        packed = 0
        for i, metas in enumerate(plan):
            tensors = [take(m) for m in metas]
            t0 = tensors[0] if len(tensors) == 1 else None
            if t0 is not None and t0.is_contiguous() and t0.device == g.device and t0.numel():
                buf = t0.detach().reshape(-1).view(torch.uint8)  # a bucket of one tensor travels without a copy
            else:
                buf = self._buffer(packed % 2, bucket_nbytes(metas), cap)
                packed += 1
                pack_into(buf, metas, tensors)
            del tensors, t0
            work = g.broadcast_async(buf, self.src)
            if pending is not None:
                g.wait(pending[0], f"broadcast of bucket {i - 1} of version {version}")
            pending = (work, buf)
        if pending is not None:
            g.wait(pending[0], f"broadcast of the last bucket of version {version}")
        if manifest is not None and next(it, None) is not None:
            g.abort()
            raise ArgumentError("named_tensors: more tensors than the manifest lists; the group was aborted")
        codes = g.all_gather_int(0)
        if any(codes):
            raise SyncError(f"ranks {[r for r, c in enumerate(codes) if c]} reported a failure after receiving")


class _Block:
    """One anonymous mapping of a :class:`ReceiveBufferPool` and its reference count when no tensor uses it."""

    __slots__ = ("idle_refs", "mem", "size")

    def __init__(self, size: int):
        self.mem = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.size = size
        self.idle_refs = sys.getrefcount(self.mem)  # only this object holds it now (same expression as idle())

    def idle(self) -> bool:
        """True when no tensor made by ``torch.frombuffer(self.mem)`` is alive (each holds one reference)."""
        return sys.getrefcount(self.mem) <= self.idle_refs


class ReceiveBufferPool:
    """Fresh-looking receive buffers that are recycled only once nothing references them (CPU only).

    Why: a receive buffer that is new memory is dominated by its first touch. The kernel faults (and zeroes) it
    in 4 KiB pages as the bytes arrive: ~90 ms per 64 MiB on a 2-core x86 CPU, where writing memory that is
    already faulted in takes ~6 ms, so a 0.5 GB transfer paid ~3x its wire time in page faults.

    How: each block is an anonymous ``mmap``; :meth:`take` hands out a *new* tensor over it
    (``torch.frombuffer``, whose storage holds a reference to the ``mmap`` object until its last view dies). A
    block is therefore in use exactly while some tensor built from it (a yielded weight, a view or slice of one,
    a dict holding them) is alive, and ``sys.getrefcount`` of the ``mmap`` object tells so without private torch
    APIs. :meth:`take` returns the smallest free block that fits, else maps a new one; a block still referenced
    is never handed out again, so yielded tensors stay valid for as long as anyone holds them.

    Buffers under ``min_bytes`` (default 1 MiB) are plain ``torch.empty`` memory: the allocator's heap already
    recycles small blocks, and a mapping per tiny bucket would waste a page each.

    Memory: idle blocks are kept up to ``keep_bytes`` (set by :meth:`trim`, the receiver calls it with one
    transfer's total); the rest are unmapped. :meth:`clear` drops every idle block. Not for CUDA buffers:
    the caching allocator already recycles device memory.
    """

    def __init__(self, *, min_bytes: int = 1 << 20) -> None:
        self.min_bytes = min_bytes
        self._blocks: list[_Block] = []

    def take(self, nbytes: int) -> Tensor:
        """A 1-D ``uint8`` CPU tensor of ``nbytes`` over a block that no live tensor references."""
        if nbytes == 0 or nbytes < self.min_bytes:
            return torch.empty(nbytes, dtype=torch.uint8)
        best = None
        for b in self._blocks:
            if b.size >= nbytes and (best is None or b.size < best.size) and b.idle():
                best = b
        if best is None:
            best = _Block(nbytes)
            self._blocks.append(best)
        return torch.frombuffer(best.mem, dtype=torch.uint8, count=nbytes)

    def idle_bytes(self) -> int:
        """Bytes held by blocks that no tensor references."""
        return sum(b.size for b in self._blocks if b.idle())

    def trim(self, keep_bytes: int) -> None:
        """Forget blocks still in use (their tensors own them now) and keep at most ``keep_bytes`` of idle ones."""
        kept, total = [], 0
        for b in sorted(self._blocks, key=lambda b: -b.size):
            if b.idle() and total + b.size <= keep_bytes:
                kept.append(b)
                total += b.size
        self._blocks = kept

    def clear(self) -> None:
        """Drop every block (memory of blocks still referenced is unmapped when their last tensor dies)."""
        self._blocks = []


class WeightReceiver:
    """Receiving side of :class:`WeightSender`.

    ``expected``: what this rank will accept: a ``{name: tensor}`` mapping (e.g. ``model.state_dict()``), an
    iterable of ``(name, tensor)``, or :class:`TensorMeta` entries. Names, shapes and dtypes must match the sender's
    manifest exactly (order is free); ``None`` accepts any manifest.

    Receive buffers (see :meth:`receive` for how long yielded tensors stay valid):

    * default: every bucket lands in a buffer that no live tensor references, so yielded tensors stay valid for
      as long as anyone holds them. On CPU these come from a :class:`ReceiveBufferPool`: a buffer whose tensors
      have all been dropped (e.g. after ``load_state_dict(dict(it))``) is reused, already faulted in, by the next
      receive. Between receives the pool keeps up to one transfer's bytes of idle memory;
      :meth:`release_buffers` frees it, and ``pool_buffers=False`` maps new memory for every bucket instead (every
      receive then pays first-touch page faults).
    * ``reuse_buffers=True``: three buffers recycled regardless of who still holds their tensors (a tensor is
      valid only until the iterator advances two buckets further; the consumer must copy as it goes).
    """

    def __init__(
        self,
        group: SyncGroup,
        src: int = 0,
        *,
        expected: object = None,
        reuse_buffers: bool = False,
        pool_buffers: bool = True,
    ):
        if group.rank == src:
            raise ArgumentError(
                f"src: this process is rank {src}, the sender; a "
                f"WeightReceiver runs on the other ranks"
            )
        self.group, self.src, self.reuse_buffers = group, src, check_bool("reuse_buffers", reuse_buffers)
        pool_buffers = check_bool("pool_buffers", pool_buffers)
        self.expected = None if expected is None else _as_specs(expected, "expected")
        self._buffers: list[Tensor | None] = [None, None, None]
        on_cpu = group.device.type == "cpu"
        self.pool = ReceiveBufferPool() if pool_buffers and on_cpu and not self.reuse_buffers else None

    def release_buffers(self) -> None:
        """Free the idle receive buffers (pool blocks and the ``reuse_buffers`` ring); live tensors are untouched."""
        self._buffers = [None, None, None]
        if self.pool is not None:
            self.pool.clear()

    def _buffer(self, slot: int, nbytes: int) -> Tensor:
        if not self.reuse_buffers:  # a buffer no live tensor references: yielded views stay valid
            if self.pool is not None:
                return self.pool.take(nbytes)
            return torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)
        return buf[:nbytes]

    def receive(self) -> tuple[int, Iterator[tuple[str, Tensor]]]:
        """Run the handshake (eagerly) and return ``(version, iterator of (name, tensor))``.

        The iterator receives bucket after bucket as it is consumed (bucket ``i + 1`` is already in flight while
        bucket ``i``'s tensors are yielded) and yields views of the bucket buffers (on ``group.device``). By default
        every bucket gets a fresh buffer, so tensors stay valid after iteration (``model.load_state_dict(dict(it))``
        works); on CPU a buffer is recycled by the pool only once every tensor from it is gone. With
        ``reuse_buffers=True`` three buffers are recycled across buckets and receives: a yielded tensor
        is valid only until the iterator advances two buckets further, so the consumer must copy each tensor as it
        goes (``engine.update_weights(it)`` and vLLM's ``load_weights`` do). The iterator must be consumed to the end
        (the sender waits for it).
        """
        g = self.group
        seq = g.next_seq()
        version, bucket_bytes, direct_bytes, specs = _parse_manifest(g.broadcast_bytes(None, self.src))
        problem = None
        if self.expected is not None:
            diffs = compare_specs(self.expected, specs)
            if diffs:
                problem = f"manifest of version {version} does not match this receiver: " + "; ".join(diffs)
        if bucket_bytes <= 0 or (direct_bytes is not None and direct_bytes <= 0):
            problem = f"manifest bucket_bytes / direct_bytes must be positive, got {bucket_bytes} / {direct_bytes}"
        _verdict(g, seq, problem)
        plan = plan_buckets(specs, bucket_bytes=bucket_bytes, direct_bytes=direct_bytes)
        if self.pool is not None:  # idle blocks beyond this transfer's size go; blocks still in use are let go
            self.pool.trim(sum(bucket_nbytes(m) for m in plan))

        def stream() -> Iterator[tuple[str, Tensor]]:
            pending = None
            for i, metas in enumerate(plan):
                buf = self._buffer(i % 3, bucket_nbytes(metas))
                work = g.broadcast_async(buf, self.src)
                if pending is not None:
                    g.wait(pending[0], f"broadcast of bucket {i - 1} of version {version}")
                    yield from unpack_bucket(Bucket(pending[1], pending[2]))
                pending = (work, buf, metas)
            if pending is not None:
                g.wait(pending[0], f"broadcast of the last bucket of version {version}")
                yield from unpack_bucket(Bucket(pending[1], pending[2]))
            g.all_gather_int(0)

        return version, stream()
