"""Safe-mode receive buffers (WeightReceiver's default ReceiveBufferPool): a buffer is recycled only once no tensor
references it. References: the sender's own tensors, compared bit for bit (uint8 views), and data pointers."""

from __future__ import annotations

import gc

import torch

from rlblocks.sync import WeightReceiver, WeightSender
from rlblocks.sync.broadcast import ReceiveBufferPool
from rlblocks.sync.buckets import plan_buckets, tensor_spec

from ._launch import run_ranks


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _states(n_versions: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    dts = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
    out = []
    for _ in range(n_versions):
        st = {}
        for i in range(14):
            dt = dts[i % len(dts)]
            x = torch.randn(37 * (i + 1), generator=g)
            st[f"t{i}"] = (x * 1000).to(dt) if not dt.is_floating_point else x.to(dt)
        st["t0"].view(torch.int32)[0] = 0x7FC0BEEF  # a NaN payload
        st["t0"][1] = -0.0
        out.append(st)
    return out


def test_pool_never_hands_out_a_referenced_block():
    pool = ReceiveBufferPool(min_bytes=0)
    default = ReceiveBufferPool()
    small = default.take(4096)  # under the default min_bytes: plain torch.empty, never pooled
    assert small.numel() == 4096
    del small
    assert default.idle_bytes() == 0 and default.take(2 << 20).numel() == 2 << 20
    assert default.idle_bytes() == 2 << 20  # the 2 MiB buffer was pooled (and its tensor is already gone)
    a = pool.take(4096)
    a.fill_(7)
    view = a[100:200].view(torch.int32)  # a view of a slice keeps the block busy too
    kept = {"w": a[:64]}
    del a
    b = pool.take(4096)
    assert b.data_ptr() != view.data_ptr() - 100
    assert bool((view.view(torch.uint8) == 7).all())
    del view
    c = pool.take(4096)
    assert c.data_ptr() != kept["w"].data_ptr()  # the dict still holds a view
    kept.clear()
    d = pool.take(1000)  # now the first block is idle again: reused, smallest fitting block first
    assert d.numel() == 1000
    assert pool.idle_bytes() == 0  # the other two are held by b and c
    del b, c, d
    assert pool.idle_bytes() == 3 * 4096
    pool.trim(2 * 4096)
    assert pool.idle_bytes() == 2 * 4096
    pool.clear()
    assert pool.idle_bytes() == 0 and pool.take(0).numel() == 0


def test_default_receiver_tensors_stay_valid_and_exact_across_receives():
    """Many small buckets (several in flight); three versions; version 1's tensors are kept while 2 and 3 arrive,
    version 2's are dropped before 3 arrives, so 3 reuses their blocks; all stay bit-exact."""
    states = _states(3)

    def sender(g):
        s = WeightSender(g, bucket_bytes=512)
        for v, st in enumerate(states):
            s.send(st, version=v)

    def receiver(g):
        r = WeightReceiver(g, expected=states[0])
        r.pool.min_bytes = 0  # pool even these tiny buckets
        v0, it = r.receive()
        first = dict(it)  # exhausted: the stream is over, the tensors must stay valid
        v1, it = r.receive()
        second = dict(it)
        second_ptrs = {t.untyped_storage().data_ptr() for t in second.values()}
        first_ptrs = {t.untyped_storage().data_ptr() for t in first.values()}
        second_ok = all(_same_bits(second[n], states[1][n]) for n in states[1])
        # the consumer drops the second receive's tensors and its spent iterator; collect so that a reference cycle
        # left by the interpreter (not the pool) cannot keep a block alive into the next receive
        del second, it
        gc.collect()
        v2, it = r.receive()
        third = dict(it)
        third_ptrs = {t.untyped_storage().data_ptr() for t in third.values()}
        return (v0, v1, v2), first, second_ok, third, first_ptrs, second_ptrs, third_ptrs

    res = run_ranks([sender, receiver])
    assert res[0] is None, res[0]
    versions, first, second_ok, third, first_ptrs, second_ptrs, third_ptrs = res[1]
    assert versions == (0, 1, 2)
    assert first.keys() == states[0].keys() and third.keys() == states[2].keys()
    assert all(_same_bits(first[n], states[0][n]) for n in states[0])  # untouched by two later receives
    assert second_ok
    assert all(_same_bits(third[n], states[2][n]) for n in states[2])
    assert not first_ptrs & second_ptrs and not first_ptrs & third_ptrs  # blocks still referenced: never reused
    assert third_ptrs <= second_ptrs  # dropped blocks were recycled (same bucket plan, same sizes)


def test_streaming_consumer_recycles_within_one_receive():
    """A consumer that copies and drops each tensor lets the pool reuse blocks during the same receive."""
    states = _states(1, seed=1)
    state = states[0]

    def sender(g):
        WeightSender(g, bucket_bytes=512).send(state, version=4)

    def receiver(g):
        r = WeightReceiver(g)
        r.pool.min_bytes = 0
        v, it = r.receive()
        got, ptrs = {}, set()
        for n, t in it:
            ptrs.add(t.untyped_storage().data_ptr())
            got[n] = t.clone()
            del t
        return v, got, len(ptrs), r.pool.idle_bytes()

    res = run_ranks([sender, receiver])
    assert res[0] is None, res[0]
    v, got, n_blocks, idle = res[1]
    assert v == 4 and got.keys() == state.keys()
    assert all(_same_bits(got[n], state[n]) for n in state)
    n_buckets = len(plan_buckets([tensor_spec(n, t) for n, t in state.items()], bucket_bytes=512))
    assert n_buckets >= 8 and n_blocks < n_buckets
    assert idle > 0


def test_pool_off_and_release():
    state = _states(1, seed=2)[0]

    def sender(g):
        s = WeightSender(g, bucket_bytes=1024)
        s.send(state, version=1)
        s.send(state, version=2)

    def receiver(g):
        r = WeightReceiver(g, pool_buffers=False)
        assert r.pool is None
        a = dict(r.receive()[1])
        r2 = WeightReceiver(g)
        r2.pool.min_bytes = 0
        b = dict(r2.receive()[1])
        del b
        idle = r2.pool.idle_bytes()
        r2.release_buffers()
        return a, idle, r2.pool.idle_bytes()

    res = run_ranks([sender, receiver])
    assert res[0] is None, res[0]
    a, idle, after = res[1]
    assert all(_same_bits(a[n], state[n]) for n in state)
    assert idle > 0 and after == 0
