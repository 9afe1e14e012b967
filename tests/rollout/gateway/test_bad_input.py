"""The gateway answers every malformed request with an OpenAI-style 4xx JSON error: never a 500, a dropped
connection or a hang; refuses non-finite rewards; reaches sessions whose id contains "/"; and leaves no empty
session behind whatever ended a request. Raw HTTP over asyncio streams, so each byte sent is the test's."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from rlblocks.errors import ArgumentError, GatewayError, RLBlocksError
from rlblocks.rollout.engines import TorchEngine
from rlblocks.rollout.gateway import Gateway

OK = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "seed": 0}


def _req(path: str, body, *, method: str = "POST", headers: str = "") -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (f"{method} {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(data)}\r\nConnection: close\r\n"
            f"{headers}\r\n").encode() + data


async def _send(port: int, data: bytes, timeout: float = 30.0) -> tuple[int, dict]:
    """Send raw bytes; the status and JSON body of the answer (a hang or a dropped connection fails the test)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    out = await asyncio.wait_for(reader.read(), timeout)
    writer.close()
    assert out, "the server closed the connection without an answer"
    head, _, body = out.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _serve(model, tok, body, **kw):
    async def main():
        async with Gateway(TorchEngine(model), tok, model="tiny", **kw) as gw:
            return await body(gw)

    return asyncio.run(main())


