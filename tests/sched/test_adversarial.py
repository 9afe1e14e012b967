"""Bad input to the sched blocks, tried as an attacker and as a new user would: NaN log-probs, non-integral
indices, truthy strings where flags are expected, absurd timeouts, and hand-edited or truncated checkpoints
(every ``load_state_dict`` names the block and the missing or unexpected key instead of a bare ``KeyError``)."""

from __future__ import annotations

import asyncio
import math
import threading
import time
import types

import numpy as np
import pytest
import torch

from rlblocks.errors import ArgumentError
from rlblocks.sched import (
    DynamicSampler,
    PartialRollout,
    PartialRolloutBuffer,
    StalenessController,
    StalenessQueue,
    balance_partitions,
    inverse_permutation,
    packed_to_pad,
    pad_to_packed,
    token_budget_microbatches,
)

NAN = float("nan")


# -------------------------------------------------------------------------------------- partial rollouts
@pytest.mark.parametrize("bad", [NAN, math.inf, np.float32("nan"), torch.tensor(NAN)])
def test_partial_rollout_refuses_a_nan_log_prob(bad):
    """A NaN (or +inf) log-prob used to be stored and resumed; trained on, it makes the whole batch's loss NaN
    steps later, far from the engine that produced it. It is refused here, naming the field and the index."""
    with pytest.raises(ArgumentError, match=r"^output_logprobs\[1\]: expected a log-probability"):
        PartialRollout(group_id="g", prompt_ids=[1], output_ids=[2, 3], output_logprobs=[-0.5, bad],
                       output_versions=[0, 0])


def test_partial_rollout_keeps_minus_inf_and_buffer_refuses_nan_through_every_door():
    """``-inf`` (a probability that underflowed) is a log-probability and is kept; a NaN is refused through
    ``put_generations`` and through a hand-edited checkpoint too."""
    s = PartialRollout(group_id="g", prompt_ids=[1], output_ids=[2], output_logprobs=[-math.inf],
                       output_versions=[0])
    assert s.output_logprobs == [-math.inf]

    gen = types.SimpleNamespace(request_id="r0", prompt_ids=[1], output_ids=[2], output_logprobs=[NAN],
                                output_versions=[0], finish_reason="abort")
    buf = PartialRolloutBuffer()
    with pytest.raises(ArgumentError, match=r"output_logprobs\[0\]"):
        buf.put_generations([gen], group_id="g", max_new_tokens=4)
    assert len(buf) == 0 and buf.stats()["samples_added"] == 0
    good = PartialRolloutBuffer()
    good.put_group([PartialRollout(group_id="g", prompt_ids=[1], output_ids=[2], output_logprobs=[-0.1],
                                   output_versions=[0])])
    state = good.state_dict()
    state["complete"][0][1][0]["output_logprobs"] = [NAN]
    with pytest.raises(ArgumentError, match=r"PartialRolloutBuffer\.load_state_dict: state\['complete'\]\[0\] "
                                            r"sample 0: output_logprobs\[0\]"):
        PartialRolloutBuffer().load_state_dict(state)


# ------------------------------------------------------------------------------------------------ checkpoints
def _queue_state():
    q = StalenessQueue(max_staleness=1)
    q.put("a", 0)
    q.put("b", 3)
    q.get_batch(1, current_version=3, timeout=0)
    return q.state_dict()


def _controller_state():
    c = StalenessController(batch_size=4, max_staleness=1, max_concurrent=8)
    assert c.try_submit(0, 3)
    c.on_accept(1)
    return c.state_dict()


def _buffer_state():
    b = PartialRolloutBuffer(group_size=2)
    b.add(PartialRollout(group_id="g", prompt_ids=[1], output_ids=[2], output_logprobs=[-0.1], output_versions=[0],
                         request_id="r1"))
    return b.state_dict()


BLOCKS = [
    ("StalenessQueue", lambda: StalenessQueue(max_staleness=1), _queue_state, "counters"),
    ("StalenessController", lambda: StalenessController(batch_size=4, max_staleness=1, max_concurrent=8),
     _controller_state, None),
    ("PartialRolloutBuffer", lambda: PartialRolloutBuffer(group_size=2), _buffer_state, "counts"),
]


