"""Fixtures of the agent tests (helpers in agent_testlib.py).

``tool_model``: a tiny random Llama trained for a few seconds on one rendered tool episode, so that greedy decoding
replays it: turn 1 is a calculator call, turn 2 the answer after the tool result. Episodes, the gateway and the
interrupt test then run real engines on a model whose behaviour is known.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from agent_testlib import build_chat_tokenizer, episode_messages, tiny_llama


@pytest.fixture(scope="session")
def hermes_tok():
    return build_chat_tokenizer("hermes")


@pytest.fixture(scope="session")
def llama3_tok():
    return build_chat_tokenizer("llama3")


@pytest.fixture(scope="session")
def chat_tok():
    """ChatML without a tool listing (short sequences): the tokenizer of the engine and gateway tests."""
    return build_chat_tokenizer("chatml")


@pytest.fixture(scope="session")
def tool_model_state(chat_tok):
    """State dict of a tiny Llama that replays the taught tool episode greedily (trained here, ~100 steps).

    Trained on the assistant tokens only, until greedy decoding reproduces every one of them. One torch thread:
    a tiny model gains nothing from two, and on a loaded machine two threads are many times slower."""
    tok = chat_tok
    msgs = episode_messages()

    def n_tokens(k: int, gen: bool) -> int:
        text = tok.apply_chat_template(msgs[:k], tokenize=False, add_generation_prompt=gen)
        return len(tok.encode(text, add_special_tokens=False))

    ids = torch.tensor([tok.encode(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)])
    labels = torch.full_like(ids, -100)
    for start, end in ((n_tokens(1, True), n_tokens(2, False)), (n_tokens(3, True), ids.shape[1])):
        labels[0, start:end] = ids[0, start:end]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = tiny_llama(len(tok))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model.train()
        replays = False
        for step in range(600):
            out = model(input_ids=ids, labels=labels)
            opt.zero_grad()
            out.loss.backward()
            opt.step()
            if step % 10 == 9:
                pred, tgt = out.logits.argmax(-1)[0, :-1], labels[0, 1:]
                replays = bool((pred[tgt != -100] == tgt[tgt != -100]).all()) and out.loss.item() < 0.05
                if replays:
                    break
    finally:
        torch.set_num_threads(threads)
    assert replays, f"the tiny model did not learn the scripted episode (loss {out.loss.item():.3f})"
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def tool_model(chat_tok, tool_model_state):
    """A fresh copy of the taught model (tests may change its weights)."""
    model = tiny_llama(len(chat_tok))
    model.load_state_dict(tool_model_state)
    return model.eval()


@pytest.fixture
def random_chat_model(chat_tok):
    """A tiny random Llama over the chat tokenizer's vocabulary (lm_head sharpened so outputs are not uniform)."""
    model = tiny_llama(len(chat_tok), seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()