MALFORMED = {
    "chunk size not hex": (b"POST /v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    "negative chunk size": (b"POST /v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\nabc\r\n",
                            400),
    "negative content-length": (b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n", 400),
    "deeply nested json": (_req("/v1/chat/completions", b"[" * 50000 + b"]" * 50000), 400),
    "NaN reward": (_req("/v1/sessions/s/reward", b'{"reward": NaN}'), 400),
    "Infinity reward": (_req("/v1/sessions/s/reward", b'{"reward": Infinity}'), 400),
    "negative token id": (_req("/v1/completions", {"model": "tiny", "prompt": [-1, 5], "max_tokens": 2}), 400),
    "token id beyond the vocabulary": (_req("/v1/completions", {"model": "tiny", "prompt": [10**6]}), 400),
    "user not a string": (_req("/v1/chat/completions", {**OK, "user": 5}), 400),
    "empty session header": (_req("/v1/chat/completions", OK, headers="X-Session-Id: \r\n"), 400),
    "body that is not JSON": (_req("/v1/chat/completions", b"x" * 5000), 400),
    "bad utf-8": (_req("/v1/chat/completions", b'{"model": "\xff"}'), 400),
    "not a request line": (b"GARBAGE\r\n\r\n", 400),
}


def test_malformed_requests_get_4xx_json_never_a_500_or_a_hang(random_chat_model, chat_tok):
    async def body(gw):
        out = {}
        for name, (data, _) in MALFORMED.items():
            out[name] = await _send(gw.port, data)
        return out, gw.stats(), dict(gw.sessions)

    out, stats, sessions = _serve(random_chat_model, chat_tok, body)
    for name, (status, err) in out.items():
        assert status == MALFORMED[name][1], (name, status, err)
        assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"], name
    assert out["NaN reward"][1]["error"]["param"] == "reward"
    assert out["negative token id"][1]["error"]["param"] == "prompt"
    assert out["user not a string"][1]["error"]["param"] == "user"
    assert stats.get("errors_5xx", 0) == 0 and stats["errors_4xx"] == len(MALFORMED)
    assert not sessions  # no refused request left a session behind
    assert stats["sessions_opened"] == stats["sessions_discarded"] > 0 and stats["sessions_finished"] == 0


def test_oversized_body_and_a_client_that_never_sends_its_body(random_chat_model, chat_tok):
    async def body(gw):
        big = await _send(gw.port, _req("/v1/chat/completions", b"x" * 5000))
        # announces 100 bytes, sends 2 and waits: answered 408 after request_timeout instead of held forever
        slow = await _send(gw.port, b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{}", timeout=10)
        return big, slow

    big, slow = _serve(random_chat_model, chat_tok, body, max_body_bytes=4096, request_timeout=0.5)
    assert big[0] == 413 and slow[0] == 408 and slow[1]["error"]["code"] == "request_timeout"


def test_rewards_sessions_with_a_slash_and_the_python_api(random_chat_model, chat_tok):
    async def body(gw):
        ok = await _send(gw.port, _req("/v1/chat/completions", {**OK, "user": "team/42"}))
        reward = await _send(gw.port, _req("/v1/sessions/team%2F42/reward", {"reward": 0.5}))
        await _send(gw.port, _req("/v1/chat/completions", OK, headers="X-Session-Id: py\r\n"))
        errors = {}
        for args in (("nope", 1.0), (None, 1.0), ("py", math.nan), ("py", True)):
            with pytest.raises(ArgumentError) as e:
                await gw.finish_session(*args)
            errors[args[0]] = str(e.value)
        with pytest.raises(ArgumentError, match="info"):
            await gw.finish_session("py", 1.0, info=[1])
        traj = await gw.finish_session("py", 1.0)
        return ok, reward, errors, traj, gw.finished

    ok, reward, errors, traj, finished = _serve(random_chat_model, chat_tok, body)
    assert ok[0] == 200 and ok[1]["rlblocks"]["session_id"] == "team/42"
    assert reward == (200, {"session_id": "team/42", "reward": 0.5, "segments": 1, "model_tokens": 2,
                            "prefix_mismatches": 0})
    assert "session_id" in errors["nope"] and "reward" in errors["py"]
    assert traj.reward == 1.0 and [t.session_id for t in finished] == ["team/42", "py"]
    assert issubclass(GatewayError, RLBlocksError)


def test_concurrent_requests_on_one_session_are_all_captured(random_chat_model, chat_tok):
    """Eight requests at once on one session are served one at a time; each re-sends the same history, which no
    longer extends the trajectory after the first answer, so each later one branches (counted): 8 segments, every
    sampled token kept."""

    async def body(gw):
        hdr = "X-Session-Id: conc\r\n"
        outs = await asyncio.gather(*(_send(gw.port, _req("/v1/chat/completions", OK, headers=hdr))
                                      for _ in range(8)))
        traj = gw.sessions["conc"].trajectory
        done = await _send(gw.port, _req("/v1/sessions/conc/reward", {"reward": 1}))
        return outs, traj, done, gw.stats()

    outs, traj, done, stats = _serve(random_chat_model, chat_tok, body)
    assert [s for s, _ in outs] == [200] * 8
    completion = sum(o["usage"]["completion_tokens"] for _, o in outs)
    assert done[1]["segments"] == 8 and done[1]["model_tokens"] == completion == 16
    assert traj.prefix_mismatches == 7 == stats["prefix_mismatches"] and stats["completion_tokens"] == completion
    assert stats["sessions_opened"] == stats["sessions_finished"] == 1 and stats["sessions_open"] == 0
    assert stats["sessions_discarded"] == 0


def test_a_first_request_cancelled_mid_generation_leaves_no_empty_session(random_chat_model, chat_tok):
    async def main():
        gw = Gateway(TorchEngine(random_chat_model), chat_tok, model="tiny")
        await gw.start()
        req = _req("/v1/chat/completions", {**OK, "max_tokens": 400}, headers="X-Session-Id: gone\r\n")
        client = asyncio.ensure_future(_send(gw.port, req))
        for _ in range(200):  # until the request is being served
            await asyncio.sleep(0.01)
            if "gone" in gw.sessions:
                break
        await gw.aclose()  # cancels the connection's task in the middle of the request
        client.cancel()
        await asyncio.gather(client, return_exceptions=True)
        return gw.sessions

    sessions = asyncio.run(main())
    assert all(s.trajectory is not None for s in sessions.values())  # "gone" is open only if it captured tokens
