"""Sync-group protocol tests with every rank in a thread of this process (each rank still builds its own group
through init_sync_group; the separate-process case is in test_broadcast_multiproc.py)."""

from __future__ import annotations

import pytest
import torch

from rlblocks.errors import SyncError, SyncMismatchError
from rlblocks.sync import WeightReceiver, WeightSender, init_sync_group
from rlblocks.sync.buckets import tensor_spec

from ._launch import run_ranks


def test_streamed_send_into_load_state_dict(tiny_hf_dir):
    from transformers import LlamaForCausalLM

    src = LlamaForCausalLM.from_pretrained(tiny_hf_dir).eval()
    with torch.no_grad():
        for p in src.parameters():
            p.mul_(1.5)
    torch.manual_seed(42)
    dst = LlamaForCausalLM.from_pretrained(tiny_hf_dir).eval()
    sd = src.state_dict()
    manifest = [tensor_spec(n, t) for n, t in sd.items()]

    def sender(g):
        stream = ((n, t.clone()) for n, t in sd.items())  # a generator: tensors materialised one at a time
        WeightSender(g, bucket_bytes=32 << 10).send(stream, version=3, manifest=manifest)

    def receiver(g):
        version, it = WeightReceiver(g, expected=dst.state_dict()).receive()
        dst.load_state_dict(dict(it))
        return version

    res = run_ranks([sender, receiver])
    assert res == [None, 3]
    x = torch.arange(12).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(src(x).logits, dst(x).logits)


def test_three_ranks_one_refuses_everyone_raises():
    state = {"a": torch.randn(10), "b": torch.randn(3, 4).bfloat16()}
    wrong = {"a": torch.randn(10), "b": torch.randn(3, 4)}  # fp32 expected, bf16 sent

    def sender(g):
        WeightSender(g).send(state, version=1)

    def receiver(expected):
        return lambda g: WeightReceiver(g, expected=expected).receive()

    res = run_ranks([sender, receiver(state), receiver(wrong)])
    assert all(isinstance(r, SyncMismatchError) for r in res), res
    for r in res:
        assert "rank 2" in str(r) and "'b'" in str(r) and "bfloat16" in str(r)


def test_sender_stream_breaking_manifest_fails_both_sides():
    state = {"a": torch.randn(10), "b": torch.randn(4)}
    manifest = [tensor_spec(n, t) for n, t in state.items()]

    def sender(g):
        WeightSender(g).send([("a", state["a"]), ("b", torch.randn(5))], version=1, manifest=manifest)

    def receiver(g):
        return dict(WeightReceiver(g).receive()[1])

    res = run_ranks([sender, receiver], timeout=5.0)
    assert isinstance(res[0], ValueError) and "manifest order" in str(res[0])
    assert isinstance(res[1], SyncError)


def test_receiver_without_expectation_gets_exact_bytes():
    g0 = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(100 * (i + 1), generator=g0).to(dt) for i, dt in enumerate([torch.float16] * 4)}
    state["nan"] = torch.full((7,), float("nan"))
    state["nan"].view(torch.int32)[0] = 0x7FC0BEEF

    def receiver(g):
        v, it = WeightReceiver(g).receive()
        return v, {n: t.clone() for n, t in it}

    res = run_ranks([lambda g: WeightSender(g, bucket_bytes=256).send(state.items(), version=5), receiver])
    v, got = res[1]
    assert v == 5 and got.keys() == state.keys()
    for n, t in state.items():
        assert torch.equal(got[n].view(torch.uint8), t.view(torch.uint8)), n


def test_init_validation():
    with pytest.raises(ValueError, match="world_size"):
        init_sync_group(master_addr="127.0.0.1", master_port=1234, world_size=1, rank=0)
    with pytest.raises(ValueError, match="rank"):
        init_sync_group(master_addr="127.0.0.1", master_port=1234, world_size=2, rank=2)
    with pytest.raises(ValueError, match="backend"):
        init_sync_group(master_addr="127.0.0.1", master_port=1234, world_size=2, rank=0, backend="mpi")


def test_reused_receive_buffers_streaming_consumer():
    """reuse_buffers=True: a consumer that copies each tensor as it goes gets exact weights, over two versions."""
    g0 = torch.Generator().manual_seed(1)
    states = [{f"t{i}": torch.randn(50 + 37 * i, generator=g0) for i in range(12)} for _ in range(2)]

    def sender(g):
        s = WeightSender(g, bucket_bytes=512)
        for v, st in enumerate(states):
            s.send(st, version=v)

    def receiver(g):
        r = WeightReceiver(g, reuse_buffers=True)
        out = []
        for _ in states:
            v, it = r.receive()
            out.append((v, {n: t.clone() for n, t in it}))
        return out

    res = run_ranks([sender, receiver])
    assert res[0] is None
    for i, ((v, got), st) in enumerate(zip(res[1], states)):
        assert v == i and got.keys() == st.keys()
        assert all(torch.equal(got[n], st[n]) for n in st)


def test_direct_tensors_are_sent_without_packing_and_arrive_bit_exact(monkeypatch):
    """direct_bytes: large contiguous tensors go out of their own memory (never through pack_into), a large
    non-contiguous one is packed; small ones are packed around them; a streamed generator with a manifest works."""
    import rlblocks.sync.broadcast as bc

    g0 = torch.Generator().manual_seed(3)
    state = {}
    for i in range(6):
        state[f"big{i}"] = torch.randn(300 + i, generator=g0)  # >= 1 KiB: direct
        state[f"norm{i}"] = torch.randn(7, generator=g0).bfloat16()
    state["big_t"] = torch.randn(20, 40, generator=g0).t()  # large but not contiguous
    state["big0"].view(torch.int32)[0] = 0x7FC0BEEF
    manifest = [tensor_spec(n, t) for n, t in state.items()]
    packed: list[str] = []
    real_pack = bc.pack_into

    def recording_pack(buf, metas, tensors):
        packed.extend(m.name for m in metas)
        real_pack(buf, metas, tensors)

    monkeypatch.setattr(bc, "pack_into", recording_pack)

    def sender(g):
        s = WeightSender(g, bucket_bytes=256, direct_bytes=1024)  # 4 norms share a bucket
        s.send(((n, t) for n, t in state.items()), version=1, manifest=manifest)

    def receiver_keep(g):
        v, it = WeightReceiver(g, expected=state).receive()
        return v, {n: t.clone() for n, t in it}

    res = run_ranks([sender, receiver_keep])
    assert res[0] is None, res[0]
    v, got = res[1]
    assert v == 1 and got.keys() == state.keys()
    for n, t in state.items():
        assert torch.equal(got[n].view(torch.uint8), t.contiguous().view(torch.uint8)), n
    assert not [n for n in packed if n.startswith("big") and n != "big_t"]  # never copied
    assert "big_t" in packed and all(f"norm{i}" in packed for i in range(6))