@pytest.mark.parametrize(("block", "make", "state", "nested"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_load_state_dict_names_the_block_and_the_key(block, make, state, nested):
    """Every required key removed in turn, an unknown key added, and the state not a dict: each raises
    ``ArgumentError`` naming the block and the key (a missing counter used to be a bare ``KeyError``); the
    untouched state still loads and round-trips."""
    full = state()
    for key in full:
        if key in ("max_staleness", "max_concurrent", "group_size"):
            continue  # configuration echoed for information: optional
        broken = {k: v for k, v in full.items() if k != key}
        with pytest.raises(ArgumentError, match=rf"^{block}\.load_state_dict: state: missing key '{key}'"):
            make().load_state_dict(broken)
    with pytest.raises(ArgumentError, match=rf"^{block}\.load_state_dict: state: unexpected key 'extra'"):
        make().load_state_dict({**full, "extra": 1})
    with pytest.raises(ArgumentError, match=rf"^{block}\.load_state_dict: state: expected a dict"):
        make().load_state_dict([("items", [])])
    if nested is not None:
        inner = dict(full[nested])
        first = next(iter(inner))
        del inner[first]
        with pytest.raises(ArgumentError, match=rf"^{block}\.load_state_dict: state\['{nested}'\]: missing key "
                                                rf"'{first}'"):
            make().load_state_dict({**full, nested: inner})
    fresh = make()
    fresh.load_state_dict(full)
    assert fresh.state_dict().keys() == full.keys()


def test_queue_checkpoint_values_are_checked():
    full = _queue_state()
    bad_counters = {**full["counters"], "drained": "0"}
    with pytest.raises(ArgumentError, match=r"state\['counters'\]\['drained'\]: expected an int"):
        StalenessQueue(max_staleness=1).load_state_dict({**full, "counters": bad_counters})
    with pytest.raises(ArgumentError, match=r"state\['items'\]\[0\]: expected a 3-tuple"):
        StalenessQueue(max_staleness=1).load_state_dict({**full, "items": [("b", 3)]})
    with pytest.raises(ArgumentError, match=r"state\['items'\]\[0\] age: expected a finite real number"):
        StalenessQueue(max_staleness=1).load_state_dict({**full, "items": [("b", 3, NAN)]})
    # a JSON round trip turns the histograms' int keys into strings: read back as the ints
    hist = full["counters"]["age_histogram"]
    assert hist == {0: 1}
    json_like = {**full, "counters": {**full["counters"], "age_histogram": {str(k): v for k, v in hist.items()}}}
    q = StalenessQueue(max_staleness=1)
    q.load_state_dict(json_like)
    assert q.stats()["age_histogram"] == hist


# ---------------------------------------------------------------------------------------------------- timeouts
def _until(pred, limit_s: float = 60.0) -> None:
    """Wait for a state change of another thread (polled; the limit only turns a hang into a failure)."""
    deadline = time.monotonic() + limit_s
    while not pred():
        assert time.monotonic() < deadline, "the other thread never reached the expected state"
        time.sleep(0.001)


def test_queue_timeout_beyond_the_platform_wait_means_no_limit():
    """``timeout=1e12`` used to raise ``OverflowError`` from inside ``Condition.wait``; a timeout longer than the
    platform can wait (``threading.TIMEOUT_MAX``, ~292 years) cannot expire within a process and means no limit,
    like ``math.inf``. The waits end on events here (a put, a get), never on time."""
    q = StalenessQueue(max_staleness=1, capacity=1)
    started = threading.Event()
    got: list = []

    def consumer():
        started.set()
        got.extend(q.get_batch(1, current_version=0, timeout=1e12))

    t = threading.Thread(target=consumer)
    t.start()
    started.wait()
    _until(lambda: q._getters == 1)  # the consumer is inside the wait that used to overflow
    q.put("x", 0, timeout=1e12)
    t.join(timeout=60)
    assert not t.is_alive() and got == ["x"]
    q.put("y", 0)
    freed = threading.Thread(target=lambda: q.get_batch(1, current_version=0, timeout=0))
    waiter = threading.Thread(target=lambda: q.put("z", 0, timeout=1e12))
    waiter.start()
    _until(lambda: q._putters == 1)  # the producer waits for room
    freed.start()
    freed.join(timeout=60)
    waiter.join(timeout=60)
    assert not waiter.is_alive() and q.get_batch(1, current_version=0, timeout=0) == ["z"]

    async def both():
        q2 = StalenessQueue(max_staleness=1)
        getter = asyncio.ensure_future(q2.aget_batch(1, current_version=0, timeout=1e12))
        while not q2._async_waiters:  # one loop turn at a time until the getter waits
            await asyncio.sleep(0)
        await q2.aput("w", 0, timeout=1e12)
        return await asyncio.wait_for(getter, 60)

    assert asyncio.run(both()) == ["w"]
    for bad in (-1, NAN, True, "1", torch.tensor(1.0)):
        with pytest.raises(ArgumentError, match=r"^timeout: expected None or a number of seconds >= 0"):
            q.get_batch(1, current_version=0, timeout=bad)


def test_put_block_must_be_a_bool():
    q = StalenessQueue(max_staleness=1, capacity=1)
    q.put("a", 0)
    with pytest.raises(ArgumentError, match=r"^block: expected True or False, got 'no'"):
        q.put("b", 0, block="no")  # a truthy "no" used to block
    assert len(q) == 1


# ------------------------------------------------------------------------------------------------- packing
@pytest.mark.parametrize("bad", [[[0, 1.5], [2]], [[True, 0]], [[0], [np.float64(1.0)]], [[0, "1"]]])
def test_inverse_permutation_refuses_non_integral_indices(bad):
    """``1.5`` used to be truncated to 1 (``int(1.5)``) and accepted as a valid permutation."""
    with pytest.raises(ArgumentError, match=r"^groups\[\d\]\[\d\]: expected an int"):
        inverse_permutation(bad)


def test_inverse_permutation_accepts_numpy_and_tensor_indices():
    groups = balance_partitions([5, 1, 4, 2, 3], 2)
    want = inverse_permutation(groups)
    assert inverse_permutation([np.array(g) for g in groups]) == want
    assert inverse_permutation([torch.tensor(g) for g in groups]) == want
    flat = [i for g in groups for i in g]
    assert [flat[j] for j in want] == list(range(5))
    with pytest.raises(ArgumentError, match=r"^groups: expected a sequence of index lists"):
        inverse_permutation(3)


def test_packing_flags_must_be_bools():
    with pytest.raises(ArgumentError, match=r"^padded: expected True or False"):
        token_budget_microbatches([1, 2], max_tokens=4, padded="no")
    with pytest.raises(ArgumentError, match=r"^equal_size: expected True or False"):
        balance_partitions([1, 2], 2, equal_size="no")
    with pytest.raises(ArgumentError, match=r"^validate: expected True or False"):
        pad_to_packed(torch.ones(2, 3), torch.tensor([[1, 1, 0], [1, 0, 0]]), validate="no")
    flat, cu = pad_to_packed(torch.arange(6.0).reshape(2, 3), torch.tensor([[1, 1, 0], [1, 0, 0]]))
    x, m = packed_to_pad(flat, cu, max_len=np.int64(4))  # a numpy int is an int
    assert x.shape == (2, 4) and m.sum() == 3
    for bad in (4.0, True, 1):
        with pytest.raises(ArgumentError, match=r"^max_len: expected an int >= the longest sequence \(2\)"):
            packed_to_pad(flat, cu, max_len=bad)


# ------------------------------------------------------------------------------------------- dynamic sampling
def test_dynamic_sampler_bad_rewards_and_verdicts_leave_no_trace():
    d = DynamicSampler(target_groups=2, over_sampling=np.float32(1.5))
    assert d.over_sampling == 1.5
    d.on_submit(1)
    with pytest.raises(ArgumentError, match=r"^rewards: expected a sequence of numbers"):
        d.add_group("g", "10")
    bad_filter = DynamicSampler(target_groups=2, filter_fn=lambda g, r: torch.tensor([True, False]))
    bad_filter.on_submit(1)
    with pytest.raises(ArgumentError, match=r"^filter_fn: expected it to return True or False"):
        bad_filter.add_group("g", [1.0, 0.0])
    assert bad_filter.stats()["in_flight"] == 1  # the group was not consumed by the failed call
    assert d.add_group("g", np.array([1.0, 0.0])) and d.stats()["accepted"] == 1
