"""Colocated handoff through shared memory: a TorchEngine in a second process loads the trainer's weights from views
of the trainer's own buffers. References: CRC-32 (zlib) of the trainer's tensors; a byte written by the engine
process into its view, read back by the trainer from its buffer (the storage is shared, not copied)."""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from rlblocks.errors import WeightUpdateError
from rlblocks.sync import HandoffSender, open_handoff
from rlblocks.sync.buckets import TensorMeta
from rlblocks.sync.handoff import HandoffBucket, HandoffMessage

WORKER = Path(__file__).with_name("_handoff_worker.py")


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())


def _mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    d = {
        "f32": torch.randn(33, 7, generator=g),
        "bf16": torch.randn(5000, generator=g).bfloat16(),
        "i64": torch.arange(-3, 9),
        "empty": torch.zeros(0, 2),
        "strided": torch.randn(8, 6, generator=g).t(),
    }
    d["f32"].view(-1).view(torch.int32)[:2] = torch.tensor([0x7FC0BEEF, -(2**31)], dtype=torch.int32)  # NaN, -0.0
    return d


def test_round_trip_in_process_bit_exact_views_and_reuse():
    sender = HandoffSender(bucket_bytes=4096)
    state = _mixed()
    msg = sender.prepare(state, version=1)
    assert msg.names == list(state) and len(msg.buckets) >= 2
    with open_handoff(pickle.loads(pickle.dumps(msg))) as named:  # the message travels pickled
        assert [n for n, _ in named] == list(state)
        for n, t in named:
            assert t.dtype == state[n].dtype and t.shape == state[n].shape and _crc(t) == _crc(state[n]), n
    first = sender.stats()
    assert first["in_flight"] == 1
    assert first["bytes_packed"] == sum(t.numel() * t.element_size() for t in state.values())
    other = sender.prepare(state, version=2)  # the first one is not released: new buffers
    assert sender.stats()["buffers_allocated"] == 2 * first["buffers_allocated"]
    sender.release(msg)
    sender.release(other)
    sender.prepare(state, version=3)  # released buffers are reused
    assert sender.stats()["buffers_allocated"] == 2 * first["buffers_allocated"]
    with pytest.raises(ValueError, match="not in flight"):
        sender.release(msg)
    sender.close()


def test_bad_messages_refused_before_any_tensor_is_made():
    meta = TensorMeta("a", (4,), torch.float32, 0)
    b = TensorMeta("b", (4,), torch.float32, 8)
    overlap = HandoffMessage(1, "x", "cpu", (HandoffBucket("rlb-none", 32, (meta, b)),))
    with pytest.raises(WeightUpdateError, match="overlap"):
        with open_handoff(overlap):
            pass
    one = HandoffBucket("rlb-none", 16, (meta,))
    twice = HandoffMessage(1, "x", "cpu", (one, one))
    with pytest.raises(WeightUpdateError, match="two buckets"):
        with open_handoff(twice):
            pass
    with pytest.raises(WeightUpdateError, match="does not exist"):
        with open_handoff(HandoffMessage(1, "x", "cpu", (HandoffBucket("rlb-none-404", 16, (meta,)),))):
            pass
    with pytest.raises(ValueError, match="duplicate"):
        HandoffSender().prepare([("a", torch.zeros(1)), ("a", torch.zeros(1))], version=1)
    s = HandoffSender()
    try:
        with pytest.raises(TypeError):  # version is keyword-only, as in every engine's update_weights
            s.prepare({"a": torch.zeros(3)}, 1)
    finally:
        s.close()


def _send(proc: subprocess.Popen, msg: HandoffMessage) -> dict:
    data = pickle.dumps(msg)
    proc.stdin.write(struct.pack("<Q", len(data)) + data)
    proc.stdin.flush()
    line = proc.stdout.readline()
    assert line, proc.stderr.read().decode(errors="replace")[-3000:]
    return json.loads(line)


def test_torch_engine_in_another_process_loads_shared_views_bit_exact(tiny_hf_dir):
    from safetensors.torch import load_file

    state = load_file(str(Path(tiny_hf_dir) / "model.safetensors"))
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, str(WORKER), tiny_hf_dir], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    sender = HandoffSender(bucket_bytes=64 << 10)
    try:
        assert proc.stdout.readline().strip() == b"READY", proc.stderr.read().decode(errors="replace")[-3000:]
        for version in (1, 2):
            g = torch.Generator().manual_seed(version)
            for t in state.values():
                t.add_(torch.randn(t.shape, generator=g).to(t.dtype))
            msg = sender.prepare(state, version=version)
            res = _send(proc, msg)  # returns once the engine has loaded the update: then it may be released
            assert res["version"] == version
            assert res["crc"] == {n: _crc(t) for n, t in state.items()}  # bit-exact, every weight
            assert res["views_share_bucket_storage"]
            first_name, first = sender.views(msg)[0]
            assert _crc(first) != _crc(state[first_name])  # the engine's write landed in the trainer's buffer
            sender.release(msg)
        assert sender.stats()["buffers_allocated"] == len(msg.buckets)  # version 2 reused version 1's buffers
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
        sender.close()
    assert proc.returncode == 0, proc.stderr.read().decode(errors="replace")[-3000:]


def test_update_from_handoff_into_an_in_process_engine():
    import asyncio

    from rlblocks.sync import update_from_handoff

    class Engine:  # records what update_weights saw, copying like every engine does
        async def update_weights(self, named_tensors, *, version, partial=False):
            self.got = ({n: t.clone() for n, t in named_tensors}, version, partial)

    state = _mixed()
    sender, engine = HandoffSender(), Engine()
    with sender.hand_over(state, version=7) as msg:
        asyncio.run(update_from_handoff(engine, msg, partial=True))
    got, version, partial = engine.got
    assert version == 7 and partial and all(_crc(got[n]) == _crc(t) for n, t in state.items())
    assert sender.stats()["in_flight"] == 0
    sender.close()


@pytest.mark.gpu
def test_cuda_handoff_views_and_vllm_update_info():
    sender = HandoffSender(device="cuda", bucket_bytes=1 << 20)
    state = {k: v.cuda() for k, v in _mixed().items()}
    msg = sender.prepare(state, version=1)
    info = sender.vllm_ipc_update_info(msg)
    assert info["names"] == list(state) and len(info["ipc_handles"]) == len(state)
    views = dict(sender.views(msg))
    assert all(torch.equal(views[n].view(torch.uint8), t.contiguous().view(torch.uint8)) for n, t in state.items())
    sender.release(msg)
    sender.close()
