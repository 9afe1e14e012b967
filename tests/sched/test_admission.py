"""StalenessController against the formula computed here, DP division, recovery, checkpointing, threads."""

from __future__ import annotations

import itertools
import pickle
import threading

import pytest

from rlblocks.sched import StalenessController


def formula(*, B, eta, C, dp, v, running, accepted):
    """AReaL's rule written out independently, with the GLOBAL B and C divided by dp here."""
    b, c = B // dp, C // dp
    return max(0, min(c - running, (eta + v + 1) * b - (accepted + running)))


def test_capacity_matches_formula_on_a_grid():
    for B, C, eta, dp in [(8, 16, 0, 1), (8, 4, 2, 2), (12, 36, 1, 3), (4, 100, 3, 4)]:
        ctl = StalenessController(batch_size=B, max_staleness=eta, max_concurrent=C, dp_size=dp)
        for running, accepted, rejected in itertools.product(range(0, 12, 3), range(0, 30, 7), (0, 5)):
            ctl.load_state_dict(
                {"batch_size": B, "dp_size": dp, "running": running, "accepted": accepted, "rejected": rejected,
                 "submitted": running + accepted + rejected}
            )
            for v in range(5):
                want = formula(B=B, eta=eta, C=C, dp=dp, v=v, running=running, accepted=accepted)
                assert ctl.capacity(v) == want


def test_dp_divisor_applied_exactly_once():
    ctl = StalenessController(batch_size=64, max_staleness=0, max_concurrent=256, dp_size=4)
    assert (ctl.batch_size, ctl.max_concurrent) == (16, 64)
    assert (ctl.global_batch_size, ctl.global_max_concurrent) == (64, 256)
    assert ctl.capacity(0) == 16  # one per-rank batch, not 64 // 16 = 4 (divided twice) nor 64 (never divided)
    with pytest.raises(ValueError, match="batch_size"):
        StalenessController(batch_size=10, max_staleness=0, max_concurrent=8, dp_size=4)
    with pytest.raises(ValueError, match="max_concurrent"):
        StalenessController(batch_size=8, max_staleness=0, max_concurrent=10, dp_size=4)
    with pytest.raises(ValueError, match="dp_size"):
        StalenessController(batch_size=8, max_staleness=0, max_concurrent=8, dp_size=0)
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessController(batch_size=8, max_staleness=-1, max_concurrent=8)


def test_synchronous_rl_admits_exactly_one_batch_per_version():
    ctl = StalenessController(batch_size=4, max_staleness=0, max_concurrent=100)
    for v in range(3):
        n = 0
        while ctl.try_submit(v):
            n += 1
        assert n == 4
        ctl.on_reject(1)  # a rejected rollout frees its slot ...
        assert ctl.try_submit(v)
        ctl.on_accept(4)  # ... an accepted one does not
        assert ctl.capacity(v) == 0


def test_counters_and_misuse():
    ctl = StalenessController(batch_size=4, max_staleness=1, max_concurrent=6)
    ctl.on_submit(3)
    ctl.on_accept(2)
    ctl.on_reject(1)
    assert (ctl.submitted, ctl.running, ctl.accepted, ctl.rejected) == (3, 0, 2, 1)
    with pytest.raises(ValueError, match="n: cannot accept 1"):
        ctl.on_accept()
    with pytest.raises(ValueError, match="n: cannot reject 1"):
        ctl.on_reject()
    with pytest.raises(ValueError, match="version"):
        ctl.capacity(-1)
    assert ctl.submitted == ctl.accepted + ctl.rejected + ctl.running


def test_recovery_does_not_inflate_capacity():
    B, C, eta = 8, 64, 1
    ctl = StalenessController(batch_size=B, max_staleness=eta, max_concurrent=C)
    fresh_cap = ctl.capacity(5)  # a restarted controller that forgot accepted: (eta + 6) * B = 56 — inflated
    assert fresh_cap == 56
    ctl.on_submit(5)
    ctl.on_version_recovered(5)
    assert (ctl.accepted, ctl.running) == (5 * B, 0)
    assert ctl.capacity(5) == formula(B=B, eta=eta, C=C, dp=1, v=5, running=0, accepted=5 * B) == 16
    assert ctl.submitted == ctl.accepted + ctl.rejected + ctl.running


def test_state_dict_round_trip_and_mismatch():
    ctl = StalenessController(batch_size=8, max_staleness=2, max_concurrent=16, dp_size=2)
    ctl.on_submit(4)
    ctl.on_accept(1)
    ctl.on_reject(1)
    state = pickle.loads(pickle.dumps(ctl.state_dict()))
    other = StalenessController(batch_size=8, max_staleness=2, max_concurrent=16, dp_size=2)
    other.load_state_dict(state)
    assert other.state_dict() == ctl.state_dict()
    with pytest.raises(ValueError, match="batch_size"):
        StalenessController(batch_size=16, max_staleness=2, max_concurrent=16, dp_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="submitted"):
        other.load_state_dict({**state, "submitted": 99})


def test_try_submit_is_atomic_across_threads():
    ctl = StalenessController(batch_size=50, max_staleness=1, max_concurrent=1000)
    expected = ctl.capacity(0)
    wins = []
    lock = threading.Lock()

    def worker():
        n = 0
        for _ in range(200):
            n += ctl.try_submit(0)
        with lock:
            wins.append(n)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(wins) == expected == ctl.running == 100


def test_stats_is_a_plain_dict_snapshot():
    ctl = StalenessController(batch_size=8, max_staleness=1, max_concurrent=16, dp_size=2)
    ctl.on_submit(3)
    ctl.on_accept(1)
    ctl.on_reject(1)
    s = ctl.stats()
    assert type(s) is dict
    assert s == {"submitted": 3, "running": 1, "accepted": 1, "rejected": 1, "batch_size": 4, "max_concurrent": 8,
                 "max_staleness": 1, "dp_size": 2}
    ctl.on_accept(1)
    assert s["running"] == 1 and ctl.stats()["running"] == 0  # a snapshot, not a live view


def test_on_discard_frees_the_slot_of_an_accepted_rollout():
    """A rollout accepted, then found stale at consumption, must give its slot back. Otherwise (or when the slot
    is given back by submitting outside capacity(), since the replacement is accepted in turn) every stale drop
    uses up one of the (eta + 1) * B slots for good, and after that many drops capacity stays 0: a stall."""
    B, eta = 4, 1
    ctl = StalenessController(batch_size=B, max_staleness=eta, max_concurrent=100)
    assert ctl.try_submit(0, (eta + 1) * B)
    ctl.on_accept((eta + 1) * B)
    assert ctl.capacity(0) == 0
    ctl.on_discard(3)  # three of them were too old when the trainer took its batch
    assert (ctl.accepted, ctl.rejected, ctl.capacity(0)) == (5, 3, 3)
    assert ctl.submitted == ctl.accepted + ctl.rejected + ctl.running
    # the same drops accounted as "resubmit outside capacity" leave capacity at 0 once the replacements finish
    leaky = StalenessController(batch_size=B, max_staleness=eta, max_concurrent=100)
    leaky.try_submit(0, (eta + 1) * B)
    leaky.on_accept((eta + 1) * B)
    leaky.on_submit(3)
    leaky.on_accept(3)
    assert leaky.capacity(1) == (eta + 2) * B - 11 == 1  # one version later only 1 slot where 4 fresh are needed
    with pytest.raises(ValueError, match="n: cannot discard 6"):
        ctl.on_discard(6)
