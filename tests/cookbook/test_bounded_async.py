"""The bounded-async protocol pair (``plumbing/bounded_async.py``) with fake groups and no model.

``RolloutAdmission`` (a rollout rank's end) and ``TrainerLedger`` (trainer rank 0's end) talk through the real
control-message encoding (``send_control`` / ``recv_control`` on a recording stand-in for the weight-sync group) and
the real ``Inbox`` filing (``Inbox.receive``, with a real journal). Every figure is checked against a count the test
keeps itself: which groups it started, finished, shipped, saw trained, expected stale, and delivered after the last
checkpoint, and the admission formula ``min(max_concurrent − running, (η + v + 1)·B − held)`` per rank from its own
tally of the slots each rank holds.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from plumbing import Journal, Recovery, Stale, Stop, Weights, recv_control, send_control
from plumbing.bounded_async import RolloutAdmission, TrainerLedger

pytestmark = pytest.mark.filterwarnings("error:rlblocks:DeprecationWarning")

K = 2  # samples per group


class Outbox(list):
    def put(self, rec):
        self.append(rec)


class Wire:
    """The weight-sync group as ``send_control`` uses it: every message trainer rank 0 broadcasts is recorded."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def broadcast_bytes(self, data, src):
        self.sent.append(data)
        return data

    def take(self) -> list:
        """The messages sent since the last call, decoded as a rollout rank decodes them."""
        out = [recv_control(_One(b)) for b in self.sent]
        self.sent = []
        return out


class _One:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def broadcast_bytes(self, data, src):
        return self.data


def rollout(rank: int, ranks: int = 1, b: int = 4, eta: int = 1, max_concurrent: int | None = None,
            **kw) -> RolloutAdmission:
    return RolloutAdmission(rank, batch_size=b * ranks, max_staleness=eta,
                            max_concurrent=max_concurrent or 64 * ranks, dp_size=ranks, outbox=Outbox(), **kw)


def ledger(wire: Wire, tmp_path, eta: int = 1, state=None) -> TrainerLedger:
    journal = Journal(tmp_path / "journal.jsonl")
    journal.append({"event": "start"})
    rec = Recovery(state, journal, starts=journal.starts(), received=journal.received() if state else 0)
    return TrainerLedger(max_staleness=eta, group_size=K, sources=(), sample_group=None, sync_group=wire,
                         recovery=rec, samples=lambda r: len(r["samples"]))


def record(uid: str, rank: int, version: int) -> dict:
    return {"uid": uid, "rank": rank, "version": version, "samples": [0] * K}


def run_group(r: RolloutAdmission, version: int) -> dict:
    """Start one admitted group at ``version``, finish it with reward variance, return what it shipped."""
    uid, _ = r.next_group()
    r.finished(uid, record(uid, r.rank, version), [0.0, 1.0])
    return r.outbox.pop()


def test_admission_stops_at_the_bound_and_resumes_after_a_commit(tmp_path):
    b, eta = 4, 1
    wire, r = Wire(), rollout(1, b=b, eta=eta)
    led = ledger(wire, tmp_path, eta=eta)
    led.announce(0, first=True)
    (first,) = wire.take()
    r.committed(first, first.version)
    assert r.first_weights.is_set()
    assert r.admit(0) == (eta + 1) * b  # (η + v + 1)·B, nothing held yet
    assert r.admit(0) == 0  # the bound: every slot of version 0 is held
    shipped = [run_group(r, 0) for _ in range((eta + 1) * b)]
    assert r.admit(0) == 0  # finished and accepted groups still hold their slots until trained
    for rec in shipped:
        led.inbox.receive(1, rec)
    batch = led.take(b, 0)
    assert [g["uid"] for g in batch] == [g["uid"] for g in shipped[:b]]  # oldest first (arrival order)
    led.trained(b * K, max_age=0)
    assert r.admit(0) == 0  # trained, but the engine still runs version 0
    led.announce(1)
    (w,) = wire.take()
    assert isinstance(w, Weights) and (w.version, w.first, w.queued) == (1, False, {})
    r.wake.clear()
    r.committed(w, w.version)
    assert r.wake.is_set()
    assert r.admit(1) == (eta + 1 + 1) * b - (eta + 1) * b == b  # exactly one batch more


