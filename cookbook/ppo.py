"""Synchronous, colocated PPO with all four roles (DeepSpeed-Chat's contract): actor, critic, frozen reference, and
a learned reward model or a verifier.

    python cookbook/ppo.py --name ppo-demo                                   # CPU demo (one process)
    torchrun --standalone --nproc_per_node 2 cookbook/ppo.py --name ppo-2    # FSDP2 over 2 ranks, an engine on each
    torchrun --nproc_per_node 8 cookbook/ppo.py --model /ckpt --prompts gsm8k.jsonl --reward math

The roles (``ppo_roles.py``), each on every rank, the trained ones FSDP2-sharded: the **actor** (log-probs through
``causal_lm_logprobs``), the **critic** (an HF decoder plus a scalar head: ``V(s_t)`` per response token), the frozen
**reference**, and the **reward** (``--reward rm``: a learned reward model, on the toy task trained first by
``reward_model.py`` and cached; or any reward of ``plumbing/rewards.py``). The rollout engine is a ``TorchEngine`` in
this process (colocated, verl's hybrid loop). One step (the loop in :func:`main` reads as this list):

1. :func:`rollout`: each rank samples ``K`` responses for each of its ``B / world`` prompts; ``build_batch``.
2. ``Scorer.score``: one scalar ``R`` per response.
3. :func:`make_experience` (no grad, before any update): π_old and π_ref log-probs, values ``V_old``; per-token
   rewards ``r_t = −β·(log π_old − log π_ref)_t`` (``--kl-in reward``; else 0) plus ``R`` at the last token; GAE
   (γ, λ) → advantages and returns; advantages whitened over the whole batch (all ranks, :func:`whiten_global`).
4. :func:`ppo_update`: ``--ppo-epochs`` × ``--mini-batches`` updates; per mini-batch the actor's clipped loss
   (``ppo_clip_loss``, + β·``low_var_kl`` with ``--kl-in loss``) and the critic's clipped value loss
   (``value_loss``), each aggregated with the mini-batch's global token count and stepped by its own optimiser.
5. :func:`weights_to_engine`: ``full_tensors`` → ``engine.update_weights(version=step)``.

Held-out evaluation: pass@k and mean@k of ``--eval-reward`` every ``--eval-every`` steps and before and after RL.
Files: ``runs/<name>/`` as the GRPO loops write them. ``--resume`` continues from the last checkpoint; on CPU the
resumed run ends with the weights of an uninterrupted run of the seed, to the bit. Lines a user changes for a real
model or task say ``REAL MODEL:``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import time
from collections import Counter
from dataclasses import dataclass

import torch
import toy
from jaxtyping import Bool, Float
from plumbing import (
    Progress,
    RunFiles,
    Task,
    TaskFlags,
    all_reduce,
    broadcast_flag,
    check_at_least,
    check_fits,
    check_max_model_len,
    check_task_flags,
    close_dist,
    eval_metrics,
    eval_reward_spec,
    every,
    heldout,
    heldout_figures,
    load_task,
    make_engine,
    mean_metrics,
    needs_reference,
    opt,
    parse_flags,
    parse_log_flag,
    prompts_per_rank,
    rank0_first,
    resolve_max_model_len,
    restore_rng,
    resume_run,
    save_policy,
    seed_rank,
    setup_dist,
)
from ppo_roles import (
    experience_stats,
    load_actor,
    load_critic,
    load_reference,
    memory_bytes,
    restore_roles,
    reward_roles,
    save_roles,
)
from reward_model import reward_model_for
from torch import Tensor, nn

from rlblocks.errors import ArgumentError
from rlblocks.losses import aggregate, gae, kl_estimate, ppo_clip_loss, value_loss
from rlblocks.rollout import GenerationRequest, RolloutBatch, SamplingParams, build_batch
from rlblocks.rollout.engines import TorchEngine
from rlblocks.sync import full_tensors


@dataclass
class Config(TaskFlags):
    """Synchronous colocated PPO: actor, critic, frozen reference, reward model or verifier (flags from these
    fields; the data, reward, evaluation and --log-to flags every loop shares come from plumbing's TaskFlags)."""

    name: str = opt("ppo", "run name: files go to <runs-dir>/<name>/")
    runs_dir: str = opt("runs", "where run directories (and the cached warm start and reward model) live")
    model: str = opt("", "actor and reference: an HF causal-LM checkpoint; empty: the tiny CPU demo model, "
                         "warm-started and cached")
    critic_model: str = opt("", "the critic's initial decoder (any HF checkpoint of the actor's width); empty: the "
                                "actor's checkpoint, as verl does (DeepSpeed-Chat starts it from the reward model)")
    reward: str = opt("rm", "rm: a learned reward model (--reward-model; on the toy task trained here first); "
                            "verifier: exact match; math: math_reward; code: code_reward; module:function or "
                            "file.py:function: your fn(sample) -> float | RewardResult")
    reward_model: str = opt("", "--reward rm: an HF sequence-classification checkpoint (scores are standardised "
                                "with the mean and std in its reward_stats.json when there is one); empty: trained "
                                "here on the toy task, then cached")
    rm_steps: int = opt(8000, "reward-model stage: Bradley–Terry steps (batches of --rm-batch pairs)")
    rm_batch: int = opt(64, "reward-model stage: pairs per step")
    rm_lr: float = opt(1e-3, "reward-model stage: AdamW learning rate")
    rm_lm_coef: float = opt(1.0, "reward-model stage: weight of the next-token loss on the accepted completions")
    rm_samples: int = opt(4, "reward-model stage: completions sampled from the initial actor per prompt")
    max_model_len: int = opt(0, "prompt + response positions of the engine's KV cache; 0: the model's own positions")
    steps: int = opt(500, "PPO steps (= policy versions); a step count, so the result does not depend on how "
                          "loaded the machine is")
    time_limit: float = opt(0.0, "also stop after this many seconds of RL (0: no limit)")
    prompts_per_step: int = opt(64, "B: prompts per step (global)")
    group_size: int = opt(4, "K: responses sampled per prompt")
    gamma: float = opt(1.0, "GAE discount γ")
    lam: float = opt(0.95, "GAE λ")
    whiten_advantages: bool = opt(True, "whiten the advantages over the whole batch (mean 0, std 1)")
    eps_low: float = opt(0.2, "actor clip offset below 1 (ratio ≥ 1 − eps_low)")
    eps_high: float = opt(0.2, "actor clip offset above 1 (ratio ≤ 1 + eps_high)")
    value_clip: float = opt(0.2, "critic clip: V within V_old ± this (negative: no clipping)")
    ppo_epochs: int = opt(2, "passes over each batch (π_old, V_old fixed before the first)")
    mini_batches: int = opt(2, "optimizer updates per pass, each on a random 1/mini_batches of the batch's samples")
    kl_coef: float = opt(0.3, "β of the KL to the frozen reference (0: no reference model)")
    kl_in: str = opt("reward", "reward: −β·k1 per token in the reward (DeepSpeed-Chat, verl); loss: "
                               "+β·low_var_kl in the actor loss (verl's use_kl_loss)", ("reward", "loss"))
    agg: str = opt("token-mean", "loss aggregation mode of both losses (global normalisers)")
    lr: float = opt(2e-4, "actor AdamW learning rate")
    critic_lr: float = opt(1e-3, "critic AdamW learning rate")
    lr_decay: bool = opt(True, "decay both learning rates linearly to 10% over --steps")
    grad_clip: float = opt(1.0, "max grad norm (each model)")
    temperature: float = opt(1.0, "sampling temperature (log-probs use the same)")
    prefix_share: bool = opt(True, "actor, reference and critic forward over the prefix tree of each batch: a "
                             "group's prompt is forwarded once (same outputs and gradients up to float rounding)")
    max_new_tokens: int = opt(6, "response budget")
    eval_every: int = opt(25, "held-out greedy accuracy every N steps, and before and after RL (0: only before "
                              "and after)")
    save_every: int = opt(0, "checkpoint every N steps (0: at the end only)")
    resume: bool = opt(False, "continue from runs/<name>/ckpt.pt (a torchrun restart does so by itself)")
    seed: int = opt(0, "seed")
    quiet: bool = opt(False, "no progress line")


def check_flags(cfg: Config) -> None:
    """Flag combinations that cannot work (raised before anything starts)."""
    check_at_least(cfg, 1, "ppo_epochs", "mini_batches", "steps", "prompts_per_step", "group_size", "max_new_tokens",
                   "rm_steps", "rm_batch", "rm_samples")
    check_at_least(cfg, 0, "eval_every", "save_every")
    for name in ("gamma", "lam"):
        if not 0.0 <= getattr(cfg, name) <= 1.0:
            raise ArgumentError(f"--{name}: expected a value in [0, 1], got {getattr(cfg, name)}")
    if cfg.kl_coef < 0:
        raise ArgumentError(f"--kl-coef: expected >= 0, got {cfg.kl_coef}")
    check_max_model_len(cfg.max_model_len)
    check_task_flags(cfg, rm_built_here=not cfg.prompts)  # the reward-model stage trains one for the toy task


# ================================================================================================ one PPO step
def rollout(cfg: Config, engine: TorchEngine, tok, task: Task, rng: random.Random, n_prompts: int,
            step: int, rank: int, loop: asyncio.AbstractEventLoop, device: torch.device):
    """``n_prompts`` prompts × ``K`` samples from the colocated engine. Returns ``(batch, prompts per row,
    output ids per row)``; ``group_ids`` mark the rows of one prompt."""
    sp = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                        stop_token_ids=(tok.eos_token_id,))
    items = [task.draw(rng) for _ in range(n_prompts)]
    reqs = [GenerationRequest(f"s{step}-r{rank}-{i}/{k}", list(p.ids), sp) for i, p in enumerate(items)
            for k in range(cfg.group_size)]

    async def gen():
        return await asyncio.gather(*[engine.generate(r) for r in reqs])

    gens = loop.run_until_complete(gen())
    rows = [p for p in items for _ in range(cfg.group_size)]
    group_ids = [i for i in range(n_prompts) for _ in range(cfg.group_size)]
    batch = build_batch(gens, pad_id=tok.pad_token_id, group_ids=group_ids, device=device)
    return batch, rows, [list(g.output_ids) for g in gens]


