"""Multi-turn trajectories under a real byte-level BPE tokenizer stay token-faithful.

A sampled sequence is often not the tokenizer's canonical encoding of its own text. Here every model turn is
exactly that: a scripted engine answers with each character as its own token (BPE would merge most of them), so
re-tokenising a model turn can never give back its ids. Trajectories built by ``run_episode`` and by the gateway
(the official ``openai`` client re-sending the history) must keep the engine's ids, append only what the
environment and the template add, and branch only where a template really rewrites history (a template that
strips earlier reasoning: still branched, and counted). Tokenizers: byte-level BPE trained here on local text,
with Qwen-style (ChatML + Hermes tool calls) and Llama-3-style templates.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from rlblocks.rollout import Generation
from rlblocks.rollout.agents import ToolEnv, Trajectory, calculator_tool, render_chat_text, run_episode

QUESTION = "What is 12*34 plus 5?"
TURNS = [
    '<tool_call>{"name": "calc", "arguments": {"expr": "12*34"}}</tool_call>',
    '<tool_call>{"name": "calc", "arguments": {"expr": "408+5"}}</tool_call>',
    "The answer is 413.",
]


def noncanonical(tok, text: str) -> list[int]:
    """Ids that decode to ``text`` but that BPE would not produce: every character on its own (an added token
    such as ``<tool_call>`` as its one id, as a model emits it)."""
    added = sorted(tok.get_added_vocab(), key=len, reverse=True)
    ids: list[int] = []
    for piece in re.split("(" + "|".join(map(re.escape, added)) + ")", text):
        if piece in added:
            ids.append(tok.convert_tokens_to_ids(piece))
        else:
            for ch in piece:
                ids += tok.encode(ch, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == text
    return ids


class ScriptedEngine:
    """Answers the k-th request of each session with the k-th scripted turn (non-canonical ids), records every
    request and generation. A turn ending with a closing tool-call tag ends there; any other ends with EOS."""

    version = 0
    is_paused = False
    max_model_len = 8192

    def __init__(self, tok, turns: list[str], finish: str = "stop") -> None:
        self.tok, self.turns, self.finish = tok, turns, finish
        self.calls: dict[str, int] = {}
        self.requests: list = []
        self.generations: list[Generation] = []

    async def generate(self, request) -> Generation:
        k = self.calls.get(request.session_id, 0)
        self.calls[request.session_id] = k + 1
        text = self.turns[k]
        ids = noncanonical(self.tok, text)
        if not text.endswith("</tool_call>") or "</tool_call>" not in self.tok.get_added_vocab():
            ids.append(self.tok.eos_token_id)
        assert ids != self.tok.encode(text, add_special_tokens=False)  # not what the tokenizer would make
        gen = Generation(request.request_id, list(request.prompt_ids), ids, [-0.5] * len(ids), [0] * len(ids),
                         self.finish)
        self.requests.append(request)
        self.generations.append(gen)
        return gen


def make_env() -> ToolEnv:
    return ToolEnv([{"role": "user", "content": QUESTION}], [calculator_tool("calc")],
                   reward_fn=lambda answer: float("413" in answer))


def check_faithful(traj, engine: ScriptedEngine) -> None:
    """Every engine request saw exactly the trajectory so far, and the trajectory holds the engine's ids."""
    for req, gen in zip(engine.requests, engine.generations):
        n = len(req.prompt_ids)
        assert traj.token_ids[:n] == list(req.prompt_ids)
        assert traj.token_ids[n:n + len(gen.output_ids)] == gen.output_ids
        assert set(traj.roles[n:n + len(gen.output_ids)]) == {"model"}


