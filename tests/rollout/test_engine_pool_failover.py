"""Router over engines that die under a live job: SGLang clients of fake SGLang servers, each in a process of its
own, killed (SIGKILL) or frozen (SIGSTOP) by pid mid-stream. No request is lost or answered twice, the tokens a
request already holds keep their versions, a hung engine is found by its heartbeat, and a restarted engine rejoins
only once it serves the live engines' weight version.

The fake model continues ``(last token + 1) % vocab`` with a logprob that depends only on the absolute position, so
a generation moved to another engine must equal the uninterrupted one exactly."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from fake_sglang import VOCAB

from rlblocks.errors import EngineError, NoLiveEngine
from rlblocks.rollout import GenerationRequest, Router, SamplingParams, resumable_generate
from rlblocks.rollout.engines import SGLangEngine

HERE = Path(__file__).resolve().parent


class Server:
    """A fake SGLang server process; ``url`` is read from its first line (it is serving once it printed it)."""

    def __init__(self, step_s: float) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HERE / "_fake_sglang_server.py"), str(step_s)],
                                     stdout=subprocess.PIPE, text=True)
        self.url = self.proc.stdout.readline().strip()
        assert self.url.startswith("http://"), self.url

    def tokens(self, rid: str) -> int:
        with urllib.request.urlopen(f"{self.url}/_test/num_tokens/{rid}", timeout=30) as r:
            return json.loads(r.read())["num_tokens"] or 0

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def servers():
    started: list[Server] = []

    def start(step_s: float = 0.01) -> Server:
        started.append(Server(step_s))
        return started[-1]

    yield start
    for s in started:
        s.kill()


def expected(prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """The fake model's uninterrupted continuation of ``prompt`` (ids, logprobs)."""
    seq, lps = list(prompt), []
    for _ in range(n):
        lps.append(-(len(seq) % 7 + 1) / 8)
        seq.append((seq[-1] + 1) % VOCAB)
    return seq[len(prompt):], lps


def run(coro, timeout: float = 120.0):
    async def main():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(main())


async def _until(cond, what: str) -> None:
    """Wait for ``cond()`` (polled on the event loop; a hang guard, not a timing assumption)."""
    for _ in range(20000):
        if await asyncio.to_thread(cond):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


def _reqs(n: int, tokens: int) -> list[GenerationRequest]:
    return [GenerationRequest(f"q{i}", [5 + i], SamplingParams(max_new_tokens=tokens)) for i in range(n)]


def test_a_killed_engine_loses_no_request_and_duplicates_none(servers):
    a, b = servers(), servers()
    engines = [SGLangEngine(a.url, timeout=60), SGLangEngine(b.url, timeout=60)]
    router = Router(engines)
    reqs = _reqs(8, 40)

    async def main():
        tasks = [asyncio.ensure_future(resumable_generate(router, r)) for r in reqs]
        on_a = [r.request_id for r in reqs[::2]]  # least-loaded dispatch alternates: the even ones went to a
        await _until(lambda: all(a.tokens(rid) >= 2 for rid in on_a), "a generates its requests")
        a.kill()  # mid-stream: its HTTP connections are reset
        out = await asyncio.gather(*tasks)
        await router.aclose()
        return out

    results = run(main())
    assert [r.request_id for r in results] == [r.request_id for r in reqs]
    for req, res in zip(reqs, results):
        ids, lps = expected(req.prompt_ids, 40)
        assert res.output_ids == ids and res.output_logprobs == lps and res.finish_reason == "length"
        assert res.output_versions == [0] * 40
    st = router.stats()
    assert st["alive"] == [False, True] and st["failures"][0][0] == 0
    assert st["failovers"] == 4  # the four requests in flight on a, each moved once
    assert st["assigned"] == [4, 8]
    assert engines[1].stats()["requests"] == 8


