"""Attacks and faults on run checkpoints, so that the holes they found stay closed: a damaged latest file never
replaces the last good one, any failure to read the latest falls back to the previous one (a FIFO without
blocking), an edited header is refused, concurrent writers never collide, and the temporaries of killed writers
are removed by the next save."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from rlblocks.checkpoint import MAGIC, Checkpoint, load_checkpoint, read_checkpoint_meta, save_checkpoint
from rlblocks.errors import ArgumentError, CheckpointError

ROOT = Path(__file__).resolve().parents[2]


def _header_end(data: bytes) -> int:
    return len(MAGIC) + data[len(MAGIC):].index(b"\n") + 1


def _edit_header(path: Path, **fields) -> None:
    """Rewrite the header of ``path`` with ``fields`` changed (the checksum left as it was)."""
    data = path.read_bytes()
    end = _header_end(data)
    header = json.loads(data[len(MAGIC):end])
    path.write_bytes(MAGIC + json.dumps({**header, **fields}).encode() + b"\n" + data[end:])


def _two_saves(tmp_path: Path) -> Checkpoint:
    ck = Checkpoint(tmp_path / "ckpt.pt")
    ck.save({"step": 1, "w": torch.ones(3)}, meta={"step": 1})
    ck.save({"step": 2, "w": torch.full((3,), 2.0)}, meta={"step": 2})
    return ck


def _in_thread(fn, *args):
    """``fn(*args)`` in a thread; the join timeout is a guard against a hang (a blocking open), not a timing."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=120)
    return t, out


# ------------------------------------------------------------------------------- a damaged latest is never rotated
def test_the_sequence_that_lost_every_checkpoint_now_ends_loadable(tmp_path):
    """Two saves, the latest torn, a save that fails (an unpicklable value): step 1 is still loadable."""
    ck = Checkpoint(tmp_path / "ckpt.pt")
    ck.save({"step": 1})
    ck.save({"step": 2})
    with open(ck.path, "r+b") as f:
        f.truncate(100)
    assert ck.load()[0] == {"step": 1}
    with pytest.raises(Exception):  # noqa: B017 - whatever pickle raises for a lambda
        ck.save({"step": 2, "bad": lambda: 0})
    state, path = ck.load()
    assert state == {"step": 1} and path == ck.prev
    assert "torn checkpoint" in ck.skipped[0][1]


def test_a_save_that_fails_after_the_rotation_keeps_the_good_previous_file(tmp_path, monkeypatch):
    """The same sequence with a failure after serialisation (a full disk during the write): the damaged latest file
    is not rotated into ``prev`` (a warning, a record in ``not_rotated``), so ``prev`` still holds step 1."""
    ck = _two_saves(tmp_path)
    data = ck.path.read_bytes()
    ck.path.write_bytes(data[:-1] + bytes([data[-1] ^ 0x01]))  # one flipped payload bit

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", full_disk)
        with pytest.warns(RuntimeWarning, match=r"ckpt\.pt fails its checks and is not kept as ckpt\.prev\.pt"):
            with pytest.raises(OSError, match="No space left"):
                ck.save({"step": 3}, meta={"step": 3})
    assert len(ck.not_rotated) == 1 and "SHA-256" in ck.not_rotated[0][1]
    state, path = ck.load()
    assert path == ck.prev and state["step"] == 1
    assert sorted(q.name for q in tmp_path.iterdir()) == ["ckpt.prev.pt", "ckpt.pt"]  # the temporary went too
    # the next save that succeeds: step 3 is the latest, step 1 still the previous one (the damaged file is gone)
    with pytest.warns(RuntimeWarning, match="not kept"):
        ck.save({"step": 3}, meta={"step": 3})
    assert load_checkpoint(ck.path)["step"] == 3 and load_checkpoint(ck.prev)["step"] == 1
    ck.save({"step": 4})  # a good latest file is rotated as before
    assert load_checkpoint(ck.prev)["step"] == 3 and len(ck.not_rotated) == 2


def test_a_latest_file_of_another_kind_is_not_rotated(tmp_path):
    ck = _two_saves(tmp_path)
    save_checkpoint(ck.path, {"step": 9}, kind="teacher")
    with pytest.warns(RuntimeWarning, match="a 'teacher' checkpoint, expected a 'run' one"):
        ck.save({"step": 3})
    assert load_checkpoint(ck.prev)["step"] == 1


# ------------------------------------------------------------------------ any failure to read the latest falls back
def _make_directory(p: Path) -> str:
    p.unlink()
    p.mkdir()
    return "a directory"


def _make_fifo(p: Path) -> str:
    p.unlink()
    os.mkfifo(p)
    return "a FIFO"


def _make_loop(p: Path) -> str:
    p.unlink()
    p.symlink_to(p.name)  # a symlink to itself: ELOOP
    return "cannot be read"


def _bytes(value):
    def edit(p: Path) -> str:
        _edit_header(p, bytes=value)
        return {-5: "header field 'bytes' is -5", 2**62: f"of its {2**62} payload bytes are there",
                True: "header field 'bytes' is True"}[value]
    return edit