def decode(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("style", ["hermes", "llama3"])
def test_append_messages_appends_the_canonical_delta_after_noncanonical_ids(bpe_tokenizers, style):
    tok = bpe_tokenizers[style]
    tools = [calculator_tool("calc").schema()]
    traj = Trajectory.from_messages(tok, [{"role": "user", "content": QUESTION}], tools=tools)
    engine = ScriptedEngine(tok, TURNS)
    results = ["408", "413"]
    for k in range(3):
        req = type("R", (), {"session_id": "s", "request_id": f"s/{k}", "prompt_ids": list(traj.token_ids)})
        gen = asyncio.run(engine.generate(req))
        traj.append_generation(gen, message={"role": "assistant", "content": TURNS[k]})
        if k == 2:
            break
        before = list(traj.token_ids)
        new = [{"role": "tool", "name": "calc", "content": results[k]}]
        full = render_chat_text(tok, [*traj.messages, *new], tools=tools)
        # re-tokenising the conversation does not give back the engine's ids (the check that used to branch)
        assert tok.encode(full, add_special_tokens=False)[:len(before)] != before
        delta = traj.append_messages(tok, new)
        assert traj.token_ids == before + delta and traj.roles[len(before):] == ["env"] * len(delta)
        # reference: the tokenizer's own encoding of the rendering, cut where the trajectory's text ends (an added
        # token, where every encoding splits)
        prefix = decode(tok, before)
        assert full.startswith(prefix)
        assert delta == tok.encode(full, add_special_tokens=False)[len(tok.encode(prefix, add_special_tokens=False)):]
        assert decode(tok, traj.token_ids) == full
    assert traj.prefix_mismatches == 0 and traj.segments() == [traj]
    model = [t for t, r in zip(traj.token_ids, traj.roles) if r == "model"]
    assert model == [t for g in engine.generations for t in g.output_ids]


SENTENCEPIECE_TEXT = [
    "hello world, what is six times seven? the answer is 42.\nuser model turn",
    "the model answers: six times seven is 42.\nand the user asks again\nwhat is 6*7?",
]
GEMMA_STYLE = (
    "{{ bos_token }}{%- for m in messages %}"
    "{{- '<start_of_turn>' + ('model' if m.role == 'assistant' else m.role) + '\n' + (m.content | trim) }}"
    "{{- '<end_of_turn>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}"
)


def test_a_sentencepiece_style_delta_is_tokenised_after_the_end_of_turn_token():
    """A Metaspace (SentencePiece-style) tokenizer marks the start of a text with a dummy prefix: the delta alone
    would begin with a spurious ``▁`` token. Tokenised after the trajectory's end-of-turn token (as inside the
    whole rendering), it gets the ids the tokenizer gives the rendering there."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    core.decoder = decoders.Metaspace(prepend_scheme="first")
    core.train_from_iterator(SENTENCEPIECE_TEXT * 20, trainers.BpeTrainer(vocab_size=200, special_tokens=specials,
                                                                          show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                  eos_token="<end_of_turn>", additional_special_tokens=["<start_of_turn>", "<eos>"])
    tok.chat_template = GEMMA_STYLE
    traj = Trajectory.from_messages(tok, [{"role": "user", "content": "what is 6*7?"}])
    answer = "six times seven is 42."
    vocab = tok.get_vocab()
    ids = [vocab["\u2581" if c == " " else c] for c in answer] + [tok.eos_token_id]  # one id per character
    assert decode(tok, ids[:-1]) == answer and ids[:-1] != tok.encode(answer, add_special_tokens=False)
    traj.append_generation(Generation("r", list(traj.token_ids), ids, [-0.1] * len(ids), [0] * len(ids), "stop"),
                           message={"role": "assistant", "content": answer})
    before = list(traj.token_ids)
    new = [{"role": "user", "content": "and the user asks again"}]
    full = render_chat_text(tok, [*traj.messages, *new])
    rest = full[len(decode(tok, before)):]
    alone = tok.encode(rest, add_special_tokens=False)
    assert decode(tok, before + alone) != full  # the dummy prefix: tokenised alone, the delta is wrong
    delta = traj.append_messages(tok, new)
    assert traj.prefix_mismatches == 0 and traj.token_ids == before + delta and decode(tok, traj.token_ids) == full
    assert delta == tok.encode("<end_of_turn>" + rest, add_special_tokens=False)[1:] != alone
    assert traj.token_ids[len(before) - len(ids):len(before)] == ids  # the engine's ids, kept


@pytest.mark.parametrize("style", ["hermes", "llama3"])
def test_run_episode_keeps_noncanonical_model_turns(bpe_tokenizers, style):
    tok = bpe_tokenizers[style]
    engine = ScriptedEngine(tok, TURNS)
    ep = asyncio.run(run_episode(engine, make_env(), tok, max_turns=3, session_id="s0"))
    traj = ep.trajectory
    print(f"{style}: prefix_mismatches={traj.prefix_mismatches} segments={len(traj.segments())}")
    assert ep.finish_reason == "done" and ep.reward == 1.0 and ep.num_tool_calls == 2
    assert traj.prefix_mismatches == 0 and traj.segments() == [traj]
    check_faithful(traj, engine)
    # the trajectory's text is the template's rendering of the whole conversation (up to the closing glue)
    text = tok.decode(traj.token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    canonical = tok.apply_chat_template(traj.messages, tools=[calculator_tool("calc").schema()], tokenize=False)
    assert canonical.startswith(text) and canonical[len(text):] in ("", "\n")


async def openai_agent(client, session_id: str) -> None:
    """An ordinary tool-calling agent on the official client: the history is re-sent verbatim every turn."""
    calc = calculator_tool("calc")
    messages = [{"role": "user", "content": QUESTION}]
    for _ in range(len(TURNS)):
        r = await client.chat.completions.create(model="m", messages=messages, tools=[calc.schema()],
                                                 max_tokens=64, extra_headers={"X-Session-Id": session_id})
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return
        for call in msg.tool_calls:
            result = calc.fn(**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "name": "calc", "content": result})


@pytest.mark.parametrize("style", ["hermes", "llama3"])
def test_gateway_with_the_openai_client_keeps_noncanonical_turns(bpe_tokenizers, style):
    openai = pytest.importorskip("openai")
    from rlblocks.rollout.gateway import Gateway

    tok = bpe_tokenizers[style]
    engine = ScriptedEngine(tok, TURNS)

    async def main():
        async with Gateway(engine, tok, model="m") as gw:
            client = openai.AsyncOpenAI(base_url=gw.url, api_key="unused", max_retries=0, timeout=60)
            await asyncio.gather(openai_agent(client, "a"), openai_agent(client, "b"))
            for sid in ("a", "b"):
                await gw.finish_session(sid, 1.0)
            await client.close()
            return gw.stats(), list(gw.finished)

    stats, finished = asyncio.run(main())
    print(f"{style} gateway: prefix_mismatches={stats['prefix_mismatches']} "
          f"segments={[len(t.segments()) for t in finished]}")
    assert stats["prefix_mismatches"] == 0
    assert sorted(t.session_id for t in finished) == ["a", "b"] and all(t.segments() == [t] for t in finished)
    for traj in finished:
        # its text is the template's rendering of the conversation the client sent (up to the closing glue)
        text = decode(tok, traj.token_ids)
        canonical = tok.apply_chat_template(traj.messages, tools=[calculator_tool("calc").schema()], tokenize=False)
        assert canonical.startswith(text) and canonical[len(text):] in ("", "\n")
        mine = ScriptedEngine(tok, TURNS)
        mine.requests = [r for r in engine.requests if r.session_id == traj.session_id]
        mine.generations = [g for r, g in zip(engine.requests, engine.generations) if r.session_id == traj.session_id]
        assert len(mine.requests) == 3
        check_faithful(traj, mine)


# Qwen3-style: earlier assistant turns are rendered without their reasoning (a real history rewrite)
STRIP_REASONING = (
    "{%- for m in messages %}"
    "{%- set content = m.content or '' %}"
    "{%- if m.role == 'assistant' and not loop.last and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1] %}{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_a_template_that_strips_reasoning_still_branches_and_is_counted(bpe_tokenizers):
    import copy

    tok = copy.deepcopy(bpe_tokenizers["hermes"])
    tok.chat_template = STRIP_REASONING
    turns = [f"<think>step {i}</think>{t}" for i, t in enumerate(TURNS)]
    engine = ScriptedEngine(tok, turns)
    ep = asyncio.run(run_episode(engine, make_env(), tok, max_turns=3, session_id="s0"))
    traj = ep.trajectory
    print(f"strip: prefix_mismatches={traj.prefix_mismatches} segments={len(traj.segments())}")
    # turns 2 and 3 are rendered after a history whose reasoning the template removed: one branch each
    assert ep.finish_reason == "done" and traj.prefix_mismatches == 2 and len(traj.segments()) == 3
    # nothing is lost: every segment ends with the model turn the engine sampled on it
    for seg, req, gen in zip(traj.segments(), engine.requests, engine.generations):
        assert seg.token_ids == [*req.prompt_ids, *gen.output_ids]
        assert seg.roles[len(req.prompt_ids):] == ["model"] * len(gen.output_ids)


def test_the_gateway_with_a_stripping_template_still_branches_and_counts(bpe_tokenizers):
    import copy

    openai = pytest.importorskip("openai")
    from rlblocks.rollout.gateway import Gateway

    tok = copy.deepcopy(bpe_tokenizers["hermes"])
    tok.chat_template = STRIP_REASONING
    engine = ScriptedEngine(tok, [f"<think>step {i}</think>{t}" for i, t in enumerate(TURNS)])

    async def main():
        async with Gateway(engine, tok, model="m") as gw:
            client = openai.AsyncOpenAI(base_url=gw.url, api_key="unused", max_retries=0, timeout=60)
            await asyncio.gather(openai_agent(client, "a"), openai_agent(client, "b"))
            trajs = [await gw.finish_session(sid, 1.0) for sid in ("a", "b")]
            await client.close()
            return gw.stats(), trajs

    stats, trajs = asyncio.run(main())
    print(f"strip gateway: prefix_mismatches={stats['prefix_mismatches']} "
          f"segments={[len(t.segments()) for t in trajs]}")
    assert stats["prefix_mismatches"] == 4 and [t.prefix_mismatches for t in trajs] == [2, 2]
    for traj in trajs:  # each later turn branched on the rewritten history; every sampled token is kept
        mine = [(r, g) for r, g in zip(engine.requests, engine.generations) if r.session_id == traj.session_id]
        assert len(traj.segments()) == 3 == len(mine)
        for seg, (req, gen) in zip(traj.segments(), mine):
            assert seg.token_ids == [*req.prompt_ids, *gen.output_ids]
            assert seg.roles[len(req.prompt_ids):] == ["model"] * len(gen.output_ids)


def test_the_gateway_refusing_mismatches_names_the_edited_message(bpe_tokenizers):
    openai = pytest.importorskip("openai")
    from rlblocks.rollout.gateway import Gateway

    tok = bpe_tokenizers["hermes"]
    engine = ScriptedEngine(tok, TURNS)
    calc = calculator_tool("calc")
    hdr = {"X-Session-Id": "e"}

    async def main():
        async with Gateway(engine, tok, model="m", on_mismatch="raise") as gw:
            client = openai.AsyncOpenAI(base_url=gw.url, api_key="unused", max_retries=0, timeout=60)
            msgs = [{"role": "user", "content": QUESTION}]
            r = await client.chat.completions.create(model="m", messages=msgs, tools=[calc.schema()],
                                                     extra_headers=hdr)
            call = r.choices[0].message.tool_calls[0]
            msgs += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "name": "calc", "content": "408"}]
            edited = [{"role": "user", "content": "What is 12*35 plus 5?"}, *msgs[1:]]
            with pytest.raises(openai.ConflictError) as e:
                await client.chat.completions.create(model="m", messages=edited, tools=[calc.schema()],
                                                     extra_headers=hdr)
            # the faithful re-send still extends the trajectory: the refused request left it as it was
            await client.chat.completions.create(model="m", messages=msgs, tools=[calc.schema()], extra_headers=hdr)
            traj = gw.sessions["e"].trajectory
            await client.close()
            return e.value, traj, gw.stats()

    err, traj, stats = asyncio.run(main())
    assert "messages[0] (role 'user') is not the message the session has there" in str(err)
    assert stats["prefix_mismatches"] == 0 and traj.segments() == [traj] and traj.num_turns == 2
    check_faithful(traj, engine)


def test_a_completion_prompt_resent_as_text_extends_the_trajectory(bpe_tokenizers):
    """``/v1/completions`` with a text prompt that re-sends the earlier prompt and completion: matched as text, only
    the new text is tokenised (the completions end on a closing tool-call tag, an added token, at the length
    limit: no EOS or stop text that a text client would not send back)."""
    openai = pytest.importorskip("openai")
    from rlblocks.rollout.gateway import Gateway

    tok = bpe_tokenizers["hermes"]
    engine = ScriptedEngine(tok, TURNS[:2], finish="length")
    hdr = {"X-Session-Id": "t"}

    async def main():
        async with Gateway(engine, tok, model="m") as gw:
            client = openai.AsyncOpenAI(base_url=gw.url, api_key="unused", max_retries=0, timeout=60)
            prompt = f"Q: {QUESTION}\nA: "
            r1 = await client.completions.create(model="m", prompt=prompt, max_tokens=64, extra_headers=hdr)
            prompt += r1.choices[0].text + "\nresult: 408\nA: "
            await client.completions.create(model="m", prompt=prompt, max_tokens=64, extra_headers=hdr)
            traj = gw.sessions["t"].trajectory
            await client.close()
            return r1.choices[0].text, prompt, traj, gw.stats()

    text, prompt, traj, stats = asyncio.run(main())
    assert text == TURNS[0] and stats["prefix_mismatches"] == 0 and traj.segments() == [traj]
    check_faithful(traj, engine)
    assert decode(tok, traj.token_ids[:len(engine.requests[1].prompt_ids)]) == prompt
