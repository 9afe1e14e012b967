"""Attacks and faults on the capture gateway, so that the holes they found stay closed.

A queue that refuses a finished trajectory (closed, full, a raising callable) and ``aclose()`` during a hand-over
never lose it; a client that disconnects mid-turn (streaming or not) does not get that turn trained, and its retry
extends the trajectory instead of branching it; CR/LF in a session id never reaches a response header; oversized
bodies get a 413 the client can read; unknown routes share one stats key. Every test checks the conservation
identities of ``Gateway.stats()`` and where each trajectory is.

Clients are the real ``openai`` package (completions) and ``httpx`` (reward posts, raw routes); byte-exact attacks
use raw sockets. Synchronisation is by events (an engine that holds a turn until released, a queue that says when a
hand-over waits), never by sleeping.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys

import pytest

from rlblocks.errors import QueueClosed, QueueRefused, SessionNotFound
from rlblocks.rollout.engines import TorchEngine
from rlblocks.rollout.gateway import Gateway
from rlblocks.sched import StalenessQueue

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

HELLO = [{"role": "user", "content": "hello"}]


def _conserved(s: dict) -> None:
    """The gateway's two conservation identities (every session and every closed trajectory is somewhere)."""
    assert s["sessions_opened"] == s["sessions_open"] + s["sessions_finished"] + s["sessions_discarded"], s
    assert s["sessions_finished"] == s["handed_over"] + s["finished_kept"] + s["finished_taken"], s


class _HeldEngine:
    """Forwards to an engine. While ``hold`` is true, a generation first waits for ``release`` (``entered`` is set
    when it starts waiting); a cancelled wait sets ``cancelled`` and, with ``finish_anyway``, generates all the same
    (an engine that completes a turn after its client left)."""

    def __init__(self, engine, *, finish_anyway: bool = False) -> None:
        self.engine, self.finish_anyway = engine, finish_anyway
        self.hold = False
        self.entered, self.release, self.cancelled = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self.generations: list = []

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def is_paused(self) -> bool:
        return self.engine.is_paused

    async def generate(self, request):
        if self.hold:
            self.entered.set()
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                if not self.finish_anyway:
                    raise
        gen = await self.engine.generate(request)
        self.generations.append(gen)
        return gen


class _SignallingQueue(StalenessQueue):
    """A StalenessQueue whose ``aput`` says when a hand-over has started waiting on it."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.entered = asyncio.Event()

    async def aput(self, item, version, *, timeout=None):
        self.entered.set()
        return await super().aput(item, version, timeout=timeout)


async def _raw(port: int, data: bytes, timeout: float = 30.0) -> tuple[int, bytes, dict]:
    """Send raw bytes, read until the server closes: (status, head, JSON body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    out = await asyncio.wait_for(reader.read(), timeout)
    writer.close()
    assert out, "the server closed the connection without an answer"
    head, _, body = out.partition(b"\r\n\r\n")
    return int(head.split()[1]), head, json.loads(body)


def _post(path: str, body: bytes, headers: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\nConnection: close\r\n{headers}"
            "\r\n").encode() + body


def _client(gw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url, api_key="unused", max_retries=0, timeout=60)


# ================================================================================================ queue refusals
def test_a_closed_queue_keeps_the_trajectory_and_answers_503(random_chat_model, chat_tok):
    q = StalenessQueue(max_staleness=1)
    q.close()

    async def main():
        async with Gateway(TorchEngine(random_chat_model), chat_tok, model="tiny", queue=q) as gw:
            client = _client(gw)
            hdr = {"X-Session-Id": "a"}
            r = await client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3, seed=0,
                                                     extra_headers=hdr)
            await client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3, seed=0, user="b")
            async with httpx.AsyncClient() as h:
                refused = await h.post(f"{gw.url}/sessions/a/reward", json={"reward": 0.5})
                again = await h.post(f"{gw.url}/sessions/a/reward", json={"reward": 0.5})
            with pytest.raises(QueueRefused) as py:  # the same from Python, with the trajectory on the exception
                await gw.finish_session("b", 1.0)
            await client.close()
            mid = gw.stats()
            kept = list(gw.finished)
            taken = gw.take_finished()
            return r, refused, again, py.value, mid, kept, taken, gw.stats(), dict(gw.sessions)

    r, refused, again, err, mid, kept, taken, end, sessions = asyncio.run(main())
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_refused"
    msg = refused.json()["error"]["message"]
    assert "QueueClosed" in msg and "kept" in msg and "'a'" in msg
    assert again.status_code == 404  # the session was closed (with its reward), not left half-open
    assert isinstance(err.__cause__, QueueClosed) and err.session_id == "b" and err.trajectory is kept[1]
    assert [t.session_id for t in kept] == ["a", "b"] and [t.reward for t in kept] == [0.5, 1.0]
    assert kept[0].num_model_tokens == r.usage.completion_tokens and taken == kept
    assert mid["handover_refused"] == 2 and mid["finished_kept"] == 2 and mid["handed_over"] == 0
    assert end["finished_kept"] == 0 and end["finished_taken"] == 2 and not sessions and len(q) == 0
    _conserved(mid)
    _conserved(end)