def whiten_global(x: Float[Tensor, "B T"], mask: Bool[Tensor, "B T"], eps: float = 1e-8) -> Float[Tensor, "B T"]:
    """``(x − μ)·rsqrt(σ² + eps)`` with μ and the unbiased σ² of the valid entries of the WHOLE batch (the sums are
    all-reduced over the ranks): ``rlblocks.losses.whiten``'s formula, which uses one rank's entries only.
    0 at masked positions."""
    xs = torch.where(mask, x, 0.0)
    s = all_reduce(torch.stack([mask.sum().to(x.dtype), xs.sum(), (xs * xs).sum()]).to(torch.float64))
    n, mean = s[0], s[1] / s[0].clamp(min=1)
    var = (s[2] - n * mean * mean) / (n - 1).clamp(min=1)
    return torch.where(mask, (xs - mean.to(x.dtype)) * torch.rsqrt(var.to(x.dtype) + eps), 0.0)


@dataclass
class Experience:
    """Everything fixed before the first update of a step (no grad): the batch, ``old_logp`` (π_old),
    ``ref_logp`` (π_ref, or None), ``old_values`` (V_old), the per-token ``rewards`` that went into GAE, the
    ``advantages`` (whitened when asked) and the ``returns`` (``A + V_old``, before whitening), all ``[B, T]``;
    ``scores`` ``[B]`` is the reward role's ``R``."""

    batch: RolloutBatch
    old_logp: Float[Tensor, "B T"]
    ref_logp: Float[Tensor, "B T"] | None
    old_values: Float[Tensor, "B T"]
    rewards: Float[Tensor, "B T"]
    advantages: Float[Tensor, "B T"]
    returns: Float[Tensor, "B T"]
    scores: Float[Tensor, " B"]


