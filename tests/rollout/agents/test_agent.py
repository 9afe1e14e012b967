"""run_episode on TorchEngine: token-faithful tool episodes, a weight update in the middle of turn 2, budgets,
environment errors returned and counted, Router session affinity; ToolEnv, tool-call parsing, the calculator and
the sandboxed Python tool's limits."""

from __future__ import annotations

import asyncio
import time

import pytest
from agent_testlib import ANSWER, CALL, QUESTION, RESULT, RecordingEngine

from rlblocks.errors import ArgumentError
from rlblocks.rollout import Router, SamplingParams
from rlblocks.rollout.agents import (
    EpisodeStats,
    StepResult,
    Tool,
    ToolEnv,
    calculator_tool,
    parse_tool_calls,
    python_tool,
    run_episode,
)
from rlblocks.rollout.agents.tools import calculator
from rlblocks.rollout.agents.trajectory import to_tensors
from rlblocks.rollout.engines import TorchEngine
from rlblocks.sandbox import SandboxLimits

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=96)


def _tool_env() -> ToolEnv:
    return ToolEnv([{"role": "user", "content": QUESTION}], [calculator_tool()],
                   reward_fn=lambda answer: float(answer == ANSWER))


def _check_faithful(rec: RecordingEngine, traj) -> None:
    """Every engine call saw a prefix of the trajectory, and its outputs sit right after that prefix."""
    for req, gen in zip(rec.requests, rec.generations):
        p = list(req.prompt_ids)
        assert traj.token_ids[: len(p)] == p
        assert traj.token_ids[len(p): len(p) + len(gen.output_ids)] == list(gen.output_ids)
        assert all(r == "model" for r in traj.roles[len(p): len(p) + len(gen.output_ids)])
    model = [t for t, r in zip(traj.token_ids, traj.roles) if r == "model"]
    assert model == [t for g in rec.generations for t in g.output_ids]


def test_tool_episode_is_token_faithful(tool_model, chat_tok):
    async def main():
        rec = RecordingEngine(TorchEngine(tool_model))
        stats = EpisodeStats()
        ep = await run_episode(rec, _tool_env(), chat_tok, sampling=GREEDY, max_turns=3, session_id="ep-1",
                               stats=stats)
        return rec, ep, stats

    rec, ep, stats = asyncio.run(main())
    t = ep.trajectory
    assert ep.finish_reason == "done" and ep.reward == 1.0 and ep.error is None
    assert ep.turn_finish == ["</tool_call>", "stop"] and ep.num_turns == 2 and ep.num_tool_calls == 1
    _check_faithful(rec, t)
    assert {r.session_id for r in rec.requests} == {"ep-1"}
    # '<tool_call>' ends with '>', the last token of the closing tag: generation continued until the real tag
    assert [r.request_id for r in rec.requests] == ["ep-1/t0", "ep-1/t0/c1", "ep-1/t1"]
    turn0 = chat_tok.decode([x for x, r, k in zip(t.token_ids, t.roles, t.turn_ids) if r == "model" and k == 0])
    turn1 = chat_tok.decode([x for x, r, k in zip(t.token_ids, t.roles, t.turn_ids) if r == "model" and k == 1])
    assert turn0 == CALL and turn1 == ANSWER + "<|im_end|>"
    env_text = chat_tok.decode([x for x, r in zip(t.token_ids, t.roles) if r == "env"])
    assert env_text == f"<|im_end|>\n<|im_start|>tool\n{RESULT}<|im_end|>\n<|im_start|>assistant\n"
    assert set(t.versions[t.prompt_len:]) <= {0, -1} and t.prefix_mismatches == 0
    s = stats.stats()
    assert s["episodes"] == 1 and s["turns"] == 2 and s["tool_calls"] == 1 and s["env_errors"] == 0
    assert s["model_tokens"] == t.num_model_tokens and s["finish_reasons"] == {"done": 1}


