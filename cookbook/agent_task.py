"""The tool-use task of the agent demos (``agent_async.py``, ``agent_gateway.py``): multiplication that needs a
calculator, the tiny chat model and tokenizer, the warm start, held-out evaluation and the GRPO loss over
trajectories.

Task: ``"a*b"`` with ``a, b`` in ``[100, 1000)``. The tiny model cannot multiply three-digit numbers; it can call
the ``calc`` tool (Hermes format, ``<tool_call>{"name": "calc", "arguments": {"expr": "a*b"}}</tool_call>``), read
the result from the ``tool`` turn, and answer with it. At most 3 turns; reward 1 iff the final answer (a turn without
a tool call) equals ``str(a * b)`` exactly.

Split (fixed seed): ``HELDOUT`` problems over the whole range are used only for evaluation. The warm start sees full
episodes (call, tool result, answer) of problems with ``a < SFT_MAX_A`` only — part of the distribution — and stops
as soon as greedy episodes on those problems reach ``target_train_accuracy``: the model knows the call format, not
yet how to copy every operand and result. RL prompts are drawn from the whole range, never a held-out pair.

Tokenizer: char-level over digits, ``*`` and newline, plus added tokens for the chat markers, the role names and the
fixed pieces of the tool call (``<tool_call>``, ``{"name": "calc", "arguments": {"expr": "``, ``"}}``,
``</tool_call>``), as a BPE tokenizer would merge them. No added token shares a character with the base characters,
so decode-then-encode gives back the ids for any token sequence (no drift between turns). The chat template is
compact ChatML without a tool listing (the model learns its one tool in the warm start).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from rlblocks.rollout import SamplingParams
from rlblocks.rollout.agents import (
    EpisodeStats,
    ToolEnv,
    Trajectory,
    calculator_tool,
    run_episode,
)
from rlblocks.rollout.engines import TorchEngine

LO, HI = 100, 1000
HELDOUT = 300
SFT_MAX_A = 500
SPLIT_SEED = 4321
MAX_TURNS = 3
TURN_TOKENS = 16  # per-turn budget: a call is 11 tokens, an answer at most 7
MODEL = {"hidden": 64, "layers": 2, "context": 256}

CALL_HEAD = '{"name": "calc", "arguments": {"expr": "'
CALL_TAIL = '"}}'
ADDED = ["<|im_start|>", "<|im_end|>", "user", "assistant", "tool", "<tool_call>", "</tool_call>", CALL_HEAD,
         CALL_TAIL]
SPECIALS = ["<pad>", "<unk>"]
CHARS = list("0123456789*\n")
TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# ------------------------------------------------------------------------------------------------ task
def split_problems() -> dict[str, list[tuple[int, int]]]:
    """``heldout`` (whole range), ``sft`` (``a < SFT_MAX_A`` only, disjoint from held-out); RL draws with
    :func:`rl_problem`."""
    rng = random.Random(SPLIT_SEED)
    held: set[tuple[int, int]] = set()
    while len(held) < HELDOUT:
        held.add((rng.randrange(LO, HI), rng.randrange(LO, HI)))
    sft: list[tuple[int, int]] = []
    seen = set(held)
    while len(sft) < 4000:
        p = (rng.randrange(LO, SFT_MAX_A), rng.randrange(LO, HI))
        if p not in seen:
            seen.add(p)
            sft.append(p)
    return {"heldout": sorted(held), "sft": sft}


def rl_problem(rng: random.Random, heldout: set[tuple[int, int]]) -> tuple[int, int]:
    """A problem from the whole range that is not held out."""
    while True:
        p = (rng.randrange(LO, HI), rng.randrange(LO, HI))
        if p not in heldout:
            return p


def problem(a: int, b: int):
    """The problem ``a*b`` as a ``plumbing.Prompt``: one user message, reference ``str(a * b)``, the pair in
    ``metadata["pair"]`` (no ids: an episode renders its turns itself)."""
    from plumbing import Prompt

    return Prompt(f"{a}*{b}", str(a * b), (), ({"role": "user", "content": f"{a}*{b}"},), {"pair": (a, b)})


def task(heldout: int = HELDOUT):
    """The tool task as a ``plumbing.Task``: the first ``heldout`` held-out problems to evaluate; training problems
    drawn from the whole range by :func:`rl_problem`, never a held-out one. Its reward is ``--reward verifier``
    (exact match of the final answer) and its tool the calculator (:func:`default_tools`)."""
    from plumbing import Task

    held = split_problems()["heldout"]
    held_set = set(held)
    return Task([], [problem(a, b) for a, b in held[:heldout]], "toy-agent",
                sampler=lambda rng: problem(*rl_problem(rng, held_set)))


def default_tools() -> list:
    """The task's one tool: the calculator, named ``calc`` (what the warm start teaches)."""
    return [calculator_tool("calc")]