def test_admission_is_capped_by_max_concurrent():
    r = rollout(1, b=4, eta=3, max_concurrent=6)
    r.committed(Weights(version=0, kind="full", first=True), 0)
    assert r.admit(0) == 6
    run_group(r, 0)
    assert r.admit(0) == 1  # one finished: one slot in flight free again, within (η + 1)·B = 16


def test_recovery_readmits_exactly_what_was_lost_and_counts_it(tmp_path):
    b, eta = 4, 1
    wire, r = Wire(), rollout(1, b=b, eta=eta)
    led = ledger(wire, tmp_path, eta=eta)
    led.announce(0, first=True)
    r.committed(wire.take()[0], 0)
    first = [run_group(r, 0) for _ in range(r.admit(0))]  # 8 groups at version 0
    for rec in first:
        led.inbox.receive(1, rec)
    led.take(b, 0)
    led.trained(b * K, 0)
    led.announce(1)
    r.committed(wire.take()[0], 1)
    ckpt = {"step": 1, **led.state_dict()}  # 4 groups queued
    queued_at_ckpt = [g["uid"] for g in first[b:]]
    later = [run_group(r, 1) for _ in range(r.admit(1))]  # received after the checkpoint: die with the trainer
    assert len(later) == b
    for rec in later:
        led.inbox.receive(1, rec)
    led.take(b, 1)  # trained by weights the crash throws away
    led.trained(b * K, 0)

    # the crash: the trainer restarts from the checkpoint, torchrun restarts the rollout rank too
    journal = Journal(tmp_path / "journal.jsonl")
    journal.append({"event": "start"})
    rec = Recovery(ckpt, journal, starts=journal.starts(), received=journal.received())
    wire2 = Wire()
    led2 = TrainerLedger(max_staleness=eta, group_size=K, sources=(), sample_group=None, sync_group=wire2,
                         recovery=rec)
    assert led2.counters["samples_lost_in_crash"] == len(later) * K
    assert led2.figures()["samples_generated"] == (len(first) + len(later)) * K
    assert sorted(item["uid"] for item, _, _ in led2.queue.state_dict()["items"]) == sorted(queued_at_ckpt)
    led2.announce(1, first=True)
    (w,) = wire2.take()
    assert (w.version, w.first, w.queued, w.run) == (1, True, {1: b}, 1)
    r2 = rollout(1, b=b, eta=eta)
    r2.committed(w, w.version)
    # accepted = v·B + the rank's queued groups: the slots of the lost groups are free again, and only those
    assert r2.admit(1) == (eta + 1 + 1) * b - (1 * b + b) == len(later)
    uid, _ = r2.next_group()
    assert uid == "r1-1-0"  # a restarted run names its groups apart from the crashed run's
    assert led2.unaccounted() == 0


def test_a_stale_group_is_reported_to_its_rollout_rank(tmp_path):
    b, eta = 2, 1
    wire = Wire()
    ranks = {1: rollout(1, ranks=2, b=b, eta=eta), 2: rollout(2, ranks=2, b=b, eta=eta)}
    led = ledger(wire, tmp_path, eta=eta)
    for r in ranks.values():
        r.committed(Weights(version=0, kind="full", first=True), 0)
        assert r.admit(0) == (eta + 1) * b  # this rank's share of B is b
    old = run_group(ranks[1], 0)
    led.inbox.receive(1, old)
    fresh = run_group(ranks[2], 0)
    fresh["version"] = 2  # as if started two versions later
    led.inbox.receive(2, fresh)
    got = led.poll(2, version=2)
    assert [g["uid"] for g in got] == [fresh["uid"]]
    (msg,) = wire.take()
    assert isinstance(msg, Stale) and msg.groups == {1: 1}
    assert led.stale_uids == [old["uid"]] and led.figures()["samples_dropped_stale"] == K
    for rank, r in ranks.items():
        r.wake.clear()
        if n := msg.groups.get(rank, 0):
            r.discard(n)
    assert ranks[1].admit(0) == 1 and ranks[1].wake.is_set()  # its slot is free again, at the same version
    assert ranks[2].admit(0) == 0 and not ranks[2].wake.is_set()


