"""The trainer ranks' state of ``grpo_async.py`` (its loop, :func:`grpo_async.trainer_main`, calls these): the
policy and optimiser, restored from the run checkpoint on a resume; the scatter of each batch over DP × CP; the
weight push; and on rank 0 the ``TrainerLedger`` of the bounded-async protocol, the held-out evaluation (of the FP8
rollout weights too), metrics.jsonl, the run checkpoint and summary.json."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist
from plumbing import (
    PolicyLogprobs,
    Reward,
    RunFiles,
    StepLaps,
    TrainerLedger,
    all_reduce,
    apply_lora,
    decoder_layers,
    eval_metrics,
    eval_reward_spec,
    every,
    heldout,
    heldout_figures,
    join_sync_group,
    load_hf,
    load_model_state,
    load_optim_state,
    model_state,
    on_model,
    optim_state,
    parse_log_flag,
    resume_run,
    rollout_columns,
    save_run_checkpoint,
    shard,
)
from plumbing.weight_sync import WeightPusher, rollout_form_model, sync_backend

from rlblocks.errors import ArgumentError
from rlblocks.sync import full_tensors


class Trainer:
    """What a trainer rank holds between steps: the policy (LoRA-wrapped with ``--sync lora``, FSDP2-sharded over
    the trainer ranks), its reference and optimiser, restored from the run checkpoint when resuming; on rank 0 also
    the ``TrainerLedger`` (queue, inbox, stale reports, accounting), the ``WeightPusher`` and the held-out
    evaluation."""

    def __init__(self, cfg, rank: int, world: int, n_train: int, device, groups: dict, path: str, port: int,
                 load_task: Callable) -> None:
        self.cfg, self.rank, self.n_train, self.device, self.is0 = cfg, rank, n_train, device, rank == 0
        self.group, self.tg = groups["train"], groups["tg"]  # the trainer ranks; this rank's DP and CP groups
        self.files = RunFiles(cfg.runs_dir, cfg.name, sinks=parse_log_flag(cfg.log_to), config=cfg)
        self.tok, self.lm = load_hf(path, device)
        self.lm.train()
        self.peft_model = None
        if cfg.sync == "lora":  # LoRA training: adapters on every decoder linear; the HF modules are wrapped in place
            if n_train > 1:
                raise ArgumentError("--sync lora: supported with one trainer rank here (no FSDP2 of peft modules)")
            self.peft_model = apply_lora(self.lm, cfg.lora_rank)
        # fresh run, or resume from the last checkpoint (--resume, or torchrun restarted the group after a rank died)
        self.recovery = resume_run(self.files, cfg, rank=rank, world=n_train, group=self.group,
                                   required=("step", "model", "optim", "rng", "config", "queue", "counters"))
        ck = self.recovery.state or {}
        if ck:
            load_model_state(self.lm, ck["model"])
        self.policy = PolicyLogprobs(self.lm, cfg.temperature, cfg.prefix_share, cp_group=self.tg.cp)
        # REAL MODEL: with several trainer ranks rank 0 keeps a whole unsharded copy only to run the held-out
        # evaluation with HF ``generate``; a real model would evaluate through the rollout engine instead.
        self.eval_lm = self.lm if n_train == 1 else load_hf(path, device)[1] if self.is0 else None
        shard(self.policy, decoder_layers(self.lm), n_train, mesh=groups.get("mesh"))
        self.ref = None
        if cfg.kl_coef > 0:
            self.ref = PolicyLogprobs(load_hf(path, device)[1].eval(), cfg.temperature, cfg.prefix_share,
                                      cp_group=self.tg.cp).requires_grad_(False)
        self.optim = torch.optim.AdamW([p for p in self.policy.parameters() if p.requires_grad], lr=cfg.lr,
                                       weight_decay=0.0)
        self.step, self.accuracy_before, self.wall_before = ck.get("step", 0), ck.get("accuracy_before"), 0.0
        if ck:
            self.wall_before = ck["wall_seconds"]
            load_optim_state(self.policy, self.optim, ck["optim"], n_train)
            if self.eval_lm is not None and self.eval_lm is not self.lm:
                self.eval_lm.load_state_dict(ck["model"])
        self.t_rl, self.last_acc, self.eval_before, self.last_eval = time.time(), None, None, None
        self.failed_calls_logged = 0  # inbox.failed_calls at the last logged step
        if self.is0:
            self.task = load_task(self.tok)  # its held-out prompts are evaluated
            self.eval_reward = Reward(eval_reward_spec(cfg), self.tok, reward_model=cfg.reward_model, device=device,
                                      timeout=cfg.reward_timeout)
            if ck:  # the held-out reward's counters of the run so far
                self.eval_reward.load_state_dict(ck["eval_reward"])
            sync_group = join_sync_group(rank, n_train, world, port, backend=sync_backend(cfg))
            self.ledger = TrainerLedger(max_staleness=cfg.max_staleness, group_size=cfg.group_size,
                                        sources=range(n_train, world), sample_group=groups["sample"],
                                        sync_group=sync_group, recovery=self.recovery)
            self.pusher = WeightPusher(cfg, sync_group)

    def wall_seconds(self) -> float:
        """Seconds of RL over every start of the run."""
        return self.wall_before + time.time() - self.t_rl

    def push(self, first: bool = False) -> list:
        """Every trainer rank gathers the full tensors (an FSDP collective); rank 0 announces version ``step`` and
        sends them (``WeightPusher``). Returns the trainer's own tensors (its evaluation and checkpoint use them)."""
        tensors = [(n.removeprefix("lm."), p) for n, p in full_tensors(self.policy)]
        if self.is0:
            self.ledger.announce(self.step, self.pusher.kind(first), first=first)
            self.pusher.push(tensors, self.step, first=first, peft_model=self.peft_model)
        return tensors

    def take_batch(self) -> tuple[list[dict], list[dict]]:
        """Rank 0 takes B fresh groups (``TrainerLedger.take``) and scatters them over the trainer ranks (a CP
        group's ranks get the same DP share). Returns ``(this rank's groups, the whole batch)`` (rank 0's)."""
        shards, batch = [None] * self.n_train, []
        if self.is0:
            batch = self.ledger.take(self.cfg.prompts_per_step, self.step)
            dp = [batch[i :: self.tg.dp_size] for i in range(self.tg.dp_size)]
            shards = [dp[i // self.tg.cp_size] for i in range(self.n_train)]
        box = [None]
        dist.scatter_object_list(box, shards if self.is0 else None, src=0, group=self.group)
        return box[0], batch

    def set_lr(self) -> None:
        """Linear decay to 10% of ``--lr`` over the budget (steps or time limit, whichever is nearer); the progress
        is broadcast from rank 0 so every trainer rank uses the same lr."""
        cfg = self.cfg
        if not cfg.lr_decay:
            return
        by_time = (time.time() - self.t_rl) / cfg.time_limit if cfg.time_limit else 0.0
        prog = torch.tensor([max(self.step / cfg.steps, by_time)], device=self.device)  # NCCL: CUDA tensors only
        dist.broadcast(prog, src=0, group=self.group)
        for pg in self.optim.param_groups:
            pg["lr"] = cfg.lr * max(0.1, 1.0 - 0.9 * min(float(prog.item()), 1.0))

    def batch_stats(self, bt: dict, version: int) -> dict:
        """Reward mean, sample and token counts, and the staleness histogram (token age = ``version`` − the token's
        version) of the whole batch, summed over the data-parallel trainer ranks (a CP group shares its samples)."""
        hist = Counter((version - bt["versions"][bt["mask"]]).tolist())
        if self.tg.dp_size > 1:  # the histogram of the whole batch, not just this rank's shard
            parts = [None] * self.tg.dp_size
            dist.all_gather_object(parts, dict(hist), group=self.tg.dp)
            hist = sum((Counter(p) for p in parts), Counter())
        sums = all_reduce(torch.tensor([bt["rewards"].sum().item(), bt["rewards"].numel(), bt["mask"].sum().item()],
                                       dtype=torch.float64), group=self.tg.dp)
        return {"reward": sums[0].item() / max(sums[1].item(), 1), "samples": int(sums[1].item()),
                "tokens": int(sums[2].item()), "hist": hist, "max_age": max(hist) if hist else 0}

    # ---------------------------------------------------------------- rank 0: evaluation, logs, checkpoint, summary
    def evaluate(self, tensors):
        """The held-out evaluation (rank 0) on a TorchEngine over the unsharded copy refreshed from the gathered
        weights; its per-prompt results go to ``eval/step_<N>.jsonl``. Returns the ``EvalResult``."""
        if self.eval_lm is not self.lm:
            self.eval_lm.load_state_dict(dict(tensors), strict=False)
        self.last_eval = on_model(self.eval_lm, lambda engine: heldout(
            engine, self.task.heldout, self.eval_reward, self.tok, self.cfg, max_new_tokens=self.cfg.max_new_tokens,
            tag=f"eval{self.step}"))
        self.files.write_eval(self.step, self.last_eval)
        return self.last_eval

    def evaluate_before(self, tensors) -> None:
        """Rank 0: the held-out accuracy before RL (a resumed run has it from its checkpoint)."""
        if self.is0:
            if self.accuracy_before is None:
                self.eval_before = self.evaluate(tensors)
                self.accuracy_before = self.eval_before.mean_at_k
            self.last_acc = self.accuracy_before
            print(f"held-out accuracy before RL: {self.accuracy_before:.3f} (version {self.step})", flush=True)

    def log_step(self, tensors, stats: dict, m: dict, batch: list[dict], laps: StepLaps, done: bool) -> None:
        """Held-out accuracy (every ``--eval-every`` steps and at the end) and one line of metrics.jsonl."""
        result = self.evaluate(tensors) if (every(self.step, self.cfg.eval_every) or done) else None
        laps.lap("eval")
        timings = laps.seconds
        inbox = self.ledger.inbox  # the failed reward calls since the last step (their groups never in a batch)
        calls, self.failed_calls_logged = inbox.failed_calls - self.failed_calls_logged, inbox.failed_calls
        self.last_acc = result.mean_at_k if result is not None else self.last_acc
        step_s = laps.step_seconds
        self.files.log({
            "step": self.step, "version": self.step, "reward": stats["reward"], "reward_failures": calls,
            **eval_metrics(result), "loss": m["loss"],
            "kl_k3": m.get("mismatch_kl_k3"), "kl_k1": m.get("mismatch_kl_k1"), "approx_kl": m.get("approx_kl"),
            "ratio_in_band_frac": m.get("mismatch_ratio_in_band_frac"),
            **{k.removeprefix("mismatch_"): v for k, v in m.items() if k.startswith("mismatch_staleness")},
            "clipfrac": m.get("clipfrac"), "clipfrac_low": m.get("clipfrac_low"),
            "clipfrac_high": m.get("clipfrac_high"), "grad_norm": m["grad_norm"], "ppo_updates": m["ppo_updates"],
            "staleness_hist": {str(k): v for k, v in sorted(stats["hist"].items())},
            "tokens_trained": stats["tokens"], "tokens_per_s": stats["tokens"] / step_s, "step_seconds": step_s,
            "generate_seconds": None,  # the rollout ranks generate, concurrently with this step
            "train_seconds": timings["train"], "sync_seconds": timings["sync"], "queue_wait_seconds": timings["wait"],
            "sync_bytes": self.pusher.bytes, "eval_seconds": timings["eval"],
            **rollout_columns(inbox.take_reports(), self.cfg.rollout_ranks),
            "queue_len": len(self.ledger.queue), "samples_generated": inbox.generated,
            "samples_trained": self.ledger.counters["samples_trained"], "samples_failed_reward": inbox.failed,
            "wall_seconds": self.wall_seconds(), "trained_uids": [g["uid"] for g in batch],
            "lr": self.optim.param_groups[0]["lr"],
            "groups_filled_unfiltered": sum(1 for g in batch if g.get("zero_variance_fill")),
            **{k: v for k, v in m.items() if k.startswith(("correction_", "zero_variance_"))},
        })

    def save_checkpoint(self) -> None:
        """The run checkpoint: weights and optimiser (gathered from every trainer rank), step, every trainer rank's
        RNG states, and on rank 0 the ledger (the queue with every group in it, the counters)."""
        model = {k.removeprefix("lm."): v for k, v in model_state(self.policy, self.n_train).items()}
        optim = optim_state(self.policy, self.optim, self.n_train)
        state = {}
        if self.is0:
            state = {"model": model, "optim": optim, "step": self.step, **self.ledger.state_dict(),
                     "accuracy_before": self.accuracy_before, "eval_reward": self.eval_reward.state_dict(),
                     "wall_seconds": self.wall_seconds()}
        save_run_checkpoint(self.files, self.cfg, state, rank=self.rank, world=self.n_train, group=self.group)

    def finish(self, tensors) -> None:
        """Rank 0: stop the rollout ranks, collect their counters, write summary.json (the conservation identity's
        terms, restarts and steps redone)."""
        rollout, cfg, led = self.ledger.stop(), self.cfg, self.ledger
        summary = {
            "accuracy_before": self.accuracy_before, "accuracy_after": self.last_acc,
            "wall_seconds": self.wall_seconds(), "rl_seconds_this_run": time.time() - self.t_rl,
            "trainer_cpu_seconds": time.process_time(), "steps": self.step, "max_staleness": cfg.max_staleness,
            **led.figures(), "groups_failed_reward": rollout.get("groups_failed_reward", 0), "rollout": dict(rollout),
            "stale_uids": led.stale_uids, "left_uids": [item["uid"] for item, _, _ in led.queue.state_dict()["items"]],
            "config": dataclasses.asdict(cfg), "sync_bytes_full": self.pusher.first_bytes, "task": self.task.source,
            "heldout_prompts": len(self.task.heldout),
            "heldout_before": heldout_figures(self.eval_before) if self.eval_before is not None else None,
            "heldout_after": heldout_figures(self.last_eval) if self.last_eval is not None else None,
            "reward_failures": rollout.get("reward_failures", 0), "eval_reward": self.eval_reward.stats(),
            **self.recovery.summary(),
        }
        if cfg.rollout_dtype == "fp8":  # the held-out metrics of the FP8 weights the rollout engine ended with
            fp8 = evaluate_rollout_form(self, tensors)
            summary["accuracy_after_fp8"], summary["heldout_after_fp8"] = fp8.mean_at_k, heldout_figures(fp8)
        self.files.write_summary(summary)
        self.files.close()
        self.eval_reward.close()
        print(f"held-out accuracy before RL: {self.accuracy_before:.3f}  after {self.step} steps: "
              f"{self.last_acc:.3f}  ({100 * (self.last_acc - self.accuracy_before):+.1f} points, "
              f"{summary['wall_seconds']:.0f} s)", flush=True)
        print(f"summary: {self.files.summary}", flush=True)


def evaluate_rollout_form(t: Trainer, tensors):
    """The held-out evaluation of :meth:`Trainer.evaluate` (same prompts, reward, k) of the policy the rollout
    engine holds (``rollout_form_model``: the FP8 form of the weights, merged first with ``--sync lora``)."""
    lm = rollout_form_model(t.cfg, t.eval_lm, t.peft_model, tensors)
    return on_model(lm, lambda engine: heldout(engine, t.task.heldout, t.eval_reward, t.tok, t.cfg,
                                               max_new_tokens=t.cfg.max_new_tokens, tag=f"eval{t.step}-fp8"))