def make_env(prompt, tools, reward, counts=None) -> ToolEnv:
    """An episode's environment: the prompt's messages, the tools, and ``reward`` (a ``plumbing.Reward``) on the
    final answer (failed reward calls are also counted in ``counts``, a ``Counter``, when given)."""
    async def score(answer: str) -> float:
        return await reward.score_answer(prompt, answer, counts)

    return ToolEnv(list(prompt.messages), tools, reward_fn=score)


def episode_text(a: int, b: int) -> list[dict]:
    """The messages of a correct episode (what the warm start imitates)."""
    return [{"role": "user", "content": f"{a}*{b}"},
            {"role": "assistant", "content": f"<tool_call>{CALL_HEAD}{a}*{b}{CALL_TAIL}</tool_call>"},
            {"role": "tool", "name": "calc", "content": str(a * b)},
            {"role": "assistant", "content": str(a * b)}]


# ------------------------------------------------------------------------------------------------ model
def build_tokenizer():
    """The demo's chat tokenizer (see the module docstring), built locally with ``tokenizers``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")
    fast.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    fast.eos_token = "<|im_end|>"
    fast.chat_template = TEMPLATE
    return fast


def build_model(tokenizer, *, seed: int = 0):
    """The tiny HF Llama of the demo (``MODEL``: 2 layers, hidden 64, head_dim 32, context 256), fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    h = MODEL["hidden"]
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=h, intermediate_size=4 * h,
                      num_hidden_layers=MODEL["layers"], num_attention_heads=h // 32, num_key_value_heads=h // 32,
                      head_dim=32, max_position_embeddings=MODEL["context"], pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


# ------------------------------------------------------------------------------------------------ evaluation
async def episodes(engine, tok, prompts, *, tools, reward, sampling: SamplingParams,
                   stats: EpisodeStats | None = None, session_prefix: str = "eval", group_ids=None,
                   max_turns: int = MAX_TURNS, seeds=None, counts=None):
    """Run one episode per prompt (``plumbing.Prompt`` s) concurrently on ``engine``; returns the
    :class:`Episode` list. ``seeds``: one sampling seed per episode (default: the engine draws them); ``counts``:
    a ``Counter`` that gets the failed reward calls."""
    def sp(i: int) -> SamplingParams:
        return sampling if seeds is None else dataclasses.replace(sampling, seed=seeds[i])

    return await asyncio.gather(*[
        run_episode(engine, make_env(p, tools, reward, counts), tok, sampling=sp(i), max_turns=max_turns,
                    session_id=f"{session_prefix}-{i}", group_id=None if group_ids is None else group_ids[i],
                    stats=stats)
        for i, p in enumerate(prompts)])


def final_answer(episode) -> str:
    """The text of an episode's final answer (its last turn without a tool call; "" when it had none)."""
    return next((info["answer"] for info in reversed(episode.infos) if "answer" in info), "")