def test_a_failed_group_frees_its_slot_and_is_counted_not_queued(tmp_path):
    wire, r = Wire(), rollout(1, b=2, eta=0)
    led = ledger(wire, tmp_path, eta=0)
    r.committed(Weights(version=0, kind="full", first=True), 0)
    assert r.admit(0) == 2
    uid, _ = r.next_group()
    r.failed(record(uid, 1, 0), K)
    assert r.admit(0) == 1
    led.inbox.receive(1, r.outbox.pop())
    f = led.figures()
    assert (f["samples_generated"], f["samples_failed_reward"], f["samples_left_in_queue"]) == (K, K, 0)
    assert led.unaccounted() == 0


class Sim:
    """A seeded random schedule of the protocol's events over ``ranks`` rollout ranks and one trainer: admit, finish
    (variance, zero variance, failed reward), ship, take, train + push, deliver a control message, checkpoint,
    crash. The test's own tally (``held``, ``running``, the queue's contents and every sample's fate) predicts
    what the pair must do."""

    def __init__(self, seed: int, tmp_path) -> None:
        self.rng = random.Random(seed)
        self.n = self.rng.randint(1, 3)
        self.b = self.rng.randint(1, 3)  # per rank
        self.eta = self.rng.randint(0, 2)
        self.maxc = self.rng.randint(1, 4 * self.b)  # per rank
        self.dyn = self.rng.random() < 0.5
        self.tmp = tmp_path
        self.journal = Journal(tmp_path / f"journal-{seed}.jsonl")
        self.journal.append({"event": "start"})
        self.wire = Wire()
        self.led = TrainerLedger(max_staleness=self.eta, group_size=K, sources=(), sample_group=None,
                                 sync_group=self.wire, recovery=Recovery(None, self.journal,
                                                                         starts=self.journal.starts()))
        self.version = 0  # the trainer's
        self.batch: list[dict] = []
        self.queue: dict[str, tuple[int, int]] = {}  # uid -> (version, rank): shipped, not failed, not consumed
        self.fate = Counter()  # generated, trained, stale, failed, lost (samples)
        self.ckpt = None
        self.restarts = 0
        self._start_rollouts()
        self.led.announce(0, first=True)
        self._broadcast()

    def _start_rollouts(self) -> None:
        self.ranks = {r: RolloutAdmission(r, batch_size=self.b * self.n, max_staleness=self.eta,
                                          max_concurrent=self.maxc * self.n, dp_size=self.n, outbox=Outbox(),
                                          dynamic_sampling=self.dyn, dynamic_max_rounds=1)
                      for r in range(1, self.n + 1)}
        self.pending = {r: [] for r in self.ranks}  # control messages not yet applied, in order
        self.engine = dict.fromkeys(self.ranks)  # committed version (None: no weights yet)
        self.held = Counter()  # slots each rank holds by the test's count: accepted + running
        self.running = {r: [] for r in self.ranks}  # (uid, version) in flight
        self.discarded = Counter()  # stale groups each rank was told of
        self.stale_to = Counter()  # stale groups reported, by rank, this start

    def _broadcast(self) -> None:
        for msg in self.wire.take():
            for r in self.ranks:
                self.pending[r].append(msg)

    # ---------------------------------------------------------------- events
    def admit(self, r: int) -> None:
        adm, v = self.ranks[r], self.engine[r]
        if v is None:
            return
        want = max(0, min(self.maxc - len(self.running[r]), (self.eta + v + 1) * self.b - self.held[r]))
        n = adm.admit(v)
        assert n == want, (n, want, r, v)
        for _ in range(n):
            uid, _ = adm.next_group()
            self.running[r].append((uid, v))
        self.held[r] += n

    def finish(self, r: int) -> None:
        if not self.running[r]:
            return
        adm = self.ranks[r]
        uid, v = self.running[r].pop(self.rng.randrange(len(self.running[r])))
        rec = record(uid, r, v)
        kind = self.rng.choice(["var", "var", "zero", "fail"])
        before = len(adm.outbox)
        if kind == "fail":
            adm.failed(rec, K)
            self.held[r] -= 1
        else:
            adm.finished(uid, rec, [0.0, 1.0] if kind == "var" else [1.0, 1.0])
            if len(adm.outbox) == before:  # filtered by dynamic sampling: never shipped, its slot freed
                assert self.dyn and kind == "zero"
                self.held[r] -= 1
        assert len(adm.outbox) in (before, before + 1)

    def ship(self, r: int) -> None:
        adm = self.ranks[r]
        if not adm.outbox:
            return
        rec = adm.outbox.pop(0)
        self.led.inbox.receive(r, rec)
        self.fate["generated"] += K
        if rec.get("reward_failed"):
            self.fate["failed"] += K
        else:
            self.queue[rec["uid"]] = (rec["version"], r)

    def take(self) -> None:
        need = self.b * self.n - len(self.batch)
        stale = {u for u, (v, _) in self.queue.items() if self.version - v > self.eta}
        fresh = sorted((v, u) for u, (v, _) in self.queue.items() if u not in stale)
        got = self.led.poll(need, self.version)
        assert {g["uid"] for g in got} <= {u for _, u in fresh}
        assert sorted(self.queue[g["uid"]][0] for g in got) == [v for v, _ in fresh[:need]]  # oldest first
        assert len(got) == min(need, len(fresh))
        by_rank = Counter(self.queue[u][1] for u in stale)
        msgs = self.wire.take()
        if stale:
            assert len(msgs) == 1 and isinstance(msgs[0], Stale) and msgs[0].groups == dict(by_rank)
        else:
            assert msgs == []
        for m in msgs:
            for r in self.ranks:
                self.pending[r].append(m)
        self.fate["stale"] += len(stale) * K
        self.stale_to.update(by_rank)
        for u in stale:
            del self.queue[u]
        for g in got:
            del self.queue[g["uid"]]
        self.batch += got
        if len(self.batch) == self.b * self.n:  # train and push the next version
            ages = [self.version - g["version"] for g in self.batch]
            assert max(ages) <= self.eta  # no trained token older than η
            self.led.trained(len(self.batch) * K, max(ages))
            self.fate["trained"] += len(self.batch) * K
            self.batch = []
            self.version += 1
            self.led.announce(self.version)
            self._broadcast()

    def deliver(self, r: int) -> None:
        if not self.pending[r]:
            return
        msg = self.pending[r].pop(0)
        adm = self.ranks[r]
        if isinstance(msg, Stale):
            if n := msg.groups.get(r, 0):
                adm.discard(n)
                self.held[r] -= n
                self.discarded[r] += n
        elif isinstance(msg, Weights):
            adm.committed(msg, msg.version)
            if msg.first:  # admission restarts: v·B trained, plus this rank's groups still queued
                self.held[r] = msg.version * self.b + msg.queued.get(r, 0)
            self.engine[r] = msg.version
        else:
            assert isinstance(msg, Stop)

    def checkpoint(self) -> None:
        if self.batch:
            return  # the loops save between steps
        self.ckpt = ({"step": self.version, **self.led.state_dict()},
                     dict(self.queue), Counter(self.fate), self.version)

    def crash(self) -> None:
        if self.ckpt is None:
            return
        state, queue, fate, version = self.ckpt
        generated = self.fate["generated"]
        self.fate = Counter(fate)
        self.fate["lost"] += generated - fate["generated"]  # received after the checkpoint
        self.fate["generated"] = generated
        self.queue, self.version, self.batch = dict(queue), version, []
        self.ckpt = (state, queue, Counter(self.fate), version)  # a second crash before the next save
        self.journal.append({"event": "start"})
        self.wire = Wire()
        self.led = TrainerLedger(max_staleness=self.eta, group_size=K, sources=(), sample_group=None,
                                 sync_group=self.wire, recovery=Recovery(state, self.journal,
                                                                         starts=self.journal.starts(),
                                                                         received=self.journal.received()))
        self.restarts += 1
        self._start_rollouts()  # torchrun restarts every rank: groups in flight never reached the trainer
        self.led.announce(self.version, first=True)
        (w,) = msgs = self.wire.take()
        assert isinstance(w, Weights) and w.first and w.run == self.restarts and w.version == self.version
        assert w.queued == dict(Counter(r for _, r in self.queue.values()))
        for r in self.ranks:
            self.pending[r] += msgs

    # ---------------------------------------------------------------- the identity, against the test's count
    def check(self) -> None:
        f, c = self.led.figures(), self.fate
        in_batch = len(self.batch) * K
        assert f["samples_generated"] == c["generated"]
        assert f["samples_trained"] == c["trained"]
        assert f["samples_dropped_stale"] == c["stale"]
        assert f["samples_failed_reward"] == c["failed"]
        assert f["samples_lost_in_crash"] == c["lost"]
        assert f["samples_left_in_queue"] == len(self.queue) * K
        assert c["generated"] == c["trained"] + c["stale"] + c["failed"] + c["lost"] + len(self.queue) * K + in_batch
        assert self.led.unaccounted() == in_batch  # the batch being filled is taken, not yet trained
        for r, adm in self.ranks.items():  # every stale group reaches its rank: applied, or on its way
            assert adm.counters["groups_dropped_stale"] == self.discarded[r]
            on_the_way = sum(m.groups.get(r, 0) for m in self.pending[r] if isinstance(m, Stale))
            assert self.discarded[r] + on_the_way == self.stale_to[r]

    def step(self) -> None:
        event = self.rng.choices(["admit", "finish", "ship", "take", "deliver", "checkpoint", "crash"],
                                 weights=[4, 6, 6, 3, 5, 1, 0.04])[0]
        if event in ("take", "checkpoint", "crash"):
            getattr(self, event)()
        else:
            getattr(self, event)(self.rng.choice(list(self.ranks)))
        self.check()


