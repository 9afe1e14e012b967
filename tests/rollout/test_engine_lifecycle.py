"""The request lifecycle every engine shares (``engines/lifecycle.py``) and TorchEngine's prefix cache, on their own
(no model): the in-flight table, the pause / sleep / wake / update rules, version spans."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
import torch

from rlblocks.errors import ArgumentError, EngineError, SGLangError, WeightUpdateError
from rlblocks.rollout import GenerationRequest, SamplingParams
from rlblocks.rollout.engines.lifecycle import (
    EngineBase,
    InFlight,
    Lifecycle,
    RequestState,
    hold,
    versions_from_spans,
    wait_returned,
)
from rlblocks.rollout.engines.torch_memory import PrefixCache


def test_in_flight_table_refuses_duplicates_and_selects_abort_targets():
    table: InFlight[int] = InFlight(" on this client")
    table.add("a", 1)
    table.add("b", 2)
    table.add("c", 3)
    with pytest.raises(ArgumentError, match=r"request_id: 'a' is already in flight on this client"):
        table.add("a", 4)
    assert table["a"] == 1  # the refused add changed nothing
    assert table.select(None) == ["a", "b", "c"]  # submission order
    assert table.select("b") == ["b"]  # a bare str is one id, not its characters
    assert table.select(["c", "zz", "a"]) == ["c", "a"]  # given order; ids not in flight dropped
    assert table.select(iter(["b"])) == ["b"]
    table.pop("b")
    table.check_new("b")  # free again
    assert table.select(None) == ["a", "c"]


def test_request_state_abort_wakes_a_waiter():
    async def main():
        st = RequestState(GenerationRequest("r", [1], SamplingParams(max_new_tokens=1)))
        waiter = asyncio.ensure_future(st.aborted.wait())
        await asyncio.sleep(0)
        assert not waiter.done() and not st.abort_requested
        st.mark_aborted()
        await waiter
        return st.abort_requested

    assert asyncio.run(main())


def test_versions_from_spans():
    assert versions_from_spans([(3, 0, 2), (5, 2, 5)], 5, what="x") == [3, 3, 5, 5, 5]
    assert versions_from_spans([], 0, what="x") == []
    assert versions_from_spans([(1, 0, 0), (2, 0, 1)], 1, what="x") == [2]  # an empty span is allowed
    with pytest.raises(EngineError, match=r"^r1: spans cover 2 of the 3 tokens$"):
        versions_from_spans([(0, 0, 2)], 3, what="r1")
    with pytest.raises(SGLangError, match="not contiguous"):
        versions_from_spans([(0, 0, 2), (1, 3, 4)], 4, what="r2", error=SGLangError)
    with pytest.raises(EngineError, match="not contiguous"):
        versions_from_spans([(0, 0, 2), (1, 1, 2)], 3, what="r3")  # overlapping
    with pytest.raises(EngineError, match="not contiguous"):
        versions_from_spans([(0, 2, 1)], 0, what="r4")  # end before start


def test_lifecycle_rules():
    s = Lifecycle("E")
    assert not s.paused
    with pytest.raises(ArgumentError, match="mode: expected 'abort' or 'keep'"):
        s.check_pause("drop")
    s.check_pause("keep")
    with pytest.raises(ArgumentError, match="level: expected 1 or 2"):
        s.check_sleep(True)
    assert s.check_sleep(2)
    s.on_sleep(2)
    assert s.paused and not s.check_sleep(2)  # the same level again: a no-op
    with pytest.raises(EngineError, match="already asleep at level 2"):
        s.check_sleep(1)
    with pytest.raises(EngineError, match="asleep"):
        s.check_resume()
    assert s.on_wake() == 2
    assert s.paused and s.needs_weights  # level 2 discarded the weights
    with pytest.raises(WeightUpdateError, match="must be complete"):
        s.check_update(partial=True)
    s.check_update(partial=False)
    s.on_complete_update()
    assert not s.paused
    s.closed = True
    for check in (s.check_open, s.check_resume, lambda: s.check_pause("abort")):
        with pytest.raises(EngineError, match="E: the engine is closed"):
            check()


def test_engine_base_answers_state_queries():
    @dataclass
    class Counters:
        n: int = 0

    class Fake(EngineBase):
        closed = 0

        def close(self) -> None:
            self.closed += 1

    with Fake("Fake", version=4, stats=Counters(2)) as eng:
        assert (eng.version, eng.is_paused, eng.num_in_flight, eng.stats()) == (4, False, 0, {"n": 2})
        eng._inflight.add("r", object())
        eng._state.user_paused = True
        assert eng.num_in_flight == 1 and eng.is_paused
        eng._inflight.add("q", object())
        assert eng.in_flight_ids() == ["r", "q"]  # submission order
    assert eng.closed == 1


def test_hold_waits_at_the_gate_until_it_opens_or_the_request_is_aborted():
    async def main():
        life = Lifecycle("E")
        gate = asyncio.Event()
        gate.set()
        st = RequestState(GenerationRequest("r", [1], SamplingParams(max_new_tokens=1)))
        assert await hold(gate, st, life) is False  # an open gate: straight through

        gate.clear()
        waiting = asyncio.ensure_future(hold(gate, st, life))
        await asyncio.sleep(0)
        assert not waiting.done()  # held while the gate is clear
        gate.set()
        assert await waiting is False  # released, not aborted

        gate.clear()
        waiting = asyncio.ensure_future(hold(gate, st, life))
        await asyncio.sleep(0)
        st.mark_aborted()
        assert await waiting is True and not gate.is_set()  # the abort wakes it: it must not be sent

        other = RequestState(GenerationRequest("s", [1], SamplingParams(max_new_tokens=1)))
        waiting = asyncio.ensure_future(hold(gate, other, life))
        await asyncio.sleep(0)
        life.closed = True
        other.mark_aborted()
        with pytest.raises(EngineError, match="closed"):
            await waiting

    asyncio.run(main())


def test_wait_returned_waits_for_every_done_event_and_no_longer():
    async def main():
        states = [RequestState(GenerationRequest(r, [1], SamplingParams(max_new_tokens=1))) for r in "abc"]
        states[0].done.set()  # returned already

        async def finish(st):
            await asyncio.sleep(0)
            st.done.set()

        tasks = [asyncio.ensure_future(finish(st)) for st in states[1:]]
        await wait_returned(states, timeout=60.0)
        assert all(st.done.is_set() for st in states)
        await asyncio.gather(*tasks)
        stuck = RequestState(GenerationRequest("d", [1], SamplingParams(max_new_tokens=1)))
        await wait_returned([stuck], timeout=0.0)  # bounded: returns though the request never does
        assert not stuck.done.is_set()

    asyncio.run(main())


def _kv(n: int, fill: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((1, 1, n, 2), fill), torch.full((1, 1, n, 2), -fill))]


def test_prefix_cache_longest_prefix_of_the_same_version_lru():
    cache = PrefixCache(2)
    kv = _kv(2, 1.0)
    cache.put([1, 2], kv, version=0, routed=None)
    kv[0][0].fill_(9.0)  # the cache holds its own copy
    cache.put([1, 2, 3], _kv(3, 2.0), version=0, routed=None)
    n, got, _ = cache.take([1, 2, 3], version=0)  # a proper prefix only: [1, 2, 3] itself is not one
    assert n == 2 and float(got[0][0].flatten()[0]) == 1.0 and float(got[0][1].flatten()[0]) == -1.0
    cache.put([1, 2], _kv(2, 1.0), version=0, routed=None)
    assert cache.take([1, 2, 3, 4], version=1) is None  # other weights: no hit
    n, got, routed = cache.take([1, 2, 3, 4], version=0)
    assert n == 3 and routed is None and float(got[0][0].flatten()[0]) == 2.0
    assert len(cache) == 1  # taken entries leave
    cache.put([5], _kv(1, 3.0), version=0, routed=None)
    cache.put([6], _kv(1, 4.0), version=0, routed=None)  # evicts [1, 2], the least recently stored
    assert len(cache) == 2 and cache.take([1, 2, 3], version=0) is None
    cache.clear()
    assert len(cache) == 0
    off = PrefixCache(0)
    off.put([1], _kv(1, 1.0), version=0, routed=None)
    assert len(off) == 0
