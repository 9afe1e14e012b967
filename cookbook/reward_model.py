"""The reward-model stage of ``ppo.py`` on the toy task (``--reward rm`` without ``--reward-model``): a learned
reward model trained before RL, Bradley–Terry on pairs of completions ranked by the exact-match checker, cached in
``<runs-dir>/reward_model/<key>/``.

Read top to bottom: :class:`RewardModelStage` (the settings, whose hash names the cache), :func:`preference_pairs`
(the pairs, sampled from the initial actor), :func:`pair_tensors` / :func:`pair_rows` (their rows),
:func:`pairwise_accuracy` (the held-out measure), :func:`reward_model_stage` (the training), and
:func:`reward_model_for` (what ``ppo.py`` calls: the checkpoint ``--reward rm`` scores with, and its statistics).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import toy
from plumbing import Prompt, rank0_first
from torch import Tensor

from rlblocks.rollout import GenerationRequest, SamplingParams
from rlblocks.rollout.engines import TorchEngine


def reward_model_for(cfg: Any, policy_path: str, rank: int, device: torch.device, log=print) -> tuple[str, dict]:
    """``(path, stats)`` of the reward model ``--reward rm`` scores with: ``--reward-model``, or (empty) the one
    :func:`reward_model_stage` trains from ``policy_path`` with the ``--rm-*`` flags (rank 0 first, the others read
    its cache). ``stats``: its ``reward_stats.json`` (empty without one, or with another ``--reward``)."""
    path = cfg.reward_model
    if cfg.reward != "rm":
        return path, {}
    if not path:
        stage = RewardModelStage(steps=cfg.rm_steps, batch=cfg.rm_batch, lr=cfg.rm_lr, lm_coef=cfg.rm_lm_coef,
                                 samples=cfg.rm_samples, seed=cfg.seed)
        path = rank0_first(rank, lambda: reward_model_stage(
            stage, policy_path, os.path.join(cfg.runs_dir, "reward_model"), device, log=log))
    stats_file = Path(path) / "reward_stats.json"
    if not stats_file.exists():
        return path, {}
    stats = json.loads(stats_file.read_text())
    log(f"reward model {path}: held-out pairwise accuracy {stats['pairwise_accuracy']:.3f}")
    return path, stats


@dataclass(frozen=True)
class RewardModelStage:
    """Settings of the toy task's reward-model stage (their hash and the initial actor's name the cache
    directory ``<runs-dir>/reward_model/<key>/``)."""

    steps: int = 8000
    batch: int = 64
    lr: float = 1e-3
    lm_coef: float = 1.0  # weight of the next-token loss on the accepted completions
    cross_frac: float = 0.5  # share of each batch's pairs whose rejected completion answers another prompt
    samples: int = 4
    test_prompts: int = 500  # RL prompts held out of the reward model's training, for its pairwise accuracy
    train_prompts: int = 0  # 0: every SFT and RL prompt but the test ones; n: the first n of them (tests)
    seed: int = 0

    def key(self, policy_path: str) -> str:
        blob = json.dumps({**dataclasses.asdict(self), "policy": os.path.basename(os.path.normpath(policy_path)),
                           "split": [toy.NUM_PAIRS, toy.HELDOUT, toy.SFT_FRAC, toy.SPLIT_SEED]}, sort_keys=True)
        return hashlib.sha1(blob.encode()).hexdigest()[:10]


def preference_pairs(engine: TorchEngine, tok, prompts: list[Prompt], samples: int, rng: random.Random,
                     loop: asyncio.AbstractEventLoop) -> list[tuple[list[int], list[int], list[int]]]:
    """``(prompt_ids, chosen_ids, rejected_ids)`` triples: the initial actor's ``samples`` completions of each
    prompt (temperature 1) and the reference completion (answer + EOS), ranked by the exact-match checker: every
    distinct completion it rejects is paired with one it accepts (the reference's, the only text it accepts).
    A prompt whose samples are all right gets one near miss instead (the answer ± 1 or ± 10), so every prompt
    gives at least one pair."""
    eos = tok.eos_token_id
    base = rng.randrange(1 << 30)  # seeded requests: the same pairs on every run of the stage

    async def sample_all():
        reqs = [GenerationRequest(f"rm-{i}-{k}", list(p.ids), SamplingParams(
                    temperature=1.0, max_new_tokens=6, stop_token_ids=(eos,), seed=base + i * samples + k))
                for i, p in enumerate(prompts) for k in range(samples)]
        return await asyncio.gather(*[engine.generate(r) for r in reqs])

    gens = loop.run_until_complete(sample_all())
    out = []
    for i, p in enumerate(prompts):
        a, b = p.metadata["pair"]
        chosen = [*tok.encode(p.reference, add_special_tokens=False), eos]
        wrong = {tuple(g.output_ids) for g in gens[i * samples:(i + 1) * samples]
                 if toy.reward(tok, a, b, list(g.output_ids)) == 0.0}
        if not wrong:
            c = a + b + rng.choice([k for k in (-10, -1, 1, 10) if a + b + k >= 0])
            wrong = {tuple([*tok.encode(str(c), add_special_tokens=False), eos])}
        out += [(list(p.ids), chosen, list(w)) for w in sorted(wrong)]
    return out


def pair_tensors(chosen: list[list[int]], rejected: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-padded ``input_ids`` and ``attention_mask`` ``[2n, L]``: the n chosen rows, then the n rejected rows."""
    rows = [*chosen, *rejected]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    return ids, mask


def pair_rows(triples, others=None) -> tuple[list[list[int]], list[list[int]]]:
    """Chosen rows ``prompt + chosen`` and rejected rows ``prompt + rejected`` of ``triples``; with ``others``
    (as many triples), the rejected rows are those of ``others`` instead (pairs across prompts)."""
    return [p + c for p, c, _ in triples], [p + r for p, _, r in (others if others is not None else triples)]


@torch.no_grad()
def pairwise_accuracy(rm, triples, pad_id: int, batch: int = 256, others=None) -> float:
    """Fraction of pairs whose chosen completion the reward model scores above the rejected one (with ``others``:
    above the rejected completion of another prompt)."""
    wins = 0
    for s in range(0, len(triples), batch):
        part = triples[s:s + batch]
        r = rm.score_ids(*pair_tensors(*pair_rows(part, others[s:s + batch] if others else None), pad_id))
        wins += int((r[:len(part)] > r[len(part):]).sum())
    return wins / max(len(triples), 1)


def reward_model_stage(stage: RewardModelStage, policy_path: str, cache_root: str, device: torch.device,
                       log=print) -> str:
    """Stage 1 (toy task): train a reward model, return its checkpoint directory (cached; written atomically).

    Model: ``AutoModelForSequenceClassification`` with one label, its backbone initialised from the initial actor
    (as DeepSpeed-Chat and OpenRLHF start their reward models from the SFT model) and a new score head, read at the
    last token by ``rlblocks.reward.RewardModel``. Data: :func:`preference_pairs` on the SFT and RL prompts minus
    ``stage.test_prompts`` RL prompts, which give the held-out pairs for its pairwise accuracy (the evaluation
    pairs of the actor are never used). Half of each batch's pairs set a completion the checker accepts against
    a rejected completion of ANOTHER prompt (still a pair the checker ranks): pairs within one prompt leave each
    prompt's offset free, and PPO's critic would then have to learn those offsets (a within-prompt accuracy of 0.94
    still ranked only 0.80 of correct-vs-wrong samples across prompts here, and PPO did not improve on it).
    Loss: Bradley–Terry ``−log σ(r_chosen − r_rejected)``, mean over a batch,
    plus ``lm_coef`` × the next-token loss of the accepted completions through an auxiliary LM head (the initial
    actor's, dropped afterwards). A pair carries one bit; the next-token loss teaches the backbone the sums the
    score head has to check (4000 steps of pairs within prompts only: 0.83 without it, 0.94 with it; with the
    cross-prompt half as here: 0.886 within prompts and 0.898 across them, 440 s on a loaded 2-core box).
    Saved with ``reward_stats.json``: the held-out and training pairwise accuracies, the mean and std of its scores
    on the training completions (PPO standardises its rewards with them), pair counts and seconds.
    """
    out = Path(cache_root) / stage.key(policy_path)
    if (out / "reward_stats.json").exists():
        return str(out)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from rlblocks.reward import RewardModel

    t0 = time.time()
    rng = random.Random(stage.seed)
    torch.manual_seed(stage.seed)
    tok = AutoTokenizer.from_pretrained(policy_path)
    split = toy.split_pairs()
    test = split["rl"][-stage.test_prompts:]
    train = split["sft"] + split["rl"][:-stage.test_prompts]
    train = train[:stage.train_prompts] if stage.train_prompts else train
    loop = asyncio.new_event_loop()
    engine = TorchEngine.from_pretrained(policy_path, device=device, max_batch_size=1024)
    try:
        train_pairs = preference_pairs(engine, tok, toy.prompts(tok, train), stage.samples, rng, loop)
        test_pairs = preference_pairs(engine, tok, toy.prompts(tok, test), stage.samples, rng, loop)
    finally:
        loop.run_until_complete(engine.aclose())  # close() from the engine's own loop, its step task awaited
        loop.close()
    log(f"reward model: {len(train_pairs)} training pairs, {len(test_pairs)} held-out pairs "
        f"({time.time() - t0:.0f} s sampling)")
    model = AutoModelForSequenceClassification.from_pretrained(policy_path, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tok.pad_token_id
    model.to(device).train()
    # the next-token loss needs an LM head on the backbone: the initial actor's, trained along and then dropped
    lm_head = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32).get_output_embeddings()
    lm_head.to(device).train()
    rm = RewardModel(model, tok)
    params = [*model.parameters(), *lm_head.parameters()]
    optim = torch.optim.AdamW(params, lr=stage.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 - 0.9 * s / stage.steps)
    for step in range(1, stage.steps + 1):
        part = rng.sample(train_pairs, min(stage.batch, len(train_pairs)))
        n = len(part)
        k = round(stage.cross_frac * n)
        chosen, rejected = pair_rows(part)
        rejected[n - k:] = pair_rows(rng.sample(train_pairs, k))[1]  # these rejected rows answer other prompts
        ids, mask = pair_tensors(chosen, rejected, tok.pad_token_id)
        ids, mask = ids.to(device), mask.to(device)
        # the forward RewardModel.score_ids runs (positions from the mask, score at the last valid token), written
        # out so that its hidden states also feed the next-token loss
        hidden = model.model(input_ids=ids, attention_mask=mask,
                             position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).last_hidden_state
        r = model.score(hidden[torch.arange(2 * n, device=device), mask.sum(-1) - 1])[:, 0].float()
        bt = -torch.nn.functional.logsigmoid(r[:n] - r[n:]).mean()  # Bradley–Terry
        labels = torch.full_like(ids[:n], -100)
        for i, (p, c, _) in enumerate(part):
            labels[i, len(p):len(p) + len(c)] = ids[i, len(p):len(p) + len(c)]
        logits = lm_head(hidden[:n, :-1])
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        loss = bt + stage.lm_coef * nll
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        sched.step()
        if step % 500 == 0 or step == stage.steps:
            model.eval()
            probe = test_pairs[:1000]
            acc = pairwise_accuracy(rm, probe, tok.pad_token_id)
            cross = pairwise_accuracy(rm, probe, tok.pad_token_id, others=probe[1:] + probe[:1])
            model.train()
            log(f"reward model: step {step} Bradley–Terry loss {bt.item():.3f} next-token loss {nll.item():.3f} "
                f"held-out pairwise accuracy {acc:.3f} (across prompts {cross:.3f})")
    model.eval()
    with torch.no_grad():
        scores = torch.cat([rm.score_ids(*pair_tensors(*pair_rows(train_pairs[s:s + 512]), tok.pad_token_id))
                            for s in range(0, len(train_pairs), 512)])
    shuffled = rng.sample(test_pairs, len(test_pairs))
    stats = {
        "pairwise_accuracy": pairwise_accuracy(rm, test_pairs, tok.pad_token_id),
        "cross_prompt_accuracy": pairwise_accuracy(rm, test_pairs, tok.pad_token_id, others=shuffled),
        "train_pairwise_accuracy": pairwise_accuracy(rm, train_pairs[:2000], tok.pad_token_id),
        "score_mean": float(scores.mean()), "score_std": float(scores.std()),
        "train_pairs": len(train_pairs), "test_pairs": len(test_pairs), "test_prompts": len(test),
        "seconds": time.time() - t0, "stage": dataclasses.asdict(stage), "policy": policy_path,
    }
    tmp = Path(cache_root) / f".tmp-{out.name}-{os.getpid()}"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "reward_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    try:
        tmp.rename(out)
    except OSError:  # another process finished first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"reward model: held-out pairwise accuracy {stats['pairwise_accuracy']:.3f} ({stats['seconds']:.0f} s)")
    return str(out)