def test_a_full_queue_then_aclose_keeps_the_waiting_trajectory(random_chat_model, chat_tok):
    async def main():
        q = _SignallingQueue(max_staleness=5, capacity=1)
        q.put("filler", 0)
        gw = Gateway(TorchEngine(random_chat_model), chat_tok, model="tiny", queue=q)
        await gw.start()
        client = _client(gw)
        await client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2, seed=0, user="w")
        await client.close()
        async with httpx.AsyncClient(timeout=60) as h:
            post = asyncio.ensure_future(h.post(f"{gw.url}/sessions/w/reward", json={"reward": 1.0}))
            await q.entered.wait()  # the hand-over waits for room in the full queue
            waiting = gw.stats()
            returned = await gw.aclose()
            resp = await post
        return q, waiting, returned, resp, gw

    q, waiting, returned, resp, gw = asyncio.run(main())
    assert waiting["handovers_waiting"] == 1 and waiting["sessions_open"] == 1  # still open while it waits
    _conserved(waiting)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "shutting_down"
    assert [t.session_id for t in returned] == ["w"] and returned[0].reward == 1.0 and gw.finished == returned
    assert len(q) == 1 and q.get_batch(1, current_version=0) == ["filler"]  # nothing else went in
    s = gw.stats()
    assert s["handover_refused"] == 1 and s["sessions_finished"] == 1 and s["handovers_waiting"] == 0
    _conserved(s)


def test_a_full_queue_times_out_then_flush_hands_the_kept_trajectory_over(random_chat_model, chat_tok):
    async def main():
        q = StalenessQueue(max_staleness=5, capacity=1)
        q.put("filler", 0)
        async with Gateway(TorchEngine(random_chat_model), chat_tok, model="tiny", queue=q,
                           handover_timeout=0.2) as gw:
            client = _client(gw)
            await client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2, seed=0, user="f")
            await client.close()
            async with httpx.AsyncClient() as h:
                full = await h.post(f"{gw.url}/sessions/f/reward", json={"reward": 2.0})
            still = await gw.flush()  # the queue is still full: refused again, still kept
            assert q.get_batch(1, current_version=0) == ["filler"]  # room
            left = await gw.flush()
            return full, still, left, q.get_batch(1, current_version=0), gw.stats()

    full, still, left, batch, s = asyncio.run(main())
    assert full.status_code == 503 and "QueueFull" in full.json()["error"]["message"]
    assert [t.session_id for t in still] == ["f"] and left == []
    assert [t.session_id for t in batch] == ["f"] and batch[0].reward == 2.0
    assert s["handed_over"] == 1 and s["handover_refused"] == 2 and s["finished_kept"] == 0
    _conserved(s)


def test_a_raising_callable_queue_keeps_the_trajectory(random_chat_model, chat_tok):
    def sink(traj):
        raise RuntimeError("trainer inbox unreachable")

    async def main():
        async with Gateway(TorchEngine(random_chat_model), chat_tok, model="tiny", queue=sink) as gw:
            client = _client(gw)
            await client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2, seed=0, user="c")
            await client.close()
            async with httpx.AsyncClient() as h:
                resp = await h.post(f"{gw.url}/sessions/c/reward", json={"reward": 1.0})
            return resp, list(gw.finished), gw.stats()

    resp, kept, s = asyncio.run(main())
    assert resp.status_code == 503 and "trainer inbox unreachable" in resp.json()["error"]["message"]
    assert [t.session_id for t in kept] == ["c"]
    _conserved(s)