def test_tokens_keep_their_versions_across_a_failover_and_a_restarted_engine_rejoins_with_the_weights(servers):
    a, b = servers(), servers()
    engines = [SGLangEngine(a.url, timeout=60), SGLangEngine(b.url, timeout=60)]
    router = Router(engines)
    reqs = _reqs(4, 40)

    async def main():
        tasks = [asyncio.ensure_future(resumable_generate(router, r)) for r in reqs]
        servers_of = {r.request_id: (a if i % 2 == 0 else b) for i, r in enumerate(reqs)}
        await _until(lambda: all(servers_of[r].tokens(r) >= 3 for r in servers_of), "every request has 3 tokens")
        await router.pause("abort")  # a weight update: each request comes back with its version-0 tokens
        a.kill()  # a dies while paused; nothing is in flight on it, so only the next call finds out
        await engines[1].update_weights_from_disk("/ckpt", version=1)
        await router.resume()  # a cannot resume: it is taken out, its requests go to b under version 1
        results = await asyncio.gather(*tasks)
        # a restarted a: another server process, at version 0, is refused until it has the live version's weights
        c = servers()
        fresh = SGLangEngine(c.url, timeout=60)
        with pytest.raises(EngineError, match="serves version 0, the live engines 1"):
            await router.rejoin(0, fresh)
        alive_before = list(router.alive)
        await fresh.update_weights_from_disk("/ckpt", version=1)
        await router.rejoin(0, fresh)
        assigned = list(router.assigned)
        after = await asyncio.gather(*[router.generate(GenerationRequest(f"n{i}", [30 + i], SamplingParams(
            max_new_tokens=5))) for i in range(4)])
        spread = [n - m for n, m in zip(router.assigned, assigned)]
        await router.aclose()
        return results, alive_before, after, fresh, spread

    results, alive_before, after, fresh, spread = run(main())
    for req, res in zip(reqs, results):
        ids, lps = expected(req.prompt_ids, 40)
        assert res.output_ids == ids and res.output_logprobs == lps
        k = res.output_versions.count(0)
        assert k >= 3 and res.output_versions == [0] * k + [1] * (40 - k)  # earlier tokens keep version 0
    assert alive_before == [False, True]
    assert router.alive == [True, True] and router.stats()["rejoins"] == 1
    assert all(g.output_versions == [1] * 5 for g in after)
    assert spread == [2, 2] and fresh.stats()["requests"] == 2  # the load is spread over both again


def test_a_hung_engine_is_found_by_its_heartbeat_and_its_requests_move(servers):
    a, b = servers(), servers()
    engines = [SGLangEngine(a.url, timeout=60), SGLangEngine(b.url, timeout=60)]
    router = Router(engines, health_timeout=1.0)
    reqs = _reqs(4, 30)

    async def main():
        assert await router.check_health() == []  # both answer
        tasks = [asyncio.ensure_future(resumable_generate(router, r)) for r in reqs]
        await _until(lambda: all(a.tokens(r.request_id) >= 1 for r in reqs[::2]), "a generates")
        os.kill(a.proc.pid, signal.SIGSTOP)  # hung: its sockets stay open, nothing answers
        out_of_service = await router.check_health()
        results = await asyncio.gather(*tasks)
        a.kill()
        await router.aclose()
        return out_of_service, results

    out_of_service, results = run(main())
    assert out_of_service == [0] and router.alive == [False, True]
    assert "heartbeat" in router.failures[0][1]
    for req, res in zip(reqs, results):
        assert (res.output_ids, res.output_logprobs) == expected(req.prompt_ids, 30)
    assert router.stats()["failovers"] == 2


def test_no_live_engine_is_an_error_naming_the_way_back(servers):
    a = servers()
    router = Router([SGLangEngine(a.url, timeout=60)])

    async def main():
        a.kill()
        with pytest.raises(NoLiveEngine, match="rejoin"):
            await router.generate(GenerationRequest("x", [1], SamplingParams(max_new_tokens=3)))
        await router.aclose()

    run(main())
    assert router.alive == [False]