async def eval_episodes(engine, tok, prompts, *, tools, reward, k: int = 1, temperature: float = 0.0,
                        turn_tokens: int = TURN_TOKENS, max_turns: int = MAX_TURNS,
                        stats: EpisodeStats | None = None, seed: int = 0):
    """The held-out evaluation of a tool task: ``k`` episodes per prompt (episode ``j`` of prompt ``i`` seeded
    ``seed + i·k + j``), their rewards summarised by ``rlblocks.reward.summarize`` (pass@k, mean@k, per prompt).
    An episode that ended in an environment error scores 0 and is counted as a failure."""
    from rlblocks.reward import RewardResult, summarize

    sampling = SamplingParams(temperature=temperature, max_new_tokens=turn_tokens)
    flat = [p for p in prompts for _ in range(k)]
    eps = await episodes(engine, tok, flat, tools=tools, reward=reward, sampling=sampling, stats=stats,
                         max_turns=max_turns, seeds=[seed + i for i in range(len(flat))])
    results = [RewardResult.failure(f"{e.finish_reason}: {e.error}") if e.finish_reason in ("env_error",
               "env_timeout") else RewardResult(e.reward) for e in eps]
    return summarize([results[i * k:(i + 1) * k] for i in range(len(prompts))], k,
                     prompts=[p.text for p in prompts], references=[p.reference for p in prompts],
                     responses=[[final_answer(e) for e in eps[i * k:(i + 1) * k]] for i in range(len(prompts))])


def accuracy(model, tok, problems, stats: EpisodeStats | None = None) -> float:
    """Greedy accuracy on ``problems`` (``(a, b)`` pairs) on a fresh TorchEngine over ``model``: the fraction of
    episodes whose final answer is exactly ``a*b`` (blocking; not from a running event loop)."""
    from plumbing import Reward

    async def main() -> float:
        reward = Reward("verifier", tok)
        engine = TorchEngine(model, max_batch_size=1024)
        try:
            result = await eval_episodes(engine, tok, [problem(a, b) for a, b in problems], tools=default_tools(),
                                         reward=reward, stats=stats)
        finally:
            await engine.aclose()
            reward.close()
        return result.mean_at_k

    return asyncio.run(main())


# ------------------------------------------------------------------------------------------------ warm start
@dataclass(frozen=True)
class WarmStart:
    """Supervised warm start settings (their hash names the cache directory)."""

    max_steps: int = 2000
    target_train_accuracy: float = 0.3
    check_every: int = 5
    batch_size: int = 32
    lr: float = 3e-3
    seed: int = 0

    def key(self) -> str:
        blob = json.dumps({**asdict(self), "task": [LO, HI, HELDOUT, SFT_MAX_A, SPLIT_SEED, ADDED, TEMPLATE],
                           "model": MODEL}, sort_keys=True)
        return hashlib.sha1(blob.encode()).hexdigest()[:10]


def sft_batch(tok, pairs) -> tuple[Tensor, Tensor]:
    """Right-padded ids and labels of whole episodes; labels only on the assistant turns (-100 elsewhere)."""
    rows, labs = [], []
    for a, b in pairs:
        msgs = episode_text(a, b)
        ids = tok.encode(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)
        lab = [-100] * len(ids)
        for k in (1, 3):  # the two assistant turns, each with its closing <|im_end|>
            start = len(tok.encode(tok.apply_chat_template(msgs[:k], tokenize=False, add_generation_prompt=True),
                                   add_special_tokens=False))
            end = len(tok.encode(tok.apply_chat_template(msgs[: k + 1], tokenize=False), add_special_tokens=False))
            lab[start:end - 1] = ids[start:end - 1]  # up to and including <|im_end|>, not the newline after it
        rows.append(ids)
        labs.append(lab)
    width = max(map(len, rows))
    pad = tok.pad_token_id
    return (torch.tensor([r + [pad] * (width - len(r)) for r in rows]),
            torch.tensor([r + [-100] * (width - len(r)) for r in labs]))