class _HeldSink:
    """A callable queue: refuses while ``refuse``, else holds each hand-over until ``release`` (``entered`` set)."""

    def __init__(self) -> None:
        self.refuse, self.got = True, []
        self.entered, self.release = asyncio.Event(), asyncio.Event()

    async def __call__(self, traj) -> None:
        if self.refuse:
            raise RuntimeError("not yet")
        self.entered.set()
        await self.release.wait()
        self.got.append(traj)


def test_flush_and_take_finished_at_once_hand_each_trajectory_over_once(random_chat_model, chat_tok):
    sink = _HeldSink()

    async def main():
        async with Gateway(TorchEngine(random_chat_model), chat_tok, model="tiny", queue=sink) as gw:
            client = _client(gw)
            for sid in ("t0", "t1", "t2"):
                await client.completions.create(model="tiny", prompt=[5, 6], max_tokens=1, seed=0, user=sid)
                with pytest.raises(QueueRefused):
                    await gw.finish_session(sid, 1.0)
            await client.close()
            sink.refuse = False
            first = asyncio.ensure_future(gw.flush())
            await sink.entered.wait()  # t0 is being offered
            second = asyncio.ensure_future(gw.flush())  # waits for the first
            taken = gw.take_finished()
            during = gw.stats()
            sink.release.set()
            return taken, during, await first, await second, gw.stats()

    taken, during, left1, left2, end = asyncio.run(main())
    assert [t.session_id for t in taken] == ["t1", "t2"] and [t.session_id for t in sink.got] == ["t0"]
    assert left1 == left2 == []
    assert during["finished_kept"] == 1 and during["finished_taken"] == 2  # t0, in hand, still counts as kept
    assert end["handed_over"] == 1 and end["handover_refused"] == 3
    _conserved(during)
    _conserved(end)


# ================================================================================================ undelivered turns
def test_a_client_that_disconnects_mid_turn_does_not_get_that_turn_trained(random_chat_model, chat_tok):
    """Turn 1 is delivered; the client gives up on turn 2 while the engine generates it, then retries it. The
    undelivered generation is cancelled and rolled back: the episode's trajectory is turn 1 + the retried turn 2,
    one segment, no branch."""
    q = StalenessQueue(max_staleness=1)

    async def main():
        engine = _HeldEngine(TorchEngine(random_chat_model))
        async with Gateway(engine, chat_tok, model="tiny", queue=q) as gw:
            client = _client(gw)
            hdr = {"X-Session-Id": "ep"}
            r1 = await client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4, seed=1,
                                                      extra_headers=hdr)
            msgs = [*HELLO, r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
            before = list(gw.sessions["ep"].trajectory.token_ids)
            engine.hold = True
            gave_up = asyncio.ensure_future(client.chat.completions.create(
                model="tiny", messages=msgs, max_tokens=4, seed=2, extra_headers=hdr))
            await engine.entered.wait()
            gave_up.cancel()  # the client closes its connection mid-request
            await asyncio.gather(gave_up, return_exceptions=True)
            await engine.cancelled.wait()  # the gateway saw the disconnect and stopped the generation
            engine.hold = False
            r2 = await client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, seed=2,
                                                      extra_headers=hdr)
            async with httpx.AsyncClient() as h:
                await h.post(f"{gw.url}/sessions/ep/reward", json={"reward": 1.0})
            await client.close()
            return r1, r2, before, engine, gw.stats()

    r1, r2, before, engine, s = asyncio.run(main())
    (traj,) = q.get_batch(1, current_version=0)
    assert traj.token_ids[: len(before)] == before and traj.prefix_mismatches == 0 and traj.branches == []
    assert traj.num_model_tokens == r1.usage.completion_tokens + r2.usage.completion_tokens
    model = [t for t, role in zip(traj.token_ids, traj.roles) if role == "model"]
    assert model == r1.model_extra["rlblocks"]["output_ids"] + r2.model_extra["rlblocks"]["output_ids"]
    assert len(engine.generations) == 2  # the cancelled generation never completed
    assert s["turns_undelivered"] == 1 and s["tokens_undelivered"] == 0 and s["prefix_mismatches"] == 0
    assert s["completion_tokens"] == r1.usage.completion_tokens + r2.usage.completion_tokens  # delivered only
    _conserved(s)


