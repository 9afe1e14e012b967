"""Run checkpoints that survive a crash: written atomically, checked on load, loaded whole or not at all.

A run checkpoint is one file holding everything a loop needs to continue where it stopped: the model and optimizer
states, every sched block's ``state_dict`` (``StalenessController``, ``StalenessQueue``, ``PartialRolloutBuffer``,
``DynamicSampler`` counters), the data cursor, the policy version, the RNG states of every rank and the counters
of the run's summary. The library only defines the file and the RNG capture; what goes into the state is the
loop's choice (``cookbook/plumbing/checkpoints.py`` is one).

File format (version :data:`FORMAT`)::

    RLBLOCKS-CHECKPOINT\\n                       magic line (a foreign file is refused at once)
    {"format": 1, "kind": ..., "bytes": N, "sha256": ..., "keys": [...], "meta": {...}}\\n     one JSON line
    <N bytes>                                   the state, serialised by ``torch.save``

Writing (:func:`save_checkpoint`): the whole file goes to a temporary file in the same directory, which is flushed
and ``fsync``-ed, then renamed over the destination (``os.replace``, atomic on POSIX), and the directory is
``fsync``-ed, so a crash at any point leaves either the old file or the new one, never a mix. Reading
(:func:`load_checkpoint`): the magic, the header, the format version, the kind, the payload length (a torn file is
shorter) and the SHA-256 of the payload (a flipped byte) are checked *before* anything is unpickled, then the
required keys; any failure raises :class:`~rlblocks.errors.CheckpointError` naming the file and what is wrong, and
nothing is returned. :class:`Checkpoint` keeps the previous file next to the latest one, so a checkpoint damaged
after it was written still leaves the one before it loadable.

The payload is a pickle (``torch.save``): load only checkpoints you wrote, as with any torch checkpoint. The
checksum detects damage, not tampering.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from rlblocks.errors import ArgumentError, CheckpointError

__all__ = [
    "FORMAT",
    "Checkpoint",
    "load_checkpoint",
    "read_checkpoint_meta",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]

FORMAT = 1
"""The version of the file layout this module writes and reads."""

MAGIC = b"RLBLOCKS-CHECKPOINT\n"
_MAX_HEADER = 1 << 20  # a header longer than this is not one of ours


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # a platform without directory descriptors: the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(path: str | os.PathLike, state: Mapping[str, Any], *, kind: str = "run",
                    meta: Mapping[str, Any] | None = None) -> int:
    """Write ``state`` to ``path`` atomically (temporary file, ``fsync``, rename, directory ``fsync``).

    Args:
        path: the destination; its directory must exist.
        state: a mapping with ``str`` keys, serialisable by ``torch.save`` (tensors, plain Python values, picklable
            objects).
        kind: a label :func:`load_checkpoint` can insist on (``kind=``), so that a checkpoint of another sort is
            refused rather than half-used.
        meta: small JSON-serialisable facts stored in the header (e.g. the step), readable without loading the
            payload (:func:`read_checkpoint_meta`).

    Returns the number of bytes written.
    """
    path = Path(path)
    if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
        raise ArgumentError(f"state: expected a mapping with str keys, got {type(state).__name__}")
    if not isinstance(kind, str) or not kind:
        raise ArgumentError(f"kind: expected a non-empty str, got {kind!r}")
    buf = io.BytesIO()
    torch.save(dict(state), buf)
    payload = buf.getbuffer()
    try:
        header = json.dumps({"format": FORMAT, "kind": kind, "bytes": len(payload),
                             "sha256": hashlib.sha256(payload).hexdigest(), "keys": sorted(state),
                             "meta": dict(meta or {})}, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise ArgumentError(f"meta: expected JSON-serialisable values, got {meta!r}: {e}") from e
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC)
            f.write(header.encode() + b"\n")
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return len(MAGIC) + len(header) + 1 + len(payload)


def _read_header(f, path: Path) -> dict[str, Any]:
    magic = f.read(len(MAGIC))
    if magic != MAGIC:
        if len(magic) < len(MAGIC) and MAGIC.startswith(magic):
            raise CheckpointError(f"{path}: torn checkpoint: the file ends inside its first line ({len(magic)} bytes)")
        raise CheckpointError(f"{path}: not an rlblocks checkpoint (expected the line {MAGIC!r} first, got "
                              f"{magic[:24]!r})")
    line = f.readline(_MAX_HEADER)
    if not line.endswith(b"\n"):
        raise CheckpointError(f"{path}: torn checkpoint: the header line is incomplete ({len(line)} bytes)")
    try:
        header = json.loads(line)
    except ValueError as e:
        raise CheckpointError(f"{path}: damaged checkpoint: the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: damaged checkpoint: expected a JSON object header, got {line[:80]!r}")
    if header.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {header.get('format')!r}, this rlblocks reads format "
                              f"{FORMAT} only")
    for key, typ in (("kind", str), ("bytes", int), ("sha256", str), ("keys", list), ("meta", dict)):
        if not isinstance(header.get(key), typ):
            raise CheckpointError(f"{path}: damaged checkpoint: header field {key!r} is {header.get(key)!r}")
    return header


def read_checkpoint_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The header of the checkpoint at ``path`` without its payload: ``{"kind", "bytes", "keys", "meta", ...}``
    (the payload is neither read nor checked; :func:`load_checkpoint` does that)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return _read_header(f, path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no checkpoint there") from None


def load_checkpoint(path: str | os.PathLike, *, kind: str | None = None,
                    required: Iterable[str] = ()) -> dict[str, Any]:
    """The state :func:`save_checkpoint` wrote to ``path``, after every check of the module docstring.

    Args:
        kind: when given, the checkpoint's kind must be this.
        required: keys the state must hold.

    Raises :class:`~rlblocks.errors.CheckpointError` (naming ``path`` and the fault: missing, foreign, torn,
    damaged, another format version or kind, a missing key) and returns nothing in that case.
    """
    path = Path(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no checkpoint there") from None
    with f:
        header = _read_header(f, path)
        payload = f.read(header["bytes"] + 1)
    if len(payload) < header["bytes"]:
        raise CheckpointError(f"{path}: torn checkpoint: {len(payload)} of its {header['bytes']} payload bytes are "
                              "there")
    if len(payload) > header["bytes"]:
        raise CheckpointError(f"{path}: damaged checkpoint: bytes follow the {header['bytes']}-byte payload")
    digest = hashlib.sha256(payload).hexdigest()
    if digest != header["sha256"]:
        raise CheckpointError(f"{path}: damaged checkpoint: the payload's SHA-256 is {digest[:16]}…, the header "
                              f"says {header['sha256'][:16]}…")
    if kind is not None and header["kind"] != kind:
        raise CheckpointError(f"{path}: a {header['kind']!r} checkpoint, expected a {kind!r} one")
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)
    except Exception as e:  # the checksum matched, so this is a file written by an incompatible torch/pickle
        raise CheckpointError(f"{path}: the payload could not be read back ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a dict payload, got {type(state).__name__}")
    missing = [k for k in required if k not in state]
    if missing:
        raise CheckpointError(f"{path}: missing key(s) {missing} (it has {sorted(state)})")
    return state


class Checkpoint:
    """A checkpoint file that keeps its predecessor: ``path`` (the latest) and ``<stem>.prev<suffix>``.

    :meth:`save` gives the latest file the ``prev`` name too (a hard link, renamed over the old ``prev``) and then
    writes the new one with :func:`save_checkpoint`, so at every instant both names hold complete files (where
    the file system has no hard links the latest file is renamed instead, and a crash before the new one is in
    place leaves only ``prev``). :meth:`load` returns the newest file
    that passes every check, falling back to the previous one when the latest is missing, torn or damaged; the
    faults it skipped are in :attr:`skipped` (``[(path, message)]``) so that a caller can report them. When no
    file passes, it raises :class:`~rlblocks.errors.CheckpointError` listing every fault.
    """

    def __init__(self, path: str | os.PathLike, *, kind: str = "run") -> None:
        self.path = Path(path)
        self.prev = self.path.with_name(f"{self.path.stem}.prev{self.path.suffix}")
        self.kind = kind
        self.skipped: list[tuple[str, str]] = []

    def exists(self) -> bool:
        """True when the latest or the previous file is there (loadable or not)."""
        return self.path.exists() or self.prev.exists()

    def save(self, state: Mapping[str, Any], *, meta: Mapping[str, Any] | None = None) -> int:
        """Write ``state`` as the latest checkpoint; the one it replaces becomes the previous one."""
        if self.path.exists():
            # a second name for the latest file becomes the previous one, so that the latest name is never absent
            link = self.prev.with_name(f".{self.prev.name}.link-{os.getpid()}")
            link.unlink(missing_ok=True)
            try:
                os.link(self.path, link)
                os.replace(link, self.prev)
            except OSError:  # no hard links on this file system: a rename (a crash before the write leaves prev)
                link.unlink(missing_ok=True)
                os.replace(self.path, self.prev)
        return save_checkpoint(self.path, state, kind=self.kind, meta=meta)

    def load(self, *, required: Iterable[str] = ()) -> tuple[dict[str, Any], Path]:
        """``(state, path)`` of the newest checkpoint that passes every check (see the class docstring)."""
        required = list(required)
        self.skipped = []
        for p in (self.path, self.prev):
            if not p.exists():
                continue
            try:
                return load_checkpoint(p, kind=self.kind, required=required), p
            except CheckpointError as e:
                self.skipped.append((str(p), str(e)))
        faults = "; ".join(m for _, m in self.skipped) or "neither file exists"
        raise CheckpointError(f"{self.path}: no loadable checkpoint ({faults})")

    def remove(self) -> None:
        """Delete both files (a fresh run)."""
        for p in (self.path, self.prev):
            p.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------------ RNG states
def rng_state(generators: Mapping[str, random.Random | torch.Generator] | None = None) -> dict[str, Any]:
    """The states of this process's random number generators: Python's global ``random`` (from which the rollout
    engines draw the seed of every request that has none), torch's CPU generator, every CUDA device's generator
    when CUDA is initialised, numpy's global generator when numpy is imported, and each of ``generators`` (a
    loop's own ``random.Random`` or ``torch.Generator``, e.g. its data sampler) under its name."""
    gens = dict(generators or {})
    out: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state(), "named": {}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        out["numpy"] = np.random.get_state()
    for name, g in gens.items():
        if isinstance(g, random.Random):
            out["named"][name] = ("python", g.getstate())
        elif isinstance(g, torch.Generator):
            out["named"][name] = ("torch", g.get_state())
        else:
            raise ArgumentError(f"generators[{name!r}]: expected a random.Random or a torch.Generator, got "
                                f"{type(g).__name__}")
    return out


