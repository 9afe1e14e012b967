"""rlblocks.checkpoint: atomic writes, every kind of damaged file refused by name, the previous file still loadable,
RNG states round-tripped exactly."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from rlblocks.checkpoint import (
    MAGIC,
    Checkpoint,
    load_checkpoint,
    read_checkpoint_meta,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from rlblocks.errors import ArgumentError, CheckpointError


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(8, 4, generator=g), "b": torch.zeros(4, dtype=torch.float64)},
            "optim": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 1e-3}]},
            "step": 7 + seed, "counters": Counter(samples_trained=64), "items": [({"uid": "r1-0-3"}, 5, 0.25)]}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_round_trip_keeps_every_value_and_the_meta(tmp_path):
    p = tmp_path / "ckpt.pt"
    n = save_checkpoint(p, _state(), meta={"step": 7})
    assert n == p.stat().st_size
    assert _same(load_checkpoint(p, kind="run", required=("model", "optim")), _state())
    meta = read_checkpoint_meta(p)
    assert meta["meta"] == {"step": 7} and meta["kind"] == "run" and meta["keys"] == sorted(_state())
    assert [q.name for q in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary file left behind


def _header_end(data: bytes) -> int:
    return len(MAGIC) + data[len(MAGIC):].index(b"\n") + 1


@pytest.mark.parametrize("where", ["magic", "header", "payload", "last_byte"])
def test_a_torn_file_is_refused_as_torn(tmp_path, where):
    p = tmp_path / "ckpt.pt"
    save_checkpoint(p, _state())
    data = p.read_bytes()
    cut = {"magic": 5, "header": len(MAGIC) + 10, "payload": _header_end(data) + 100, "last_byte": len(data) - 1}
    p.write_bytes(data[:cut[where]])
    with pytest.raises(CheckpointError, match=r"ckpt\.pt: torn checkpoint"):
        load_checkpoint(p)


def test_a_flipped_payload_byte_fails_the_checksum(tmp_path):
    p = tmp_path / "ckpt.pt"
    save_checkpoint(p, _state())
    data = bytearray(p.read_bytes())
    data[_header_end(data) + len(data[_header_end(data):]) // 2] ^= 0x01
    p.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256"):
        load_checkpoint(p)


def test_a_flipped_header_byte_is_refused(tmp_path):
    p = tmp_path / "ckpt.pt"
    save_checkpoint(p, _state())
    data = p.read_bytes()
    end = _header_end(data)
    header = json.loads(data[len(MAGIC):end])
    header["bytes"] += 1  # a byte of the length field changed: the payload now looks torn
    p.write_bytes(MAGIC + json.dumps(header).encode() + b"\n" + data[end:])
    with pytest.raises(CheckpointError, match="torn"):
        load_checkpoint(p)
    p.write_bytes(MAGIC + b"{not json\n" + data[end:])
    with pytest.raises(CheckpointError, match="header is not JSON"):
        load_checkpoint(p)


def test_another_format_version_kind_or_a_foreign_file_is_refused(tmp_path):
    p = tmp_path / "ckpt.pt"
    save_checkpoint(p, _state())
    data = p.read_bytes()
    end = _header_end(data)
    header = json.loads(data[len(MAGIC):end])
    for fmt in (3, 0, "2", True):
        p.write_bytes(MAGIC + json.dumps({**header, "format": fmt}).encode() + b"\n" + data[end:])
        with pytest.raises(CheckpointError, match=f"checkpoint format {fmt!r}, this rlblocks reads formats 1, 2"):
            load_checkpoint(p)
    save_checkpoint(p, _state(), kind="teacher")
    with pytest.raises(CheckpointError, match="a 'teacher' checkpoint, expected a 'run' one"):
        load_checkpoint(p, kind="run")
    torch.save(_state(), p)  # a plain torch file (e.g. written by an older loop)
    with pytest.raises(CheckpointError, match="not an rlblocks checkpoint"):
        load_checkpoint(p)
    with pytest.raises(CheckpointError, match="no checkpoint there"):
        load_checkpoint(tmp_path / "absent.pt")


def test_a_missing_key_is_named(tmp_path):
    p = tmp_path / "ckpt.pt"
    state = _state()
    del state["optim"]
    save_checkpoint(p, state)
    with pytest.raises(CheckpointError, match=r"missing key\(s\) \['optim'\]"):
        load_checkpoint(p, required=("model", "optim", "step"))


def test_bad_arguments_are_refused_by_name(tmp_path):
    with pytest.raises(ArgumentError, match="state"):
        save_checkpoint(tmp_path / "c.pt", {1: 2})
    with pytest.raises(ArgumentError, match="meta"):
        save_checkpoint(tmp_path / "c.pt", {"a": 1}, meta={"x": object()})
    with pytest.raises(ArgumentError, match="kind"):
        save_checkpoint(tmp_path / "c.pt", {"a": 1}, kind="")
    assert not (tmp_path / "c.pt").exists()


@pytest.mark.parametrize("damage", ["torn", "flipped", "foreign", "deleted"])
def test_the_previous_checkpoint_is_still_loadable_when_the_latest_is_damaged(tmp_path, damage):
    ck = Checkpoint(tmp_path / "ckpt.pt")
    ck.save(_state(0), meta={"step": 7})
    ck.save(_state(1), meta={"step": 8})
    assert ck.prev.exists() and read_checkpoint_meta(ck.prev)["meta"] == {"step": 7}
    state, path = ck.load(required=("model",))
    assert path == ck.path and _same(state, _state(1)) and ck.skipped == []
    data = ck.path.read_bytes()
    if damage == "torn":
        ck.path.write_bytes(data[: len(data) // 2])
    elif damage == "flipped":
        ck.path.write_bytes(data[:-10] + bytes([data[-10] ^ 0x80]) + data[-9:])
    elif damage == "foreign":
        ck.path.write_bytes(b"PK\x03\x04 something else")
    else:
        ck.path.unlink()
    state, path = ck.load(required=("model",))
    assert path == ck.prev and _same(state, _state(0))
    assert len(ck.skipped) == (0 if damage == "deleted" else 1)
    ck.prev.write_bytes(b"")  # both gone: one error naming every fault
    with pytest.raises(CheckpointError, match="no loadable checkpoint"):
        ck.load()


_WRITER = """
import sys, torch
from rlblocks.checkpoint import Checkpoint
ck = Checkpoint(sys.argv[1])
big = torch.arange(8 << 20, dtype=torch.float32)  # 32 MiB: a write takes long enough to be caught in the middle
i = 0
while True:
    i += 1
    ck.save({"step": i, "model": {"w": big + i}}, meta={"step": i})
