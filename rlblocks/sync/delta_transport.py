"""Transports for :class:`~rlblocks.sync.delta.DeltaPacket` s: a shared directory, or a sync group.

Directory layout (``DirectoryTransport(root)``)::

    root/v000042/packet.bin   # DeltaPacket.to_bytes()
    root/v000042/meta.json    # {"version": 42, "base_version": 41 | null, "nbytes": ...}

A version is written under ``root/.tmp-v000042-<pid>-<random>/`` (files flushed and fsync-ed) and then published
by a single ``os.rename`` to ``root/v000042``; a directory rename is atomic on POSIX filesystems, so a reader
either sees no ``v000042`` or a complete one. Garbage collection renames old versions to a hidden name before
deleting them, so readers never list a half-deleted version; a reader that loses a race with GC simply gets
``None`` / the next candidate. The packet's own CRC guards against anything else (e.g. a torn network copy).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from pathlib import Path

from rlblocks.errors import ArgumentError
from rlblocks.sync.broadcast import SyncGroup
from rlblocks.sync.delta import DeltaPacket

_VDIR = re.compile(r"^v(\d{6,})$")


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class DirectoryTransport:
    """Publish / read delta packets through a directory on a shared filesystem.

    ``keep``: how many newest versions stay on disk after each publish (>= 1). A reader that falls further
    behind than that must restart from a full packet (:meth:`next` returns the newest full one in that case).
    """

    def __init__(self, root: str | os.PathLike, *, keep: int = 4):
        if not isinstance(keep, int) or keep < 1:
            raise ArgumentError(f"keep: expected an int >= 1, got {keep!r}")
        self.root = Path(root)
        self.keep = keep
        self.root.mkdir(parents=True, exist_ok=True)

    # ---- writer -------------------------------------------------------------------------------------------
    def publish(self, packet: DeltaPacket) -> Path:
        """Atomically publish ``packet`` as ``v{version:06d}/``; then garbage-collect beyond ``keep``.

        Refuses (ValueError) a version that already exists: a published version is immutable.
        """
        if not isinstance(packet, DeltaPacket):
            raise ArgumentError(f"packet: expected a DeltaPacket, got {type(packet).__name__}")
        if packet.version < 0:
            raise ArgumentError(f"packet.version: expected >= 0, got {packet.version}")
        final = self.root / f"v{packet.version:06d}"
        if final.exists():
            raise ArgumentError(f"packet.version: {final} is already published")
        data = packet.to_bytes()
        tmp = self.root / f".tmp-{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            _fsync_write(tmp / "packet.bin", data)
            meta = {"version": packet.version, "base_version": packet.base_version, "nbytes": len(data)}
            _fsync_write(tmp / "meta.json", json.dumps(meta).encode())
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        dfd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        self.gc()
        return final

    def gc(self) -> list[int]:
        """Delete every published version but the ``keep`` newest; returns the deleted versions."""
        gone = self.versions()[: -self.keep]
        for v in gone:
            src = self.root / f"v{v:06d}"
            trash = self.root / f".gc-{src.name}-{secrets.token_hex(4)}"
            try:
                os.rename(src, trash)
            except FileNotFoundError:
                continue
            shutil.rmtree(trash, ignore_errors=True)
        return gone

    # ---- reader -------------------------------------------------------------------------------------------
    def versions(self) -> list[int]:
        """Published versions, ascending."""
        out = []
        for name in os.listdir(self.root):
            m = _VDIR.match(name)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def meta(self, version: int) -> dict | None:
        """``{"version", "base_version", "nbytes"}`` of a published version; None if absent (or collected)."""
        try:
            return json.loads((self.root / f"v{version:06d}" / "meta.json").read_bytes())
        except FileNotFoundError:
            return None

    def read(self, version: int) -> DeltaPacket | None:
        """The packet of ``version`` (checksum-verified), or None if it is not (or no longer) published."""
        try:
            data = (self.root / f"v{version:06d}" / "packet.bin").read_bytes()
        except FileNotFoundError:
            return None
        return DeltaPacket.from_bytes(data)

    def latest(self, *, full: bool = False) -> DeltaPacket | None:
        """The newest published packet (``full=True``: the newest full one), or None."""
        for v in reversed(self.versions()):
            m = self.meta(v)
            if m is None or (full and m["base_version"] is not None):
                continue
            p = self.read(v)
            if p is not None:
                return p
        return None

    def next(self, current: int | None) -> DeltaPacket | None:
        """What a decoder at version ``current`` should apply next, or None if nothing newer is published.

        The delta whose ``base_version == current`` if published; otherwise the newest full packet newer than
        ``current`` (the reader fell behind GC or never had a version: ``current=None``); otherwise None.
        """
        vs = self.versions()
        if current is not None:
            for v in vs:
                if v > current:
                    m = self.meta(v)
                    if m is not None and m["base_version"] == current:
                        p = self.read(v)
                        if p is not None:
                            return p
        for v in reversed(vs):
            if current is not None and v <= current:
                break
            m = self.meta(v)
            if m is not None and m["base_version"] is None:
                p = self.read(v)
                if p is not None:
                    return p
        return None

    def wait_next(self, current: int | None, *, timeout: float, poll: float = 0.05) -> DeltaPacket:
        """Poll :meth:`next` until a packet appears; raises TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            p = self.next(current)
            if p is not None:
                return p
            if time.monotonic() > deadline:
                raise TimeoutError(f"no packet after version {current} in {self.root} within {timeout} s")
            time.sleep(poll)


class GroupDeltaTransport:
    """Carry delta packets over a :class:`~rlblocks.sync.broadcast.SyncGroup` (rank ``src`` to all others).

    ``send`` on ``src`` and ``receive`` on every other rank must be called in the same order. The wire bytes are
    exactly ``packet.to_bytes()`` (length first), so the receiver re-checks the whole-packet CRC.
    """

    def __init__(self, group: SyncGroup, src: int = 0):
        if not 0 <= src < group.world_size:
            raise ArgumentError(f"src: expected a rank in [0, {group.world_size}), got {src}")
        self.group, self.src = group, src

    def send(self, packet: DeltaPacket) -> int:
        """Broadcast ``packet``; returns its wire size in bytes."""
        if self.group.rank != self.src:
            raise ArgumentError(f"src: only rank {self.src} sends; this is rank {self.group.rank}")
        if not isinstance(packet, DeltaPacket):
            raise ArgumentError(f"packet: expected a DeltaPacket, got {type(packet).__name__}")
        data = packet.to_bytes()
        self.group.broadcast_bytes(data, self.src)
        return len(data)

    def receive(self) -> DeltaPacket:
        """Receive the next packet (raises DeltaError if its bytes are corrupted, SyncError if the sender died)."""
        if self.group.rank == self.src:
            raise ArgumentError(f"src: rank {self.src} sends; receive runs on the other ranks")
        return DeltaPacket.from_bytes(self.group.broadcast_bytes(None, self.src))