def test_merged_stats_equal_one_stats_that_recorded_every_episode():
    from rlblocks.rollout.agents import Episode

    eps = [Episode(f"s{i}", None, reward=0.5 * i, finish_reason=r, error=None if r == "done" else f"e{i}",
                   num_turns=i % 3, num_tool_calls=i % 2)
           for i, r in enumerate(["done", "env_error", "done", "engine_error", "max_turns"] * 6)]
    whole, parts = EpisodeStats(), [EpisodeStats() for _ in range(3)]
    for i, e in enumerate(eps):
        whole.record(e)
        parts[i * 3 // len(eps)].record(e)  # three contiguous runs, so the errors keep their order
    merged = EpisodeStats()
    for p in parts:
        merged.merge(p)
    assert merged.stats() == whole.stats()
    assert merged.stats()["episodes"] == 30 and len(merged.stats()["last_errors"]) == 16  # of 18
    assert parts[0].stats()["episodes"] == 10  # the merged-in stats are unchanged


def test_weight_update_in_the_middle_of_turn_two_keeps_every_tokens_version(tool_model, tool_model_state,
                                                                             chat_tok):
    async def reference():
        return await run_episode(TorchEngine(tool_model), _tool_env(), chat_tok, sampling=GREEDY, max_turns=3)

    ref = asyncio.run(reference()).trajectory

    async def interrupted():
        engine = TorchEngine(tool_model)
        task = asyncio.create_task(run_episode(engine, _tool_env(), chat_tok, sampling=GREEDY, max_turns=3,
                                               session_id="s"))
        t0 = time.monotonic()
        while (engine.num_output_tokens("s/t1") or 0) < 5:  # turn 2 has sampled a few tokens
            assert time.monotonic() - t0 < 60 and not task.done()
            await asyncio.sleep(0.0005)
        await engine.pause("abort")
        await engine.update_weights(list(tool_model_state.items()), version=1)  # same values: greedy unchanged
        await engine.resume()
        return await task

    ep = asyncio.run(interrupted())
    t = ep.trajectory
    assert ep.finish_reason == "done" and ep.reward == 1.0
    assert t.token_ids == ref.token_ids  # the interrupt lost nothing and changed nothing
    model_turn = [(k, v) for r, k, v in zip(t.roles, t.turn_ids, t.versions) if r == "model"]
    assert all(v == 0 for k, v in model_turn if k == 0)
    turn2 = [v for k, v in model_turn if k == 1]
    n0 = turn2.count(0)
    assert n0 >= 5 and turn2 == [0] * n0 + [1] * (len(turn2) - n0) and len(turn2) > n0
    spans = t.version_spans()
    assert [v for v, _, _ in spans] == [0, 0, 1] and spans[1][2] == spans[2][1]
    assert t.oldest_version == 0 and t.staleness(current_version=1) == 1
    batch = to_tensors([t], pad_id=chat_tok.pad_token_id)
    got = batch.versions[0][batch.loss_mask[0]].tolist()
    assert got == [v for _, v in model_turn]


class _EchoEnv:
    """Never done: every step answers 'go on' (a multi-turn env for budget and routing tests)."""

    def __init__(self, fail: str | None = None, delay: float = 0.0) -> None:
        self.fail, self.delay, self.steps = fail, delay, 0

    async def reset(self):
        if self.fail == "reset":
            raise RuntimeError("reset failed: no task")
        return [{"role": "user", "content": "start"}]

    async def step(self, action):
        self.steps += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail == "step":
            raise RuntimeError("tool backend down")
        return StepResult([{"role": "user", "content": "go on"}], 0.5, False, {})


SAMPLE = SamplingParams(temperature=1.0, max_new_tokens=6, seed=1)


def test_env_errors_and_timeouts_are_returned_and_counted(random_chat_model, chat_tok):
    async def main():
        engine, stats = TorchEngine(random_chat_model), EpisodeStats()
        raising = await run_episode(engine, _EchoEnv("step"), chat_tok, sampling=SAMPLE, stats=stats)
        slow = await run_episode(engine, _EchoEnv(delay=5.0), chat_tok, sampling=SAMPLE, env_timeout=0.05,
                                 stats=stats)
        no_reset = await run_episode(engine, _EchoEnv("reset"), chat_tok, sampling=SAMPLE, stats=stats)
        return raising, slow, no_reset, stats

    raising, slow, no_reset, stats = asyncio.run(main())
    assert raising.finish_reason == "env_error" and "tool backend down" in raising.error
    assert "RuntimeError" in raising.error and raising.trajectory.num_model_tokens > 0  # turn 1 is kept
    assert slow.finish_reason == "env_timeout" and "0.05" in slow.error and slow.trajectory.num_model_tokens > 0
    assert no_reset.finish_reason == "env_error" and no_reset.trajectory is None and "no task" in no_reset.error
    s = stats.stats()
    assert s["episodes"] == 3 and s["env_errors"] == 2 and s["env_timeouts"] == 1
    assert [e[1] for e in s["last_errors"]] == ["env_error", "env_timeout", "env_error"]


def test_turn_and_token_budgets(random_chat_model, chat_tok):
    async def main():
        engine = TorchEngine(random_chat_model)
        turns = await run_episode(engine, _EchoEnv(), chat_tok, sampling=SAMPLE, max_turns=3)
        prompt_len = turns.trajectory.prompt_len
        tokens = await run_episode(engine, _EchoEnv(), chat_tok, sampling=SAMPLE, max_turns=10,
                                   max_total_tokens=prompt_len + 20)
        return turns, tokens

    turns, tokens = asyncio.run(main())
    assert turns.finish_reason == "max_turns" and turns.num_turns == 3 and turns.rewards == [0.5] * 3
    assert turns.reward == 1.5 and turns.trajectory.reward == 1.5
    assert tokens.finish_reason == "max_tokens" and len(tokens.trajectory) <= tokens.trajectory.prompt_len + 20
    with pytest.raises(ArgumentError, match="max_turns"):
        asyncio.run(run_episode(None, _EchoEnv(), chat_tok, max_turns=0))


def test_router_keeps_each_episode_on_one_engine(random_chat_model, chat_tok):
    async def main():
        recs = [RecordingEngine(TorchEngine(random_chat_model)) for _ in range(2)]
        router = Router(recs)
        eps = await asyncio.gather(*[
            run_episode(router, _EchoEnv(), chat_tok, sampling=SamplingParams(max_new_tokens=4, seed=i),
                        max_turns=3, session_id=f"sess-{i}") for i in range(4)])
        return recs, eps

    recs, eps = asyncio.run(main())
    where = {}
    for i, rec in enumerate(recs):
        for req in rec.requests:
            where.setdefault(req.session_id, set()).add(i)
    assert sorted(where) == [f"sess-{i}" for i in range(4)]
    assert all(len(v) == 1 for v in where.values())  # every request of a session on the same engine
    assert {next(iter(v)) for v in where.values()} == {0, 1}  # and the sessions spread over both
    for ep in eps:
        assert ep.num_turns == 3


def test_parse_tool_calls():
    calls, errors, content = parse_tool_calls(
        'let me compute <tool_call>{"name": "calc", "arguments": {"expr": "2*3"}}</tool_call>'
        '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call> then')
    assert [(c.name, c.arguments) for c in calls] == [("calc", {"expr": "2*3"}), ("f", {"x": 1})]
    assert errors == [] and content == "let me compute  then"
    calls, errors, content = parse_tool_calls('<tool_call>{"name": 3}</tool_call><tool_call>{oops</tool_call>'
                                              '<tool_call>{"name": "g", "arguments": [1]}</tool_call>x<tool_call>{')
    assert calls == [] and len(errors) == 4
    assert "string \"name\"" in errors[0] and "JSON" in errors[1] and "object" in errors[2] and "unterminated" in \
        errors[3]
    assert content.startswith("<tool_call>{\"name\": 3}")  # malformed blocks stay in the text
    assert parse_tool_calls('<tool_call>{"name": "h", "parameters": {"y": 2}}</tool_call>')[0][0].arguments == \
        {"y": 2}


def test_tool_env_runs_calls_and_reports_tool_errors():
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    def broken(x: str) -> str:
        raise OSError("disk full")

    env = ToolEnv([{"role": "user", "content": "q"}], [calculator_tool(), add, broken],
                  reward_fn=lambda a: float(a == "42"))
    add_schema = next(t for t in env.tools if t["function"]["name"] == "add")["function"]
    assert add_schema["parameters"] == {"type": "object", "properties": {"a": {"type": "integer"},
                                                                         "b": {"type": "integer"}},
                                        "required": ["a", "b"]}
    assert add_schema["description"] == "Add two integers."

    async def main():
        await env.reset()
        action = ''.join(f'<tool_call>{c}</tool_call>' for c in [
            '{"name": "calc", "arguments": {"expr": "123456*789"}}', '{"name": "add", "arguments": {"a": 1, "b": 2}}',
            '{"name": "add", "arguments": {"a": "1"}}', '{"name": "nope", "arguments": {}}',
            '{"name": "broken", "arguments": {"x": "y"}}', '{bad json'])
        obs, r, done, info = await env.step(action)
        final = await env.step("42")
        return obs, r, done, info, final

    obs, r, done, info, final = asyncio.run(main())
    assert not done and r == 0.0 and info == {"tool_calls": 5, "tool_errors": 4}  # 3 failed calls + bad JSON
    contents = [m["content"] for m in obs]
    assert "could not parse the tool call as JSON" in contents[0]  # parse errors come first
    assert contents[1] == "97406784" and contents[2] == "3"
    assert "missing required argument(s) ['b']" in contents[3] and "unknown tool 'nope'" in contents[4]
    assert "OSError: disk full" in contents[5]
    assert all(m["role"] == "tool" for m in obs) and len(obs) == 6
    assert final.done and final.reward == 1.0 and final.info["answer"] == "42"


def test_calculator_is_exact_and_refuses_code():
    assert calculator("123456789*987654321") == str(123456789 * 987654321)
    assert calculator("(7 - 10) // 2") == "-2" and calculator("7/2") == "3.5" and calculator("2**10") == "1024"
    for bad in ("__import__('os')", "a+1", "[1]*3", "9**9999"):
        with pytest.raises(ValueError):
            calculator(bad)
    with pytest.raises(ArgumentError):
        Tool("bad name!", calculator)


LIMITS = SandboxLimits(cpu_seconds=1.0, wall_seconds=5.0, memory_bytes=256 << 20, max_output_bytes=1000)


def test_python_tool_sandbox_limits():
    tool = python_tool(LIMITS)

    async def main():
        hits = []

        async def on_connect(reader, writer):
            hits.append(1)
            writer.close()

        server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        t0 = time.perf_counter()
        loop_out = await tool({"code": "while True:\n    pass\n"})
        loop_s = time.perf_counter() - t0
        bomb = await tool({"code": "x = bytearray(2 << 30)\nprint('allocated')"})
        connect = f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        net = await tool({"code": connect + "    print('connected')\nexcept OSError as e:\n    print('refused', e)\n"})
        flood = await tool({"code": "print('x' * 100000)"})
        ok = await tool({"code": "print(sum(range(10)))"})
        env = ToolEnv([{"role": "user", "content": "q"}], [tool])
        obs, *_ = await env.step('<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>')
        server.close()
        await server.wait_closed()
        return loop_out, loop_s, bomb, net, flood, ok, obs, hits

    loop_out, loop_s, bomb, net, flood, ok, obs, hits = asyncio.run(main())
    # killed by the CPU limit, or by the wall clock when a loaded machine gives it less than 1 s of CPU in 5 s
    assert loop_out in ("[stopped: cpu limit]", "[stopped: wall limit]") and loop_s < LIMITS.wall_seconds + 2
    assert "MemoryError" in bomb and "[stopped: memory limit]" in bomb and "allocated" not in bomb
    assert "refused" in net and "connected" not in net.split("refused")[0] and hits == []
    assert "[output truncated:" in flood and len(flood) < 1200
    assert ok == "45" and obs[0]["content"] == "42"