FAULTS = {"directory": _make_directory, "fifo": _make_fifo, "symlink loop": _make_loop, "bytes -5": _bytes(-5),
          "bytes 2**62": _bytes(2**62), "bytes true": _bytes(True)}


@pytest.mark.parametrize("fault", FAULTS)
def test_any_failure_to_read_the_latest_falls_back_to_the_previous_file(tmp_path, fault):
    ck = _two_saves(tmp_path)
    why = FAULTS[fault](ck.path)
    t, out = _in_thread(ck.load)
    if t.is_alive():  # unblock a reader stuck in open() so that the test ends
        os.close(os.open(ck.path, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"load() blocked on {fault}")
    state, path = out["value"]
    assert path == ck.prev and state["step"] == 1
    assert len(ck.skipped) == 1 and ck.skipped[0][0] == str(ck.path) and why in ck.skipped[0][1]
    with pytest.raises(CheckpointError) as e:  # the function alone: a CheckpointError too, naming the fault
        load_checkpoint(ck.path)
    assert why in str(e.value) and str(ck.path) in str(e.value)
    # the previous file fails too (a directory): one error that names both faults
    ck.prev.unlink()
    ck.prev.mkdir()
    with pytest.raises(CheckpointError, match=r"ckpt\.pt: no loadable checkpoint") as e:
        ck.load()
    assert why in str(e.value) and "ckpt.prev.pt: a directory" in str(e.value)


def test_an_unreadable_latest_falls_back_to_the_previous_file(tmp_path, monkeypatch):
    """``PermissionError`` (a root test runner reads any file, so the refusal of ``open`` is also simulated)."""
    ck = _two_saves(tmp_path)
    ck.path.chmod(0)
    real_open = os.open

    def refuse(path, *args, **kw):
        if Path(path) == ck.path:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *args, **kw)

    monkeypatch.setattr(os, "open", refuse)
    state, path = ck.load()
    assert path == ck.prev and state["step"] == 1
    assert "cannot be read (PermissionError: Permission denied)" in ck.skipped[0][1]


