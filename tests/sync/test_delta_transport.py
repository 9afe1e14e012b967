"""Directory transport: atomic publish, GC, chain following, and a reader racing a writer."""

from __future__ import annotations

import threading

import pytest
import torch

from rlblocks.errors import DeltaError
from rlblocks.sync import DeltaDecoder, DeltaEncoder, DeltaPacket, DirectoryTransport


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
            assert dec.apply(tr.next(current_version=dec.version)) == p.version
    assert tr.versions() == [5, 6, 7]  # GC kept the newest 3
    assert not [x for x in tmp_path.iterdir() if x.name.startswith(".")]  # no temporary or trash left
    # The reader at version 2 fell behind GC: it is handed the newest full packet (5), then follows deltas.
    p = tr.next(current_version=2)
    assert p.is_full and p.version == 5
    dec.apply(p)
    while (p := tr.next(current_version=dec.version)) is not None:
        dec.apply(p)
    assert dec.version == 7
    for k in receiver:
        assert torch.equal(receiver[k].view(torch.uint8), states[7][k].view(torch.uint8))
    assert tr.latest().version == 7 and tr.latest(full=True).version == 5
    with pytest.raises(ValueError, match="already published"):
        tr.publish(DeltaPacket.from_bytes(tr.read(version=7).to_bytes()))
    with pytest.raises(TimeoutError):
        tr.wait_next(current_version=7, timeout=0.2)


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
                    p = reader_tr.read(version=v)  # may vanish (GC) -> None, but must never be partial
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


def _published(tmp_path, n=3, full_at=(3,)):
    """Versions 1..n published (1 and those in full_at full, the rest deltas); returns transport and states."""
    tr = DirectoryTransport(tmp_path, keep=10)
    g = torch.Generator().manual_seed(1)
    s = {"w": torch.randn(2048, generator=g)}
    enc = DeltaEncoder(s, version=0)
    states = {}
    for v in range(1, n + 1):
        s["w"][torch.rand(2048, generator=g) < 0.05] += 1.0
        tr.publish(enc.full(s, version=v) if v == 1 or v in full_at else enc.encode(s, version=v))
        states[v] = s["w"].clone()
    return tr, states


def test_torn_meta_json_falls_back_to_the_packet(tmp_path):
    tr, _ = _published(tmp_path, full_at=())
    (tmp_path / "v000002" / "meta.json").write_bytes(b'{"version": 2, "base_ver')  # torn write
    p = tr.next(current_version=1)
    assert p is not None and p.version == 2 and p.base_version == 1  # the packet header says the same
    with pytest.raises(DeltaError, match=r"meta\.json is not valid"):
        tr.meta(version=2)


@pytest.mark.parametrize("damage", ["truncated packet", "torn meta and truncated packet"])
def test_damaged_delta_skipped_for_a_newer_full_version(tmp_path, damage):
    tr, states = _published(tmp_path, n=4, full_at=(3,))  # 1 full, 2 delta, 3 full, 4 delta
    pkt = tmp_path / "v000002" / "packet.bin"
    pkt.write_bytes(pkt.read_bytes()[:-100])
    if "torn meta" in damage:
        (tmp_path / "v000002" / "meta.json").write_bytes(b"{")
    with pytest.warns(RuntimeWarning, match="v000002 .* damaged"):
        p = tr.next(current_version=1)
    assert p.is_full and p.version == 3
    assert tr.stats()["damaged_skipped"] >= 1 and 2 in tr.damaged
    r = {"w": states[1].clone()}
    dec = DeltaDecoder(r, version=1)
    dec.apply(p)
    dec.apply(tr.next(current_version=dec.version))
    assert dec.version == 4 and torch.equal(r["w"], states[4])


def test_damaged_delta_without_a_full_fallback_raises_until_one_is_published(tmp_path):
    tr, states = _published(tmp_path, n=3, full_at=())
    pkt = tmp_path / "v000002" / "packet.bin"
    pkt.write_bytes(pkt.read_bytes()[:-1])
    with pytest.warns(RuntimeWarning, match="damaged"):
        with pytest.raises(DeltaError, match=r"no intact packet follows version 1.*v000002.*checksum"):
            tr.next(current_version=1)
    with pytest.raises(DeltaError, match="v000002"):
        tr.wait_next(current_version=1, timeout=0.1, poll=0.02)  # damage, not silence, is reported
    enc = DeltaEncoder({"w": states[3]}, version=3)
    tr.publish(enc.full({"w": states[3]}, version=4))
    p = tr.next(current_version=1)
    assert p.is_full and p.version == 4


def test_two_writers_of_one_version_get_a_clear_error(tmp_path, monkeypatch):
    import rlblocks.sync.delta_transport as dt

    tr, _ = _published(tmp_path, n=1)
    other = DirectoryTransport(tmp_path, keep=10)
    p2 = DeltaEncoder({"w": torch.zeros(8)}).full({"w": torch.ones(8)}, version=2)
    real_write, calls = dt._fsync_write, []

    def write_racing(path, data):  # while the first writer writes, the second publishes the same version
        real_write(path, data)
        if not calls:
            calls.append(path)
            other.publish(DeltaPacket.from_bytes(p2.to_bytes()))

    monkeypatch.setattr(dt, "_fsync_write", write_racing)
    with pytest.raises(DeltaError, match="published by another writer"):
        tr.publish(p2)
    monkeypatch.setattr(dt, "_fsync_write", real_write)
    assert tr.read(version=2).to_bytes() == p2.to_bytes()
    assert not [x for x in tmp_path.iterdir() if x.name.startswith(".")]  # the loser's temporary is gone


def test_publish_refuses_going_back_unless_allowed(tmp_path):
    tr, states = _published(tmp_path, n=3)
    enc = DeltaEncoder({"w": states[3]}, version=3)
    old = enc.full({"w": states[1]}, version=0, allow_rollback=True)
    with pytest.raises(DeltaError, match="not newer than the newest published version 3"):
        tr.publish(old)
    assert tr.publish(old, allow_rollback=True).name == "v000000"
    with pytest.raises(DeltaError, match="already published"):
        tr.publish(enc.full({"w": states[1]}, version=2, allow_rollback=True), allow_rollback=True)
    with pytest.raises(TypeError):  # versions are keyword-only
        tr.next(2)
    assert tr.next(current_version=2).version == 3 and tr.read(version=3).version == 3


def test_group_transport_refuses_going_back_unless_allowed():
    from rlblocks.sync import GroupDeltaTransport

    from ._launch import run_ranks

    s = {"w": torch.zeros(64)}
    enc = DeltaEncoder(s)
    p1 = enc.full({"w": torch.ones(64)}, version=1)
    p0 = enc.full({"w": torch.zeros(64)}, version=0, allow_rollback=True)

    def sender(g):
        tr = GroupDeltaTransport(g)
        tr.send(p1)
        try:
            tr.send(p1)
        except DeltaError as e:
            refused = str(e)
        tr.send(p0, allow_rollback=True)
        return refused

    def receiver(g):
        tr = GroupDeltaTransport(g)
        return [tr.receive().version for _ in range(2)]

    refused, got = run_ranks([sender, receiver])
    assert "not newer than the last version sent (1)" in refused
    assert got == [1, 0]