def test_a_stream_closed_before_its_turn_is_sent_is_rolled_back_and_retried(random_chat_model, chat_tok):
    async def main():
        engine = _HeldEngine(TorchEngine(random_chat_model))
        async with Gateway(engine, chat_tok, model="tiny") as gw:
            client = _client(gw)
            engine.hold = True
            stream = await client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4, seed=3,
                                                          user="s", stream=True)
            first = await stream.__anext__()  # the headers and the role chunk came at once
            await engine.entered.wait()
            await stream.close()  # the client drops the stream while the turn is generated
            await engine.cancelled.wait()
            engine.hold = False
            retry = await client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4, seed=3,
                                                         user="s", stream=True)
            chunks = [c async for c in retry]
            await client.close()
            traj = await gw.finish_session("s", 0.0)
            return first, chunks, traj, gw.stats()

    first, chunks, traj, s = asyncio.run(main())
    assert first.choices[0].delta.role == "assistant"
    text = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    assert traj.num_turns == 1 and traj.branches == [] and traj.num_model_tokens == len(
        chunks[-1].model_extra["rlblocks"]["output_ids"])
    assert chat_tok.decode([t for t, r in zip(traj.token_ids, traj.roles) if r == "model"]).startswith(text)
    # the first stream's session was emptied by the rollback, dropped, and opened again by the retry
    assert s["turns_undelivered"] == 1 and s["sessions_discarded"] == 1 and s["stream_requests"] == 2
    _conserved(s)


def test_a_turn_generated_after_its_client_left_is_not_captured(random_chat_model, chat_tok):
    """An engine that completes the turn even though the request was cancelled: the reply cannot be delivered, so
    its tokens are counted as undelivered, not appended."""

    async def main():
        engine = _HeldEngine(TorchEngine(random_chat_model), finish_anyway=True)
        async with Gateway(engine, chat_tok, model="tiny") as gw:
            client = _client(gw)
            await client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3, seed=0, user="g")
            before = list(gw.sessions["g"].trajectory.token_ids)
            engine.hold = True
            gone = asyncio.ensure_future(client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=3,
                                                                   seed=0, user="g"))
            await engine.entered.wait()
            gone.cancel()
            await asyncio.gather(gone, return_exceptions=True)
            await engine.cancelled.wait()
            await client.close()
            # the abandoned request holds the session's lock until its turn is undone
            async with gw.sessions["g"].lock:
                after = list(gw.sessions["g"].trajectory.token_ids)
            return before, after, engine, gw.stats()

    before, after, engine, s = asyncio.run(main())
    assert after == before
    assert len(engine.generations) == 2  # the second was generated, but never delivered
    assert s["turns_undelivered"] == 1 and s["tokens_undelivered"] == len(engine.generations[1].output_ids) > 0
    _conserved(s)


# ================================================================================================ headers and bodies
def test_cr_lf_in_a_session_id_is_refused_and_never_reaches_a_header(random_chat_model, chat_tok):
    async def main():
        async with Gateway(TorchEngine(random_chat_model), chat_tok, model="tiny") as gw:
            client = _client(gw)
            with pytest.raises(openai.BadRequestError) as injected:
                await client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2,
                                                     user="u\r\nX-Injected: yes")
            raw_ok = await client.chat.completions.with_raw_response.create(model="tiny", messages=HELLO,
                                                                            max_tokens=2, user="team/42 é")
            await client.close()
            body = json.dumps({"model": "tiny", "messages": HELLO, "max_tokens": 2}).encode()
            tab = await _raw(gw.port, _post("/v1/chat/completions", body, "X-Session-Id: a\tb\r\n"))
            long = await _raw(gw.port, _post("/v1/chat/completions", body, f"X-Session-Id: {'s' * 513}\r\n"))
            return injected.value, raw_ok, tab, long, gw.stats(), dict(gw.sessions)

    injected, raw_ok, tab, long, s, sessions = asyncio.run(main())
    assert injected.body["param"] == "user" and "control characters" in injected.body["message"]
    assert "x-injected" not in injected.response.headers
    assert dict(raw_ok.headers.raw)[b"x-session-id"] == "team/42 é".encode()  # echoed as UTF-8
    assert tab[0] == 400 and tab[2]["error"]["param"] == "X-Session-Id"
    assert long[0] == 400 and "512" in long[2]["error"]["message"]
    assert list(sessions) == ["team/42 é"] and s["errors_4xx"] == 3
    _conserved(s)


