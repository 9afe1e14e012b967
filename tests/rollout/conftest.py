"""Fixtures of the rollout tests: tiny HF models loaded from the shared ``tiny_hf_dir`` checkpoint; the SGLang
contract pieces (``sglang_0_5_23``, vendored SGLang types), the stricter fake server (``fake_sglang``) and the
agent helpers (``agent_testlib``) made importable by name (pytest runs with ``--import-mode=importlib``, so this
folder is not on ``sys.path``).

The chat fixtures (``chat_tok``, ``tool_model``, ``random_chat_model``) serve the agent, gateway and engine tests.
``tool_model``: a tiny random Llama trained for a few seconds on one rendered tool episode, so that greedy decoding
replays it: turn 1 is a calculator call, turn 2 the answer after the tool result. Episodes, the gateway and the
interrupt test then run real engines on a model whose behaviour is known.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).parent


def _register(name: str, path: Path) -> None:
    if name in sys.modules:
        return
    is_pkg = path.is_dir()
    spec = importlib.util.spec_from_file_location(
        name, path / "__init__.py" if is_pkg else path, submodule_search_locations=[str(path)] if is_pkg else None
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


_register("sglang_0_5_23", _HERE / "sglang_0_5_23")
_register("fake_sglang", _HERE / "fake_sglang.py")
_register("agent_testlib", _HERE / "agent_testlib.py")

from agent_testlib import build_chat_tokenizer, episode_messages, tiny_llama  # noqa: E402


def _load_tiny_model(path: str, sharpen: float):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if sharpen != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(sharpen)
    return model


@pytest.fixture
def make_tiny_model(tiny_hf_dir):
    """Factory of fresh tiny Llamas in fp32 eval mode (tests may update their weights). ``sharpen`` scales
    ``lm_head`` so that next-token distributions are peaked: a random tiny model is nearly uniform, which makes
    top-k/top-p uninformative and greedy decoding a matter of near-ties."""
    return lambda sharpen=20.0: _load_tiny_model(tiny_hf_dir, sharpen)


@pytest.fixture
def tiny_model(make_tiny_model):
    """A fresh sharpened tiny Llama."""
    return make_tiny_model()


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
