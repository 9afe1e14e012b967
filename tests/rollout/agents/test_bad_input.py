"""Bad arguments to the batch builders, trajectories and agent episodes raise ArgumentError naming the argument:
never a silent reinterpretation (a float group id truncated into another group, a bare string split into
characters, a mis-sized loss mask ignored) and never a raw TypeError from inside. An environment that returns
garbage ends its episode with ``"env_error"``; the episode is still returned and counted."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from rlblocks.errors import ArgumentError
from rlblocks.rollout import Generation, SamplingParams, build_batch
from rlblocks.rollout.agents import (
    EpisodeStats,
    StepResult,
    Tool,
    ToolEnv,
    generate_turn,
    parse_tool_calls,
    python_tool,
    run_episode,
)
from rlblocks.rollout.agents.trajectory import Trajectory, to_tensors, trajectory_rows
from rlblocks.rollout.engines import TorchEngine
from rlblocks.rollout.resume import ResumableResult

G = Generation("r", [1, 2], [3, 4], [-0.1, -0.2], [0, 0], "stop")
MSGS = [{"role": "user", "content": "x"}]


def _rr(mask):
    return ResumableResult("r", [1, 2], [3, 4], [-0.1, -0.2], [0, 0], "stop", loss_mask=mask)


def _traj(group_id=None, reward=None):
    t = Trajectory([1, 2], group_id=group_id)
    t.reward = reward
    return t


class _NoEngine:
    version = 0

    async def generate(self, request):
        raise AssertionError("bad arguments must be refused before any engine call")


class _Env:
    async def reset(self):
        return MSGS

    async def step(self, action):
        return StepResult((), 0.0, True, {})


def _episode(tok, **kw):
    return asyncio.run(run_episode(_NoEngine(), _Env(), tok, **kw))


BAD = [
    # build_batch: per-row values are checked, not converted
    (r"group_ids\[0\]", lambda tok: build_batch([G, G], pad_id=0, group_ids=[0.5, 1.7])),  # was [0, 1]
    (r"group_ids\[0\]", lambda tok: build_batch([G, G], pad_id=0, group_ids=[True, False])),
    ("group_ids", lambda tok: build_batch([G, G], pad_id=0, group_ids=torch.tensor([0.5, 1.5]))),
    (r"group_ids\[0\]", lambda tok: build_batch([G, G], pad_id=0, group_ids=["a", "b"])),
    (r"rewards\[1\]", lambda tok: build_batch([G, G], pad_id=0, rewards=[1.0, None])),  # a failed reward
    (r"rewards\[0\]", lambda tok: build_batch([G, G], pad_id=0, rewards=["1", "2"])),
    (r"rewards\[0\]", lambda tok: build_batch([G, G], pad_id=0, rewards=[True, False])),
    ("pad_id", lambda tok: build_batch([G], pad_id=-1)),
    (r"stop_token_ids\[0\]", lambda tok: build_batch([G], pad_id=0, stop_token_ids=[3.5])),
    ("stop_token_ids", lambda tok: build_batch([G], pad_id=0, stop_token_ids="3")),  # was read as {3}
    ("stop_token_ids", lambda tok: build_batch([G], pad_id=0, stop_token_ids=3)),
    (r"generations\[0\].loss_mask", lambda tok: build_batch([_rr([True])], pad_id=0)),  # was ignored
    # trajectories
    (r"trajectories\[1\].group_id", lambda tok: to_tensors([_traj(0), _traj()], pad_id=0)),  # was all group 0
    (r"trajectories\[0\].reward", lambda tok: to_tensors([_traj(0), _traj(1, 1.0)], pad_id=0)),  # lost rewards
    (r"group_ids\[0\]", lambda tok: to_tensors([_traj(0), _traj(1)], pad_id=0, group_ids=[0.5, 1.5])),
    (r"rewards\[0\]", lambda tok: to_tensors([_traj(0), _traj(1)], pad_id=0, rewards=[None, 1.0])),
    ("group_id", lambda tok: Trajectory([1], group_id=1.5)),
    ("session_id", lambda tok: Trajectory([1], session_id=5)),
    (r"prompt_ids\[0\]", lambda tok: Trajectory([-1])),
    ("generation.loss_mask", lambda tok: Trajectory([1, 2]).append_generation(_rr([False]))),
    ("messages", lambda tok: Trajectory([1]).append_env([2], messages="hi")),
    (r"messages\[0\]", lambda tok: Trajectory([1], messages=[5])),
    ("text", lambda tok: Trajectory([1]).text_delta(tok, [5])),
    ("text", lambda tok: Trajectory([1]).extend_to_text(tok, None)),
    ("on_mismatch", lambda tok: Trajectory([1]).extend_to_text(tok, "a", on_mismatch="skip")),
    (r"trajectories\[0\]", lambda tok: trajectory_rows([1, 2])),
    ("trajectories", lambda tok: trajectory_rows([])),
    # tools
    ("timeout", lambda tok: Tool("a", print, timeout=-1)),
    ("timeout", lambda tok: Tool("a", print, timeout="1")),
    ("max_hung", lambda tok: Tool("a", print, max_hung=0)),
    ("max_hung", lambda tok: Tool.from_function(print, max_hung=2.5)),
    ("description", lambda tok: Tool("a", print, description=5)),
    ("fn", lambda tok: Tool.from_function(5)),
    ("max_calls_per_turn", lambda tok: ToolEnv(MSGS, [], max_calls_per_turn=2.5)),
    ("max_calls_per_turn", lambda tok: ToolEnv(MSGS, [], max_calls_per_turn=True)),
    ("messages", lambda tok: ToolEnv([1, 2], [])),
    ("tools", lambda tok: ToolEnv(MSGS, 5)),
    (r"tools\[0\]", lambda tok: ToolEnv(MSGS, [5])),
    ("tags", lambda tok: ToolEnv(MSGS, [], tags="<a>")),
    ("reward_fn", lambda tok: ToolEnv(MSGS, [], reward_fn=1.0)),
    ("tags", lambda tok: parse_tool_calls("x", tags=("a",))),
    ("tags", lambda tok: parse_tool_calls("x", tags=("", ""))),
    ("max_result_chars", lambda tok: python_tool(max_result_chars=100.5)),
    # episodes and turns: refused before the engine is called
    ("max_turns", lambda tok: _episode(tok, max_turns=True)),
    ("max_turns", lambda tok: _episode(tok, max_turns=2.5)),
    ("max_total_tokens", lambda tok: _episode(tok, max_total_tokens=10.5)),
    ("env_timeout", lambda tok: _episode(tok, env_timeout=-1)),
    ("env_timeout", lambda tok: _episode(tok, env_timeout=math.nan)),
    ("stop_texts", lambda tok: _episode(tok, stop_texts="</tool_call>")),  # every character became a stop text
    ("sampling", lambda tok: _episode(tok, sampling={"temperature": 0})),
    ("stats", lambda tok: _episode(tok, stats={})),
    ("tokenizer", lambda tok: _episode(None)),
    ("sampling", lambda tok: asyncio.run(generate_turn(_NoEngine(), [1], {}, request_id="x"))),
    ("stop_texts", lambda tok: asyncio.run(generate_turn(_NoEngine(), [1], SamplingParams(), request_id="x",
                                                          stop_texts="ab", tokenizer=tok))),
    ("request_id", lambda tok: asyncio.run(generate_turn(_NoEngine(), [1], SamplingParams(), request_id=5))),
    ("episode", lambda tok: EpisodeStats().record(5)),
    ("other", lambda tok: EpisodeStats().merge({"episodes": 1})),
]


@pytest.mark.parametrize(("arg", "call"), BAD, ids=[f"{i}-{a}" for i, (a, _) in enumerate(BAD)])
def test_refused_and_named(arg, call, chat_tok):
    with pytest.raises(ArgumentError, match=arg):
        call(chat_tok)


def test_valid_per_row_values_still_work():
    np = pytest.importorskip("numpy")
    b = build_batch([G, G], pad_id=np.int64(0), group_ids=torch.tensor([3, 4]), rewards=[np.float32(0.5), 1],
                    stop_token_ids=[np.int64(3)])
    assert b.group_ids.tolist() == [3, 4] and b.rewards.tolist() == [0.5, 1.0]
    assert b.response_mask.tolist() == [[True], [True]]  # ends at the first stop token (3), inclusive
    nan = build_batch([G], pad_id=0, rewards=[math.nan]).rewards  # NaN in valid data propagates, never vanishes
    assert math.isnan(nan[0])
    masked = build_batch([_rr([False, True])], pad_id=0)
    assert masked.loss_mask.tolist() == [[False, True]]
    both = to_tensors([_traj(0, 1.0), _traj(1, 0.0)], pad_id=0)
    assert both.group_ids.tolist() == [0, 1] and both.rewards.tolist() == [1.0, 0.0]
    neither = to_tensors([_traj(), _traj()], pad_id=0)
    assert neither.group_ids.tolist() == [0, 0] and neither.rewards is None


class _Garbage:
    """An environment whose step returns ``out``."""

    def __init__(self, out):
        self.out = out

    async def reset(self):
        return MSGS

    async def step(self, action):
        return self.out


@pytest.mark.parametrize("out", [("", None, True, {}), ("", 0.0, True, None), ("", 0.0, True, {"tool_calls": "x"}),
                                 ("", "1", True, {}), ("", 0.0, "no", {}), 5],
                         ids=["reward-None", "info-None", "tool_calls-str", "reward-str", "done-str", "not-a-tuple"])
def test_an_environment_returning_garbage_ends_its_episode_which_is_recorded(out, random_chat_model, chat_tok):
    """These used to escape run_episode as raw TypeError/ValueError, and the episode was never recorded."""

    async def main():
        stats = EpisodeStats()
        ep = await run_episode(TorchEngine(random_chat_model), _Garbage(out), chat_tok,
                               sampling=SamplingParams(max_new_tokens=2, seed=0), stats=stats)
        return ep, stats.stats()

    if isinstance(out, tuple) and out[1:] == (0.0, True, None):  # info=None is no info: a valid, finished episode
        ep, st = asyncio.run(main())
        assert ep.finish_reason == "done" and st["episodes"] == 1
        return
    ep, st = asyncio.run(main())
    assert ep.finish_reason == "env_error" and "env.step" in ep.error
    assert ep.trajectory is not None and ep.trajectory.num_model_tokens == 2  # the turn so far is kept
    assert st["episodes"] == 1 and st["env_errors"] == 1