@torch.no_grad()
def make_experience(cfg: Config, actor: nn.Module, critic: nn.Module, ref: nn.Module | None, batch: RolloutBatch,
                    scores: Float[Tensor, " B"]) -> Experience:
    """π_old, π_ref and V_old on the batch, token rewards, GAE and whitening.

    ``r_t = −β·(log π_old − log π_ref)_t`` on every response token with ``--kl-in reward`` (k1, as DeepSpeed-Chat
    and verl put it in the reward; 0 with ``--kl-in loss``, where the KL goes into the actor loss instead), plus the
    score ``R`` on the row's last response token. ``gae(r, V_old, mask, γ, λ)`` gives ``A`` and ``returns = A +
    V_old``; ``A`` is whitened over the valid tokens of the whole batch."""
    ids, plens, mask = batch.input_ids, batch.prompt_lens, batch.loss_mask
    old_logp = actor(ids, plens, batch.response_mask)
    old_values = critic(ids, plens, batch.response_mask)
    ref_logp = ref(ids, plens, batch.response_mask) if ref is not None else None
    rewards = torch.zeros_like(old_logp)
    if ref_logp is not None and cfg.kl_in == "reward":
        rewards = torch.where(mask, -cfg.kl_coef * kl_estimate(old_logp, ref_logp, kind="k1", mask=mask), 0.0)
    lengths = mask.sum(-1)
    last = (lengths - 1).clamp(min=0)
    # a row without a trained token (none here: every prompt leaves room for one) would add its score nowhere
    rewards = rewards.scatter_add(1, last[:, None], torch.where(lengths > 0, scores, 0.0)[:, None].to(rewards.dtype))
    advantages, returns = gae(rewards, old_values, mask, gamma=cfg.gamma, lam=cfg.lam)
    if cfg.whiten_advantages:
        advantages = whiten_global(advantages, mask)
    return Experience(batch, old_logp, ref_logp, old_values, rewards, advantages, returns, scores)


