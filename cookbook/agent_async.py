"""Bounded-async GRPO on a multi-turn tool task: the policy learns to use a calculator (AReaL-style, under torchrun).

    torchrun --standalone --nproc_per_node 2 cookbook/agent_async.py --name demo-agent     # CPU demo (make demo-agent)

Rank 0 trains, ranks 1.. generate. The task (``cookbook/agent_task.py``): ``a*b`` with three-digit operands, which
the tiny model cannot multiply; it can call ``calc`` with a Hermes tool call, read the ``tool`` turn and answer; at
most 3 turns, reward 1 iff the final answer is exactly ``a*b``.

Rollout rank: a TorchEngine on an asyncio loop. Prompt groups are admitted by a ``StalenessController`` (at most
``(η + v + 1)·B`` groups accepted or running at policy version v); each group is ``K`` concurrent ``run_episode``
calls on one problem (``ToolEnv`` + calculator). Every turn goes through ``resumable_generate``: a weight update
(pause → ``update_weights`` → resume, driven by a receiver thread) interrupts the turns in flight, which resume under
the new weights with every token keeping the version that sampled it. Finished groups (their ``Trajectory`` s, each
with per-token ids, roles, logprobs, versions and turn ids) travel to rank 0 with ``send_object_list``.

Trainer rank 0: groups wait in a ``StalenessQueue`` keyed by their OLDEST token version; each step takes ``B`` groups
whose age is ``≤ η`` (stale ones are counted and given back to their rollout rank), builds the batch with
``to_tensors`` (model tokens trained, tool results and chat markers masked), computes per-episode GRPO advantages
and the PPO-clip loss against the engine's logprobs, steps, and sends the new weights (``WeightSender``) as the next
version. Held-out accuracy: greedy episodes on held-out problems every ``--eval-every`` steps.

Files: ``runs/<name>/metrics.jsonl`` (one line per step), ``summary.json`` (with ``turns_mean``, ``tool_calls``,
``env_errors``, ``prefix_mismatches``), ``policy/`` (the trained model and tokenizer); ``python cookbook/plot.py
runs/<name>`` draws the curves.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import queue as pyqueue
import random
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import agent_task as task

from rlblocks.rollout import SamplingParams, TorchEngine
from rlblocks.rollout.agent import EpisodeStats
from rlblocks.sched import StalenessController, StalenessQueue
from rlblocks.sync import WeightReceiver, WeightSender, init_sync_group


def _opt(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    """Bounded-async GRPO on the calculator tool task (every field is a flag)."""

    name: str = _opt("demo-agent", "run name: files go to <runs-dir>/<name>/")
    runs_dir: str = _opt("runs", "where run directories live")
    model: str = _opt("", "checkpoint directory; empty: the tiny demo model, warm-started and cached")
    steps: int = _opt(100000, "optimizer steps (= policy versions); the demo stops on --time-limit first")
    time_limit: float = _opt(240.0, "stop training after this many seconds of RL (0: no limit)")
    prompts_per_step: int = _opt(16, "B: prompt groups per optimizer step")
    group_size: int = _opt(8, "K: episodes per prompt")
    max_staleness: int = _opt(1, "η: largest version gap of a trained token (0 = synchronous)")
    max_concurrent: int = _opt(48, "groups in flight over all rollout ranks")
    lr: float = _opt(3e-4, "AdamW learning rate")
    lr_decay: bool = _opt(True, "decay lr linearly to a tenth over the budget (steps or time limit, the nearer)")
    grad_clip: float = _opt(1.0, "max grad norm")
    eps_clip: float = _opt(0.2, "PPO clip offset (both sides)")
    temperature: float = _opt(1.0, "sampling temperature")
    eval_every: int = _opt(25, "held-out greedy accuracy every N steps (and at the end)")
    heldout: int = _opt(300, "held-out problems evaluated (at most 300)")
    warmstart_target: float = _opt(0.2, "warm start: stop once greedy accuracy on SFT problems reaches this")
    seed: int = _opt(0, "seed")
    quiet: bool = _opt(False, "no per-eval progress lines")


def parse_flags(argv: list[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(description=Config.__doc__)
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                help=f.metadata["help"])
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default, help=f.metadata["help"])
    ns = parser.parse_args(argv)
    return Config(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(Config)})


# ================================================================================================ rollout side
class Rollout:
    """One rollout rank: admission-controlled groups of episodes, weight updates, shipping groups to rank 0."""

    def __init__(self, cfg: Config, rank: int, world: int, sample_group, sync_group, tok, model) -> None:
        self.cfg, self.rank = cfg, rank
        self.sample_group, self.sync_group = sample_group, sync_group
        self.tok, self.engine = tok, TorchEngine(model, max_batch_size=4096)
        n_roll = world - 1
        self.ctrl = StalenessController(batch_size=cfg.prompts_per_step, max_staleness=cfg.max_staleness,
                                        max_concurrent=cfg.max_concurrent, dp_size=n_roll)
        self.heldout = set(task.split_problems()["heldout"])
        self.rng = random.Random(cfg.seed * 1000 + rank)
        self.stats = EpisodeStats()
        self.outbox: pyqueue.Queue = pyqueue.Queue()
        self.counter = 0
        self.stopping = False
        self.first = asyncio.Event()
        self.wake = asyncio.Event()
        self.counts: Counter = Counter()

    async def _group(self, uid: str, gid: int) -> None:
        a, b = task.rl_problem(self.rng, self.heldout)
        sp = SamplingParams(temperature=self.cfg.temperature, max_new_tokens=task.TURN_TOKENS)
        eps = await task.episodes(self.engine, self.tok, [(a, b)] * self.cfg.group_size, sampling=sp,
                                  stats=self.stats, session_prefix=uid, group_ids=[gid] * self.cfg.group_size)
        trajs = [e.trajectory for e in eps]
        versions = [t.oldest_version for t in trajs if t is not None and t.oldest_version is not None]
        self.ctrl.on_accept()
        self.counts["groups"] += 1
        self.outbox.put({"uid": uid, "rank": self.rank, "problem": (a, b), "trajectories": trajs,
                         "episodes": [(e.finish_reason, e.num_turns, e.num_tool_calls, e.reward) for e in eps],
                         "version": min(versions) if versions else int(self.engine.version)})

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._weights_thread, args=(loop,), daemon=True).start()
        sender = threading.Thread(target=self._send_thread, daemon=True)
        sender.start()
        await self.first.wait()
        tasks: set[asyncio.Task] = set()
        while not self.stopping:
            v = self.engine.version
            while not self.stopping and self.ctrl.try_submit(v):
                gid = self.rank * 10**9 + self.counter  # group ids unique over rollout ranks (advantage groups)
                tasks.add(loop.create_task(self._group(f"r{self.rank}-{self.counter}", gid)))
                self.counter += 1
            self.wake.clear()
            waiter = loop.create_task(self.wake.wait())
            await asyncio.wait([*tasks, waiter], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            for t in [t for t in tasks if t.done()]:
                tasks.discard(t)
                if t.exception() is not None:
                    raise t.exception()  # a failed group is a bug: stop loudly rather than lose it
        for t in list(tasks):
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.counts["groups_cancelled_at_stop"] = len(tasks)
        self.outbox.put(None)
        sender.join()

    def _send_thread(self) -> None:
        while True:
            rec = self.outbox.get()
            if rec is None:
                end = {"op": "end", "rank": self.rank, "episodes": self.stats.stats(), "counts": dict(self.counts)}
                dist.send_object_list([end], dst=0, group=self.sample_group)
                return
            dist.send_object_list([rec], dst=0, group=self.sample_group)

    def _weights_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        receiver = WeightReceiver(self.sync_group, 0)
        while True:
            msg = json.loads(self.sync_group.broadcast_bytes(None, 0))
            if msg["op"] == "stop":
                loop.call_soon_threadsafe(self._stop)
                return
            version, it = receiver.receive()
            tensors = [(n, t.clone()) for n, t in it]
            stale = int(msg.get("stale", {}).get(str(self.rank), 0))
            asyncio.run_coroutine_threadsafe(self._update(tensors, version, stale), loop).result()

    async def _update(self, tensors, version: int, stale: int) -> None:
        """Quiesce, swap, commit, resume: turns in flight come back aborted and are resumed by
        resumable_generate under the new weights; their earlier tokens keep their version."""
        await self.engine.pause(mode="abort")
        await self.engine.update_weights(tensors, version=version)
        await self.engine.resume()
        if stale:
            # groups of this rank the trainer dropped as stale will never be trained: they leave the accepted
            # count, which frees their admission slots (a replacement submitted outside capacity instead would be
            # accepted in turn, and after (η+1)·B drops capacity would stay 0: the run would stall)
            self.ctrl.on_discard(stale)
            self.counts["groups_dropped_stale"] += stale
        self.first.set()
        self.wake.set()

    def _stop(self) -> None:
        self.stopping = True
        self.wake.set()


# ================================================================================================ trainer side
class Inbox:
    """Rank 0: one thread per rollout rank receives groups into the StalenessQueue (nothing dropped)."""

    def __init__(self, world: int, sample_group, q: StalenessQueue) -> None:
        self.q, self.ended, self.received = q, {}, 0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, args=(r, sample_group), daemon=True)
                        for r in range(1, world)]
        for t in self.threads:
            t.start()

    def _loop(self, src: int, group) -> None:
        while True:
            box = [None]
            dist.recv_object_list(box, src=src, group=group)
            rec = box[0]
            if rec.get("op") == "end":
                with self.lock:
                    self.ended[src] = rec
                return
            self.q.put(rec, rec["version"])
            with self.lock:
                self.received += 1


def trainer_main(cfg: Config, world: int, sample_group, sync_group, path: str) -> None:
    run_dir = Path(cfg.runs_dir) / cfg.name
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_path, summary_path = run_dir / "metrics.jsonl", run_dir / "summary.json"
    for p in (metrics_path, summary_path):
        p.unlink(missing_ok=True)
    tok, model = task.load(path)
    _, eval_model = task.load(path)
    model.train()
    heldout = task.split_problems()["heldout"][: cfg.heldout]
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    stale = Counter()

    def on_stale(rec: dict, version: int) -> None:  # counted and reported to its rollout rank, never silent
        stale[str(rec["rank"])] += 1

    q = StalenessQueue(max_staleness=cfg.max_staleness, on_stale=on_stale)
    inbox = Inbox(world, sample_group, q)
    sender = WeightSender(sync_group, 0)

    def push(version: int) -> float:
        t0 = time.perf_counter()
        dropped, _ = dict(stale), stale.clear()  # their ranks free the groups' slots (on_discard)
        sync_group.broadcast_bytes(json.dumps({"op": "weights", "version": version, "stale": dropped}).encode(), 0)
        sender.send([(n, p.detach()) for n, p in model.state_dict().items()], version=version)
        return time.perf_counter() - t0

    eval_stats = EpisodeStats()

    def evaluate() -> float:
        eval_model.load_state_dict(model.state_dict())
        return task.accuracy(eval_model.eval(), tok, heldout, stats=eval_stats)

    step = 0
    push(step)
    acc_before = evaluate()
    print(f"held-out accuracy before RL: {acc_before:.3f} ({len(heldout)} problems, greedy episodes)", flush=True)
    t_start = t_rl = time.time()
    last_acc, max_age, trained_eps, dropped_stale = acc_before, 0, 0, 0
    ep_counts: Counter = Counter()
    while step < cfg.steps:
        t0 = time.perf_counter()
        batch: list[dict] = []
        while len(batch) < cfg.prompts_per_step:
            batch += q.get_batch(cfg.prompts_per_step - len(batch), current_version=step, timeout=0.5)
            if len(inbox.ended) == world - 1:
                raise RuntimeError("every rollout rank ended while the trainer still needs groups")
        wait_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        trajs = [t for rec in batch for t in rec["trajectories"] if t is not None]
        for rec in batch:
            for reason, turns, calls, _r in rec["episodes"]:
                ep_counts["episodes"] += 1
                ep_counts["turns"] += turns
                ep_counts["tool_calls"] += calls
                ep_counts[f"finish_{reason}"] += 1
        optim.zero_grad(set_to_none=True)
        m = task.grpo_backward(model, trajs, tok.pad_token_id, eps_low=cfg.eps_clip, eps_high=cfg.eps_clip)
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        if cfg.lr_decay:
            prog = max(step / cfg.steps, (time.time() - t_rl) / cfg.time_limit if cfg.time_limit else 0.0)
            for g in optim.param_groups:
                g["lr"] = cfg.lr * max(0.1, 1.0 - 0.9 * min(prog, 1.0))
        optim.step()
        ages = Counter(step - v for t in trajs for s in t.segments() for v, r in zip(s.versions, s.roles)
                       if r == "model")
        max_age = max(max_age, max(ages) if ages else 0)
        train_s = time.perf_counter() - t1
        step += 1
        trained_eps += len(trajs)
        dropped_stale += sum(stale.values())
        sync_s = push(step)
        done = step >= cfg.steps or (cfg.time_limit > 0 and time.time() - t_rl > cfg.time_limit)
        acc = evaluate() if (step % cfg.eval_every == 0 or done) else None
        last_acc = acc if acc is not None else last_acc
        rewards = [t.reward for t in trajs]
        rec = {
            "step": step, "version": step, "reward": sum(rewards) / len(rewards), "heldout_acc": acc,
            "loss": m["loss"], "approx_kl": m.get("approx_kl"),
            "clipfrac_low": m.get("clipfrac_low"), "clipfrac_high": m.get("clipfrac_high"), "grad_norm": float(gnorm),
            "staleness_hist": {str(k): v for k, v in sorted(ages.items())}, "tokens_trained": m["tokens_trained"],
            "tokens_per_s": m["tokens_trained"] / (time.perf_counter() - t0), "queue_wait_seconds": wait_s,
            "train_seconds": train_s, "sync_seconds": sync_s, "queue_len": len(q),
            "tool_calls_per_episode": sum(c for r in batch for _, _, c, _ in r["episodes"]) / len(trajs),
            "turns_mean": sum(t for r in batch for _, t, _, _ in r["episodes"]) / len(trajs),
            "lr": optim.param_groups[0]["lr"], "wall_seconds": time.time() - t_start,
        }
        with open(metrics_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if acc is not None and not cfg.quiet:
            print(f"step {step:4d}  {time.time() - t_rl:5.0f} s  reward {rec['reward']:.3f}  held-out {acc:.3f}  "
                  f"tool calls/episode {rec['tool_calls_per_episode']:.2f}  queue {len(q)}", flush=True)
        if done:
            break
    sync_group.broadcast_bytes(json.dumps({"op": "stop"}).encode(), 0)
    for t in inbox.threads:
        t.join()
    rollout = _sum_stats([e["episodes"] for e in inbox.ended.values()])
    counts = Counter()
    for e in inbox.ended.values():
        counts.update(e["counts"])
    summary = {
        "accuracy_before": acc_before, "accuracy_after": last_acc, "wall_seconds": time.time() - t_start,
        "rl_seconds_this_run": time.time() - t_rl, "steps": step, "max_staleness": cfg.max_staleness,
        "max_staleness_seen": max_age, "samples_generated": rollout["episodes"], "samples_trained": trained_eps,
        "samples_dropped_stale": dropped_stale * cfg.group_size, "samples_left_in_queue": len(q) * cfg.group_size,
        "turns_mean": rollout["turns"] / max(rollout["episodes"], 1), "tool_calls": rollout["tool_calls"],
        "env_errors": rollout["env_errors"] + rollout["env_timeouts"],
        "prefix_mismatches": rollout["prefix_mismatches"],
        "finish_reasons": rollout["finish_reasons"], "trained_episodes": dict(ep_counts),
        "rollout": dict(counts), "eval_episode_stats": eval_stats.stats(), "config": dataclasses.asdict(cfg),
    }
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    model.save_pretrained(run_dir / "policy")  # the trained policy, loadable with from_pretrained
    tok.save_pretrained(run_dir / "policy")
    print(f"held-out accuracy before RL: {acc_before:.3f}  after {step} steps: {last_acc:.3f}  "
          f"(+{100 * (last_acc - acc_before):.1f} points, {summary['wall_seconds']:.0f} s of RL)", flush=True)
    print(f"summary: {summary_path}", flush=True)


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


# ================================================================================================ main
def main(argv: list[str] | None = None) -> None:
    cfg = parse_flags(argv)
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        raise ValueError(f"world: expected >= 2 processes (rank 0 trains, the others generate), got {world}")
    torch.manual_seed(cfg.seed + rank)
    torch.set_num_threads(1)  # one core per process: a tiny model gains nothing from more, and they would contend
    sample_group = dist.new_group(list(range(world)), backend="gloo")
    if cfg.model:
        path = cfg.model
    else:
        root = os.path.join(cfg.runs_dir, "warmstart-agent")
        ws = task.WarmStart(target_train_accuracy=cfg.warmstart_target)
        if rank == 0:
            task.warm_start(root, ws, log=lambda s: print(s, flush=True))
        dist.barrier()
        path = task.warm_start(root, ws)
    box = [0]
    if rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            box[0] = s.getsockname()[1]
    dist.broadcast_object_list(box, src=0)
    sync_group = init_sync_group(master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"), master_port=int(box[0]),
                                 world_size=world, rank=rank, timeout=600.0)
    if rank == 0:
        trainer_main(cfg, world, sample_group, sync_group, path)
    else:
        tok, model = task.load(path)

        async def go():
            await Rollout(cfg, rank, world, sample_group, sync_group, tok, model.eval()).run()

        asyncio.run(go())
    dist.barrier(sample_group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
