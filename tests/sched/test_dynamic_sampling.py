"""DynamicSampler: filtering, over-sampling arithmetic, done signal, aborts, surplus, insufficient policy."""

from __future__ import annotations

import math
import random
import subprocess
import sys

import pytest
import torch

from rlblocks.errors import InsufficientGroupsError
from rlblocks.sched import DynamicSampler, nonzero_reward_variance


def test_default_filter_is_exact_zero_variance():
    assert nonzero_reward_variance(None, [1.0, 1.0, 1.0]) is False
    assert nonzero_reward_variance(None, [0.0, 0.0, 1e-12]) is True  # exact comparison: tiny spread is kept
    assert nonzero_reward_variance(None, [0.5]) is False


def test_simulated_step_counts_and_done():
    """Drive a step with random groups (40% all-equal rewards); check every counter against the test's own tally."""
    rng = random.Random(0)
    target, factor = 16, 1.5
    sampler = DynamicSampler(target_groups=target, over_sampling=factor)
    in_flight: list[int] = []
    next_id, tally = 0, {"submitted": 0, "accepted": 0, "filtered": 0, "surplus": 0, "aborted": 0}
    accepted_ids = []
    while not sampler.done:
        want = max(0, math.ceil((target - tally["accepted"]) * factor) - len(in_flight))
        assert sampler.num_to_submit() == want
        for _ in range(want):
            in_flight.append(next_id)
            next_id += 1
            sampler.on_submit()
            tally["submitted"] += 1
        gid = in_flight.pop(rng.randrange(len(in_flight)))
        rewards = [1.0] * 4 if rng.random() < 0.4 else [float(rng.random() < 0.5) for _ in range(3)] + [0.0, 1.0]
        informative = len(set(rewards)) > 1
        kept = sampler.add_group(gid, torch.tensor(rewards))
        assert kept == informative
        tally["accepted" if informative else "filtered"] += 1
        if informative:
            accepted_ids.append(gid)
        assert sampler.stats()["in_flight"] == len(in_flight)
    assert tally["accepted"] == target and sampler.num_to_submit() == 0
    # groups finishing after the target are surplus (if informative) or filtered, never lost
    late = in_flight.pop()
    assert sampler.add_group(late, [0.0, 1.0]) is False
    tally["surplus"] += 1
    sampler.on_abort(len(in_flight))
    tally["aborted"] += len(in_flight)
    c = sampler.stats()
    assert {k: c[k] for k in tally} == tally
    assert c["submitted"] == c["accepted"] + c["filtered"] + c["surplus"] + c["aborted"] + c["in_flight"]
    assert c["in_flight"] == 0
    assert sampler.finish() == accepted_ids
    leftover = sampler.reset()
    assert leftover["surplus"] == [late] and len(leftover["filtered"]) == tally["filtered"]
    assert sampler.stats()["submitted"] == 0 and not sampler.done


def test_insufficient_policy_and_carry_over():
    keep = DynamicSampler(target_groups=3, keep_when_insufficient=True)
    strict = DynamicSampler(target_groups=3, keep_when_insufficient=False)
    for s in (keep, strict):
        s.on_submit(3)
        s.add_group("g0", [0.0, 1.0])
        s.add_group("g1", [1.0, 1.0])
    assert keep.finish() == ["g0"]
    with pytest.raises(InsufficientGroupsError, match="only 1 of target_groups=3"):
        strict.finish()
    out = keep.reset()  # the third group is still in flight: it is carried into the next step
    assert out["stats"]["carried_in_flight"] == 1
    assert keep.stats()["in_flight"] == 1 and keep.add_group("g2", [0.0, 2.0]) is True


def test_custom_filter_and_bad_arguments():
    s = DynamicSampler(target_groups=1, filter_fn=lambda group, rewards: max(rewards) > 0.5)
    s.on_submit(2)
    assert s.add_group("low", [0.1, 0.2]) is False
    assert s.add_group("high", [0.9, 0.9]) is True and s.done
    with pytest.raises(ValueError, match="no group in flight"):
        s.add_group("extra", [1.0, 0.0])
    with pytest.raises(ValueError, match="n: cannot abort"):
        s.on_abort()
    with pytest.raises(ValueError, match="target_groups"):
        DynamicSampler(target_groups=0)
    with pytest.raises(ValueError, match="over_sampling"):
        DynamicSampler(target_groups=1, over_sampling=0.5)
    t = DynamicSampler(target_groups=1)
    t.on_submit()
    with pytest.raises(ValueError, match=r"rewards\[1\]"):
        t.add_group("nan", [0.0, float("nan")])
    with pytest.raises(ValueError, match="rewards"):
        t.add_group("empty", [])


