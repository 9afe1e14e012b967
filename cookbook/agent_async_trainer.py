"""Trainer rank 0's state of ``agent_async.py`` (its loop, :func:`agent_async.trainer_main`, calls these): the policy,
its evaluation copy and optimiser, restored from the run checkpoint on a resume; the ``TrainerLedger`` of the
bounded-async protocol and the weight push; the held-out episodes, metrics.jsonl, the run checkpoint and
summary.json."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

import agent_task as task
import torch
from plumbing import (
    Reward,
    RunFiles,
    StepLaps,
    TrainerLedger,
    eval_metrics,
    eval_reward_spec,
    every,
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
    save_policy,
    save_run_checkpoint,
)

from rlblocks.rollout.agents import EpisodeStats
from rlblocks.sync import WeightSender


class Trainer:
    """Rank 0 of ``agent_async.py`` between steps (one trainer rank, on the CPU)."""

    def __init__(self, cfg, world: int, sample_group, path: str, port: int, tok, loop_task, tools: list) -> None:
        self.cfg, self.tok, self.loop_task, self.tools = cfg, tok, loop_task, tools
        self.files = RunFiles(cfg.runs_dir, cfg.name, sinks=parse_log_flag(cfg.log_to), config=cfg)
        self.model = load_hf(path, torch.device("cpu"))[1]
        self.eval_model = load_hf(path, torch.device("cpu"))[1]
        self.model.train()
        self.heldout = loop_task.heldout[: cfg.heldout]
        self.eval_reward = Reward(eval_reward_spec(cfg), self.tok, reward_model=cfg.reward_model,
                                  timeout=cfg.reward_timeout)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.0)
        # fresh run, or resume from the last checkpoint (--resume, or torchrun restarted the group after a rank died)
        self.recovery = resume_run(self.files, cfg, rank=0, world=1,
                                   required=("step", "model", "optim", "rng", "config", "queue", "counters"))
        ck = self.recovery.state
        if ck is not None:
            load_model_state(self.model, ck["model"])
            load_optim_state(self.model, self.optim, ck["optim"], 1)
            self.eval_reward.load_state_dict(ck["eval_reward"])
        sync_group = join_sync_group(0, 1, world, port)
        self.ledger = TrainerLedger(max_staleness=cfg.max_staleness, group_size=cfg.group_size,
                                    sources=range(1, world), sample_group=sample_group, sync_group=sync_group,
                                    recovery=self.recovery, samples=lambda rec: len(rec["episodes"]))
        self.sender = WeightSender(sync_group, 0)
        self.eval_stats = EpisodeStats()
        self.step = self.recovery.step
        # the trained episodes' finish reasons, turns and tool calls, over every start of the run
        self.episodes: Counter = Counter(ck["episodes"]) if ck is not None else Counter()
        self.failed_calls_logged = 0  # inbox.failed_calls at the last logged step
        self.push(first=True)
        if ck is None:
            eval_before = self.evaluate()
            self.acc_before = self.last_acc = eval_before.mean_at_k
            self.heldout_before = self.heldout_after = heldout_figures(eval_before)
        else:
            self.acc_before, self.last_acc = ck["accuracy_before"], ck["accuracy_after"]
            self.heldout_before, self.heldout_after = ck["heldout_before"], ck["heldout_after"]
        print(f"held-out accuracy before RL: {self.acc_before:.3f} ({len(self.heldout)} prompts, "
              f"{loop_task.heldout_source}, {cfg.eval_k} episode(s) each)", flush=True)
        self.t_start = self.t_rl = time.time()
        if ck is not None:
            self.t_start -= ck["wall_seconds"]

    def push(self, first: bool = False) -> None:
        """The weights as version ``step`` to every rollout rank (announced by the ledger: the run's first push
        carries each rank's groups still queued and the run's start number)."""
        self.ledger.announce(self.step, "full", first=first)
        self.sender.send([(n, p.detach()) for n, p in self.model.state_dict().items()], version=self.step)

    def evaluate(self):
        """``--eval-k`` episodes per held-out prompt on a TorchEngine over a copy of the current weights."""
        cfg = self.cfg
        self.eval_model.load_state_dict(self.model.state_dict())
        result = on_model(self.eval_model, lambda engine: task.eval_episodes(
            engine, self.tok, self.heldout, tools=self.tools, reward=self.eval_reward, k=cfg.eval_k,
            temperature=cfg.eval_temperature, turn_tokens=cfg.turn_tokens, max_turns=cfg.max_turns,
            stats=self.eval_stats, seed=cfg.seed))
        self.files.write_eval(self.step, result)
        return result

    def count_episodes(self, batch: list[dict]) -> None:
        """Add the batch's episodes (finish reasons, turns, tool calls) to the trained episodes' counts."""
        for rec in batch:
            for reason, turns, calls, _r in rec["episodes"]:
                self.episodes.update({"episodes": 1, "turns": turns, "tool_calls": calls, f"finish_{reason}": 1})

    def log_step(self, batch: list[dict], trajs: list, m: dict, gnorm: float, ages: Counter, laps: StepLaps,
                 done: bool) -> None:
        """Held-out accuracy (every ``--eval-every`` steps and at the end) and one line of metrics.jsonl."""
        cfg, inbox = self.cfg, self.ledger.inbox
        result = self.evaluate() if (every(self.step, cfg.eval_every) or done) else None
        laps.lap("eval")
        timings, step_s = laps.seconds, laps.step_seconds
        if result is not None:
            self.last_acc, self.heldout_after = result.mean_at_k, heldout_figures(result)
        rewards = [t.reward for t in trajs]
        # the failed reward calls received since the last step (their groups were failed whole, never in a batch)
        calls, self.failed_calls_logged = inbox.failed_calls - self.failed_calls_logged, inbox.failed_calls
        row = {
            "step": self.step, "version": self.step, "reward": sum(rewards) / len(rewards),
            "reward_failures": calls, **eval_metrics(result),
            "loss": m["loss"], "approx_kl": m.get("approx_kl"),
            "clipfrac_low": m.get("clipfrac_low"), "clipfrac_high": m.get("clipfrac_high"), "grad_norm": float(gnorm),
            "staleness_hist": {str(k): v for k, v in sorted(ages.items())}, "tokens_trained": m["tokens_trained"],
            "tokens_per_s": m["tokens_trained"] / step_s, "queue_wait_seconds": timings["wait"],
            "train_seconds": timings["train"], "sync_seconds": timings["sync"], "queue_len": len(self.ledger.queue),
            "eval_seconds": timings["eval"], "step_seconds": step_s,
            "generate_seconds": None,  # the rollout ranks generate
            "samples_generated": inbox.generated, "samples_trained": self.ledger.counters["samples_trained"],
            "samples_failed_reward": inbox.failed,
            "tool_calls_per_episode": sum(c for r in batch for _, _, c, _ in r["episodes"]) / len(trajs),
            "turns_mean": sum(t for r in batch for _, t, _, _ in r["episodes"]) / len(trajs),
            "lr": self.optim.param_groups[0]["lr"], "wall_seconds": time.time() - self.t_start,
            "trained_uids": [r["uid"] for r in batch],
        }
        self.files.log(row)
        if result is not None and not cfg.quiet:
            print(f"step {self.step:4d}  {time.time() - self.t_rl:5.0f} s  reward {row['reward']:.3f}  held-out "
                  f"{self.last_acc:.3f}  tool calls/episode {row['tool_calls_per_episode']:.2f}  "
                  f"queue {len(self.ledger.queue)}", flush=True)

    def save_checkpoint(self) -> None:
        """The run checkpoint: weights, optimizer, the ledger (the queue, read with the received count under the
        inbox's lock so that they agree; the counters) and the summary's figures so far."""
        state = {"step": self.step, "model": model_state(self.model, 1),
                 "optim": optim_state(self.model, self.optim, 1), **self.ledger.state_dict(),
                 "episodes": dict(self.episodes), "accuracy_before": self.acc_before, "accuracy_after": self.last_acc,
                 "heldout_before": self.heldout_before, "heldout_after": self.heldout_after,
                 "eval_reward": self.eval_reward.state_dict(), "wall_seconds": time.time() - self.t_start}
        save_run_checkpoint(self.files, self.cfg, state, rank=0, world=1)

    def finish(self) -> None:
        """Stop the rollout ranks, collect their counters, write the summary and the policy. Every episode received
        is trained, without a trajectory (its env failed to reset), dropped as stale, failed with its group for its
        reward, lost in a crash (received after the last checkpoint) or left in the queue."""
        cfg, led = self.cfg, self.ledger
        rollout_counts = led.stop()
        rollout = _sum_stats([e.episodes for e in led.inbox.ended.values()])
        summary = {
            "accuracy_before": self.acc_before, "accuracy_after": self.last_acc,
            "wall_seconds": time.time() - self.t_start, "rl_seconds_this_run": time.time() - self.t_rl,
            "steps": self.step, "max_staleness": cfg.max_staleness, **led.figures(),
            "groups_failed_reward": rollout_counts["groups_failed_reward"],
            # episodes_run_this_start = the samples shipped this start + episodes_cancelled_at_stop (the finished
            # episodes of the groups cancelled at Stop); finish_reasons counts the same episodes
            "episodes_run_this_start": rollout["episodes"],
            "episodes_cancelled_at_stop": rollout_counts["episodes_cancelled_at_stop"],
            "turns_mean": rollout["turns"] / max(rollout["episodes"], 1), "tool_calls": rollout["tool_calls"],
            "env_errors": rollout["env_errors"] + rollout["env_timeouts"],
            "prefix_mismatches": rollout["prefix_mismatches"],
            "finish_reasons": rollout["finish_reasons"], "trained_episodes": dict(self.episodes),
            "rollout": dict(rollout_counts), "eval_episode_stats": self.eval_stats.stats(),
            "config": dataclasses.asdict(cfg), "task": self.loop_task.source, "heldout_prompts": len(self.heldout),
            "heldout_before": self.heldout_before, "heldout_after": self.heldout_after,
            "reward_failures": rollout_counts["reward_failures"], "eval_reward": self.eval_reward.stats(),
            **self.recovery.summary(),
        }
        self.files.write_summary(summary)
        self.files.close()
        self.eval_reward.close()
        self.model.save_pretrained(self.files.dir / "policy")  # the trained policy, loadable with from_pretrained
        self.tok.save_pretrained(self.files.dir / "policy")
        save_policy(cfg, self.tok, self.model)  # --save-hf: the same, where the user asks
        print(f"held-out accuracy before RL: {self.acc_before:.3f}  after {self.step} steps: {self.last_acc:.3f}  "
              f"(+{100 * (self.last_acc - self.acc_before):.1f} points, {summary['wall_seconds']:.0f} s of RL)",
              flush=True)
        print(f"summary: {self.files.summary}", flush=True)


def _sum_stats(parts: list[dict]) -> dict:
    """Sum the rollout ranks' ``EpisodeStats.stats()`` dicts (counts add, finish reasons merge)."""
    out: Counter = Counter()
    reasons: Counter = Counter()
    for p in parts:
        for k, v in p.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] += v
        reasons.update(p.get("finish_reasons", {}))
    res = dict(out)
    res["finish_reasons"] = dict(reasons)
    for k in ("episodes", "turns", "tool_calls", "env_errors", "env_timeouts", "prefix_mismatches"):
        res.setdefault(k, 0)
    return res