def set_rng_state(state: Mapping[str, Any],
                  generators: Mapping[str, random.Random | torch.Generator] | None = None) -> None:
    """Restore what :func:`rng_state` captured, into the global generators and each of ``generators`` (the same
    names and kinds as at capture; a name missing on either side raises :class:`~rlblocks.errors.CheckpointError`
    before anything is restored)."""
    gens = dict(generators or {})
    if not isinstance(state, Mapping) or "python" not in state or "torch" not in state:
        raise CheckpointError(f"rng state: expected the mapping rng_state() returns, got {type(state).__name__}")
    named = state.get("named", {})
    if set(named) != set(gens):
        raise CheckpointError(f"rng state: holds generators {sorted(named)}, expected {sorted(gens)}")
    for name, g in gens.items():
        want = "python" if isinstance(g, random.Random) else "torch" if isinstance(g, torch.Generator) else None
        if want is None:
            raise ArgumentError(f"generators[{name!r}]: expected a random.Random or a torch.Generator, got "
                                f"{type(g).__name__}")
        if named[name][0] != want:
            raise CheckpointError(f"rng state: generator {name!r} was a {named[name][0]} generator, got a {want} one")
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np = sys.modules.get("numpy")
    if "numpy" in state and np is not None:
        np.random.set_state(state["numpy"])
    for name, g in gens.items():
        if isinstance(g, random.Random):
            g.setstate(named[name][1])
        else:
            g.set_state(named[name][1])
