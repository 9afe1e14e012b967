"""Hypothesis state machine over interleavings of submit / accept / reject / version bumps / get_batch / restarts.

The test keeps its own model (counters, the set of queued items with their arrival order) and checks the
controller and queue against it after every step.
"""

from __future__ import annotations

import itertools
import pickle

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rlblocks.errors import QueueFull
from rlblocks.sched import StalenessController, StalenessQueue


class SchedMachine(RuleBasedStateMachine):
    @initialize(
        B=st.sampled_from([2, 4, 6]),
        eta=st.integers(0, 2),
        C_mult=st.integers(1, 3),
        dp=st.sampled_from([1, 2]),
        qcap=st.sampled_from([None, 3, 8]),
        use_callback=st.booleans(),
    )
    def setup(self, B, eta, C_mult, dp, qcap, use_callback):
        self.B, self.eta, self.C, self.dp = B * dp, eta, B * C_mult * dp, dp  # global values
        self.qcap, self.use_callback = qcap, use_callback
        self.version = 0
        self.ids = itertools.count()
        # model of the controller
        self.m_submitted = self.m_accepted = self.m_rejected = 0
        self.running: list[tuple[int, int]] = []  # (item id, version at submission)
        # model of the queue
        self.waiting_put: list[tuple[int, int]] = []  # accepted but the queue was full: must be retried, not lost
        self.queued: list[tuple[int, int, int]] = []  # (version, arrival, id)
        self.arrival = itertools.count()
        self.put_ids: set[int] = set()
        self.returned: list[int] = []
        self.stale: list[int] = []
        self._build()

    def _build(self, ctl_state=None, q_state=None):
        self.ctl = StalenessController(batch_size=self.B, max_staleness=self.eta, max_concurrent=self.C,
                                       dp_size=self.dp)
        on_stale = (lambda item, version: self.stale.append(item)) if self.use_callback else None
        self.q = StalenessQueue(max_staleness=self.eta, capacity=self.qcap, on_stale=on_stale)
        if ctl_state is not None:
            self.ctl.load_state_dict(ctl_state)
            self.q.load_state_dict(q_state)

    def expected_capacity(self, v):
        b, c = self.B // self.dp, self.C // self.dp
        run = len(self.running)
        return max(0, min(c - run, (self.eta + v + 1) * b - (self.m_accepted + run)))

    # ------------------------------------------------------------------ controller rules
    @rule()
    def submit(self):
        expected = self.expected_capacity(self.version)
        ok = self.ctl.try_submit(self.version)
        assert ok == (expected > 0)
        if ok:
            self.m_submitted += 1
            self.running.append((next(self.ids), self.version))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def accept(self, data):
        i = data.draw(st.integers(0, len(self.running) - 1))
        item_id, v = self.running.pop(i)
        self.ctl.on_accept()
        self.m_accepted += 1
        self._put(item_id, v)

    def _put(self, item_id, v):
        try:
            self.q.put(item_id, v, block=False)
        except QueueFull:
            assert self.qcap is not None and len(self.queued) >= self.qcap
            self.waiting_put.append((item_id, v))
            return
        self.queued.append((v, next(self.arrival), item_id))
        self.put_ids.add(item_id)

    @precondition(lambda self: self.waiting_put)
    @rule()
    def retry_put(self):
        item_id, v = self.waiting_put.pop(0)
        self._put(item_id, v)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def reject(self, data):
        self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        self.ctl.on_reject()
        self.m_rejected += 1

    @rule()
    def bump_version(self):
        self.version += 1

    # ------------------------------------------------------------------ queue rules
    @rule(n=st.integers(1, 6))
    def get_batch(self, n):
        got = self.q.get_batch(n, current_version=self.version, timeout=0)
        if not self.use_callback:
            self.stale.extend(item for item, _ in self.q.drain_stale())
        # independent expectation: drop stale entries, then the n oldest by (version, arrival)
        limit = self.version - self.eta
        now_stale = sorted(e for e in self.queued if e[0] < limit)
        fresh = sorted(e for e in self.queued if e[0] >= limit)
        assert set(self.stale[len(self.stale) - len(now_stale):]) == {e[2] for e in now_stale}
        expected = [e[2] for e in fresh[:n]]
        assert got == expected
        for e in fresh[:n]:
            assert self.version - e[0] <= self.eta  # nothing older than eta is ever returned
        self.queued = fresh[n:]
        self.returned.extend(got)

    @rule()
    def restart(self):
        ctl_state = pickle.loads(pickle.dumps(self.ctl.state_dict()))
        q_state = pickle.loads(pickle.dumps(self.q.state_dict()))
        self._build(ctl_state, q_state)

    @rule()
    def crash_and_recover(self):
        """The process died: in-flight rollouts are gone; controller and queue come back from their checkpoint."""
        ctl_state = pickle.loads(pickle.dumps(self.ctl.state_dict()))
        q_state = pickle.loads(pickle.dumps(self.q.state_dict()))
        self._build(ctl_state, q_state)
        self.ctl.on_version_recovered(self.version)
        self.running = []
        self.m_accepted = self.version * (self.B // self.dp)
        self.m_submitted = self.m_accepted + self.m_rejected

    # ------------------------------------------------------------------ invariants
    @invariant()
    def controller_counters(self):
        ctl = self.ctl
        assert ctl.submitted == ctl.accepted + ctl.rejected + ctl.running
        assert (ctl.submitted, ctl.accepted, ctl.rejected, ctl.running) == (
            self.m_submitted, self.m_accepted, self.m_rejected, len(self.running))

    @invariant()
    def capacity_bounds(self):
        for v in (self.version, self.version + 1):
            cap = self.ctl.capacity(v)
            assert 0 <= cap == self.expected_capacity(v)

    @invariant()
    def nothing_lost(self):
        s = self.q.stats()
        queued_ids = {e[2] for e in self.queued}
        assert s["put"] == len(self.put_ids) == s["returned"] + s["stale"] + s["queued"]
        assert s["queued"] == len(self.queued) == len(self.q)
        assert len(self.returned) == len(set(self.returned)) == s["returned"]
        assert len(self.stale) == len(set(self.stale)) == s["stale"]
        assert set(self.returned) | set(self.stale) | queued_ids == self.put_ids
        assert not (set(self.returned) & set(self.stale)) and not (queued_ids & set(self.returned))
        if self.qcap is not None:
            assert s["queued"] <= self.qcap


TestSched = SchedMachine.TestCase
TestSched.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
