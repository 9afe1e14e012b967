"""Synchronous, colocated GRPO (verl's hybrid loop): generate → score → advantages → train → push weights → repeat.

    python cookbook/grpo_sync.py --name sync-demo                       # CPU demo, one process
    torchrun --nproc_per_node 8 cookbook/grpo_sync.py --model /ckpt     # FSDP2 over 8 ranks, engine on each rank

Every rank holds the policy (FSDP2 ``fully_shard`` when there is more than one rank) and an in-process rollout
engine. Each step, each rank generates its share of the ``B`` prompt groups (``K`` samples each), scores them
(exact match), computes GRPO advantages, and takes one optimizer step with ``linear_token_logprobs`` log-probs and
globally normalised aggregation. It then gathers the new weights (``full_tensors``) and loads them into its engine
(``update_weights``, version = step). Every trained token was sampled by the weights being trained
(``max_staleness_seen`` is 0); the only train/rollout gap is numerical (``--correction`` handles it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import toy
from common import (
    PolicyLogprobs,
    Progress,
    RunFiles,
    all_reduce,
    batch_tensors,
    global_counts,
    group_record,
    grpo_loss,
    load_hf,
    opt,
    parse_flags,
)

from rlblocks.rollout import GenerationRequest, SamplingParams, TorchEngine, resumable_generate
from rlblocks.sync import full_tensors


@dataclass
class Config:
    """Synchronous colocated GRPO (flags are generated from these fields)."""

    name: str = opt("sync", "run name: files go to <runs-dir>/<name>/")
    runs_dir: str = opt("runs", "where run directories live")
    model: str = opt("", "HF checkpoint directory; empty: the tiny CPU demo model, warm-started and cached")
    steps: int = opt(200, "optimizer steps")
    time_limit: float = opt(450.0, "stop after this many seconds of RL (0: no limit)")
    prompts_per_step: int = opt(64, "B: prompt groups per step (global)")
    group_size: int = opt(8, "K: samples per prompt")
    correction: str = opt("none", "train/rollout mismatch correction", ("tis", "mis", "none"))
    correction_cap: float = opt(2.0, "tis/mis bound on π_prox/π_rollout")
    loss: str = opt("ppo", "policy loss", ("ppo", "gspo", "cispo", "decoupled"))
    agg: str = opt("token-mean", "loss aggregation mode (global normalisers)")
    eps_low: float = opt(0.2, "clip offset below 1")
    eps_high: float = opt(0.2, "clip offset above 1")
    kl_coef: float = opt(0.0, "k3 KL penalty to the initial policy (0: no reference model)")
    lr: float = opt(3e-4, "AdamW learning rate")
    grad_clip: float = opt(1.0, "max grad norm")
    temperature: float = opt(1.0, "sampling temperature")
    max_new_tokens: int = opt(6, "response budget")
    length_tail: float = opt(0.0, "benchmark: >0 forces lognormal response lengths with this median (p99/p50≈10)")
    eval_every: int = opt(10, "held-out greedy accuracy every N steps (and at the end)")
    seed: int = opt(0, "seed")
    quiet: bool = opt(False, "no progress bar")


def length_budget(cfg: Config, rng: random.Random) -> int:
    """``max_new_tokens``, or a lognormal length with median ``length_tail`` and σ = 0.99 (p99/p50 = 10)."""
    if cfg.length_tail <= 0:
        return cfg.max_new_tokens
    import math

    return max(cfg.max_new_tokens, min(round(rng.lognormvariate(math.log(cfg.length_tail), 0.99)), 200))


def until_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


async def rollout_step(cfg, engine, tok, pairs, rng, n_groups: int, rank: int, step: int) -> list[dict]:
    """Generate ``n_groups`` prompt groups of ``group_size`` samples with the colocated engine and score them."""

    async def one_group(i: int) -> dict:
        pair = rng.choice(pairs)
        prompt = toy.encode_prompt(tok, *pair)
        stop = (tok.eos_token_id,) if cfg.length_tail <= 0 else ()
        sp = SamplingParams(temperature=cfg.temperature, max_new_tokens=length_budget(cfg, rng), stop_token_ids=stop)
        uid = f"s{step}-r{rank}-{i}"
        gens = await asyncio.gather(
            *[resumable_generate(engine, GenerationRequest(f"{uid}/{k}", prompt, sp)) for k in range(cfg.group_size)]
        )
        rewards = [toy.reward(tok, *pair, until_eos(g.output_ids, tok.eos_token_id)) for g in gens]
        return group_record(uid, pair, prompt, gens, rewards, rank)

    return list(await asyncio.gather(*[one_group(i) for i in range(n_groups)]))


def main(argv: list[str] | None = None) -> None:
    cfg = parse_flags(Config, argv)
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else "cpu"
    if cfg.prompts_per_step % world:
        raise ValueError(f"prompts_per_step: expected a multiple of the world size {world}, got {cfg.prompts_per_step}")
    torch.manual_seed(cfg.seed + rank)
    rng = random.Random(cfg.seed * 1000 + rank)
    files = RunFiles(cfg.runs_dir, cfg.name)
    # ---- model, tokenizer, engine (same process)
    path = cfg.model
    if not path:
        root = os.path.join(cfg.runs_dir, "warmstart")
        if rank == 0:
            toy.warm_start(root, log=lambda s: print(s, flush=True))
        if distributed:
            dist.barrier()
        path = toy.warm_start(root)
    tok, lm = load_hf(path, device)
    engine = TorchEngine(load_hf(path, device)[1], max_batch_size=1024)
    if rank == 0:
        files.fresh()
    eval_lm = lm
    policy = PolicyLogprobs(lm, cfg.temperature)
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        eval_lm = engine.model  # the engine's copy holds the same weights after every push
        for layer in lm.model.layers:
            fully_shard(layer)
        fully_shard(policy)
    ref = None
    if cfg.kl_coef > 0:
        ref = PolicyLogprobs(load_hf(path, device)[1].eval(), cfg.temperature).requires_grad_(False)
    optim = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)
    pairs = toy.split_pairs()["rl"]
    n_local = cfg.prompts_per_step // world
    stats = Counter()
    loop = asyncio.new_event_loop()
    acc_before = toy.heldout_accuracy(eval_lm, tok) if rank == 0 else 0.0
    if rank == 0:
        print(f"held-out accuracy before RL: {acc_before:.3f}", flush=True)
    last_acc = acc_before
    bar = Progress(cfg.steps, 0, enabled=rank == 0 and not cfg.quiet)
    t_start = time.time()
    trained = generated = 0
    step = 0
    while step < cfg.steps:
        t0 = time.perf_counter()
        groups = loop.run_until_complete(
            rollout_step(cfg, engine, tok, pairs, rng, n_local, rank, step))
        gen_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        bt = batch_tensors(groups, tok.pad_token_id, device)
        counts = global_counts(bt)
        loss, m = grpo_loss(cfg, policy, bt, global_counts=counts, ref_policy=ref, grad_scale=float(world))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip)
        optim.step()
        train_s = time.perf_counter() - t1
        step += 1
        # ---- push the new weights into the colocated engine (version = step)
        t2 = time.perf_counter()
        tensors = [(n.removeprefix("lm."), t) for n, t in full_tensors(policy)]
        loop.run_until_complete(engine.update_weights(tensors, version=step))
        sync_s = time.perf_counter() - t2
        sums = torch.tensor([bt["rewards"].sum().item(), bt["rewards"].numel(), bt["mask"].sum().item()],
                            dtype=torch.float64)
        all_reduce(sums)
        trained += int(sums[1].item())
        generated += int(sums[1].item())
        done = step >= cfg.steps or (cfg.time_limit > 0 and time.time() - t_start > cfg.time_limit)
        if distributed:
            flag = torch.tensor([int(done)])
            dist.broadcast(flag, 0)
            done = bool(flag.item())
        if rank == 0:
            acc = toy.heldout_accuracy(eval_lm, tok) if (step % cfg.eval_every == 0 or done) else None
            last_acc = acc if acc is not None else last_acc
            step_s = time.perf_counter() - t0
            files.log({
                "step": step, "version": step, "reward": sums[0].item() / max(sums[1].item(), 1),
                "heldout_acc": acc, "loss": m["loss"], "kl_k3": m.get("mismatch_kl_k3"),
                "kl_k1": m.get("mismatch_kl_k1"), "approx_kl": m.get("approx_kl"),
                "clipfrac_low": m.get("clipfrac_low"), "clipfrac_high": m.get("clipfrac_high"),
                "grad_norm": float(gnorm), "staleness_hist": {"0": int(sums[2].item())},
                "tokens_trained": int(sums[2].item()), "tokens_per_s": sums[2].item() / step_s,
                "step_seconds": step_s, "generate_seconds": gen_s, "train_seconds": train_s, "sync_seconds": sync_s,
                "queue_wait_seconds": 0.0, "samples_generated": generated, "samples_trained": trained,
                "wall_seconds": time.time() - t_start, **dict(stats),
            })
            bar.update({"reward": sums[0].item() / max(sums[1].item(), 1), "acc": last_acc})
        if done:
            break
    bar.close()
    if rank == 0:
        summary = {
            "accuracy_before": acc_before, "accuracy_after": last_acc, "wall_seconds": time.time() - t_start,
            "steps": step, "max_staleness": 0, "max_staleness_seen": 0, "samples_generated": generated,
            "samples_trained": trained, "samples_dropped_stale": 0, "rollout": dict(stats),
            "config": dataclasses.asdict(cfg),
        }
        files.write_summary(summary)
        print(f"held-out accuracy before RL: {acc_before:.3f}  after {step} steps: {last_acc:.3f}  "
              f"(+{100 * (last_acc - acc_before):.1f} points, {summary['wall_seconds']:.0f} s)", flush=True)
    loop.close()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