def ppo_update(cfg: Config, actor: nn.Module, critic: nn.Module, actor_opt: torch.optim.Optimizer,
               critic_opt: torch.optim.Optimizer, exp: Experience, *, grad_scale: float = 1.0,
               step: int = 0) -> dict[str, float]:
    """``--ppo-epochs`` passes, each over ``--mini-batches`` random splits of this rank's samples; per mini-batch
    one actor update and one critic update. Returns the metrics averaged over the updates.

    Actor: ``ppo_clip_loss(logp, old_logp, A, mask, eps_low, eps_high)`` (ratio ``exp(logp − old_logp)``, clip
    offsets from 1), ``+ β·low_var_kl(logp ‖ ref_logp)`` per token with ``--kl-in loss``. Critic: ``value_loss(V,
    V_old, returns, mask, clip=value_clip)`` = ``½·max((V − R)², (clip(V, V_old ± c) − R)²)``. Each is
    ``aggregate``d with the mini-batch's token count over all ranks, scaled by ``grad_scale`` (FSDP averages
    gradients over the ranks), clipped to ``--grad-clip`` and stepped by its own optimiser."""
    b = exp.batch
    mask = b.loss_mask
    shuffle = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    records: list[dict[str, Tensor]] = []
    for _epoch in range(cfg.ppo_epochs):
        order = torch.randperm(mask.shape[0], generator=shuffle).to(mask.device)
        for rows in order.tensor_split(cfg.mini_batches):
            m_mask = mask[rows]
            # the mini-batch's tokens over all ranks (float64: exact): the ranks' losses add up to the mini-batch's
            n_tokens = all_reduce(m_mask.sum().to(torch.float64)).to(torch.float32)
            args = (b.input_ids[rows], b.prompt_lens[rows], b.response_mask[rows])
            # ---- actor
            logp = actor(*args)
            pg, m = ppo_clip_loss(logp, exp.old_logp[rows], exp.advantages[rows], m_mask, eps_low=cfg.eps_low,
                                  eps_high=cfg.eps_high)
            if exp.ref_logp is not None and cfg.kl_in == "loss":
                kl = kl_estimate(logp, exp.ref_logp[rows], kind="low_var_kl", mask=m_mask)
                pg = pg + cfg.kl_coef * kl
                m["kl_loss"] = torch.where(m_mask, kl, 0.0).sum() / m_mask.sum().clamp(min=1)
            loss = aggregate(pg, m_mask, mode=cfg.agg, num_tokens=n_tokens)
            actor_opt.zero_grad(set_to_none=True)
            (loss * grad_scale).backward()
            m["grad_norm"] = torch.nn.utils.clip_grad_norm_(actor.parameters(), cfg.grad_clip)
            actor_opt.step()
            m["loss"] = loss.detach()
            # ---- critic
            values = critic(*args)
            vl, vm = value_loss(values, exp.old_values[rows], exp.returns[rows], m_mask,
                                clip=cfg.value_clip if cfg.value_clip >= 0 else None)
            vloss = aggregate(vl, m_mask, mode=cfg.agg, num_tokens=n_tokens)
            critic_opt.zero_grad(set_to_none=True)
            (vloss * grad_scale).backward()
            m["critic_grad_norm"] = torch.nn.utils.clip_grad_norm_(critic.parameters(), cfg.grad_clip)
            critic_opt.step()
            m.update(vm)
            m["value_loss"] = vloss.detach()
            records.append({k: v.detach() for k, v in m.items()})
    return {**mean_metrics(records), "ppo_updates": len(records)}


