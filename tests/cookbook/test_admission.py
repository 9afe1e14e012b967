"""The async loop's admission bookkeeping on a fake clock: the real ``Rollout`` accounting (admit, finish, stale
discard) against a trainer that takes B fresh groups per version from a ``StalenessQueue``.

A whole run cannot make the stall this guards against happen quickly (it needs (η+1)·B groups dropped as stale on one
rollout rank, which on the tiny model takes minutes of long-tailed generation), so the clock here is a tick counter
and a group's generation time is chosen: every third group of one rank takes several trainer steps, longer than η
versions, and is dropped as stale when the trainer reaches it.
"""

from __future__ import annotations

from collections import Counter

import grpo_async
import pytest
from plumbing import Weights

from rlblocks.sched import StalenessQueue

# a deprecated rlblocks name (the library's DeprecationWarnings all start with "rlblocks:") fails the test
pytestmark = pytest.mark.filterwarnings("error:rlblocks:DeprecationWarning")

B, ETA = 4, 1  # global prompt groups per step, max staleness


def make_rollout(rank: int = 1, ranks: int = 1, **flags) -> grpo_async.Rollout:
    cfg = grpo_async.Config(prompts_per_step=B, max_staleness=ETA, max_concurrent=64, rollout_ranks=ranks, **flags)
    return grpo_async.Rollout(cfg, rank, n_train=1, sample_group=None, sync_group=None, tokenizer=None,
                              engine=None, max_model_len=64, task=None, reward=None)


def simulate(rollouts: list[grpo_async.Rollout], *, steps: int, ticks: int, slow_every: dict[int, int],
             slow: int = 4, rewards=lambda i: [0.0, 1.0, 0.0, 1.0]) -> dict:
    """Tick by tick: each rollout rank admits what its controller allows at the current version (a group takes 1
    tick, every ``slow_every[rank]``-th ``slow`` ticks); finished groups go through the rank's own accounting into
    the trainer's queue, keyed by the version they were submitted at; the trainer takes fresh groups, oldest first,
    one step (= one version) per tick once it holds B, and reports the stale ones by rank, as the ``Stale`` control
    message does. Returns counters, including the tick at which the trainer reached ``steps`` (None: it stalled)."""
    stale_by_rank: Counter = Counter()
    q = StalenessQueue(max_staleness=ETA, on_stale=lambda item, v: stale_by_rank.update({item["rank"]: 1}))
    version, running, batch, trained = 0, [], [], 0
    started: Counter = Counter()
    dropped: Counter = Counter()
    by_rank = {r.rank: r for r in rollouts}
    for tick in range(ticks):
        for r in rollouts:
            for _ in range(r.admit(version)):
                i = started[r.rank]
                dur = slow if i % slow_every[r.rank] == slow_every[r.rank] - 1 else 1
                running.append((tick + dur, r.rank, f"r{r.rank}-{i}", version, rewards(i)))
                started[r.rank] += 1
        for item in [g for g in running if g[0] == tick]:
            running.remove(item)
            _, rank, uid, v, rew = item
            by_rank[rank].finished(uid, {"uid": uid, "version": v, "rank": rank}, rew)
        for r in rollouts:  # what each rank's send thread ships to the trainer's queue
            while not r.outbox.empty():
                rec = r.outbox.get()
                q.put(rec, rec["version"])
        batch += q.get_batch(B - len(batch), current_version=version, timeout=0)
        for rank, n in stale_by_rank.items():  # the trainer's Stale message; each rank applies it on its loop
            dropped[rank] += n
            by_rank[rank].discard(n)
        stale_by_rank.clear()
        if len(batch) == B:
            trained += B
            batch = []
            version += 1
            if version == steps:
                break
    return {"done_at": tick if version == steps else None, "version": version, "trained": trained,
            "dropped": dict(dropped), "queued": len(q), "in_batch": len(batch),
            "running": Counter(g[1] for g in running)}


def test_stale_drops_give_their_slots_back():
    # two rollout ranks, B/2 per rank: rank 1's every third group takes 8 trainer steps (older than η when the
    # trainer reaches it: dropped as stale), rank 2's are quick. Each drop must free its slot on rank 1. Replaced
    # outside capacity instead (the loop's earlier "refund"), a drop only borrows the slot from a later version:
    # on this clock the trainer then stalls for good at version 8 after 5 drops: 3 of its B groups in hand, none
    # running, and no slot left on either rank
    ranks = [make_rollout(1, 2), make_rollout(2, 2)]
    out = simulate(ranks, steps=100, ticks=2000, slow_every={1: 3, 2: 10**9}, slow=8)
    assert out["done_at"] is not None, f"the trainer stalled at version {out['version']}: {ranks} {out}"
    assert out["dropped"][1] > 10 * (ETA + 1) * B, out
    accepted = 0
    for r in ranks:  # the stale groups count as rejected; every accepted one is trained, waiting, or in the batch
        s = r.ctrl.stats()
        assert s["rejected"] == out["dropped"].get(r.rank, 0) == r.counters["groups_dropped_stale"], (s, out)
        assert s["running"] == out["running"][r.rank]
        accepted += s["accepted"]
    assert accepted == out["trained"] + out["queued"] + out["in_batch"], out


def test_resume_counts_queued_groups_as_accepted():
    # a restart at version v with q of this rank's groups still queued at the trainer: accepted = v·B + q, so the
    # rank admits (η+1)·B − q more, not (η+1)·B
    r = make_rollout()
    r.committed(Weights(version=5, kind="full", first=True, queued={1: 3, 2: 7}), 5)
    assert r.ctrl.stats()["accepted"] == 5 * B + 3
    assert r.admit(5) == (ETA + 1) * B - 3


def test_dynamic_sampling_round_bound_on_the_fake_clock():
    # every group has zero variance: the sampler discards rounds·B of them per batch window, then ships the next
    # B marked as filled; the trainer still gets its batches and nothing is lost
    rounds = 2
    r = make_rollout(dynamic_sampling=True, dynamic_max_rounds=rounds)
    out = simulate([r], steps=10, ticks=2000, slow_every={1: 10**9}, rewards=lambda i: [0.0] * 4)
    assert out["done_at"] is not None, out
    c = r.counters
    assert c["groups_filled_unfiltered"] >= 10 * B and c["groups_filtered"] >= 10 * rounds * B
    s = r.ctrl.stats()
    assert s["rejected"] == c["groups_filtered"]
    assert s["accepted"] == c["groups_filled_unfiltered"] == out["trained"] + out["queued"] + out["in_batch"]
