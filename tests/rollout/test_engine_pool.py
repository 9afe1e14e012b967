"""Router: session affinity over 1000 requests, load spread, least-loaded dispatch, broadcast and abort routing."""

import asyncio
import random
from collections import Counter, defaultdict

import pytest
import torch

from rlblocks.rollout import Generation, GenerationRequest, Router, SamplingParams, resumable_generate
from rlblocks.rollout.engines import TorchEngine
from rlblocks.rollout.types import RolloutEngine


def run(coro, timeout=60.0):
    async def main():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(main())


class FakeEngine:
    """Records what it serves; each generate sleeps a random short time; supports abort of in-flight ids."""

    def __init__(self, name, seed=0):
        self.name = name
        self.served = []
        self.calls = []
        self._version = 0
        self._rng = random.Random(seed)
        self._inflight = {}
        self.hold = False
        self.paused = False

    @property
    def version(self):
        return self._version

    async def generate(self, request):
        """Completes after a seeded number of event-loop turns (deterministic scheduling), or when aborted;
        with ``hold`` set, only when aborted."""
        self.served.append(request)
        ev = asyncio.Event()
        self._inflight[request.request_id] = ev
        try:
            if self.hold:
                await ev.wait()
            for _ in range(self._rng.randrange(8)):
                if ev.is_set():
                    break
                await asyncio.sleep(0)
            reason = "abort" if ev.is_set() else "length"
        finally:
            self._inflight.pop(request.request_id, None)
        return Generation(request.request_id, request.prompt_ids, [7], [-1.0], [self._version], reason)

    async def abort(self, request_ids=None):
        ids = list(self._inflight) if request_ids is None else [r for r in request_ids if r in self._inflight]
        for r in ids:
            self._inflight[r].set()
        self.calls.append(("abort", ids))
        return ids

    async def pause(self, mode="abort"):
        self.calls.append(("pause", mode))
        self.paused = True

    async def resume(self):
        self.calls.append(("resume",))
        self.paused = False

    async def update_weights(self, named_tensors, *, version, partial=False, allow_rollback=False):
        self.calls.append(("update", [n for n, _ in named_tensors], version, partial, allow_rollback))
        self._version = version

    async def sleep(self, level=1):
        self.calls.append(("sleep", level))

    async def wake(self):
        self.calls.append(("wake",))

    @property
    def is_paused(self):
        return self.paused

    @property
    def num_in_flight(self):
        return len(self._inflight)

    def stats(self):
        return {"served": len(self.served)}

    def close(self):
        self.calls.append(("close",))


def test_session_affinity_over_1000_requests_and_load_spread():
    engines = [FakeEngine(f"e{i}", seed=i) for i in range(4)]
    router = Router(engines)
    assert isinstance(router, RolloutEngine)
    rng = random.Random(0)
    sessions = [f"s{i}" for i in range(60)]
    reqs = [GenerationRequest(f"r{i}", [1, 2], session_id=rng.choice(sessions)) for i in range(1000)]

    async def main():
        sem = asyncio.Semaphore(32)

        async def one(r):
            async with sem:
                return await router.generate(r)

        return await asyncio.gather(*[one(r) for r in reqs])

    gens = run(main())
    assert [g.request_id for g in gens] == [r.request_id for r in reqs]
    where = defaultdict(set)
    for e in engines:
        for r in e.served:
            where[r.session_id].add(e.name)
    assert sum(len(e.served) for e in engines) == 1000
    assert all(len(v) == 1 for v in where.values()), "a session was split across engines"
    per_engine_sessions = Counter(next(iter(v)) for v in where.values())
    assert all(10 <= per_engine_sessions[e.name] <= 20 for e in engines), per_engine_sessions
    assert all(150 <= len(e.served) <= 350 for e in engines), [len(e.served) for e in engines]
    assert router.in_flight == [0, 0, 0, 0]


