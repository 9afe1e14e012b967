"""Attacks and faults on the agent loop, so that the holes they found stay closed: hung sync tools do not starve
later calls; NaN/inf environment rewards and engine failures end the episode as failed, returned and counted.
Synchronisation is by events, never by sleeping.
"""

from __future__ import annotations

import asyncio
import math
import threading

import pytest

from rlblocks.errors import EngineError, ToolUnavailable
from rlblocks.rollout import Generation, SamplingParams
from rlblocks.rollout.agents import EpisodeStats, StepResult, Tool, ToolEnv, calculator_tool, run_episode
from rlblocks.rollout.engines import TorchEngine


# ================================================================================================ agent
def test_hung_sync_tools_do_not_starve_later_calls():
    """Eight calls of a sync tool that hangs time out; a quick tool still runs at once, the hung tool refuses a
    ninth call with a clear error while its eight threads run, and works again once they returned."""
    gate = threading.Event()

    def slow(x: str) -> str:
        if x == "hang":
            gate.wait(60)
        return f"slow {x}"

    async def main():
        tool = Tool.from_function(slow, timeout=0.05, max_hung=8)
        calc = calculator_tool()
        calc.timeout = 30.0
        timeouts = 0
        for _ in range(8):
            with pytest.raises(asyncio.TimeoutError):
                await tool({"x": "hang"})
            timeouts += 1
        hung = tool.hung
        quick = await calc({"expr": "6*7"})
        with pytest.raises(ToolUnavailable, match="max_hung=8"):
            await tool({"x": "quick"})
        env = ToolEnv([{"role": "user", "content": "go"}], [tool, calc], max_calls_per_turn=10)
        call = '<tool_call>{"name": "%s", "arguments": %s}</tool_call>'
        step = await env.step(call % ("slow", '{"x": "quick"}') + call % ("calc", '{"expr": "2+2"}'))
        gate.set()
        threads = [t for t in threading.enumerate() if t.name == "rlblocks-tool:slow"]
        await asyncio.to_thread(lambda: [t.join(30) for t in threads])
        return timeouts, hung, quick, step, tool.hung, await tool({"x": "quick"}), len(threads)

    timeouts, hung, quick, step, hung_after, again, n_threads = asyncio.run(main())
    assert timeouts == 8 and hung == 8 and n_threads == 8 and quick == "42"
    assert [m["content"] for m in step.observation] == [
        "error: ToolUnavailable: slow: 8 earlier calls timed out and are still running (max_hung=8); this call was "
        "not started", "4"]
    assert step.info == {"tool_calls": 2, "tool_errors": 1}
    assert hung_after == 0 and again == "slow quick"


class _RewardEnv:
    """Two steps: a reward of 1.0, then ``bad``."""

    def __init__(self, bad) -> None:
        self.bad, self.steps = bad, 0

    async def reset(self):
        return [{"role": "user", "content": "start"}]

    async def step(self, action):
        self.steps += 1
        if self.steps == 1:
            return StepResult([{"role": "user", "content": "again"}], 1.0, False, {})
        return StepResult((), self.bad, True, {})


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 10**400], ids=["nan", "inf", "-inf", "huge-int"])
def test_a_non_finite_env_reward_fails_the_episode_and_is_never_summed(bad, random_chat_model, chat_tok):
    async def main():
        stats = EpisodeStats()
        ep = await run_episode(TorchEngine(random_chat_model), _RewardEnv(bad), chat_tok,
                               sampling=SamplingParams(max_new_tokens=2, seed=0), stats=stats)
        return ep, stats.stats()

    ep, st = asyncio.run(main())
    assert ep.finish_reason == "env_error" and ep.failed and "reward" in ep.error and "finite" in ep.error
    assert ep.reward == 1.0 and ep.rewards == [1.0] and ep.trajectory.reward == 1.0  # the bad reward is not in it
    assert ep.trajectory.num_turns == 2 and ep.trajectory.info["finish_reason"] == "env_error"
    assert st["episodes"] == 1 and st["env_errors"] == 1 and math.isfinite(st["reward_sum"])


class _AnswerEngine:
    """Answers every turn with ``text`` then the end-of-turn token."""

    def __init__(self, tok, text: str) -> None:
        self.ids = [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
        self.version, self.is_paused = 0, False

    async def generate(self, request):
        n = len(self.ids)
        return Generation(request.request_id, list(request.prompt_ids), self.ids, [-0.5] * n, [0] * n, "stop")


def test_a_reward_fn_returning_nan_fails_the_tool_episode(chat_tok):
    async def main():
        stats = EpisodeStats()
        env = ToolEnv([{"role": "user", "content": "6*7?"}], [calculator_tool()], reward_fn=lambda a: math.nan)
        ep = await run_episode(_AnswerEngine(chat_tok, "42"), env, chat_tok, stats=stats)
        return ep, stats.stats()

    ep, st = asyncio.run(main())
    assert ep.trajectory.messages[-1]["content"] == "42" and ep.finish_reason == "env_error" and "reward" in ep.error
    assert ep.reward == 0.0 and st["env_errors"] == 1


class _FailingEngine:
    """Forwards to an engine; generation number ``fail_at`` (0-based) raises ``error``."""

    def __init__(self, engine, fail_at: int, error: Exception) -> None:
        self.engine, self.fail_at, self.error, self.calls = engine, fail_at, error, 0

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def is_paused(self) -> bool:
        return self.engine.is_paused

    async def generate(self, request):
        self.calls += 1
        if self.calls - 1 == self.fail_at:
            raise self.error
        return await self.engine.generate(request)


def test_engine_errors_end_the_episode_which_is_returned_and_counted(random_chat_model, chat_tok):
    async def main():
        stats = EpisodeStats()
        base = TorchEngine(random_chat_model)
        sp = SamplingParams(max_new_tokens=2, seed=0)
        crash = await run_episode(_FailingEngine(base, 1, EngineError("engine died")), _RewardEnv(0.0), chat_tok,
                                  sampling=sp, stats=stats, session_id="crash")
        refused = await run_episode(_FailingEngine(base, 0, ValueError("prompt too long")), _RewardEnv(0.0),
                                    chat_tok, sampling=sp, stats=stats, session_id="refused")
        fine = await run_episode(base, _RewardEnv(0.5), chat_tok, sampling=sp, stats=stats, session_id="fine")
        return crash, refused, fine, stats.stats()

    crash, refused, fine, st = asyncio.run(main())
    assert crash.finish_reason == "engine_error" and crash.failed and "engine died" in crash.error
    assert "turn 1" in crash.error and crash.trajectory.num_turns == 1 and crash.reward == 1.0
    assert refused.finish_reason == "engine_error" and "prompt too long" in refused.error
    assert refused.trajectory.num_model_tokens == 0
    assert fine.finish_reason == "done" and not fine.failed
    assert st["episodes"] == 3 and st["engine_errors"] == 2 and st["finish_reasons"] == {"engine_error": 2, "done": 1}
    assert [e[0] for e in st["last_errors"]] == ["crash", "refused"]
