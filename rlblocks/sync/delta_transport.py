"""Transports for :class:`~rlblocks.sync.delta.DeltaPacket` s: a shared directory, or a sync group.

Directory layout (``DirectoryTransport(root)``)::

    root/v000042/packet.bin   # DeltaPacket.to_bytes()
    root/v000042/meta.json    # {"version": 42, "base_version": 41 | null, "nbytes": ...}

A version is written under ``root/.tmp-v000042-<pid>-<random>/`` (files flushed and fsync-ed) and then published
by a single ``os.rename`` to ``root/v000042``; a directory rename is atomic on POSIX filesystems, so a reader
either sees no ``v000042`` or a complete one. Two writers of one version: the rename of the second one fails
because the first one's directory is not empty, and it gets a :class:`~rlblocks.errors.DeltaError` saying so.
Garbage collection renames old versions to a hidden name before deleting them, so readers never list a
half-deleted version; a reader that loses a race with GC simply gets ``None`` / the next candidate.

Damaged versions. ``meta.json`` only saves reading a whole packet to learn its ``base_version``; the packet's own
header says the same, and its CRC-32 guards every byte. So a reader that meets an unreadable ``meta.json`` reads
the packet instead, and a packet that fails its checksum (truncated, torn network copy) or disagrees with its
directory name or meta is *damaged*: :meth:`DirectoryTransport.next` skips it for the next best candidate (a newer
full packet), counts it (:meth:`DirectoryTransport.stats`) and warns once per version. Only when a damaged
version could be the next one and nothing else is applicable does it raise :class:`DeltaError` (recover by
publishing a full packet), rather than returning ``None`` as if nothing had been published.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import time
import warnings
from pathlib import Path

from rlblocks._checks import check_bool, check_int, check_version
from rlblocks.errors import ArgumentError, DeltaError
from rlblocks.sync.broadcast import SyncGroup
from rlblocks.sync.delta import DeltaPacket

_VDIR = re.compile(r"^v(\d{6,})$")
_UNKNOWN = object()  # base version of a damaged entry whose meta and packet are both unreadable


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _check_current(current_version: object) -> int | None:
    if current_version is None:
        return None
    return check_version("current_version", current_version)


class DirectoryTransport:
    """Publish / read delta packets through a directory on a shared filesystem.

    ``keep``: how many newest versions stay on disk after each publish (>= 1). A reader that falls further
    behind than that must restart from a full packet (:meth:`next` returns the newest full one in that case).
    """

    def __init__(self, root: str | os.PathLike, *, keep: int = 4):
        keep = check_int("keep", keep, minimum=1)
        self.root = Path(root)
        self.keep = keep
        self.root.mkdir(parents=True, exist_ok=True)
        self._damaged: dict[int, str] = {}
        self._stats = {"published": 0, "damaged_skipped": 0}

    # ---- writer -------------------------------------------------------------------------------------------
    def publish(self, packet: DeltaPacket, *, allow_rollback: bool = False) -> Path:
        """Atomically publish ``packet`` as ``v{version:06d}/``; then garbage-collect beyond ``keep``.

        Refuses (:class:`DeltaError`) a version that already exists, whether it was there before or another
        writer published it while this one was writing: a published version is immutable. Refuses a version
        that is not newer than the newest published one unless ``allow_rollback=True``.
        """
        if not isinstance(packet, DeltaPacket):
            raise ArgumentError(f"packet: expected a DeltaPacket, got {type(packet).__name__}")
        allow_rollback = check_bool("allow_rollback", allow_rollback)
        if packet.version < 0:
            raise ArgumentError(f"packet.version: expected >= 0, got {packet.version}")
        final = self.root / f"v{packet.version:06d}"
        if final.exists():
            raise DeltaError(f"packet.version: {final} is already published (published versions are immutable)")
        published = self.versions()
        if published and packet.version <= published[-1] and not allow_rollback:
            raise DeltaError(
                f"packet.version: {packet.version} is not newer than the newest published version {published[-1]} "
                f"in {self.root}; pass allow_rollback=True to go back on purpose"
            )
        data = packet.to_bytes()
        tmp = self.root / f".tmp-{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            _fsync_write(tmp / "packet.bin", data)
            meta = {"version": packet.version, "base_version": packet.base_version, "nbytes": len(data)}
            _fsync_write(tmp / "meta.json", json.dumps(meta).encode())
            try:
                os.rename(tmp, final)
            except OSError as e:
                if final.exists():  # the rename failed because another writer's directory is already there
                    raise DeltaError(
                        f"packet.version: {final} was published by another writer while this one was writing; "
                        "two writers must not publish the same version"
                    ) from e
                raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        dfd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        self._stats["published"] += 1
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

    def stats(self) -> dict[str, int]:
        """Counters of this object: ``published`` versions, ``damaged_skipped`` (damaged versions passed over)."""
        return dict(self._stats)

    @property
    def damaged(self) -> dict[int, str]:
        """Damaged versions this reader has met, with the reason (see the module docstring)."""
        return dict(self._damaged)

    def meta(self, *, version: int) -> dict | None:
        """``{"version", "base_version", "nbytes"}`` of a published version; None if absent (or collected).

        Raises :class:`DeltaError` if ``meta.json`` is unreadable or inconsistent with the directory name.
        """
        version = check_version("version", version)
        try:
            raw = (self.root / f"v{version:06d}" / "meta.json").read_bytes()
        except FileNotFoundError:
            return None
        try:
            m = json.loads(raw)
            base = m["base_version"]
            ok = m["version"] == version and (base is None or (isinstance(base, int) and base < version))
        except (ValueError, KeyError, TypeError) as e:
            raise DeltaError(f"v{version:06d}/meta.json is not valid ({e})") from e
        if not ok:
            raise DeltaError(f"v{version:06d}/meta.json does not describe version {version}: {m!r:.200}")
        return m

    def read(self, *, version: int) -> DeltaPacket | None:
        """The packet of ``version`` (checksum-verified), or None if it is not (or no longer) published.

        Raises :class:`DeltaError` if the bytes fail the checksum or the packet is not the one its directory names.
        """
        version = check_version("version", version)
        try:
            data = (self.root / f"v{version:06d}" / "packet.bin").read_bytes()
        except FileNotFoundError:
            return None
        p = DeltaPacket.from_bytes(data)
        if p.version != version:
            raise DeltaError(f"v{version:06d}/packet.bin holds version {p.version}")
        return p

    def _note_damaged(self, version: int, reason: str) -> None:
        self._stats["damaged_skipped"] += 1
        if version not in self._damaged:
            warnings.warn(f"DirectoryTransport: v{version:06d} in {self.root} is damaged and skipped: {reason}",
                          RuntimeWarning, stacklevel=3)
        self._damaged[version] = reason

    def _base(self, version: int) -> object:
        """``base_version`` of a published version (None: full), ``_UNKNOWN`` if damaged, or False if gone."""
        try:
            m = self.meta(version=version)
            return False if m is None else m["base_version"]
        except DeltaError as meta_error:
            try:  # the packet's own header says the same; its checksum vouches for it
                p = self.read(version=version)
            except DeltaError as e:
                self._note_damaged(version, f"{meta_error}; {e}")
                return _UNKNOWN
            return False if p is None else p.base_version

    def _packet(self, version: int, base: object) -> DeltaPacket | None:
        """The packet of ``version`` if it is intact and has ``base``; None if gone or damaged (noted)."""
        try:
            p = self.read(version=version)
        except DeltaError as e:
            self._note_damaged(version, str(e))
            return None
        if p is not None and p.base_version != base:
            self._note_damaged(version, f"meta.json says base_version {base}, the packet {p.base_version}")
            return None
        return p

    def latest(self, *, full: bool = False) -> DeltaPacket | None:
        """The newest intact published packet (``full=True``: the newest full one), or None."""
        for v in reversed(self.versions()):
            base = self._base(v)
            if base is False or base is _UNKNOWN or (full and base is not None):
                continue
            p = self._packet(v, base)
            if p is not None:
                return p
        return None

    def next(self, *, current_version: int | None) -> DeltaPacket | None:
        """What a decoder at ``current_version`` should apply next, or None if nothing newer is published.

        The delta whose ``base_version == current_version`` if published and intact; otherwise the newest intact
        full packet newer than ``current_version`` (the reader fell behind GC, met a damaged version, or never had
        a version: ``current_version=None``); otherwise None. Raises :class:`DeltaError` when a damaged version
        newer than ``current_version`` may have been the next one and nothing else applies.
        """
        current = _check_current(current_version)
        bases = {}  # version -> base_version (None: full) or _UNKNOWN; versions collected meanwhile left out
        for v in self.versions():
            if current is None or v > current:
                base = self._base(v)
                if base is not False:
                    bases[v] = base
        blocked = {v for v, base in bases.items() if base is _UNKNOWN}
        if current is not None:
            for v, base in bases.items():  # ascending
                if isinstance(base, int) and base == current:
                    p = self._packet(v, base)
                    if p is not None:
                        return p
                    blocked.add(v)
        for v in sorted(bases, reverse=True):
            if bases[v] is None:
                p = self._packet(v, None)
                if p is not None:
                    return p
                blocked.add(v)
        if blocked:
            reasons = "; ".join(f"v{v:06d}: {self._damaged.get(v, 'damaged')}" for v in sorted(blocked))
            raise DeltaError(
                f"no intact packet follows version {current} in {self.root}: {reasons}. "
                "Publish a full packet (DeltaEncoder.full) to let readers recover"
            )
        return None

    def wait_next(self, *, current_version: int | None, timeout: float, poll: float = 0.05) -> DeltaPacket:
        """Poll :meth:`next` until a packet appears.

        A damaged version that blocks the chain does not end the wait: the writer may still publish a full packet.
        After ``timeout`` seconds raises the last :class:`DeltaError` if damage was what blocked, else
        ``TimeoutError``.
        """
        # NaN compares False with everything: the deadline would never pass and the wait would never end
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise ArgumentError(f"timeout: expected a number of seconds >= 0, got {timeout!r}")
        if isinstance(poll, bool) or not isinstance(poll, (int, float)) or not 0 < poll < math.inf:
            raise ArgumentError(f"poll: expected a finite number of seconds > 0, got {poll!r}")
        deadline = time.monotonic() + timeout
        while True:
            err = None
            try:
                p = self.next(current_version=current_version)
            except DeltaError as e:
                p, err = None, e
            if p is not None:
                return p
            if time.monotonic() > deadline:
                if err is not None:
                    raise err
                raise TimeoutError(f"no packet after version {current_version} in {self.root} within {timeout} s")
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
        self.last_version: int | None = None

    def send(self, packet: DeltaPacket, *, allow_rollback: bool = False) -> int:
        """Broadcast ``packet``; returns its wire size in bytes.

        Refuses (:class:`DeltaError`, nothing sent) a version not newer than the last one sent, unless
        ``allow_rollback=True``.
        """
        if self.group.rank != self.src:
            raise ArgumentError(f"src: only rank {self.src} sends; this is rank {self.group.rank}")
        if not isinstance(packet, DeltaPacket):
            raise ArgumentError(f"packet: expected a DeltaPacket, got {type(packet).__name__}")
        allow_rollback = check_bool("allow_rollback", allow_rollback)
        if self.last_version is not None and packet.version <= self.last_version and not allow_rollback:
            raise DeltaError(
                f"packet.version: {packet.version} is not newer than the last version sent ({self.last_version}); "
                "pass allow_rollback=True to go back on purpose"
            )
        data = packet.to_bytes()
        self.group.broadcast_bytes(data, self.src)
        self.last_version = packet.version
        return len(data)

    def receive(self) -> DeltaPacket:
        """Receive the next packet (raises DeltaError if its bytes are corrupted, SyncError if the sender died)."""
        if self.group.rank == self.src:
            raise ArgumentError(f"src: rank {self.src} sends; receive runs on the other ranks")
        return DeltaPacket.from_bytes(self.group.broadcast_bytes(None, self.src))