"""


def test_a_writer_killed_mid_write_leaves_a_loadable_checkpoint(tmp_path):
    p = tmp_path / "ckpt.pt"
    Checkpoint(p).save({"step": 0, "model": {"w": torch.zeros(3)}}, meta={"step": 0})
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(p)], env={**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), *sys.path])})
    try:
        deadline = time.monotonic() + 120  # a hang guard only: it is killed as soon as a write is in progress
        while time.monotonic() < deadline and proc.poll() is None:
            if any(q.name.startswith(".ckpt.pt.tmp-") for q in tmp_path.iterdir()) and read_checkpoint_meta(
                    p)["meta"]["step"] >= 2:
                break
            time.sleep(0.01)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    state, _ = Checkpoint(p).load(required=("model", "step"))
    assert state["step"] >= 1
    if state["step"] > 0:  # a complete write, never a mix of two
        assert torch.equal(state["model"]["w"], torch.arange(8 << 20, dtype=torch.float32) + state["step"])


def test_rng_states_round_trip_exactly():
    data = random.Random(5)
    perm = torch.Generator().manual_seed(3)
    saved = rng_state({"data": data, "perm": perm})
    first = (random.random(), torch.rand(3), data.random(), torch.randperm(10, generator=perm), random.getrandbits(62))
    set_rng_state(saved, {"data": data, "perm": perm})
    again = (random.random(), torch.rand(3), data.random(), torch.randperm(10, generator=perm), random.getrandbits(62))
    assert first[0] == again[0] and torch.equal(first[1], again[1]) and first[2] == again[2]
    assert torch.equal(first[3], again[3]) and first[4] == again[4]


def test_rng_state_with_other_generators_is_refused_before_anything_is_restored():
    saved = rng_state({"data": random.Random(1)})
    random.seed(11)
    expected = random.Random(11).random()
    with pytest.raises(CheckpointError, match=r"holds generators \['data'\], expected \['other'\]"):
        set_rng_state(saved, {"other": random.Random(2)})
    with pytest.raises(CheckpointError, match="was a python generator"):
        set_rng_state(saved, {"data": torch.Generator()})
    assert random.random() == expected  # the global generator was not touched
    with pytest.raises(ArgumentError, match=r"generators\['x'\]"):
        rng_state({"x": 3})


# ------------------------------------------------------------------------------------------------ replace_dir
def test_replace_dir_writes_replaces_and_leaves_the_old_directory_on_failure(tmp_path):
    from rlblocks.checkpoint import replace_dir

    out = tmp_path / "sub" / "policy"
    with replace_dir(out) as d:
        assert d.is_dir() and d.parent == out.parent and d != out and not out.exists()
        (d / "a.txt").write_text("one")
    assert sorted(p.name for p in out.parent.iterdir()) == ["policy"]  # no temporary left beside it
    assert (out / "a.txt").read_text() == "one"

    with replace_dir(out) as d:  # an existing directory is replaced whole (its other files go too)
        (d / "b.txt").write_text("two")
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"]

    with pytest.raises(RuntimeError, match="killed"):
        with replace_dir(out) as d:
            (d / "c.txt").write_text("half")
            raise RuntimeError("killed mid-write")
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"]  # untouched
    assert sorted(p.name for p in out.parent.iterdir()) == ["policy"]  # the half-written temporary is gone

    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ArgumentError, match="path: expected a directory to write, got the file"):
        with replace_dir(f):
            pass
    assert f.read_text() == "x"
