"""Zero-copy colocated weight handoff: the trainer's weights reach an engine on the same host through shared memory.

Why: a colocated engine (verl's hybrid engine, ms-swift's colocate mode) shares the machine, and on a GPU the
device, with the trainer. Shipping tensors to it as raw bytes through an RPC copies every weight several times
through host memory (tensor -> bytes, pickling, the socket or pipe both ways, bytes -> tensor) before the engine's
own load. Here the trainer writes each bucket once into memory the engine process maps as well, and sends only a
small picklable :class:`HandoffMessage` (segment names or CUDA IPC handles plus the bucket layout); the engine
builds tensor *views* of that memory and loads from them (its own copy into its weights is the only other one).

* CPU: each bucket is a POSIX shared-memory segment (``multiprocessing.shared_memory``, ``/dev/shm``), attached by
  name in the engine process (no file descriptor passing: any transport can carry the message).
* CUDA: each bucket is a device buffer exported with ``torch.multiprocessing.reductions.reduce_tensor`` (CUDA IPC),
  keyed by the GPU's UUID as vLLM's IPC weight transfer does; the engine process opens it with
  ``rebuild_cuda_tensor`` on its own device index. :meth:`HandoffSender.vllm_ipc_update_info` gives the
  ``update_info`` of vLLM's ``weight_transfer_config={"backend": "ipc"}`` path; for SGLang, pass
  :meth:`HandoffSender.views` to ``update_weights_from_tensor`` (its serializer turns views of the shared buckets
  into IPC handles).

Lifetime: buffers of a handed-off version stay untouched, and alive, until :meth:`HandoffSender.release` (the
engine confirmed that it loaded them); a later :meth:`HandoffSender.prepare` takes other buffers meanwhile. The
engine side (:func:`open_handoff`) must copy what it needs before it confirms (every engine's ``update_weights``
does). Layout: the same bucket format as :mod:`rlblocks.sync.buckets` (64-byte aligned, checked on both sides).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import torch
from torch import Tensor

from rlblocks._checks import check_int, check_version
from rlblocks.errors import ArgumentError, WeightUpdateError
from rlblocks.sync.buckets import (
    TensorMeta,
    bucket_nbytes,
    check_layout,
    dtype_name,
    pack_into,
    plan_buckets,
    tensor_spec,
)

__all__ = ["HandoffBucket", "HandoffMessage", "HandoffSender", "open_handoff", "update_from_handoff"]


@dataclass(frozen=True)
class HandoffBucket:
    """One shared buffer: ``handle`` (CPU: the shared-memory segment's name; CUDA: ``{gpu_uuid: rebuild args}``),
    its size in bytes, and the tensors it holds (offsets as in :mod:`rlblocks.sync.buckets`)."""

    handle: Any
    nbytes: int
    tensors: tuple[TensorMeta, ...]


@dataclass(frozen=True)
class HandoffMessage:
    """What the trainer sends the engine process for one update (picklable; a few hundred bytes per bucket)."""

    version: int
    handoff_id: str
    device: str
    buckets: tuple[HandoffBucket, ...]

    @property
    def names(self) -> list[str]:
        return [m.name for b in self.buckets for m in b.tensors]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


_OWN: set[str] = set()  # segments created by this process (their resource-tracker entry is the creator's)


def _u8_over(shm: shared_memory.SharedMemory, size: int) -> Tensor:
    return torch.frombuffer(shm.buf, dtype=torch.uint8, count=size) if size else torch.empty(0, dtype=torch.uint8)


class _Segment:
    """A CPU shared-memory segment and a uint8 tensor over it (the sender's side)."""

    def __init__(self, size: int):
        name = f"rlb-{os.getpid()}-{secrets.token_hex(6)}"
        self.shm = shared_memory.SharedMemory(name=name, create=True, size=max(size, 1))
        _OWN.add(self.shm.name)
        self.size = size
        self.tensor = _u8_over(self.shm, size)
        self.handle = self.shm.name

    def close(self) -> None:
        self.tensor = None
        with contextlib.suppress(BufferError):  # a view still held elsewhere keeps the mapping until it dies
            self.shm.close()
        with contextlib.suppress(FileNotFoundError):
            self.shm.unlink()
        _OWN.discard(self.shm.name)


class _CudaBuffer:
    def __init__(self, size: int, device: torch.device):
        from torch.multiprocessing.reductions import reduce_tensor

        self.size = size
        self.tensor = torch.empty(max(size, 1), dtype=torch.uint8, device=device)[:size]
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        self.handle = {uuid: reduce_tensor(self.tensor)[1]}

    def close(self) -> None:
        self.tensor = None


class HandoffSender:
    """Trainer side of the handoff (see the module docstring).

    ``device``: where the shared buckets live, ``"cpu"`` (default) or a CUDA device the engine process can open
    (same host). ``bucket_bytes`` bounds one buffer (an oversize tensor gets one of its own), as in
    :func:`~rlblocks.sync.buckets.plan_buckets`. Buffers are kept and reused for later updates once released;
    :meth:`close` frees them all.
    """

    def __init__(self, *, device: torch.device | str = "cpu", bucket_bytes: int = 512 << 20):
        bucket_bytes = check_int("bucket_bytes", bucket_bytes, minimum=1)
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError):
            raise ArgumentError(f"device: expected 'cpu' or a CUDA device, got {device!r}") from None
        if self.device.type not in ("cpu", "cuda"):
            raise ArgumentError(f"device: expected 'cpu' or a CUDA device, got {device!r}")
        self.bucket_bytes = bucket_bytes
        self._free: list[_Segment | _CudaBuffer] = []
        self._live: dict[str, list[_Segment | _CudaBuffer]] = {}
        self._messages: dict[str, HandoffMessage] = {}
        self._stats = {"prepared": 0, "released": 0, "bytes_packed": 0, "buffers_allocated": 0, "bytes_allocated": 0}

    def stats(self) -> dict[str, int]:
        """Counters: ``prepared`` / ``released`` updates, ``in_flight`` (prepared, not released), ``bytes_packed``
        (bytes this side copied into shared buffers: the only copy before the engine's load), ``buffers_allocated``
        and ``bytes_allocated`` (new shared buffers; released ones are reused)."""
        return {**self._stats, "in_flight": len(self._live)}

    def _take(self, size: int) -> _Segment | _CudaBuffer:
        fits = [b for b in self._free if b.size >= size]
        if fits:
            best = min(fits, key=lambda b: b.size)
            self._free.remove(best)
            return best
        self._stats["buffers_allocated"] += 1
        self._stats["bytes_allocated"] += size
        return _Segment(size) if self.device.type == "cpu" else _CudaBuffer(size, self.device)

    def prepare(
        self, named_tensors: Iterable[tuple[str, Tensor]] | Mapping[str, Tensor], *, version: int
    ) -> HandoffMessage:
        """Copy ``named_tensors`` into shared buckets and describe them; the buckets stay untouched until
        :meth:`release` of the returned message. Bit-exact for every dtype; names must be unique."""
        version = check_version("version", version)
        try:
            items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        except TypeError:
            raise ArgumentError(f"named_tensors: expected (str, Tensor) pairs or a mapping, got "
                                f"{type(named_tensors).__name__}") from None
        if not items:  # an update of nothing: every engine refuses it, so it is refused before any buffer is taken
            raise ArgumentError("named_tensors: expected at least one tensor, got none")
        specs = []
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise ArgumentError(f"named_tensors: expected (str, Tensor) pairs, got {type(item).__name__}")
            specs.append(tensor_spec(*item))
            dtype_name(item[1].dtype)  # a wire name for every dtype, checked before anything is allocated
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ArgumentError("named_tensors: duplicate names")
        tensors = dict(items)
        buckets, taken = [], []
        try:
            for metas in plan_buckets(specs, bucket_bytes=self.bucket_bytes):
                size = bucket_nbytes(metas)
                buf = self._take(size)
                taken.append(buf)
                with torch.no_grad():
                    pack_into(buf.tensor[:size], metas, [tensors[m.name].detach() for m in metas])
                self._stats["bytes_packed"] += sum(m.nbytes for m in metas)
                buckets.append(HandoffBucket(buf.handle, size, tuple(metas)))
        except BaseException:
            self._free.extend(taken)
            raise
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the engine reads on its own stream
        msg = HandoffMessage(version, secrets.token_hex(8), "cpu" if self.device.type == "cpu" else "cuda",
                             tuple(buckets))
        self._live[msg.handoff_id] = taken
        self._messages[msg.handoff_id] = msg
        self._stats["prepared"] += 1
        return msg

    def views(self, message: HandoffMessage) -> list[tuple[str, Tensor]]:
        """This process's ``(name, tensor)`` views of a prepared message's buckets (no copy), e.g. for an engine
        client that serializes tensors as IPC handles itself (SGLang's ``update_weights_from_tensor``)."""
        bufs = self._buffers(message)
        out = []
        for buf, b in zip(bufs, message.buckets):
            out += [(m.name, buf.tensor[m.offset : m.offset + m.nbytes].view(m.dtype).view(m.shape)) for m in b.tensors]
        return out

    def vllm_ipc_update_info(self, message: HandoffMessage) -> dict:
        """vLLM's IPC weight-transfer ``update_info`` (non-packed: one handle per tensor, each a view of a shared
        bucket) for ``WeightTransferUpdateRequest(update_info=...)`` on an engine started with
        ``weight_transfer_config={"backend": "ipc"}`` (initialised with ``{"packed": False}``). CUDA only."""
        if message.device != "cuda":
            raise ArgumentError("message: vLLM's IPC weight transfer needs CUDA buckets (HandoffSender(device='cuda'))")
        from torch.multiprocessing.reductions import reduce_tensor

        uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        views = self.views(message)
        return {
            "names": [n for n, _ in views],
            "dtype_names": [dtype_name(t.dtype) for _, t in views],
            "shapes": [list(t.shape) for _, t in views],
            "ipc_handles": [{uuid: reduce_tensor(t)[1]} for _, t in views],
        }

    def _buffers(self, message: HandoffMessage) -> list[_Segment | _CudaBuffer]:
        if not isinstance(message, HandoffMessage):
            raise ArgumentError(f"message: expected a HandoffMessage, got {type(message).__name__}")
        try:
            return self._live[message.handoff_id]
        except KeyError:
            raise ArgumentError(
                f"message: handoff {message.handoff_id} is not in flight (released, or prepared by another sender)"
            ) from None

    def release(self, message: HandoffMessage) -> None:
        """The engine confirmed the load of ``message``: its buffers may be reused by a later :meth:`prepare`."""
        bufs = self._buffers(message)
        del self._live[message.handoff_id], self._messages[message.handoff_id]
        self._free.extend(bufs)
        self._stats["released"] += 1

    @contextlib.contextmanager
    def hand_over(
        self, named_tensors: Iterable[tuple[str, Tensor]] | Mapping[str, Tensor], *, version: int
    ) -> Iterator[HandoffMessage]:
        """``with sender.hand_over(named, version=v) as msg: <engine loads msg>``: released when the block ends
        (the block must return only once the engine confirmed, e.g. after awaiting its ``update_weights``)."""
        msg = self.prepare(named_tensors, version=version)
        try:
            yield msg
        finally:
            self.release(msg)

    def close(self) -> None:
        """Free every buffer, including those of updates still in flight (call once the engine is gone)."""
        for b in self._free + [b for bufs in self._live.values() for b in bufs]:
            b.close()
        self._free, self._live, self._messages = [], {}, {}

    def __del__(self) -> None:  # the segments are also unlinked by Python's resource tracker if this never runs
        with contextlib.suppress(Exception):
            self.close()


def _attach_segment(name: str) -> shared_memory.SharedMemory:
    """Attach a segment created by another process without letting this process's resource tracker unlink it when
    this process exits (the sender owns it)."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    shm = shared_memory.SharedMemory(name=name)
    if shm.name in _OWN:  # attached in the creating process (tests): the creator's entry must stay
        return shm
    from multiprocessing import resource_tracker

    with contextlib.suppress(Exception):
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


def _check_message(message: HandoffMessage) -> None:
    """The message's structure, before any segment is attached: it comes from another process, so a malformed one
    is a refused update (:class:`WeightUpdateError`), never a TypeError from inside."""
    if message.device not in ("cpu", "cuda"):
        raise WeightUpdateError(f"message.device: expected 'cpu' or 'cuda', got {message.device!r}")
    if not isinstance(message.buckets, tuple) or not message.buckets:
        raise WeightUpdateError(f"message.buckets: expected a non-empty tuple of HandoffBucket, got "
                                f"{message.buckets!r:.60}")
    for i, b in enumerate(message.buckets):
        where = f"message.buckets[{i}]"
        if not isinstance(b, HandoffBucket):
            raise WeightUpdateError(f"{where}: expected a HandoffBucket, got {type(b).__name__}")
        if isinstance(b.nbytes, bool) or not isinstance(b.nbytes, int) or b.nbytes < 0:
            raise WeightUpdateError(f"{where}.nbytes: expected an int >= 0, got {b.nbytes!r}")
        if not isinstance(b.tensors, tuple) or not all(isinstance(m, TensorMeta) for m in b.tensors):
            raise WeightUpdateError(f"{where}.tensors: expected a tuple of TensorMeta, got {b.tensors!r:.60}")
        want = str if message.device == "cpu" else dict
        if not isinstance(b.handle, want):
            raise WeightUpdateError(f"{where}.handle: expected a {want.__name__} for device {message.device!r}, got "
                                    f"{type(b.handle).__name__}")


@contextlib.contextmanager
def open_handoff(
    message: HandoffMessage, *, device: torch.device | str | None = None
) -> Iterator[list[tuple[str, Tensor]]]:
    """Engine side: ``with open_handoff(msg) as named: await engine.update_weights(named, version=msg.version)``.

    Yields ``(name, tensor)`` views of the sender's shared buckets (no copy; read-only by contract). CUDA buckets
    are opened on ``device`` (default: the current CUDA device). The layout is checked first (names unique, every
    tensor inside its bucket, no overlaps): a bad message raises :class:`~rlblocks.errors.WeightUpdateError` before
    any tensor is made. Mappings are closed when the block ends (a view kept beyond it keeps its mapping alive).
    """
    if not isinstance(message, HandoffMessage):
        raise ArgumentError(f"message: expected a HandoffMessage, got {type(message).__name__}")
    _check_message(message)
    seen: set[str] = set()
    for i, b in enumerate(message.buckets):
        try:
            check_layout(b.tensors, b.nbytes, where=f"message.buckets[{i}]")
        except ArgumentError as e:
            raise WeightUpdateError(str(e)) from e
        for m in b.tensors:
            if m.name in seen:
                raise WeightUpdateError(f"message: tensor {m.name!r} appears in two buckets")
            seen.add(m.name)
    segments: list[shared_memory.SharedMemory] = []
    named: list[tuple[str, Tensor]] = []
    try:
        for b in message.buckets:
            if message.device == "cpu":
                try:
                    shm = _attach_segment(b.handle)
                except FileNotFoundError as e:
                    raise WeightUpdateError(
                        f"message: shared-memory segment {b.handle!r} does not exist (already released, or the "
                        "trainer process is gone)"
                    ) from e
                segments.append(shm)
                if shm.size < b.nbytes:
                    raise WeightUpdateError(f"message: segment {b.handle} holds {shm.size} bytes, expected {b.nbytes}")
                buf = _u8_over(shm, b.nbytes)
            elif message.device == "cuda":
                from torch.multiprocessing.reductions import rebuild_cuda_tensor

                dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
                uuid = str(torch.cuda.get_device_properties(dev).uuid)
                if uuid not in b.handle:
                    raise WeightUpdateError(f"message: no IPC handle for GPU {uuid} (have {list(b.handle)})")
                args = list(b.handle[uuid])
                args[6] = dev.index  # the device index in reduce_tensor's args: this process's numbering
                buf = rebuild_cuda_tensor(*args)
            else:
                raise WeightUpdateError(f"message.device: expected 'cpu' or 'cuda', got {message.device!r}")
            named += [(m.name, buf[m.offset : m.offset + m.nbytes].view(m.dtype).view(m.shape)) for m in b.tensors]
        yield named
    finally:
        named.clear()
        buf = None
        for shm in segments:
            with contextlib.suppress(BufferError):  # a view kept by the caller: unmapped when it dies
                shm.close()


async def update_from_handoff(engine: Any, message: HandoffMessage, **kwargs: Any) -> None:
    """Engine process: load ``message`` with ``await engine.update_weights(views, version=message.version)`` (any
    engine of the rollout protocol; ``kwargs`` such as ``partial=True`` are passed on). Returns once the engine
    loaded it: the caller then confirms to the trainer, which calls :meth:`HandoffSender.release`."""
    with open_handoff(message) as named:
        await engine.update_weights(named, version=message.version, **kwargs)