def test_an_oversized_body_gets_a_413_the_client_can_read(random_chat_model, chat_tok):
    async def main():
        async with Gateway(TorchEngine(random_chat_model), chat_tok, model="tiny", max_body_bytes=4096) as gw:
            client = _client(gw)
            with pytest.raises(openai.APIStatusError) as big:
                await client.chat.completions.create(model="tiny", max_tokens=2,
                                                     messages=[{"role": "user", "content": "x" * 100_000}])
            ok = await client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2)  # still serving
            await client.close()
            huge = await _raw(gw.port, _post("/v1/chat/completions", b"{" + b" " * (8 << 20) + b"}"))
            chunk = b"x" * 3000
            chunked = await _raw(gw.port, b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n"
                                 b"Connection: close\r\n\r\n" + (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * 2
                                 + b"0\r\n\r\n")
            return big.value, ok, huge, chunked, gw.stats()

    big, ok, huge, chunked, s = asyncio.run(main())
    assert big.status_code == 413 and big.body["code"] == "body_too_large" and "max_body_bytes" in big.body["message"]
    assert "4096" in big.body["message"] and ok.choices[0].finish_reason in ("stop", "length")
    assert huge[0] == 413 and str((8 << 20) + 2) in huge[2]["error"]["message"]
    assert chunked[0] == 413 and "more than 4096" in chunked[2]["error"]["message"]
    assert s["errors_4xx"] == 3
    _conserved(s)


def test_unknown_routes_share_one_stats_key_and_get_json_404s(random_chat_model, chat_tok):
    async def main():
        async with Gateway(TorchEngine(random_chat_model), chat_tok, model="tiny") as gw:
            base = gw.url.removesuffix("/v1")
            async with httpx.AsyncClient() as h:
                unknown = [await h.get(f"{base}/probe/{i}") for i in range(40)]
                odd = await h.request("PURGE", f"{gw.url}/models")
                docs = await h.get(f"{base}/docs")
            return unknown, odd, docs, gw.stats()

    unknown, odd, docs, s = asyncio.run(main())
    assert {r.status_code for r in unknown} == {404} and docs.status_code == 404 and odd.status_code == 405
    err = unknown[7].json()["error"]
    assert err["code"] == "not_found" and "/probe/7" in err["message"] and "/v1/chat/completions" in err["message"]
    assert odd.json()["error"]["code"] == "method_not_allowed"
    assert s["requests unknown"] == 42 and s["errors_4xx"] == 42
    assert not [k for k in s if "probe" in k or "PURGE" in k or "docs" in k]


def test_garbage_and_slow_headers_get_json_errors(random_chat_model, chat_tok):
    async def main():
        async with Gateway(TorchEngine(random_chat_model), chat_tok, model="tiny", request_timeout=0.3) as gw:
            garbage = await _raw(gw.port, b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n")  # a TLS hello
            slow = await _raw(gw.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n", timeout=10)
            return garbage, slow, gw.stats()

    garbage, slow, s = asyncio.run(main())
    assert garbage[0] == 400 and garbage[2]["error"]["code"] == "invalid_http"
    assert slow[0] == 408 and "headers" in slow[2]["error"]["message"]
    assert s["errors_4xx"] == 2


@pytest.mark.parametrize(("arg", "kw"), [("handover_timeout", {"handover_timeout": -1}),
                                         ("handover_timeout", {"handover_timeout": math.nan}),
                                         ("session_header", {"session_header": "X-Session-Id\r\nX-Injected"}),
                                         ("session_header", {"session_header": "X Session"})])
def test_gateway_arguments_are_checked(arg, kw, random_chat_model, chat_tok):
    with pytest.raises(ValueError, match=arg):
        Gateway(TorchEngine(random_chat_model), chat_tok, **kw)


def test_python_api_refusals_leave_nothing_behind(random_chat_model, chat_tok):
    async def main():
        async with Gateway(TorchEngine(random_chat_model), chat_tok, model="tiny") as gw:
            with pytest.raises(SessionNotFound):
                await gw.finish_session("nobody", 1.0)
            with pytest.raises(ValueError, match="reward"):
                await gw.finish_session("nobody", math.inf)
            return gw.stats()

    _conserved(asyncio.run(main()))


def test_only_the_server_module_imports_fastapi_and_uvicorn():
    """The optional extra stays optional: the package, its schema, sessions and errors import without the server."""
    code = ("import sys\n"
            "import rlblocks.rollout.gateway.schema, rlblocks.rollout.gateway.sessions\n"
            "import rlblocks.rollout.gateway\n"
            "assert not {'fastapi', 'uvicorn', 'starlette'} & set(sys.modules), sorted(sys.modules)\n"
            "from rlblocks.rollout.gateway import Gateway\n"
            "assert {'fastapi', 'uvicorn'} <= set(sys.modules)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
