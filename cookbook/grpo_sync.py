"""Synchronous, colocated GRPO (verl's hybrid loop): generate → score → advantages → train → push weights → repeat.

    python cookbook/grpo_sync.py --name sync-demo                       # CPU demo, one process
    torchrun --nproc_per_node 8 cookbook/grpo_sync.py --model /ckpt     # FSDP2 over 8 ranks, engine on each rank
    torchrun --nproc_per_node 8 cookbook/grpo_sync.py --model /ckpt --cp 4   # long traces: 2 DP × 4 CP ranks

Every rank holds the policy (FSDP2 ``fully_shard`` when there is more than one rank) and an in-process rollout
engine (``--engine torch|vllm``; ``sglang`` drives a server you started next to the trainer). Each step, each rank
generates its share of the ``B`` prompt groups (``K`` samples each) of the task (the toy additions, or
``--prompts``), scores them (``--reward``), and runs
``grpo_step`` (``cookbook/grpo.py``, the update ``grpo_async.py`` runs too): GRPO advantages, π_old once, then
``--ppo-epochs`` × ``--mini-batches`` optimizer updates with ``linear_token_logprobs`` log-probs and globally
normalised aggregation. With ``--cp N`` the trainer ranks form DP × CP groups: the N ranks of a CP group each
generate part of one data-parallel share, exchange it, and train on all of it, each forwarding a zigzag shard of
every sequence (ring attention across the group; ``causal_lm_logprobs(..., cp_group=)``), so a long trace's
activations are split N ways. It then gathers the new weights (``full_tensors``) and loads them into its engine
(``update_weights``, version = step). Every trained token was
sampled by the weights of the step's start (``max_staleness_seen`` is 0); the only train/rollout gap is numerical
(``--correction`` handles it).

Held-out evaluation (``plumbing/evaluation.py``): ``--eval-k`` samples per held-out prompt on the colocated engine,
pass@k and mean@k, every ``--eval-every`` steps and before and after RL.

Files: ``runs/<name>/metrics.jsonl`` (one line per step; TensorBoard / W&B with ``--log-to``), ``summary.json``,
``eval/`` (per-prompt held-out results) and ``ckpt.pt``, as ``grpo_async.py`` writes them; ``--save-hf DIR``
writes the trained policy as an HF directory (``--lora-rank``: merged, or the adapter with ``--save-lora adapter``).
``--resume`` (or a ``torchrun --max-restarts`` restart) continues from the last checkpoint; on CPU with the
TorchEngine the resumed run ends with the weights an uninterrupted run of the seed ends with, to the bit (the
checkpoint holds the weights, the optimizer, every rank's RNG states, the data sampler's and the counters).
Lines a user changes for a real model or task are marked ``REAL MODEL:``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import time
from collections import Counter
from dataclasses import dataclass

import distill
import torch
import toy
from grpo import grpo_step
from plumbing import (
    EngineFlags,
    PolicyLogprobs,
    Progress,
    Reward,
    RunFiles,
    TaskFlags,
    all_reduce,
    apply_lora,
    batch_tensors,
    broadcast_flag,
    check_at_least,
    check_engine_flags,
    check_fits,
    check_loss_flags,
    check_max_model_len,
    check_task_flags,
    close_dist,
    decoder_layers,
    eval_metrics,
    eval_reward_spec,
    every,
    gather_cp,
    group_record,
    heldout,
    heldout_figures,
    length_budget,
    load_hf,
    load_model_state,
    load_optim_state,
    load_task,
    make_engine,
    merged_tensors,
    model_state,
    needs_reference,
    on_model,
    opt,
    optim_state,
    parse_flags,
    parse_log_flag,
    prompts_per_rank,
    rank0_first,
    resolve_engine_dtype,
    resolve_max_model_len,
    restore_rng,
    resume_run,
    save_policy,
    save_run_checkpoint,
    seed_rank,
    setup_dist,
    shard,
    trainer_groups,
    until_eos,
)
from plumbing.losses import LossFlags

from rlblocks.errors import ArgumentError
from rlblocks.rollout import GenerationRequest, SamplingParams, resumable_generate
from rlblocks.sync import full_tensors


@dataclass
class Config(TaskFlags, EngineFlags, LossFlags):
    """Synchronous colocated GRPO (flags are generated from these fields; the data, reward, evaluation and --log-to
    flags every loop shares come from plumbing's TaskFlags, the policy-loss flags from LossFlags)."""

    name: str = opt("sync", "run name: files go to <runs-dir>/<name>/")
    runs_dir: str = opt("runs", "where run directories live")
    model: str = opt("", "HF checkpoint directory; empty: the tiny CPU demo model, warm-started and cached")
    engine: str = opt("torch", "rollout engine (in this process; sglang: a server next to it)",
                      ("torch", "vllm", "sglang"))
    sglang_url: str = opt("http://127.0.0.1:30000", "SGLang server base URL (--engine sglang)")
    max_model_len: int = opt(0, "prompt + response positions the engine's KV cache is sized for; 0: the model's "
                                "own positions (a real model: set it to your prompt + response budget)")
    steps: int = opt(200, "optimizer steps (= policy versions); a step count, so the result does not depend on how "
                          "loaded the machine is")
    time_limit: float = opt(0.0, "also stop after this many seconds of RL (0: no limit)")
    prompts_per_step: int = opt(64, "B: prompt groups per step (global)")
    group_size: int = opt(8, "K: samples per prompt")
    ppo_epochs: int = opt(1, "passes over each batch (π_old fixed at the first; > 1 makes ratios move and clip)")
    mini_batches: int = opt(1, "optimizer updates per pass, each on a random 1/mini_batches of the batch's samples")
    agg: str = opt("token-mean", "loss aggregation mode (global normalisers)")
    kl_coef: float = opt(0.0, "k3 KL penalty to the initial policy (0: no reference model)")
    lora_rank: int = opt(0, "LoRA adapters of this rank (alpha = 2·rank) on every linear layer of the decoder, the "
                            "base frozen; the engine gets the merged weights; 0: full fine-tuning (one rank only "
                            "with LoRA)")
    lr: float = opt(3e-4, "AdamW learning rate")
    grad_clip: float = opt(1.0, "max grad norm")
    temperature: float = opt(1.0, "sampling temperature (log-probs use the same)")
    prefix_share: bool = opt(True, "trainer forward over the prefix tree of each batch: a group's prompt is "
                             "forwarded once (same log-probs and gradients up to float rounding)")
    max_new_tokens: int = opt(6, "response budget")
    length_tail: float = opt(0.0, "benchmark: >0 forces lognormal response lengths with this median (p99/p50≈10)")
    eval_every: int = opt(10, "held-out greedy accuracy every N steps, and before and after RL (0: only before "
                              "and after)")
    save_every: int = opt(20, "checkpoint every N steps, and after the last (0: after the last only)")
    resume: bool = opt(False, "continue from runs/<name>/ckpt.pt (a torchrun restart does so by itself)")
    seed: int = opt(0, "seed")
    quiet: bool = opt(False, "no progress bar")
    cp: int = opt(1, "context-parallel ranks per sequence (ranks = DP × CP): each sequence's positions are split over "
                     "CP ranks with ring attention, for traces too long for one device's activations; 1: off")
    # on-policy distillation (cookbook/distill.py): the same loop, with a frozen teacher scoring the student's samples
    distill_from: str = opt("", "teacher checkpoint: an HF directory, or a run directory / ckpt.pt (weights loaded "
                                "into the student's architecture); empty: plain GRPO")
    distill_mode: str = opt("sampled", "sampled: advantage = teacher_logp − student_logp per sampled token; dense: "
                                       "exact reverse KL over the vocabulary (one rank)", distill.MODES)
    distill_reward_weight: float = opt(0.0, "add this × the GRPO task advantage (sampled) or policy loss (dense)")
    distill_discount: float = opt(0.0, "sampled: discount γ of the future reverse KL credited to a token (0: none)")


def check_flags(cfg: Config) -> None:
    """Flag combinations that cannot work (raised before anything starts)."""
    check_engine_flags(cfg)  # first: resolves --correction auto
    check_loss_flags(cfg)
    check_task_flags(cfg)
    distill.check_distill_flags(cfg)
    check_max_model_len(cfg.max_model_len)
    check_at_least(cfg, 0, "eval_every", "save_every")
    check_at_least(cfg, 1, "cp")
    check_at_least(cfg, 0, "lora_rank")
    if cfg.lora_rank and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ArgumentError(f"--lora-rank: supported with one rank here (no FSDP2 of peft modules), got "
                            f"--lora-rank {cfg.lora_rank} with {os.environ['WORLD_SIZE']} ranks")
    if cfg.cp > 1 and cfg.distill_from:
        raise ArgumentError("--cp: context parallelism covers the policy and the reference, not the --distill-from "
                            f"teacher; got --cp {cfg.cp} with --distill-from")


# ================================================================================================ rollout
async def rollout_step(cfg: Config, engine, tok, task, reward, rng: random.Random, n_groups: int, rank: int,
                       step: int, max_model_len: int, counters: Counter) -> list[dict]:
    """Generate ``n_groups`` prompt groups of ``group_size`` samples with the colocated engine and score them;
    ``counters`` gets the samples and tokens generated, the engine resubmissions, the failed reward calls and the
    groups failed whole for them (``groups_failed_reward``, ``samples_failed_reward``: in the batch, never trained)."""

    async def one_group(i: int) -> dict:
        item = task.draw(rng)  # a Prompt: the toy task's, or a --prompts row (ids through the chat template)
        prompt = list(item.ids)
        stop = (tok.eos_token_id,) if cfg.length_tail <= 0 else ()
        budget = length_budget(cfg.max_new_tokens, cfg.length_tail, max_model_len - len(prompt), rng)
        sp = SamplingParams(temperature=cfg.temperature, max_new_tokens=budget, stop_token_ids=stop)
        uid = f"s{step}-r{rank}-{i}"
        gens = await asyncio.gather(
            *[resumable_generate(engine, GenerationRequest(f"{uid}/{k}", prompt, sp)) for k in range(cfg.group_size)]
        )
        counters["samples_generated"] += len(gens)
        counters["tokens_generated"] += sum(len(g.output_ids) for g in gens)
        counters["resubmissions"] += sum(g.num_submissions - 1 for g in gens)
        rewards, keep, failed = await reward.group_scores(
            [item] * len(gens), [until_eos(g.output_ids, tok.eos_token_id) for g in gens], len(gens))
        counters["reward_failures"] += failed
        rec = group_record(uid, item.metadata.get("pair", item.text), prompt, gens, rewards, rank)
        if not keep[0]:  # a reward call's retries ran out: the group is failed whole (batch_tensors trains none of it)
            rec["reward_failed"] = True
            counters["groups_failed_reward"] += 1
            counters["samples_failed_reward"] += len(gens)
        return rec

    return list(await asyncio.gather(*[one_group(i) for i in range(n_groups)]))


# ================================================================================================ main
def main(argv: list[str] | None = None) -> None:
    cfg = parse_flags(Config, argv, check=check_flags)
    rank, world, device = setup_dist()
    n_local = prompts_per_rank(cfg, world)  # prompt groups this rank generates
    tg = trainer_groups(range(world), cfg.cp, rank)  # DP × CP; a CP group trains on what its ranks generated
    rng = random.Random(cfg.seed * 1000 + rank)
    files = RunFiles(cfg.runs_dir, cfg.name, sinks=parse_log_flag(cfg.log_to), config=cfg)
    say = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)

    # ---- set-up: checkpoint, policy (FSDP2 over the ranks), engine in this process, reference, optimiser
    path = cfg.model or rank0_first(rank, lambda: toy.warm_start(os.path.join(cfg.runs_dir, "warmstart"), log=say))
    seed_rank(cfg.seed, rank)  # after the warm start (it seeds and draws when not cached); the engine's seeds too
    max_model_len = resolve_max_model_len(cfg.max_model_len, path)
    tok, lm = load_hf(path, device)
    # ---- the task (the toy additions, or --prompts) and its rewards: training, held-out
    task = (load_task(tok, cfg, needs_reference=needs_reference(cfg.reward, eval_reward_spec(cfg)))
            if cfg.prompts else toy.task(tok))
    check_fits(task, max_model_len)
    reward = Reward(cfg.reward, tok, reward_model=cfg.reward_model, device=device, timeout=cfg.reward_timeout)
    spec = eval_reward_spec(cfg)
    eval_reward = reward if spec == cfg.reward else Reward(spec, tok, reward_model=cfg.reward_model, device=device,
                                                           timeout=cfg.reward_timeout)
    loop = asyncio.new_event_loop()  # the engine is created in, and always driven by, this loop

    async def start_engine():
        return make_engine(cfg.engine, path, device, max_model_len=max_model_len, max_staleness=0,
                           sglang_url=cfg.sglang_url, dtype=resolve_engine_dtype(cfg),
                           kv_cache_mb=cfg.kv_cache_mb, inline_steps=device.type == "cpu")  # 1 OpenMP team

    engine = loop.run_until_complete(start_engine())
    # ---- LoRA (--lora-rank): adapters wrapped into lm in place, the base frozen; the engine gets merged weights
    peft_model = apply_lora(lm, cfg.lora_rank) if cfg.lora_rank else None
    # ---- fresh run, or resume: the weights (before sharding) and the engine at the checkpoint's version
    rec = resume_run(files, cfg, rank=rank, world=world)
    if rec.state is not None:
        load_model_state(lm, rec.state["model"])
        weights = merged_tensors(peft_model) if peft_model is not None else list(rec.state["model"].items())
        loop.run_until_complete(engine.update_weights(weights, version=rec.step))
    policy = PolicyLogprobs(lm, cfg.temperature, cfg.prefix_share, cp_group=tg.cp)
    shard(policy, decoder_layers(lm), world)
    ref = None
    if cfg.kl_coef > 0:
        ref = PolicyLogprobs(load_hf(path, device)[1].eval(), cfg.temperature, cfg.prefix_share,
                             cp_group=tg.cp).requires_grad_(False)
    teacher = (distill.load_teacher(cfg.distill_from, path, device, world=world, mode=cfg.distill_mode)
               if cfg.distill_from else None)
    optim = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
    counters = Counter()  # this rank's rollout counters: samples / tokens generated, resubmissions, reward failures
    totals = Counter()  # all ranks: samples and tokens generated and trained

    def evaluate(step: int):
        """Rank 0: the held-out evaluation on the colocated engine (it holds the current weights)."""
        result = loop.run_until_complete(heldout(engine, task.heldout, eval_reward, tok, cfg,
                                                 max_new_tokens=cfg.max_new_tokens, tag=f"eval{step}"))
        files.write_eval(step, result)
        return result

    step, t_start = rec.step, time.time()
    if rec.state is None:
        eval_before = evaluate(0) if rank == 0 else None
        acc_before = eval_before.mean_at_k if eval_before is not None else 0.0
        heldout_before = heldout_figures(eval_before) if eval_before is not None else None
        teacher_acc = None
        if teacher is not None and rank == 0:
            teacher_acc = on_model(teacher, lambda e: heldout(e, task.heldout, eval_reward, tok, cfg,
                                                              max_new_tokens=cfg.max_new_tokens)).mean_at_k
        last_acc, heldout_after = acc_before, heldout_before
    else:  # the optimizer, the counters and the figures of the run so far
        load_optim_state(policy, optim, rec.state["optim"], world)
        totals.update(rec.state["totals"])
        if rank == 0:  # the reward counters of the summary (rank 0's, as it reports them)
            reward.load_state_dict(rec.state["rewards"]["train"])
            if eval_reward is not reward:
                eval_reward.load_state_dict(rec.state["rewards"]["eval"])
        acc_before, teacher_acc, last_acc, heldout_before, heldout_after = (rec.state["summary"][k] for k in (
            "accuracy_before", "teacher_accuracy", "accuracy_after", "heldout_before", "heldout_after"))
        t_start -= rec.state["summary"]["wall_seconds"]
    say(f"held-out accuracy before RL: {acc_before:.3f} ({len(task.heldout)} prompts, {task.heldout_source})")
    if teacher_acc is not None:
        say(f"teacher held-out accuracy: {teacher_acc:.3f}")

    def save_checkpoint() -> None:  # weights, optimizer, counters; every rank's RNG and the prompt sampler's
        state = {"step": step, "model": {k.removeprefix("lm."): v for k, v in model_state(policy, world).items()},
                 "optim": optim_state(policy, optim, world), "totals": dict(totals),
                 "rewards": {"train": reward.state_dict(), "eval": eval_reward.state_dict()},
                 "summary": {"accuracy_before": acc_before, "teacher_accuracy": teacher_acc,
                             "accuracy_after": last_acc, "heldout_before": heldout_before,
                             "heldout_after": heldout_after, "wall_seconds": time.time() - t_start}}
        save_run_checkpoint(files, cfg, state, rank=rank, world=world, generators={"data": rng})

    bar = Progress(cfg.steps, step, enabled=rank == 0 and not cfg.quiet)
    restore_rng(rec, rank, {"data": rng})  # last before the first step: set-up draws nothing after this
    while step < cfg.steps:
        # ---- one step: generate with the current weights, then update on exactly those samples
        t0 = time.perf_counter()
        before = Counter(counters)
        groups = loop.run_until_complete(
            rollout_step(cfg, engine, tok, task, reward, rng, n_local, rank, step, max_model_len, counters))
        gen_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        groups = gather_cp(groups, tg)  # --cp: the CP group's ranks train on the share they generated together
        bt = batch_tensors(groups, tok.pad_token_id, device)
        if teacher is not None:
            m = distill.distill_step(cfg, policy, optim, bt, teacher, grad_scale=float(world), step=step)
        else:
            m = grpo_step(cfg, policy, optim, bt, ref_policy=ref, group=tg.dp, grad_scale=float(world), step=step)
        train_s = time.perf_counter() - t1
        step += 1
        # ---- weight push into the colocated engine (version = step)
        t2 = time.perf_counter()
        tensors = (merged_tensors(peft_model) if peft_model is not None
                   else [(n.removeprefix("lm."), t) for n, t in full_tensors(policy)])
        loop.run_until_complete(engine.update_weights(tensors, version=step))
        sync_s = time.perf_counter() - t2
        # ---- logging: generated counts come from the rollout, trained counts from the batch, summed over ranks
        gen_keys = ("samples_generated", "tokens_generated", "resubmissions", "reward_failures",
                    "groups_failed_reward", "samples_failed_reward")
        trained = bt["trained"]
        sums = torch.cat([  # trained: over the DP ranks (a CP group shares its batch); generated: over all ranks
            all_reduce(torch.tensor([bt["rewards"][trained].sum().item(), trained.sum().item(),
                                     bt["mask"].sum().item()], dtype=torch.float64), group=tg.dp),
            all_reduce(torch.tensor([counters[k] - before[k] for k in gen_keys], dtype=torch.float64))])
        totals.update({"samples_trained": int(sums[1]), "tokens_trained": int(sums[2]),
                       **{k: int(v) for k, v in zip(gen_keys, sums[3:].tolist())}})
        done = step >= cfg.steps or (cfg.time_limit > 0 and time.time() - t_start > cfg.time_limit)
        done = broadcast_flag(done, device=device)  # rank 0's clock decides for every rank
        if rank == 0:
            result = evaluate(step) if (every(step, cfg.eval_every) or done) else None
            if result is not None:
                last_acc, heldout_after = result.mean_at_k, heldout_figures(result)
            step_s = time.perf_counter() - t0
            mean_reward = sums[0].item() / max(sums[1].item(), 1)
            files.log({
                "step": step, "version": step, "reward": mean_reward, "reward_failures": int(sums[6]),
                "samples_failed_reward": totals["samples_failed_reward"], **eval_metrics(result), "loss": m["loss"],
                "lr": optim.param_groups[0]["lr"],
                "kl_k3": m.get("mismatch_kl_k3"), "kl_k1": m.get("mismatch_kl_k1"), "approx_kl": m.get("approx_kl"),
                "clipfrac": m.get("clipfrac"), "clipfrac_low": m.get("clipfrac_low"),
                "clipfrac_high": m.get("clipfrac_high"), "grad_norm": m["grad_norm"],
                "ppo_updates": m["ppo_updates"], "staleness_hist": {"0": int(sums[2].item())},
                "tokens_trained": int(sums[2].item()), "tokens_per_s": sums[2].item() / step_s,
                "step_seconds": step_s, "generate_seconds": gen_s, "train_seconds": train_s, "sync_seconds": sync_s,
                "queue_wait_seconds": 0.0, "samples_generated": totals["samples_generated"],
                "samples_trained": totals["samples_trained"], "tokens_generated": totals["tokens_generated"],
                "resubmissions": totals["resubmissions"], "wall_seconds": time.time() - t_start,
                **{k: v for k, v in m.items() if k.startswith(("correction_", "distill_", "zero_variance_"))},
            })
            bar.update({"reward": mean_reward, "acc": last_acc})
        if every(step, cfg.save_every) or done:
            save_checkpoint()
        if done:
            break
    bar.close()
    saved = save_policy(cfg, tok, lm, peft_model=peft_model, policy=policy, world=world, rank=rank, base=path,
                        log=say)  # --save-hf
    if rank == 0:
        summary = {
            "accuracy_before": acc_before, "accuracy_after": last_acc, "wall_seconds": time.time() - t_start,
            "steps": step, "max_staleness": 0, "max_staleness_seen": 0,
            "samples_generated": totals["samples_generated"], "samples_trained": totals["samples_trained"],
            "samples_dropped_stale": 0, "samples_failed_reward": totals["samples_failed_reward"],
            "groups_failed_reward": totals["groups_failed_reward"], "reward_failures": totals["reward_failures"],
            "rollout": dict(totals),
            "config": dataclasses.asdict(cfg),
            "teacher_accuracy": teacher_acc, "task": task.source, "heldout_prompts": len(task.heldout),
            "heldout_before": heldout_before, "heldout_after": heldout_after, "reward": reward.stats(),
            "saved_hf": saved,
            **rec.summary(),
        }
        files.write_summary(summary)
        say(f"held-out accuracy before RL: {acc_before:.3f}  after {step} steps: {last_acc:.3f}  "
            f"({100 * (last_acc - acc_before):+.1f} points, {summary['wall_seconds']:.0f} s)")
    # release the engine inside the loop that drives it (its step task, vLLM's output handler), then the loop
    loop.run_until_complete(engine.aclose())
    loop.close()
    for r in {id(reward): reward, id(eval_reward): eval_reward}.values():
        r.close()
    files.close()
    close_dist()


if __name__ == "__main__":
    main()