def warm_start(root: str | os.PathLike = "runs/warmstart-agent", cfg: WarmStart = WarmStart(), log=print) -> str:
    """The cached warm-start checkpoint directory (trained first when absent; written atomically)."""
    out = Path(root) / cfg.key()
    if (out / "config.json").exists():
        return str(out)
    tok = build_tokenizer()
    model = build_model(tok, seed=cfg.seed)
    pairs = split_problems()["sft"]
    probe = pairs[:100]  # the stopping rule reads SFT problems only, never held-out ones
    rng = random.Random(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    for step in range(1, cfg.max_steps + 1):
        model.train()
        ids, lab = sft_batch(tok, rng.sample(pairs, cfg.batch_size))
        loss = model(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long(), labels=lab).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % cfg.check_every == 0:
            acc = accuracy(model.eval(), tok, probe)
            log(f"warm start: step {step} loss {loss.item():.3f} greedy episode accuracy on SFT problems {acc:.3f}")
            if acc >= cfg.target_train_accuracy:
                break
    model.eval()
    tmp = Path(root) / f".tmp-{cfg.key()}-{os.getpid()}"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process finished first: keep theirs
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


# ------------------------------------------------------------------------------------------------ loss
def grpo_backward(model, batch_trajs: list[Trajectory], pad_id: int, *, eps_low: float = 0.2, eps_high: float = 0.2,
                  max_tokens: int = 4096, prefix_share: bool = False) -> dict[str, float]:
    """GRPO loss over trajectories (one reward per trajectory, its ``group_id`` the prompt group), back-propagated
    into ``model``'s gradients (no optimizer step: the caller clips and steps); returns the metrics (``loss`` is the
    batch loss, ``tokens_trained`` the model tokens it covers).

    The update is ``grpo.grpo_step`` (the GRPO loops' own) with ``optim=None``, on the trajectories' batch tensors
    (``plumbing.trajectory_tensors``: one row per segment, only the model's own tokens trained, the advantage
    computed once per trajectory and broadcast to its rows, the engine's log-probs as π_old): PPO-clip
    (``--loss ppo`` with ``eps_low``/``eps_high``), no correction, no reference penalty, token-mean over the
    batch, on this rank alone (:func:`this_rank_alone`). Rows are sorted by length and cut into micro-batches of
    at most ``max_tokens`` padded tokens; the trainer's log-probs come from ``PolicyLogprobs``
    (``linear_token_logprobs`` on the last hidden states, no ``[N, V]`` logits). ``prefix_share``: each
    micro-batch's decoder forward runs over the prefix tree of its rows (the episodes of a group share their task
    prompt, a turn's row repeats the history of the turn before); the loss and gradients are the same up to float
    rounding.
    """
    from types import SimpleNamespace

    from grpo import grpo_step
    from plumbing import PolicyLogprobs, trajectory_tensors

    bt = trajectory_tensors(batch_trajs, pad_id, model.get_output_embeddings().weight.device)
    cfg = SimpleNamespace(loss="ppo", eps_low=eps_low, eps_high=eps_high, rollout_weight_cap=None, correction="none",
                          correction_cap=None, kl_coef=0.0, agg="token-mean", ppo_epochs=1, mini_batches=1, seed=0)
    m = grpo_step(cfg, PolicyLogprobs(model, prefix_share=prefix_share), None, bt, group=this_rank_alone(),
                  max_tokens=max_tokens)
    return {**m, "tokens_trained": float(bt["mask"].sum())}


@functools.cache
def this_rank_alone():
    """The process group of this rank alone when torch.distributed runs with more than one rank (else ``None``):
    the agent loops train on one rank while the others roll out, so ``grpo_step``'s normalisers are this rank's own
    (collectives over a one-rank group are skipped). Created by this rank only (``use_local_synchronization``)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.new_group([dist.get_rank()], use_local_synchronization=True)
