"""The OpenAI-compatible gateway driven by the real ``openai`` package: non-stream, stream, tools, completions,
sessions (header and ``user``), re-sent history checked token for token, rewards into a StalenessQueue, and
OpenAI-style errors for malformed requests."""

from __future__ import annotations

import asyncio
import json

import pytest
from agent_testlib import ANSWER, QUESTION, RESULT, calc_schema

from rlblocks.rollout import SamplingParams
from rlblocks.rollout.agents import ToolEnv, calculator_tool, run_episode
from rlblocks.rollout.agents.tools import calculator
from rlblocks.rollout.engines import TorchEngine
from rlblocks.rollout.gateway import Gateway
from rlblocks.sched import StalenessQueue

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


def _serve(model, tok, body, **gateway_kwargs):
    """Run ``body(client, gateway, engine)`` against a gateway on a fresh TorchEngine, on one event loop."""

    async def main():
        engine = TorchEngine(model)
        async with Gateway(engine, tok, model="tiny", **gateway_kwargs) as gw:
            client = openai.AsyncOpenAI(base_url=gw.url, api_key="unused", max_retries=0, timeout=60)
            try:
                return await body(client, gw, engine)
            finally:
                await client.close()

    return asyncio.run(main())


def test_chat_with_tools_captures_the_agent_loops_trajectory(tool_model, chat_tok):
    q = StalenessQueue(max_staleness=1)

    async def agent(client, gw, engine):
        hdr = {"X-Session-Id": "ep-7"}
        msgs = [{"role": "user", "content": QUESTION}]
        r1 = await client.chat.completions.create(model="tiny", messages=msgs, tools=calc_schema(), temperature=0,
                                                  max_tokens=96, logprobs=True, extra_headers=hdr)
        call = r1.choices[0].message.tool_calls[0]
        result = calculator(**json.loads(call.function.arguments))
        msgs += [r1.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": result}]
        r2 = await client.chat.completions.create(model="tiny", messages=msgs, tools=calc_schema(), temperature=0,
                                                  max_tokens=96, logprobs=True, extra_headers=hdr)
        async with httpx.AsyncClient() as h:
            rr = await h.post(f"{gw.url}/sessions/ep-7/reward", json={"reward": 1.0})
        ref = await run_episode(engine, ToolEnv([{"role": "user", "content": QUESTION}], [calculator_tool()]),
                                chat_tok, sampling=SamplingParams(temperature=0, max_new_tokens=96))
        return r1, r2, rr.json(), result, ref, gw.stats()

    r1, r2, rr, result, ref, stats = _serve(tool_model, chat_tok, agent, queue=q)
    c1, c2 = r1.choices[0], r2.choices[0]
    assert c1.finish_reason == "tool_calls" and c1.message.content is None
    call = c1.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "calc" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"expr": "123456*789"} and result == RESULT
    assert c2.finish_reason == "stop" and c2.message.content == ANSWER and not c2.message.tool_calls
    assert rr == {"session_id": "ep-7", "reward": 1.0, "segments": 1,
                  "model_tokens": r1.usage.completion_tokens + r2.usage.completion_tokens, "prefix_mismatches": 0}
    (traj,) = q.get_batch(1, current_version=0, timeout=5)
    assert traj.reward == 1.0 and traj.session_id == "ep-7" and traj.prefix_mismatches == 0
    # the gateway captured exactly the tokens of the agent loop on the same engine: same ids, same roles
    assert traj.token_ids == ref.trajectory.token_ids and traj.roles == ref.trajectory.roles
    model_lps = [lp for lp, r in zip(traj.logprobs, traj.roles) if r == "model"]
    got_lps = [x.logprob for x in c1.logprobs.content] + [x.logprob for x in c2.logprobs.content]
    assert got_lps == model_lps  # the processed logprobs the client saw are the trajectory's, exactly
    assert r1.model_extra["rlblocks"]["output_ids"] + r2.model_extra["rlblocks"]["output_ids"] == \
        [t for t, r in zip(traj.token_ids, traj.roles) if r == "model"]
    assert stats["sessions_finished"] == 1 and stats["tool_calls"] == 1 and stats["sessions_open"] == 0


def test_stream_gives_the_same_completion_as_non_stream(tool_model, chat_tok):
    async def agent(client, gw, engine):
        msgs = [{"role": "user", "content": QUESTION}]
        plain = await client.chat.completions.create(model="tiny", messages=msgs, tools=calc_schema(),
                                                     temperature=0, max_tokens=96, user="a")
        stream = await client.chat.completions.create(model="tiny", messages=msgs, tools=calc_schema(),
                                                      temperature=0, max_tokens=96, user="b", stream=True,
                                                      stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        text_stream = await client.chat.completions.create(model="tiny", messages=msgs, temperature=0,
                                                           max_tokens=96, user="c", stream=True)
        text_chunks = [c async for c in text_stream]
        return plain, chunks, text_chunks, dict(gw.sessions)

    plain, chunks, text_chunks, sessions = _serve(tool_model, chat_tok, agent)
    calls = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])]
    assert [(tc.function.name, tc.function.arguments) for tc in calls] == \
        [(tc.function.name, tc.function.arguments) for tc in plain.choices[0].message.tool_calls]
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["tool_calls"]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    # without tools the same output is plain text, streamed
    text = "".join(ch.delta.content or "" for c in text_chunks for ch in c.choices)
    assert text.startswith("<tool_call>") and text_chunks[-1].choices[0].finish_reason == "stop"
    assert sorted(sessions) == ["a", "b", "c"]  # the ``user`` field keyed the sessions
    assert sessions["a"].trajectory.token_ids == sessions["b"].trajectory.token_ids


