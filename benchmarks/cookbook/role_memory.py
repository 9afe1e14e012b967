"""Bytes per role of the PPO loop (actor, critic, reference, reward model, rollout engine) against the critic-free
GRPO loops, measured on the demo model after one real update of each.

    .venv/bin/python benchmarks/cookbook/role_memory.py [--model DIR] [--reward-model DIR] [--json OUT]

Each role is built as the loop builds it (``cookbook/ppo_roles.py``'s loaders; the GRPO loops' actor is the same HF
causal LM under the same AdamW, and their engine the same ``TorchEngine``), one rollout of 16 prompts × 4 samples
is generated, and one update runs: PPO's ``make_experience`` + ``ppo_update`` (2 epochs × 2 mini-batches, actor and
critic), GRPO's advantages + ``ppo_clip_loss`` + ``aggregate`` on the actor. Then the tensors each role holds are
counted (``ppo_roles.role_bytes``): parameters, gradients (as held after the update) and optimiser states (AdamW's two
moments and its step counters). The GRPO loops keep a reference only with ``--kl-coef > 0`` (their default is 0),
so both GRPO figures are printed. Activations and KV caches are not counted (they depend on batch and length, not
on the roles). Single process, fp32 (the CPU demo's dtype).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

# the cookbook's modules import each other by name (their folder is sys.path[0] when a loop runs as a script)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "cookbook"))
import ppo
import toy
from plumbing import Reward
from ppo_roles import load_actor, load_critic, role_bytes

from rlblocks.losses import aggregate, grpo_advantages, ppo_clip_loss
from rlblocks.rollout.engines import TorchEngine


def rollout(path: str, tok, loop) -> tuple:
    engine = TorchEngine.from_pretrained(path, device="cpu", max_batch_size=1024)
    task = toy.task(tok)
    cfg = SimpleNamespace(temperature=1.0, max_new_tokens=6, group_size=4)
    batch, prompts, outputs = ppo.rollout(cfg, engine, tok, task, random.Random(0), 16, 0, 0, loop,
                                          torch.device("cpu"))
    scores = torch.tensor(loop.run_until_complete(Reward("verifier", tok).scores(prompts, outputs))[0])
    return engine, batch, scores


def ppo_roles(path: str, rm_path: str, loop) -> dict[str, dict[str, int]]:
    from rlblocks.reward import RewardModel

    tok, actor = load_actor(path, torch.device("cpu"), 1.0)
    critic = load_critic(path, torch.device("cpu"))
    ref = load_actor(path, torch.device("cpu"), 1.0)[1].eval().requires_grad_(False)
    rm = RewardModel.from_pretrained(rm_path).model.requires_grad_(False)
    engine, batch, scores = rollout(path, tok, loop)
    cfg = SimpleNamespace(gamma=1.0, lam=0.95, whiten_advantages=True, kl_coef=0.3, kl_in="reward", eps_low=0.2,
                          eps_high=0.2, value_clip=0.2, ppo_epochs=2, mini_batches=2, agg="token-mean",
                          grad_clip=1.0, seed=0)
    a_opt = torch.optim.AdamW(actor.parameters(), lr=2e-4, weight_decay=0.0)
    c_opt = torch.optim.AdamW(critic.parameters(), lr=1e-3, weight_decay=0.0)
    exp = ppo.make_experience(cfg, actor, critic, ref, batch, scores)
    ppo.ppo_update(cfg, actor, critic, a_opt, c_opt, exp)
    out = {"actor": role_bytes(actor, a_opt), "critic": role_bytes(critic, c_opt),
           "reference": role_bytes(ref), "reward model": role_bytes(rm), "engine": role_bytes(engine.model)}
    loop.run_until_complete(engine.aclose())
    return out


def grpo_roles(path: str, loop) -> dict[str, dict[str, int]]:
    tok, actor = load_actor(path, torch.device("cpu"), 1.0)
    engine, batch, scores = rollout(path, tok, loop)
    opt = torch.optim.AdamW(actor.parameters(), lr=1.5e-4, weight_decay=0.0)
    adv = grpo_advantages(scores, batch.group_ids)
    mask = batch.loss_mask
    with torch.no_grad():
        old = actor(batch.input_ids, batch.prompt_lens, batch.response_mask)
    for _ in range(2):  # 2 epochs × 2 mini-batches, as the GRPO demo
        for rows in torch.randperm(batch.batch_size).tensor_split(2):
            logp = actor(batch.input_ids[rows], batch.prompt_lens[rows], batch.response_mask[rows])
            loss, _ = ppo_clip_loss(logp, old[rows], adv[rows], mask[rows])
            opt.zero_grad(set_to_none=True)
            aggregate(loss, mask[rows]).backward()
            opt.step()
    ref = load_actor(path, torch.device("cpu"), 1.0)[1].eval().requires_grad_(False)
    out = {"actor": role_bytes(actor, opt), "engine": role_bytes(engine.model),
           "reference (--kl-coef > 0 only)": role_bytes(ref)}
    loop.run_until_complete(engine.aclose())
    return out


def total(r: dict[str, int]) -> int:
    return r["weights"] + r["grads"] + r["optimizer"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Bytes per role: PPO (four roles) vs GRPO (critic-free), demo model.")
    ap.add_argument("--model", default="", help="actor checkpoint (default: the cached demo warm start)")
    ap.add_argument("--reward-model", default="", help="reward-model checkpoint (default: the cached demo one, "
                                                       "else a sequence-classification head on --model)")
    ap.add_argument("--runs-dir", default="runs", help="where the demo caches live")
    ap.add_argument("--json", default="", help="also write the figures here")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    path = args.model or toy.warm_start(os.path.join(args.runs_dir, "warmstart"))
    rm_path = args.reward_model
    if not rm_path:
        cached = sorted((Path(args.runs_dir) / "reward_model").glob("*/reward_stats.json"))
        if cached:
            rm_path = str(cached[0].parent)
        else:  # same bytes as a trained one: the policy's backbone and a one-output score head
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            rm_path = str(Path(args.runs_dir) / "role_memory_rm")
            AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).save_pretrained(rm_path)
            AutoTokenizer.from_pretrained(path).save_pretrained(rm_path)
    loop = asyncio.new_event_loop()
    p, g = ppo_roles(path, rm_path, loop), grpo_roles(path, loop)
    loop.close()
    n_actor = p["actor"]["weights"] // 4
    print(f"demo model: {n_actor} actor parameters (fp32)\n")
    print("| loop | role | weights | grads | optimizer | total |")
    print("|---|---|---|---|---|---|")
    for name, roles in (("PPO", p), ("GRPO", g)):
        for role, r in roles.items():
            print(f"| {name} | {role} | {r['weights']:,} | {r['grads']:,} | {r['optimizer']:,} | {total(r):,} |")
    ppo_total = sum(total(r) for r in p.values())
    grpo_total = total(g["actor"]) + total(g["engine"])
    grpo_ref = grpo_total + total(g["reference (--kl-coef > 0 only)"])
    print(f"\nPPO total {ppo_total:,} B ({ppo_total / n_actor:.1f} B per actor parameter)")
    print(f"GRPO total {grpo_total:,} B without a reference: {1 - grpo_total / ppo_total:.1%} less than PPO; "
          f"{grpo_ref:,} B with one: {1 - grpo_ref / ppo_total:.1%} less")
    if args.json:
        Path(args.json).write_text(json.dumps({"ppo": p, "grpo": g, "ppo_total": ppo_total, "grpo_total": grpo_total,
                                               "grpo_total_with_reference": grpo_ref}, indent=2) + "\n")


if __name__ == "__main__":
    main()