def test_sched_does_not_import_rollout_or_engines():
    code = (
        "import sys, rlblocks.sched; "
        "print([m for m in ('rlblocks.rollout', 'vllm', 'transformers') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


# ---------------------------------------------------------------------------------------- round limit
def run_window(sampler, rewards_stream, *, max_finished=10_000):
    """Drive one batch window the documented way; returns the finished groups in order (the test's own tally)."""
    finished, in_flight, next_id = [], [], 0
    while not sampler.done:
        for _ in range(sampler.num_to_submit()):
            in_flight.append(next_id)
            next_id += 1
            sampler.on_submit()
        gid = in_flight.pop(0)
        sampler.add_group(gid, next(rewards_stream))
        finished.append(gid)
        assert len(finished) <= max_finished, "the window did not complete"
    return finished, in_flight


@pytest.mark.parametrize("rounds", [0, 1, 3])
def test_max_rounds_bounds_a_window_of_zero_variance_groups(rounds):
    """Every group has equal rewards: unbounded, the step would never end; with R rounds it ends after exactly
    R·B discards, then B filled groups."""
    B = 4
    sampler = DynamicSampler(target_groups=B, max_rounds=rounds, over_sampling=1.5)
    finished, in_flight = run_window(sampler, iter(lambda: [1.0, 1.0, 1.0], None))
    assert len(finished) == (rounds + 1) * B
    s = sampler.stats()
    assert (s["accepted"], s["filled"], s["filtered"]) == (0, B, rounds * B)
    assert sampler.filled_groups == finished[rounds * B:] == sampler.finish()
    assert sampler.filtered_groups == finished[: rounds * B]
    assert s["submitted"] == s["accepted"] + s["filled"] + s["filtered"] + s["surplus"] + s["aborted"] + s["in_flight"]
    assert s["in_flight"] == len(in_flight)


def test_max_rounds_fills_only_the_shortfall_and_keeps_arrival_order():
    rng = random.Random(1)
    B, R = 8, 2
    pattern = [[0.0, 1.0] if rng.random() < 0.15 else [0.0, 0.0] for _ in range(1000)]
    sampler = DynamicSampler(target_groups=B, max_rounds=R)
    finished, _ = run_window(sampler, iter(pattern))
    informative = [g for g in finished if len(set(pattern[g])) > 1]
    flat = [g for g in finished if len(set(pattern[g])) == 1]
    # independent expectation: the first R·B flat groups are discarded, every later one fills the batch
    assert sampler.filtered_groups == flat[: R * B]
    assert sampler.filled_groups == flat[R * B:]
    assert sampler.finish() == [g for g in finished if g in set(informative) | set(flat[R * B:])]
    assert len(sampler.finish()) == B
    # after the batch is full, late groups are surplus or filtered, never filled
    sampler.on_submit(2)
    assert sampler.add_group("late-flat", [1.0, 1.0]) is False
    assert sampler.add_group("late-good", [0.0, 1.0]) is False
    assert sampler.stats()["filled"] == len(flat) - R * B and sampler.surplus_groups == ["late-good"]
    out = sampler.reset()
    assert out["filled"] == flat[R * B:] and out["stats"]["filled"] == len(flat) - R * B
    assert sampler.stats()["filled"] == 0 and sampler.filled_groups == []  # the next window starts from zero


def test_max_rounds_streaming_window_like_an_async_loop():
    """Ship every group add_group keeps, reset when done (what an asynchronous rollout loop does): every window
    ships exactly B groups and at most R·B discards are made per window, however flat the rewards are."""
    B, R = 3, 1
    sampler = DynamicSampler(target_groups=B, max_rounds=R)
    rng = random.Random(7)
    shipped_per_window, shipped, discarded = [], 0, 0
    sampler.on_submit(5)
    for i in range(200):
        kept = sampler.add_group(i, [0.0, 1.0] if rng.random() < 0.05 else [0.5, 0.5])
        sampler.on_submit()
        shipped += kept
        discarded += not kept
        assert discarded <= R * B
        if sampler.done:
            shipped_per_window.append(shipped)
            shipped = discarded = 0
            sampler.reset()
    assert shipped_per_window and set(shipped_per_window) == {B}
    assert sampler.stats()["in_flight"] == 5


def test_stats_is_the_one_name_of_the_counters():
    s = DynamicSampler(target_groups=1)
    assert not hasattr(s, "counts")
    out = s.reset()
    assert type(out) is dict and set(out) == {"stats", "surplus", "filtered", "filled"}
    assert type(s.stats()) is dict and out["stats"]["carried_in_flight"] == 0
    with pytest.raises(ValueError, match="max_rounds"):
        DynamicSampler(target_groups=1, max_rounds=-1)
    with pytest.raises(ValueError, match="max_rounds"):
        DynamicSampler(target_groups=1, max_rounds=True)