@pytest.mark.parametrize("seed", range(40))
def test_conservation_under_random_interleavings(seed, tmp_path):
    sim = Sim(seed, tmp_path)
    for _ in range(1500):
        sim.step()
    # the end: drain, train what is fresh, and every sample generated is accounted for
    assert sim.version > 0 or sim.fate["generated"] == 0 or sim.restarts, "the schedule trained nothing"
    sim.led.stop()
    assert isinstance(sim.wire.take()[-1], Stop)
    sim.check()


class FeedWire:
    """A rollout rank's side of the weight-sync group: ``recv_control`` blocks until the test feeds a message."""

    def __init__(self) -> None:
        import queue

        self.q: queue.Queue = queue.Queue()

    def feed(self, msg) -> None:
        wire = Wire()
        send_control(wire, msg)
        self.q.put(wire.sent[0])

    def broadcast_bytes(self, data, src):
        return self.q.get()


class RunOutbox(Outbox):
    def start(self) -> None:
        self.started = True

    def close(self, end) -> None:
        self.end = end


def test_stop_cancels_generating_groups_but_a_scored_group_ships():
    """``Stop`` while one group still generates and another is scoring (past :meth:`settle`): the first is cancelled
    (counted) and never scored; the second finishes its rewards after ``Stop`` and reaches the outbox before the end
    message, so every scored sample reaches the trainer."""
    import asyncio

    wire = FeedWire()

    class Rank(RolloutAdmission):
        def __init__(self) -> None:
            super().__init__(0, batch_size=2, max_staleness=0, max_concurrent=8, dp_size=1, outbox=RunOutbox(),
                             sync_group=wire)
            self.scoring, self.release = asyncio.Event(), asyncio.Event()
            self.scored: list[str] = []

        def version(self) -> int:
            return 0

        async def load(self, tensors, version) -> None:
            pass

        def receive(self, msg):
            return [], msg.version

        async def group(self, uid: str, gid: int) -> None:
            if gid % 2 == 0:
                try:
                    await asyncio.Event().wait()  # still generating when Stop comes
                except asyncio.CancelledError:  # Stop's cancelling reached it: only now does the reward return
                    self.release.set()
                    raise
            self.settle()
            self.scoring.set()
            await self.release.wait()
            self.scored.append(uid)
            self.finished(uid, record(uid, self.rank, 0), [0.0, 1.0])

    async def main() -> Rank:
        r = Rank()
        task = asyncio.create_task(r.run())
        wire.feed(Weights(version=0, kind="full", first=True))
        await r.scoring.wait()
        wire.feed(Stop())
        await task
        return r

    r = asyncio.run(main())
    assert r.scored == ["r0-0-1"] and [rec["uid"] for rec in r.outbox] == ["r0-0-1"]
    assert r.outbox.end.counters["groups_cancelled_at_stop"] == 1
    assert not r.settled  # a finished group leaves the settled set