def test_resent_history_is_checked_and_a_mismatch_branches(random_chat_model, chat_tok):
    async def agent(client, gw, engine):
        hdr = {"X-Session-Id": "s"}
        msgs = [{"role": "user", "content": "hello"}]
        r1 = await client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, seed=1,
                                                  extra_headers=hdr)
        msgs += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        await client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, seed=2, extra_headers=hdr)
        faithful = gw.sessions["s"].trajectory.prefix_mismatches
        edited = [{"role": "user", "content": "HELLO"}, *msgs[1:]]  # the client rewrote the history
        await client.chat.completions.create(model="tiny", messages=edited, max_tokens=5, seed=3, extra_headers=hdr)
        traj = gw.sessions["s"].trajectory
        return faithful, traj, gw.stats()

    faithful, traj, stats = _serve(random_chat_model, chat_tok, agent)
    assert faithful == 0
    assert traj.prefix_mismatches == 1 and len(traj.branches) == 1 and stats["prefix_mismatches"] == 1
    assert traj.branches[0].num_turns == 2 and traj.num_model_tokens == 5  # the old segment kept, whole


def test_completions_token_in_and_text(random_chat_model, chat_tok):
    async def agent(client, gw, engine):
        hdr = {"X-Session-Id": "c"}
        prompt = chat_tok.encode("12+34=", add_special_tokens=False)
        r1 = await client.completions.create(model="tiny", prompt=prompt, max_tokens=4, logprobs=0, seed=0,
                                             extra_headers=hdr)
        out = r1.model_extra["rlblocks"]["output_ids"]
        r2 = await client.completions.create(model="tiny", prompt=prompt + out + prompt, max_tokens=3, seed=0,
                                             extra_headers=hdr, stream=True)
        chunks = [c async for c in r2]
        r3 = await client.completions.create(model="tiny", prompt="abc", max_tokens=2, user="t")
        return r1, out, chunks, r3, gw.sessions["c"].trajectory

    r1, out, chunks, r3, traj = _serve(random_chat_model, chat_tok, agent)
    assert r1.object == "text_completion" and len(out) == 4 and r1.choices[0].finish_reason in ("length", "stop")
    assert r1.choices[0].logprobs.token_logprobs == traj.logprobs[traj.prompt_len: traj.prompt_len + len(out)]
    assert traj.prefix_mismatches == 0 and traj.num_turns == 2 and traj.num_env_tokens == 6  # "12+34=" again
    assert chunks[-1].choices[0].finish_reason in ("length", "stop") and r3.usage.prompt_tokens == 3


def test_malformed_requests_get_openai_errors(random_chat_model, chat_tok):
    async def agent(client, gw, engine):
        errors = []
        ok_msgs = [{"role": "user", "content": "hi"}]
        bad_calls = [
            dict(messages=[]),
            dict(messages=[{"role": "wizard", "content": "hi"}]),
            dict(messages=ok_msgs, temperature=5),
            dict(messages=ok_msgs, n=2),
            dict(messages=ok_msgs, logprobs=True, top_logprobs=3),
            dict(messages=ok_msgs, tools=calc_schema(), tool_choice="required"),
            dict(messages=ok_msgs, max_tokens=0),
            dict(messages=ok_msgs, presence_penalty=0.5),
        ]
        for kw in bad_calls:
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(model="tiny", **kw)
            errors.append(e.value.body)
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model="tiny", prompt=[], max_tokens=2)
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("other-model")
        models = await client.models.list()
        async with httpx.AsyncClient() as h:
            raw = {
                "bad_json": await h.post(f"{gw.url}/chat/completions", content=b"{not json",
                                         headers={"content-type": "application/json"}),
                "not_object": await h.post(f"{gw.url}/chat/completions", json=[1, 2]),
                "wrong_method": await h.get(f"{gw.url}/chat/completions"),
                "unknown_route": await h.post(f"{gw.url}/embeddings", json={}),
                "unknown_session": await h.post(f"{gw.url}/sessions/nope/reward", json={"reward": 1}),
                "bad_reward": await h.post(f"{gw.url}/sessions/nope/reward", json={"reward": "high"}),
            }
        return errors, models, raw, gw.stats(), dict(gw.sessions)

    errors, models, raw, stats, sessions = _serve(random_chat_model, chat_tok, agent)
    params = [e["param"] for e in errors]
    assert params == ["messages", "messages[0].role", "temperature", "n", "top_logprobs", "tool_choice",
                      "max_tokens", "presence_penalty"]
    assert all(e["type"] == "invalid_request_error" and e["message"] for e in errors)
    assert [m.id for m in models.data] == ["tiny"]
    status = {k: v.status_code for k, v in raw.items()}
    assert status == {"bad_json": 400, "not_object": 400, "wrong_method": 405, "unknown_route": 404,
                      "unknown_session": 404, "bad_reward": 400}
    for v in raw.values():
        err = v.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert raw["bad_json"].json()["error"]["code"] == "invalid_json"
    assert stats["errors_4xx"] == 10 + 6 and not sessions  # refused requests leave no session behind