def test_a_fifo_at_the_latest_path_neither_blocks_a_save_nor_becomes_prev(tmp_path):
    ck = _two_saves(tmp_path)
    _make_fifo(ck.path)
    with pytest.warns(RuntimeWarning, match="a FIFO, not a checkpoint file"):
        t, out = _in_thread(ck.save, {"step": 3})
    if t.is_alive():
        os.close(os.open(ck.path, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("save() blocked on a FIFO")
    assert "error" not in out, out
    assert load_checkpoint(ck.path)["step"] == 3 and load_checkpoint(ck.prev)["step"] == 1
    assert read_checkpoint_meta(ck.path)["keys"] == ["step"]


# ------------------------------------------------------------------------------------------ the header is checked
def test_an_edited_header_is_refused_and_the_previous_file_loads(tmp_path):
    ck = _two_saves(tmp_path)
    data = ck.path.read_bytes()
    assert data.count(b'"step": 2') == 1
    ck.path.write_bytes(data.replace(b'"step": 2', b'"step": 7'))
    assert read_checkpoint_meta(ck.path)["meta"] == {"step": 7}  # the header alone is not checked (documented)
    with pytest.raises(CheckpointError, match=r"damaged checkpoint: the SHA-256 of its header and payload"):
        load_checkpoint(ck.path)
    state, path = ck.load()
    assert path == ck.prev and state["step"] == 1
    for field in ({"keys": ["step"]}, {"kind": "teacher"}, {"meta": {}}):
        ck.path.write_bytes(data)
        _edit_header(ck.path, **field)
        with pytest.raises(CheckpointError, match="SHA-256 of its header and payload"):
            load_checkpoint(ck.path)


def _format1(path: Path, state: dict, **header) -> None:
    """A file as the format-1 writer made it (its checksum covers the payload only)."""
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    head = {"format": 1, "kind": "run", "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest(),
            "keys": sorted(state), "meta": {"step": state["step"]}, **header}
    path.write_bytes(MAGIC + json.dumps(head, sort_keys=True).encode() + b"\n" + payload)


def test_files_of_the_previous_format_still_load_and_their_keys_are_checked(tmp_path):
    p = tmp_path / "ckpt.pt"
    _format1(p, {"step": 4, "w": torch.arange(3)})
    state = load_checkpoint(p, required=("w",))
    assert state["step"] == 4 and torch.equal(state["w"], torch.arange(3))
    ck = Checkpoint(p)
    ck.save({"step": 5})  # a format-1 latest file passes its checks: it becomes prev
    assert load_checkpoint(ck.prev)["step"] == 4 and read_checkpoint_meta(p)["format"] == 2
    _format1(p, {"step": 4, "w": torch.arange(3)}, keys=["step", "v"])
    with pytest.raises(CheckpointError, match=r"the header lists the keys \['step', 'v'\], the state holds"):
        load_checkpoint(p)
    # a format-2 file relabelled format 1 fails the (payload-only) checksum
    save_checkpoint(p, {"step": 6})
    _edit_header(p, format=1)
    with pytest.raises(CheckpointError, match="SHA-256 of its payload"):
        load_checkpoint(p)


# --------------------------------------------------------------------------------------------- concurrent writers
@pytest.mark.parametrize(("shared", "relative"), [(True, False), (False, False), (False, True)],
                         ids=["one-object", "one-object-per-thread", "relative-path"])
def test_eight_threads_saving_five_times_never_raise_and_the_last_file_loads(tmp_path, monkeypatch, shared,
                                                                              relative):
    """With a relative path too: a save's cleanup must recognise another thread's temporary in progress however
    the directory is spelt (``./.ckpt.pt.tmp-...``)."""
    if relative:
        monkeypatch.chdir(tmp_path)
    path = Path("ckpt.pt") if relative else tmp_path / "ckpt.pt"
    one = Checkpoint(path)
    start = threading.Barrier(8)
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        ck = one if shared else Checkpoint(path)
        try:
            start.wait()
            for j in range(5):
                ck.save({"writer": i, "save": j, "w": torch.full((1000,), float(10 * i + j))}, meta={"w": i})
        except BaseException as e:  # collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for p in (path, one.prev):
        state = load_checkpoint(p)
        assert torch.equal(state["w"], torch.full((1000,), float(10 * state["writer"] + state["save"])))
    assert sorted(q.name for q in tmp_path.iterdir()) == ["ckpt.prev.pt", "ckpt.pt"]


# ------------------------------------------------------------------------------------------- stale temporaries
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temporaries_are_removed_by_the_next_save_and_live_ones_kept(tmp_path):
    ck = _two_saves(tmp_path)
    dead = _dead_pid()
    stale = [f".ckpt.pt.tmp-{dead}", f".ckpt.pt.tmp-{dead}-77-0a1b2c", f".ckpt.pt.tmp-{os.getpid()}-1-0a1b2c",
             f".ckpt.prev.pt.link-{dead}-3-ffffff"]
    live = [".ckpt.pt.tmp-1-1-0a1b2c",  # pid 1 runs: another writer's file in progress
            ".ckpt.pt.tmp-notapid", "other.tmp-5"]
    for name in stale + live:
        (tmp_path / name).write_bytes(b"x" * 100)
    ck.save({"step": 3})
    left = sorted(q.name for q in tmp_path.iterdir())
    assert left == sorted(["ckpt.pt", "ckpt.prev.pt", *live])
    save_checkpoint(tmp_path / "other.pt", {"a": 1})  # the function alone cleans its own path's temporaries only
    assert (tmp_path / ".ckpt.pt.tmp-1-1-0a1b2c").exists()


_KILLED_WRITER = """
import os, sys
from rlblocks import checkpoint

def hang(fd):
    print("writing", flush=True)
    sys.stdin.read()  # until killed

os.fsync = hang
checkpoint.Checkpoint(sys.argv[1]).save({"step": 3, "blob": b"x" * (1 << 20)})
"""


def test_the_temporary_of_a_writer_killed_mid_write_is_removed_by_the_next_save(tmp_path):
    ck = _two_saves(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(ck.path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout.readline() == b"writing\n"  # the full temporary is on disk, its writer waits
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()
    temps = [q for q in tmp_path.iterdir() if q.name.startswith(".ckpt.pt.tmp-")]
    assert len(temps) == 1 and temps[0].stat().st_size > 1 << 20
    assert ck.load()[0]["step"] == 2  # the kill left both files as they were
    ck.save({"step": 4})
    assert sorted(q.name for q in tmp_path.iterdir()) == ["ckpt.prev.pt", "ckpt.pt"]
    assert ck.load()[0]["step"] == 4


# ------------------------------------------------------------------------------------------------ bad destinations
def test_a_missing_directory_or_a_directory_at_the_path_is_refused_by_name(tmp_path):
    missing = tmp_path / "no" / "such" / "ckpt.pt"
    with pytest.raises(ArgumentError, match=rf"path: the directory {missing.parent} of {missing} does not exist"):
        save_checkpoint(missing, {"a": 1})
    with pytest.raises(ArgumentError, match="does not exist"):
        Checkpoint(missing).save({"a": 1})
    (tmp_path / "d").mkdir()
    with pytest.raises(ArgumentError, match=rf"path: {tmp_path / 'd'} is a directory"):
        save_checkpoint(tmp_path / "d", {"a": 1})
    with pytest.raises(ArgumentError, match="is a directory"):
        Checkpoint(tmp_path / "d").save({"a": 1})
    ck = Checkpoint(tmp_path / "c.pt")
    ck.prev.mkdir()
    with pytest.raises(ArgumentError, match=r"c\.prev\.pt \(where the previous checkpoint of .* goes\) is a dir"):
        ck.save({"a": 1})
    assert sorted(q.name for q in tmp_path.iterdir()) == ["c.prev.pt", "d"]
