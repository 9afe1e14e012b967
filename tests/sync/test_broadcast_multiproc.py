"""Multi-process sync over gloo: separately launched trainer / rollout processes (no shared torchrun world).

The workers (tests/sync/_worker.py) each call init_sync_group themselves; the default process group is never
initialised in either. References: the sender's own tensors (CRC-32 of every tensor's bytes).
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _launch import free_port, launch, result

START_TIMEOUT = 240  # process start-up (torch imports) on a loaded 2-core machine


@pytest.fixture(scope="module")
def session(tiny_hf_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sync_session")
    port = free_port()
    procs = [
        launch(role, rank=r, world_size=2, port=port, out=tmp / f"{role}.json", timeout=60, model_dir=tiny_hf_dir)
        for r, role in enumerate(("session_trainer", "session_rollout"))
    ]
    logs = [p.communicate(timeout=START_TIMEOUT)[0].decode(errors="replace") for p in procs]
    res = [result(tmp / f"{role}.json") for role in ("session_trainer", "session_rollout")]
    for r, log in zip(res, logs):
        assert r["ok"], r.get("exception", "") + log[-3000:]
    return res


def test_full_sync_receiver_equals_sender(session):
    trainer, rollout = session
    assert rollout["version"] == 7
    assert rollout["full_crc"] == trainer["full_crc"]
    assert not trainer["default_pg_initialized"] and not rollout["default_pg_initialized"]


def test_metadata_mismatch_refused_on_both_sides(session):
    trainer, rollout = session
    for side in (trainer, rollout):
        assert side["mismatch"].startswith("SyncMismatchError"), side["mismatch"]
        assert "norm.weight" in side["mismatch"] and "[3]" in side["mismatch"]


def test_delta_over_group(session):
    trainer, rollout = session
    assert rollout["versions"] == [8, 9, 10]
    assert rollout["delta_crc"] == trainer["delta_crc"]
    assert rollout["delta_crc"] != rollout["full_crc"]
    # ~3 % of fp32 elements changed per step: far below the full size (gap16 bound 1.1 * 0.03 * (4 + 2) / 4).
    assert all(0 < w < 0.06 * trainer["full_bytes"] for w in trainer["wire"])


@pytest.fixture(scope="module")
def dead_peers(tmp_path_factory):
    """Two pairs at once: in one the sender is SIGKILLed (connection reset), in the other the receiver is
    SIGSTOPped (alive but silent: only the group timeout can end the wait)."""
    tmp = tmp_path_factory.mktemp("sync_dead")
    timeout = 5.0
    pairs = {}
    for case in ("kill_sender", "stop_receiver"):
        port = free_port()
        s = launch("loop_sender", rank=0, world_size=2, port=port, out=tmp / f"{case}_s.json", timeout=timeout)
        r = launch("loop_receiver", rank=1, world_size=2, port=port, out=tmp / f"{case}_r.json", timeout=timeout)
        pairs[case] = (s, r)
    out = {}
    for case, (s, r) in pairs.items():
        victim, survivor = (s, r) if case == "kill_sender" else (r, s)
        line = victim.stdout.readline()
        assert line.strip() == b"READY", line + victim.stdout.read()[-2000:]
        victim.send_signal(signal.SIGSTOP if case.startswith("stop") else signal.SIGKILL)
        t0 = time.monotonic()
        survivor.communicate(timeout=START_TIMEOUT)
        waited = time.monotonic() - t0
        victim.kill()
        victim.communicate()
        name = f"{case}_{'r' if survivor is r else 's'}.json"
        out[case] = (result(tmp / name), waited, timeout)
    return out


@pytest.mark.parametrize("case", ["kill_sender", "stop_receiver"])
def test_dead_peer_fails_within_timeout(dead_peers, case):
    res, waited, timeout = dead_peers[case]
    assert res["ok"], res.get("exception")
    assert res["error"].startswith("SyncError"), res["error"]
    assert res["fail_after_s"] < timeout + 2.0
    assert waited < timeout + 15.0  # the survivor process exited instead of hanging
    if case == "kill_sender":
        assert res["equal"]  # what it received before the sender died was exact