def test_least_loaded_dispatch_without_sessions():
    engines = [FakeEngine(f"e{i}") for i in range(3)]
    router = Router(engines)

    async def main():
        # all in flight at once: 9 requests -> 3 per engine
        await asyncio.gather(*[router.generate(GenerationRequest(f"a{i}", [1])) for i in range(9)])
        counts_concurrent = [len(e.served) for e in engines]
        # sequential: round-robin through the assigned-count tie-break
        for i in range(6):
            await router.generate(GenerationRequest(f"b{i}", [1]))
        return counts_concurrent, [len(e.served) for e in engines]

    concurrent, total = run(main())
    assert concurrent == [3, 3, 3] and total == [5, 5, 5]


def test_abort_routing_broadcast_and_resubmission_stickiness():
    engines = [FakeEngine(f"e{i}") for i in range(2)]
    for e in engines:
        e.hold = True  # long-running requests, ended only by abort
    router = Router(engines)

    async def main():
        tasks = [asyncio.ensure_future(router.generate(GenerationRequest(f"r{i}", [1]))) for i in range(4)]
        await asyncio.sleep(0.01)
        got = await router.abort(["r1", "nope"])
        g1 = await tasks[1]
        # the re-submission of r1 goes back to the engine that aborted it
        owner = next(i for i, e in enumerate(engines) if any(r.request_id == "r1" for r in e.served))
        assert router.engine_for(GenerationRequest("r1", [1, 7])) == owner
        t1 = asyncio.ensure_future(router.generate(GenerationRequest("r1", [1, 7])))
        await asyncio.sleep(0.01)
        rest = await router.abort(None)
        for e in engines:
            e.hold = False
        await asyncio.gather(*tasks, t1)
        await router.pause("keep")
        paused = router.is_paused
        await router.resume()
        await router.sleep(2)
        await router.wake()

        def stream():
            yield "w", torch.zeros(2)

        await router.update_weights(stream(), version=3, partial=True)
        await router.aclose()
        return got, g1, owner, rest, paused

    got, g1, owner, rest, paused = run(main())
    assert paused and not router.is_paused and router.num_in_flight == 0
    assert router.stats() == {
        "num_in_flight": 0,
        "in_flight": [0, 0],
        "assigned": [len(e.served) for e in engines],
        "alive": [True, True],
        "failovers": 0,
        "rejoins": 0,
        "health_checks": 0,
        "failures": [],
        "engines": [{"served": len(e.served)} for e in engines],
    }
    assert got == ["r1"] and g1.finish_reason == "abort"
    assert [r.request_id for r in engines[owner].served].count("r1") == 2
    assert sorted(rest) == ["r0", "r1", "r2", "r3"]
    assert router.version == 3
    for e in engines:
        assert ("pause", "keep") in e.calls and ("resume",) in e.calls and ("sleep", 2) in e.calls
        assert ("update", ["w"], 3, True, False) in e.calls  # every engine saw the whole (one-shot) stream
        assert e.calls[-1] == ("close",)
    with pytest.raises(ValueError, match="engines"):
        Router([])


def test_router_over_torch_engines_with_resumable_generate(tiny_model, make_tiny_model):
    engines = [TorchEngine(tiny_model), TorchEngine(make_tiny_model())]
    router = Router(engines)
    sp = SamplingParams(temperature=0.0, max_new_tokens=12)
    new = {n: p.detach() * 1.1 for n, p in tiny_model.named_parameters()}

    async def main():
        ref = await engines[0].generate(GenerationRequest("ref", [1, 8, 9], sp))
        tasks = [
            asyncio.ensure_future(resumable_generate(router, GenerationRequest(f"q{i}", [1, 8, 9], sp, session_id="s")))
            for i in range(4)
        ]
        while not any((e.num_output_tokens(f"q{i}") or 0) >= 3 for e in engines for i in range(4)):
            await asyncio.sleep(0.0005)
        await router.pause("abort")
        await router.update_weights(new.items(), version=1)
        await router.resume()
        return ref, await asyncio.gather(*tasks)

    ref, results = run(main())
    assert [e.version for e in engines] == [1, 1] and router.version == 1
    # one session, one engine
    assert engines[1].stats()["decode_tokens"] == 0 and engines[1].stats()["prefill_tokens"] == 0
    for res in results:
        assert res.num_output_tokens == 12 and res.version_spans()[-1][0] == 1
        k = res.version_spans()[0][2] if res.version_spans()[0][0] == 0 else 0
        assert res.output_ids[:k] == ref.output_ids[:k]
