"""Run checkpoints that survive a crash: written atomically, checked on load, loaded whole or not at all.

A run checkpoint is one file holding everything a loop needs to continue where it stopped: the model and optimizer
states, every sched block's ``state_dict``, the data cursor, the policy version, the RNG states of every rank and
the counters of the run's summary. The library only defines the file and the RNG capture; what goes into the state
is the loop's choice (``cookbook/plumbing/checkpoints.py`` is one). The file is a magic line, one JSON header (the
format version :data:`FORMAT`, kind, keys, ``meta``, payload length, a SHA-256 over header and payload) and the
``torch.save`` payload.

Writing (:func:`save_checkpoint`): a temporary file of this writer in the same directory, flushed and
``fsync``-ed, renamed over the destination (``os.replace``, atomic on POSIX), the directory ``fsync``-ed, so a
crash leaves either the old file or the new one, never a mix; temporaries of writers killed mid-write are removed
by the next save. :func:`replace_dir` does the same for a whole directory (an exported model, a saved adapter).

Reading (:func:`load_checkpoint`): the path must be a regular file, then the magic, the header, the format, the
kind, the payload length against the file's size (a torn file) and the SHA-256 are checked *before* anything is
unpickled, then the required keys; any failure raises :class:`~rlblocks.errors.CheckpointError` naming the file,
and nothing is returned. :class:`Checkpoint` keeps the previous file next to the latest one, so a checkpoint
damaged after it was written still leaves the one before it loadable. The payload is a pickle: load only
checkpoints you wrote; the checksum detects damage, not tampering. The format byte by byte: ``docs/faults.md``.

One file: writing and reading share the format, the temporaries' names and the checks, and each is tested against
the other.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import stat
import sys
import threading
import uuid
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from rlblocks.errors import ArgumentError, CheckpointError

__all__ = [
    "FORMAT",
    "Checkpoint",
    "load_checkpoint",
    "read_checkpoint_meta",
    "replace_dir",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]

FORMAT = 2
"""The version of the file layout this module writes."""

READ_FORMATS = (1, 2)
"""The versions it reads (format 1: the checksum covers the payload only)."""

MAGIC = b"RLBLOCKS-CHECKPOINT\n"
_MAX_HEADER = 1 << 20  # a header longer than this is not one of ours
_CHUNK = 1 << 20  # bytes hashed at a time when a file is checked without being loaded

# The temporaries this process is writing now: a save removes the other temporaries of this pid (left by an
# earlier process that had the same pid and was killed), never these.
_ACTIVE: set[str] = set()
_ACTIVE_LOCK = threading.Lock()


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


# ------------------------------------------------------------------------------------------------ temporaries
def _temp_name(path: Path, tag: str) -> Path:
    """``.<name>.<tag>-<pid>-<thread>-<random>`` next to ``path``: unique per writer, and the pid tells a later save
    whether its writer still runs."""
    return path.with_name(f".{path.name}.{tag}-{os.getpid()}-{threading.get_native_id()}-{uuid.uuid4().hex[:12]}")


class _Writing:
    """Registers a temporary of this process for the time it is written (see :data:`_ACTIVE`)."""

    def __init__(self, tmp: Path) -> None:
        self.key = tmp.name  # unique (pid, thread, random), and the same however the directory is spelt

    def __enter__(self) -> None:
        with _ACTIVE_LOCK:
            _ACTIVE.add(self.key)

    def __exit__(self, *exc: object) -> None:
        with _ACTIVE_LOCK:
            _ACTIVE.discard(self.key)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it runs, under another user
        return True
    return True


def _remove_stale(path: Path, tags: Iterable[str]) -> None:
    """Remove the temporaries of ``path`` (``.<name>.<tag>-<pid>...``) whose writer no longer runs: its pid is not
    alive, or it is this process's pid and the file is not one of this process's writes in progress. Temporaries
    of a live process (another writer) are kept, and so is a name that does not start with a pid."""
    prefixes = [f".{path.name}.{t}-" for t in tags]
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return
    me = os.getpid()
    for e in entries:
        prefix = next((p for p in prefixes if e.name.startswith(p)), None)
        if prefix is None:
            continue
        pid = e.name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        with _ACTIVE_LOCK:
            if e.name in _ACTIVE:
                continue
        if int(pid) == me or not _pid_alive(int(pid)):
            try:
                os.unlink(e.path)
            except OSError:  # removed by another writer meanwhile, or not ours to remove
                pass


# ------------------------------------------------------------------------------------------------ writing
def _check_destination(path: str | os.PathLike) -> Path:
    """``path`` as a ``Path`` whose directory exists and which is not itself a directory."""
    try:
        path = Path(path)
    except TypeError:
        raise ArgumentError(f"path: expected a file path (str or os.PathLike), got {type(path).__name__}") from None
    if not path.name:
        raise ArgumentError(f"path: expected a file path, got {str(path)!r}")
    if not path.parent.is_dir():
        raise ArgumentError(f"path: the directory {path.parent} of {path} does not exist (create it first)")
    if path.is_dir():
        raise ArgumentError(f"path: {path} is a directory, expected the path of a checkpoint file")
    return path


def _header_digest(fields: Mapping[str, Any], payload: bytes | memoryview) -> str:
    """The format-2 checksum: SHA-256 of the header without ``sha256`` (sorted-key JSON) and of the payload."""
    h = hashlib.sha256(json.dumps(fields, sort_keys=True).encode())
    h.update(b"\n")
    h.update(payload)
    return h.hexdigest()


def _encode(state: Mapping[str, Any], kind: str, meta: Mapping[str, Any] | None) -> tuple[bytes, memoryview]:
    """The checked arguments as ``(magic + header line, payload)``; nothing is written."""
    if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
        raise ArgumentError(f"state: expected a mapping with str keys, got {type(state).__name__}")
    if not isinstance(kind, str) or not kind:
        raise ArgumentError(f"kind: expected a non-empty str, got {kind!r}")
    if meta is not None and not isinstance(meta, Mapping):
        raise ArgumentError(f"meta: expected a mapping of JSON-serialisable values, got {type(meta).__name__}")
    buf = io.BytesIO()
    torch.save(dict(state), buf)
    payload = buf.getbuffer()
    fields = {"format": FORMAT, "kind": kind, "bytes": len(payload), "keys": sorted(state), "meta": dict(meta or {})}
    try:
        # a round trip, so that the reader hashes exactly what was hashed here (tuples become lists, ...)
        fields = json.loads(json.dumps(fields, sort_keys=True))
        header = json.dumps({**fields, "sha256": _header_digest(fields, payload)}, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise ArgumentError(f"meta: expected JSON-serialisable values, got {meta!r:.200}: {e}") from e
    return MAGIC + header.encode() + b"\n", payload


def _write(path: Path, head: bytes, payload: memoryview) -> int:
    """``head + payload`` to ``path`` by a temporary of this writer (module docstring); returns the bytes written."""
    tmp = _temp_name(path, "tmp")
    with _Writing(tmp):
        try:
            with open(tmp, "xb") as f:
                f.write(head)
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as e:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            if isinstance(e, (FileNotFoundError, NotADirectoryError)) and not path.parent.is_dir():
                raise ArgumentError(f"path: the directory {path.parent} of {path} does not exist") from None
            if isinstance(e, IsADirectoryError) or (isinstance(e, OSError) and path.is_dir()):
                raise ArgumentError(f"path: {path} is a directory, expected the path of a checkpoint file") from None
            raise
    _fsync_dir(path.parent)
    _remove_stale(path, ("tmp",))
    return len(head) + len(payload)


def save_checkpoint(path: str | os.PathLike, state: Mapping[str, Any], *, kind: str = "run",
                    meta: Mapping[str, Any] | None = None) -> int:
    """Write ``state`` to ``path`` atomically (temporary file, ``fsync``, rename, directory ``fsync``).

    Args:
        path: the destination; its directory must exist (else :class:`~rlblocks.errors.ArgumentError` naming it,
            as for a directory at ``path``).
        state: a mapping with ``str`` keys, serialisable by ``torch.save`` (tensors, plain Python values, picklable
            objects).
        kind: a label :func:`load_checkpoint` can insist on (``kind=``), so that a checkpoint of another sort is
            refused rather than half-used.
        meta: small JSON-serialisable facts stored in the header (e.g. the step), readable without loading the
            payload (:func:`read_checkpoint_meta`) and covered by the checksum.

    Returns the number of bytes written. A state that cannot be serialised raises before anything is written;
    a failed write (a full disk) removes its temporary and leaves ``path`` as it was. A successful one also
    removes the temporaries that writers killed mid-write left next to ``path`` (module docstring).
    """
    path = _check_destination(path)
    head, payload = _encode(state, kind, meta)
    return _write(path, head, payload)


@contextlib.contextmanager
def replace_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Write a whole directory at ``path`` so that a crash leaves the old one or the new one, never a part.

    The block writes into the yielded path, a fresh temporary sibling of ``path`` (``.<name>.dir-<pid>-...``,
    unique per writer; its parent is created). When the block ends without an exception the temporary is renamed to
    ``path`` (an existing directory there is renamed aside first and removed after), and the parent is
    ``fsync``-ed; when it raises, the temporary is removed and ``path`` is left as it was. A directory rename is
    atomic on POSIX, but the replacement takes two: between them ``path`` is briefly absent, never half-written.
    A file at ``path`` is refused (:class:`~rlblocks.errors.ArgumentError`)."""
    path = Path(path)
    if path.is_file() or path.is_symlink():
        raise ArgumentError(f"path: expected a directory to write, got the file {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(path, "dir")
    tmp.mkdir()
    try:
        yield tmp
        if path.exists():
            old = _temp_name(path, "old")
            path.rename(old)
            try:
                tmp.rename(path)
            except BaseException:
                old.rename(path)  # put the old directory back
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(path.parent)


# ------------------------------------------------------------------------------------------------ reading
_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _not_regular(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    return next((what for test, what in _FILE_KINDS if test(mode)), "not a regular file")


def _os_fault(path: Path, e: OSError) -> CheckpointError:
    return CheckpointError(f"{path}: cannot be read ({type(e).__name__}: {e.strerror or e})")


def _open_regular(path: Path, label: Path | None = None):
    """``(file, size)`` of the regular file at ``path``, opened for reading. Anything else (missing, a directory,
    a FIFO, a device, no permission) raises :class:`CheckpointError` without a blocking ``open``: the file is
    opened non-blocking and checked again through its descriptor (it may have been replaced since the ``stat``).
    Errors name ``label`` (default ``path``)."""
    label = path if label is None else label
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{label}: no checkpoint there") from None
    except OSError as e:
        raise _os_fault(label, e) from None
    what = _not_regular(st.st_mode)
    if what is not None:
        raise CheckpointError(f"{label}: {what}, not a checkpoint file")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointError(f"{label}: no checkpoint there") from None
    except OSError as e:
        raise _os_fault(label, e) from None
    try:
        st = os.fstat(fd)
        what = _not_regular(st.st_mode)
        if what is not None:
            raise CheckpointError(f"{label}: {what}, not a checkpoint file")
        return os.fdopen(fd, "rb"), st.st_size
    except BaseException:
        os.close(fd)
        raise


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
    fmt = header.get("format")
    if type(fmt) is not int or fmt not in READ_FORMATS:
        raise CheckpointError(f"{path}: checkpoint format {fmt!r}, this rlblocks reads formats "
                              f"{', '.join(map(str, READ_FORMATS))}")
    for key, typ in (("kind", str), ("bytes", int), ("sha256", str), ("keys", list), ("meta", dict)):
        if not isinstance(header.get(key), typ) or isinstance(header.get(key), bool):
            raise CheckpointError(f"{path}: damaged checkpoint: header field {key!r} is {header.get(key)!r:.80}")
    if header["bytes"] < 0:
        raise CheckpointError(f"{path}: damaged checkpoint: header field 'bytes' is {header['bytes']}")
    if not all(isinstance(k, str) for k in header["keys"]):
        raise CheckpointError(f"{path}: damaged checkpoint: header field 'keys' is {header['keys']!r:.80}")
    return header


def _check_length(path: Path, header: Mapping[str, Any], available: int) -> None:
    """The payload length of the header against the bytes the file holds after the header (nothing is read, so a
    damaged length such as ``2**62`` is never allocated)."""
    n = header["bytes"]
    if available < n:
        raise CheckpointError(f"{path}: torn checkpoint: {available} of its {n} payload bytes are there")
    if available > n:
        raise CheckpointError(f"{path}: damaged checkpoint: bytes follow the {n}-byte payload")


def _check_digest(path: Path, header: Mapping[str, Any], digest: str) -> None:
    if digest != header["sha256"]:
        what = "header and payload" if header["format"] >= 2 else "payload"
        raise CheckpointError(f"{path}: damaged checkpoint: the SHA-256 of its {what} is {digest[:16]}…, the header "
                              f"says {header['sha256'][:16]}…")


def _new_digest(header: Mapping[str, Any]):
    """A running SHA-256 primed for ``header``'s format (format 2 hashes the header first)."""
    if header["format"] >= 2:
        fields = {k: v for k, v in header.items() if k != "sha256"}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode() + b"\n")
    return hashlib.sha256()


def _check_kind(path: Path, header: Mapping[str, Any], kind: str | None) -> None:
    if kind is not None and header["kind"] != kind:
        raise CheckpointError(f"{path}: a {header['kind']!r} checkpoint, expected a {kind!r} one")


def _verify(path: Path, kind: str | None, label: Path) -> None:
    """Every check of :func:`load_checkpoint` that does not unpickle, on ``path`` (named ``label`` in the errors):
    the file is read and hashed in chunks (memory: one chunk), the state is not built."""
    try:
        f, size = _open_regular(path, label)
        with f:
            header = _read_header(f, label)
            _check_length(label, header, size - f.tell())
            h = _new_digest(header)
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    except OSError as e:
        raise _os_fault(label, e) from None
    _check_digest(label, header, h.hexdigest())
    _check_kind(label, header, kind)


def read_checkpoint_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The header of the checkpoint at ``path`` without its payload: ``{"kind", "bytes", "keys", "meta", ...}``.

    Neither the payload nor the checksum (which covers this header) is read or checked: a damaged header can come
    back from here; :func:`load_checkpoint` checks both. Raises :class:`~rlblocks.errors.CheckpointError` when
    ``path`` is not a readable checkpoint file."""
    path = Path(path)
    try:
        f, _ = _open_regular(path)
        with f:
            return _read_header(f, path)
    except OSError as e:
        raise _os_fault(path, e) from None


def load_checkpoint(path: str | os.PathLike, *, kind: str | None = None,
                    required: Iterable[str] = ()) -> dict[str, Any]:
    """The state :func:`save_checkpoint` wrote to ``path``, after every check of the module docstring.

    Args:
        kind: when given, the checkpoint's kind must be this.
        required: keys the state must hold.

    Raises :class:`~rlblocks.errors.CheckpointError` (naming ``path`` and the fault: missing, not a regular file,
    unreadable, foreign, torn, damaged header or payload, another format version or kind, a missing key) and
    returns nothing in that case.
    """
    path = Path(path)
    try:
        f, size = _open_regular(path)
        with f:
            header = _read_header(f, path)
            _check_length(path, header, size - f.tell())
            try:
                payload = f.read(header["bytes"] + 1)
            except MemoryError:
                raise CheckpointError(f"{path}: its {header['bytes']}-byte payload does not fit in memory") from None
    except OSError as e:
        raise _os_fault(path, e) from None
    if len(payload) != header["bytes"]:  # the file changed while it was read
        raise CheckpointError(f"{path}: torn checkpoint: {len(payload)} of its {header['bytes']} payload bytes "
                              "could be read")
    h = _new_digest(header)
    h.update(payload)
    _check_digest(path, header, h.hexdigest())
    _check_kind(path, header, kind)
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)
    except Exception as e:  # the checksum matched, so this is a file written by an incompatible torch/pickle
        raise CheckpointError(f"{path}: the payload could not be read back ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a dict payload, got {type(state).__name__}")
    if sorted(state) != header["keys"]:  # format 1 has no checksum over the header
        raise CheckpointError(f"{path}: damaged checkpoint: the header lists the keys {header['keys']}, the state "
                              f"holds {sorted(state)}")
    missing = [k for k in required if k not in state]
    if missing:
        raise CheckpointError(f"{path}: missing key(s) {missing} (it has {sorted(state)})")
    return state


class Checkpoint:
    """A checkpoint file that keeps its predecessor: ``path`` (the latest) and ``<stem>.prev<suffix>``.

    :meth:`save` first serialises the new state (a state that cannot be serialised changes nothing), then gives
    the latest file the ``prev`` name too (a hard link, renamed over the old ``prev``) — only when that file passes
    every check of :func:`load_checkpoint` but the unpickling (it is read and hashed once more) — and then writes
    the new one with :func:`save_checkpoint`, so at every instant both names hold complete files (where the file
    system has no hard links the latest file is renamed instead, and a crash before the new one is in place leaves
    only ``prev``). A latest file that fails its checks is not kept: ``prev`` stays as it is, which a
    ``RuntimeWarning`` says and :attr:`not_rotated` (``[(path, message)]``, over the object's life) records, so
    that a damaged file never replaces the last good one. Saves through one object are serialised (a lock); saves
    from several objects, threads or processes use writer-unique temporaries and never collide.

    :meth:`load` returns the newest file that passes every check, falling back to the previous one when the
    latest is missing or fails in any way (torn, damaged, foreign, a directory, a FIFO, unreadable, a header whose
    numbers are impossible); the faults it skipped are in :attr:`skipped` (``[(path, message)]``) so that a caller
    can report them. When no file passes, it raises :class:`~rlblocks.errors.CheckpointError` listing every fault.
    """

    def __init__(self, path: str | os.PathLike, *, kind: str = "run") -> None:
        try:
            self.path = Path(path)
        except TypeError:
            raise ArgumentError(f"path: expected a file path (str or os.PathLike), got {type(path).__name__}") from None
        if not self.path.name:
            raise ArgumentError(f"path: expected a file path, got {str(path)!r}")
        if not isinstance(kind, str) or not kind:
            raise ArgumentError(f"kind: expected a non-empty str, got {kind!r}")
        self.prev = self.path.with_name(f"{self.path.stem}.prev{self.path.suffix}")
        self.kind = kind
        self.skipped: list[tuple[str, str]] = []
        self.not_rotated: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def exists(self) -> bool:
        """True when the latest or the previous file is there (loadable or not)."""
        return self.path.exists() or self.prev.exists()

    def _rotate(self) -> None:
        """The latest file becomes ``prev`` when it passes its checks (class docstring)."""
        try:
            os.lstat(self.path)
        except OSError:
            return  # nothing there (or nothing this process can see): prev stays
        link = _temp_name(self.prev, "link")
        with _Writing(link):
            try:
                os.link(self.path, link)  # the file checked below is the one that becomes prev, whatever happens
                source = link
            except FileNotFoundError:
                return
            except OSError:  # no hard links here (or not a file): the latest is renamed after its check
                source = self.path
            try:
                _verify(source, self.kind, self.path)
                os.replace(source, self.prev)
            except CheckpointError as e:
                self.not_rotated.append((str(self.path), str(e)))
                warnings.warn(f"{self.path} fails its checks and is not kept as {self.prev.name}, which stays as it "
                              f"was: {e}", RuntimeWarning, stacklevel=3)
            finally:
                if source is link:
                    link.unlink(missing_ok=True)

    def save(self, state: Mapping[str, Any], *, meta: Mapping[str, Any] | None = None) -> int:
        """Write ``state`` as the latest checkpoint; the one it replaces becomes the previous one if it passes its
        checks (class docstring). Returns the bytes written; raises as :func:`save_checkpoint` does."""
        path = _check_destination(self.path)
        if self.prev.is_dir():
            raise ArgumentError(f"path: {self.prev} (where the previous checkpoint of {path} goes) is a directory")
        head, payload = _encode(state, self.kind, meta)
        with self._lock:
            self._rotate()
            n = _write(path, head, payload)
        _remove_stale(self.prev, ("link",))
        return n

    def load(self, *, required: Iterable[str] = ()) -> tuple[dict[str, Any], Path]:
        """``(state, path)`` of the newest checkpoint that passes every check (see the class docstring)."""
        required = list(required)
        self.skipped = []
        for p in (self.path, self.prev):
            try:
                os.stat(p)
            except FileNotFoundError:
                continue  # absent: not a fault (a run before its first save, a deleted file)
            except OSError:
                pass  # load_checkpoint names it
            try:
                return load_checkpoint(p, kind=self.kind, required=required), p
            except CheckpointError as e:
                self.skipped.append((str(p), str(e)))
            except Exception as e:  # anything else that fails reading this file: the other one may be good
                self.skipped.append((str(p), f"{p}: could not be loaded ({type(e).__name__}: {e})"))
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
