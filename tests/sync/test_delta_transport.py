"""Directory transport: atomic publish, GC, chain following, and a reader racing a writer."""

from __future__ import annotations

import threading

import pytest
import torch

from rlblocks.sync import DeltaDecoder, DeltaEncoder, DeltaPacket, DirectoryTransport
from rlblocks.sync.delta import DeltaError


def _walk(n_versions, *, size=4096, density=0.05, seed=0, full_every=None):
    """Yield (packet, sender state copy) for versions 1..n; full packets at multiples of full_every."""
    g = torch.Generator().manual_seed(seed)
    s = {"w": torch.randn(size, generator=g), "b": torch.randn(size // 8, generator=g).bfloat16()}
    enc = DeltaEncoder(s)
    for v in range(1, n_versions + 1):
        for t in s.values():
            m = torch.rand(t.numel(), generator=g) < density
            t[m] = torch.randn(int(m.sum()), generator=g).to(t.dtype)
        p = enc.full(s, version=v) if full_every and v % full_every == 0 else enc.encode(s, version=v)
        yield p, {k: t.clone() for k, t in s.items()}


def test_publish_gc_and_follow_chain(tmp_path):
    tr = DirectoryTransport(tmp_path, keep=3)
    states = {}
    g = torch.Generator().manual_seed(0)
    init = {"w": torch.randn(4096, generator=g), "b": torch.randn(512, generator=g).bfloat16()}
    receiver = {k: t.clone() for k, t in init.items()}
    dec = DeltaDecoder(receiver)
    for p, st in _walk(7, full_every=5):
        tr.publish(p)
        states[p.version] = st
        if p.version <= 2:  # the reader keeps up for two versions
            assert dec.apply(tr.next(dec.version)) == p.version
    assert tr.versions() == [5, 6, 7]  # GC kept the newest 3
    assert not [x for x in tmp_path.iterdir() if x.name.startswith(".")]  # no temporary or trash left
    # The reader at version 2 fell behind GC: it is handed the newest full packet (5), then follows deltas.
    p = tr.next(2)
    assert p.is_full and p.version == 5
    dec.apply(p)
    while (p := tr.next(dec.version)) is not None:
        dec.apply(p)
    assert dec.version == 7
    for k in receiver:
        assert torch.equal(receiver[k].view(torch.uint8), states[7][k].view(torch.uint8))
    assert tr.latest().version == 7 and tr.latest(full=True).version == 5
    with pytest.raises(ValueError, match="already published"):
        tr.publish(DeltaPacket.from_bytes(tr.read(7).to_bytes()))
    with pytest.raises(TimeoutError):
        tr.wait_next(7, timeout=0.2)


def test_reader_racing_writer_never_sees_partial_version(tmp_path):
    tr = DirectoryTransport(tmp_path, keep=2)
    n = 25
    packets = {p.version: p.to_bytes() for p, _ in _walk(n, size=1 << 18, density=0.5)}  # ~1 MB packets
    done = threading.Event()
    seen: dict[int, int] = {}
    errors: list[BaseException] = []

    def reader():
        reader_tr = DirectoryTransport(tmp_path, keep=2)
        while not done.is_set() or not seen.get(n):
            try:
                for v in reader_tr.versions():
                    p = reader_tr.read(v)  # may vanish (GC) -> None, but must never be partial
                    if p is not None:
                        assert p.to_bytes() == packets[v]
                        seen[v] = seen.get(v, 0) + 1
            except (DeltaError, AssertionError) as e:
                errors.append(e)
                return

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    for v in range(1, n + 1):
        tr.publish(DeltaPacket.from_bytes(packets[v]))
    done.set()
    t.join(60)
    assert not t.is_alive()
    assert not errors, errors[0]
    assert len(seen) >= 3  # the reader really ran alongside the writer
    assert tr.versions() == [n - 1, n]
