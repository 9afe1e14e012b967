"""The CPU demo's verifiable task, tiny model, warm start and held-out evaluation (shared by both cookbook loops).

Task: two-digit addition ``"a+b="`` -> ``"c"`` with ``a, b`` in ``[0, 100)``; reward 1 when the decoded completion
(special tokens removed, whitespace stripped) equals ``str(a + b)`` exactly, else 0.

Split of the 10 000 pairs (fixed seed): ``HELDOUT`` pairs are used only for evaluation; of the rest, ``SFT_FRAC``
(30 %) is the supervised warm-start set and the other 70 % are the RL prompts. Held-out, SFT and RL pairs are
disjoint, so the held-out accuracy measures generalisation, not memorisation.

Warm start: a *brief* supervised run (batches of 64) on the SFT pairs only, stopped as soon as the greedy accuracy
on 200 of those SFT pairs reaches ``target_train_accuracy`` (40 %; checked every 25 steps, every 5 from 25 %;
held-out pairs are never read). It stops while the model knows the format and part of the arithmetic, which leaves
honest room for RL on pairs it never saw with a label. The result is cached as an HF checkpoint directory under
``runs/warmstart/<hash of the settings>/`` (model + char-level tokenizer), so every later run starts from it.

The tiny model is an HF ``LlamaForCausalLM`` (2 layers, hidden 64, head_dim 32 so that vLLM accepts it) with a
char-level ``PreTrainedTokenizerFast`` built locally with ``tokenizers`` (no hub access).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = list("0123456789+=")
NUM_PAIRS = 100
HELDOUT = 500
SFT_FRAC = 0.3
SPLIT_SEED = 1234


# ------------------------------------------------------------------------------------------------ task
def split_pairs() -> dict[str, list[tuple[int, int]]]:
    """Disjoint ``heldout`` / ``sft`` / ``rl`` lists of ``(a, b)`` pairs (fixed seed)."""
    pairs = [(a, b) for a in range(NUM_PAIRS) for b in range(NUM_PAIRS)]
    random.Random(SPLIT_SEED).shuffle(pairs)
    held, rest = pairs[:HELDOUT], pairs[HELDOUT:]
    n_sft = int(SFT_FRAC * len(rest))
    return {"heldout": held, "sft": rest[:n_sft], "rl": rest[n_sft:]}


def prompt_text(a: int, b: int) -> str:
    return f"{a}+{b}="


def answer_text(a: int, b: int) -> str:
    return str(a + b)


def encode_prompt(tokenizer, a: int, b: int) -> list[int]:
    """Prompt ids: BOS (when the tokenizer has one) followed by the characters of ``"a+b="``."""
    ids = tokenizer.encode(prompt_text(a, b), add_special_tokens=False)
    return ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []) + list(ids)


def prompts(tokenizer, pairs: list[tuple[int, int]]):
    """The pairs as ``plumbing.Prompt`` s: text ``"a+b="``, reference ``str(a + b)``, ids :func:`encode_prompt`,
    the pair in ``metadata["pair"]``."""
    from plumbing import Prompt

    return [Prompt(prompt_text(a, b), answer_text(a, b), tuple(encode_prompt(tokenizer, a, b)),
                   ({"role": "user", "content": prompt_text(a, b)},), {"pair": (a, b)}) for a, b in pairs]


def task(tokenizer):
    """The toy task as a ``plumbing.Task``: the RL pairs to train on, the held-out pairs to evaluate (their
    reward is ``--reward verifier``, exact match, which is :func:`reward`)."""
    from plumbing import Task

    split = split_pairs()
    return Task(prompts(tokenizer, split["rl"]), prompts(tokenizer, split["heldout"]), "toy")


def reward(tokenizer, a: int, b: int, output_ids: list[int]) -> float:
    """Exact-match reward: 1.0 iff the completion decodes to ``str(a + b)`` and ends with EOS (not cut by length)."""
    if not output_ids or output_ids[-1] != tokenizer.eos_token_id:
        return 0.0
    text = tokenizer.decode(output_ids, skip_special_tokens=True).replace(" ", "").strip()
    return float(text == answer_text(a, b))


# ------------------------------------------------------------------------------------------------ model
def build_tokenizer():
    """Char-level fast tokenizer over ``CHARS`` with <pad>/<s>/</s>/<unk> (built locally, no hub)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def build_tiny_model(tokenizer, *, seed: int = 0, hidden: int = 64, layers: int = 2):
    """A tiny random HF Llama (head_dim 32, 2 heads, fp32) whose ids match ``tokenizer``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 32,
        head_dim=32,
        max_position_embeddings=64,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


# ------------------------------------------------------------------------------------------------ warm start
@dataclass(frozen=True)
class WarmStart:
    """Settings of the supervised warm start (their hash names the cache directory)."""

    max_steps: int = 3000
    target_train_accuracy: float = 0.4
    check_every: int = 25
    # accuracy climbs ~15 points in 25 steps near the target: from fine_from on, check every fine_check_every
    # steps, so the warm start stops near the target instead of overshooting it (and the room left for RL is
    # the same from one machine to the next)
    fine_from: float = 0.25
    fine_check_every: int = 5
    batch_size: int = 64
    lr: float = 3e-3
    seed: int = 0
    hidden: int = 64
    layers: int = 2

    def key(self) -> str:
        blob = json.dumps({**asdict(self), "split": [NUM_PAIRS, HELDOUT, SFT_FRAC, SPLIT_SEED]}, sort_keys=True)
        return hashlib.sha1(blob.encode()).hexdigest()[:10]


def sft_batch(tokenizer, pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` and ``labels`` (-100 on prompt and padding) for teacher forcing."""
    seqs, labels = [], []
    for a, b in pairs:
        p = encode_prompt(tokenizer, a, b)
        o = [*tokenizer.encode(answer_text(a, b), add_special_tokens=False), tokenizer.eos_token_id]
        seqs.append(p + o)
        labels.append([-100] * len(p) + o)
    width = max(map(len, seqs))
    ids = torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s)) for s in seqs])
    lab = torch.tensor([s + [-100] * (width - len(s)) for s in labels])
    return ids, lab