def weights_to_engine(actor: nn.Module, engine: TorchEngine, version: int, loop: asyncio.AbstractEventLoop) -> float:
    """Gather the actor's full weights (an FSDP collective) and load them into this rank's engine."""
    t0 = time.perf_counter()
    tensors = [(n.removeprefix("lm."), t) for n, t in full_tensors(actor)]
    loop.run_until_complete(engine.update_weights(tensors, version=version))
    return time.perf_counter() - t0


# ================================================================================================ main
def main(argv: list[str] | None = None) -> None:
    cfg = parse_flags(Config, argv, check=check_flags)
    rank, world, device = setup_dist()
    n_local = prompts_per_rank(cfg, world)
    rng = random.Random(cfg.seed * 1000 + rank)
    files = RunFiles(cfg.runs_dir, cfg.name, sinks=parse_log_flag(cfg.log_to), config=cfg)
    say = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)

    # ---- checkpoints: the actor's (warm start), the reward model's (reward_model.py's stage, --reward rm)
    path = cfg.model or rank0_first(rank, lambda: toy.warm_start(os.path.join(cfg.runs_dir, "warmstart"), log=say))
    rm_path, rm_stats = reward_model_for(cfg, path, rank, device, log=say)
    seed_rank(cfg.seed, rank)  # after the cached stages (they seed and draw when built); the engine's seeds too

    # ---- roles: actor, critic, reference, reward; the engine in this process
    tok, actor = load_actor(path, device, cfg.temperature, cfg.prefix_share)
    max_model_len = resolve_max_model_len(cfg.max_model_len, path)
    eval_spec = eval_reward_spec(cfg)
    task = (load_task(tok, cfg, needs_reference=needs_reference(cfg.reward, eval_spec)) if cfg.prompts
            else toy.task(tok))
    check_fits(task, max_model_len)
    loop = asyncio.new_event_loop()  # the engine binds to the loop that first drives it: always this one
    engine = make_engine("torch", path, device, max_model_len=max_model_len, inline_steps=device.type == "cpu")
    critic = load_critic(cfg.critic_model or path, device, cfg.prefix_share)
    ref = load_reference(path, device, cfg.temperature, cfg.prefix_share) if cfg.kl_coef > 0 else None
    scorer, checker = reward_roles(cfg, tok, eval_spec, rm_path, device)  # checker: --eval-reward
    # ---- fresh run, or resume: weights, the engine's version, sharding, both optimizers and their states
    rec = resume_run(files, cfg, rank=rank, world=world,
                     required=("step", "model", "critic", "actor_optim", "critic_optim", "rng", "config"))
    actor, critic, ref, actor_opt, critic_opt = restore_roles(cfg, rec, actor, critic, ref, engine, world, loop)

    def evaluate(step: int):  # rank 0: the engine holds the current weights, unsharded
        result = loop.run_until_complete(heldout(engine, task.heldout, checker, tok, cfg,
                                                 max_new_tokens=cfg.max_new_tokens, tag=f"eval{step}"))
        files.write_eval(step, result)
        return result

    # the summary's figures so far (a resumed run's from its checkpoint), the counters
    totals, t_start = Counter(), time.time()
    if rec.state is None:
        ev = evaluate(0) if rank == 0 else None
        before = (ev.mean_at_k, heldout_figures(ev)) if ev is not None else (0.0, None)
        figures = {"accuracy_before": before[0], "accuracy_after": before[0], "heldout_before": before[1],
                   "heldout_after": before[1], "memory_bytes_per_rank": {}}
    else:
        totals.update(rec.state["totals"])
        checker.load_state_dict(rec.state["checker"])  # the held-out reward's counters of the run so far
        figures = dict(rec.state["summary"])
        t_start -= figures.pop("wall_seconds")
    say(f"held-out accuracy before RL: {figures['accuracy_before']:.3f} ({len(task.heldout)} prompts, "
        f"{task.heldout_source})")

    def save_checkpoint(steps_done: int) -> None:
        extra = {"totals": dict(totals), "checker": checker.state_dict(),
                 "summary": {**figures, "wall_seconds": time.time() - t_start}}
        save_roles(files, cfg, actor, critic, actor_opt, critic_opt, steps_done, world, rank, rng, extra)

    steps_done = rec.step
    bar = Progress(cfg.steps, rec.step, enabled=rank == 0 and not cfg.quiet, desc="ppo")
    restore_rng(rec, rank, {"data": rng})  # last before the first step: set-up draws nothing after this
    for step in range(rec.step, cfg.steps):
        t0 = time.perf_counter()
        frac = max(0.1, 1.0 - 0.9 * min(step / cfg.steps, 1.0)) if cfg.lr_decay else 1.0  # --lr-decay: to 10%
        for optim, base in ((actor_opt, cfg.lr), (critic_opt, cfg.critic_lr)):
            for pg in optim.param_groups:
                pg["lr"] = base * frac
        # ---- 1-2. rollout and reward
        batch, prompts, outputs = rollout(cfg, engine, tok, task, rng, n_local, step, rank, loop, device)
        gen_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        failures_before = scorer.failures
        scores, keep = scorer.score(batch, prompts, outputs, loop, cfg.group_size)
        # a group whose reward failed (retries ran out) is failed whole: its rows are not trained, never scored 0
        batch.loss_mask = batch.loss_mask & keep[:, None]
        checked = scores if checker is scorer.verifier else torch.tensor(  # a failed check counts as wrong here
            loop.run_until_complete(checker.scores(prompts, outputs))[0], device=device)
        reward_s = time.perf_counter() - t1
        # ---- 3-4. experience, then PPO epochs × mini-batches on the actor and the critic
        t2 = time.perf_counter()
        exp = make_experience(cfg, actor, critic, ref, batch, scores)
        m = ppo_update(cfg, actor, critic, actor_opt, critic_opt, exp, grad_scale=float(world), step=step)
        train_s = time.perf_counter() - t2
        if step == 0:  # bytes per role, with the grads and optimiser states of a real update still held
            figures["memory_bytes_per_rank"] = memory_bytes(actor, actor_opt, critic, critic_opt, ref, scorer, engine)
        # ---- 5. weights into the colocated engine (version = step + 1)
        sync_s = weights_to_engine(actor, engine, step + 1, loop)
        st = experience_stats(exp, checked)
        failed = int(all_reduce(torch.tensor(float(scorer.failures - failures_before), dtype=torch.float64)))
        totals.update({"samples_generated": st["samples"], "samples_trained": st["samples_trained"],
                       "samples_failed_reward": st["samples"] - st["samples_trained"],
                       "tokens_trained": st["tokens"], "reward_failures": failed})
        done = step + 1 >= cfg.steps or (cfg.time_limit > 0 and time.time() - t_start > cfg.time_limit)
        done = broadcast_flag(done, device=device)  # rank 0's clock decides for every rank
        if rank == 0:
            result = evaluate(step + 1) if (every(step + 1, cfg.eval_every) or done) else None
            if result is not None:
                figures["accuracy_after"], figures["heldout_after"] = result.mean_at_k, heldout_figures(result)
            step_s = time.perf_counter() - t0
            files.log({
                "step": step + 1, "version": step + 1, "reward": st["score"], "reward_failures": failed,
                "train_accuracy": st["train_accuracy"], **eval_metrics(result),
                **{k: v for k, v in st.items() if k not in ("score", "train_accuracy")}, **m,
                "staleness_hist": {"0": st["tokens"]}, "tokens_trained": st["tokens"],
                "tokens_per_s": st["tokens"] / step_s, "step_seconds": step_s, "generate_seconds": gen_s,
                "reward_seconds": reward_s, "train_seconds": train_s, "sync_seconds": sync_s,
                "queue_wait_seconds": 0.0, "lr": actor_opt.param_groups[0]["lr"],
                "samples_generated": totals["samples_generated"], "samples_trained": totals["samples_trained"],
                "samples_failed_reward": totals["samples_failed_reward"], "wall_seconds": time.time() - t_start,
            })
            bar.update({"score": st["score"], "train_acc": st["train_accuracy"], "acc": figures["accuracy_after"],
                        "clipfrac": m["clipfrac"], "vf_mse": m["vf_mse"]})
        steps_done = step + 1
        if every(step + 1, cfg.save_every) or done:
            save_checkpoint(steps_done)
        if done:
            break
    bar.close()
    saved = save_policy(cfg, tok, actor.lm, policy=actor, world=world, rank=rank, base=path, log=say)  # --save-hf
    if rank == 0:
        summary = {
            **figures, "wall_seconds": time.time() - t_start, "cpu_seconds": time.process_time(),
            "steps": steps_done, "max_staleness": 0, "max_staleness_seen": 0, "saved_hf": saved,
            "samples_generated": totals["samples_generated"], "samples_trained": totals["samples_trained"],
            "samples_dropped_stale": 0, "samples_failed_reward": totals["samples_failed_reward"],
            "groups_failed_reward": totals["samples_failed_reward"] // cfg.group_size, "rollout": dict(totals),
            "world_size": world, "reward_model": {"path": rm_path, **rm_stats} if cfg.reward == "rm" else None,
            "reward_failures": totals["reward_failures"], "eval_reward": checker.stats(),
            "config": dataclasses.asdict(cfg), "task": task.source, "heldout_prompts": len(task.heldout),
            **rec.summary(),
        }
        files.write_summary(summary)
        gain = figures["accuracy_after"] - figures["accuracy_before"]
        say(f"held-out accuracy before RL: {figures['accuracy_before']:.3f}  after {steps_done} steps: "
            f"{figures['accuracy_after']:.3f}  ({100 * gain:+.1f} points, {summary['wall_seconds']:.0f} s)")
    loop.run_until_complete(engine.aclose())  # close() from the engine's own loop, its step task awaited
    scorer.close()
    if checker is not scorer.verifier:
        checker.close()
    loop.close()
    files.close()
    close_dist()


if __name__ == "__main__":
    main()