def warm_start(cache_root: str | os.PathLike = "runs/warmstart", cfg: WarmStart = WarmStart(), log=print) -> str:
    """Return the directory of the cached warm-start checkpoint, training it first if it is not there.

    Written atomically (temporary directory, then rename), so concurrent callers never read a half-written one.
    """
    out = Path(cache_root) / cfg.key()
    if (out / "config.json").exists():
        return str(out)
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, seed=cfg.seed, hidden=cfg.hidden, layers=cfg.layers)
    pairs = split_pairs()["sft"]
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    model.train()
    probe = pairs[:200]  # stopping rule reads only SFT (training) pairs, never held-out ones
    every = cfg.check_every
    for step in range(1, cfg.max_steps + 1):
        ids, lab = sft_batch(tokenizer, rng.sample(pairs, cfg.batch_size))
        loss = model(input_ids=ids, labels=lab).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % every == 0:
            train_acc = heldout_accuracy(model, tokenizer, probe)
            log(f"warm start: step {step} sft loss {loss.item():.3f} accuracy on SFT pairs {train_acc:.3f}")
            if train_acc >= cfg.target_train_accuracy:
                break
            if train_acc >= cfg.fine_from:
                every = cfg.fine_check_every
    model.eval()
    tmp = Path(cache_root) / f".tmp-{cfg.key()}-{os.getpid()}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process finished first: keep theirs
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


# ------------------------------------------------------------------------------------------------ evaluation
@torch.no_grad()
def heldout_accuracy(model, tokenizer, pairs: list[tuple[int, int]] | None = None, *, max_new_tokens: int = 6) -> float:
    """Greedy exact-match accuracy on the held-out pairs (batched HF ``generate``, left padding)."""
    pairs = split_pairs()["heldout"] if pairs is None else pairs
    was_training = model.training
    model.eval()
    prompts = [encode_prompt(tokenizer, a, b) for a, b in pairs]
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    device = next(model.parameters()).device
    ids = ids.to(device)
    out = model.generate(
        input_ids=ids,
        attention_mask=(ids != pad).long(),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=tokenizer.eos_token_id,
    )[:, width:].tolist()
    correct = 0
    for (a, b), row in zip(pairs, out):
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id) + 1]
        correct += reward(tokenizer, a, b, row)
    model.train(was_training)
    return correct / len(pairs)
