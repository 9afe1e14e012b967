"""Bounded-async GRPO on a multi-turn tool task: the policy learns to use a calculator (AReaL-style, under torchrun).

    torchrun --standalone --nproc_per_node 2 cookbook/agent_async.py --name demo-agent     # CPU demo (make demo-agent)

Rank 0 trains, ranks 1.. generate. The task (``cookbook/agent_task.py``): ``a*b`` with three-digit operands, which
the tiny model cannot multiply; it can call ``calc`` with a Hermes tool call, read the ``tool`` turn and answer; at
most 3 turns, reward 1 iff the final answer is exactly ``a*b``. With ``--prompts`` the episodes answer your prompts
instead, with ``--tools`` (default: the calculator) and ``--reward`` on the final answer (``plumbing/``).

Rollout rank: a TorchEngine on an asyncio loop. Prompt groups are admitted by a ``StalenessController`` (at most
``(η + v + 1)·B`` groups accepted or running at policy version v); each group is ``K`` concurrent ``run_episode``
calls on one problem (``ToolEnv`` + calculator). Every turn goes through ``resumable_generate``: a weight update
(pause → ``update_weights`` → resume, driven by a receiver thread on the typed control messages ``Weights`` /
``Stale`` / ``Stop``) interrupts the turns in flight, which resume under the new weights with every token keeping
the version that sampled it. Finished groups (their ``Trajectory`` s, each with per-token ids, roles, logprobs,
versions and turn ids) travel to rank 0 through an ``Outbox`` (``send_object_list``).

Trainer rank 0 (:func:`trainer_main`): groups wait in a ``StalenessQueue`` keyed by their OLDEST token version (the
``Inbox`` threads put them there); each step takes ``B`` groups whose age is ``≤ η`` (stale ones are counted and
given back to their rollout rank with a ``Stale`` message), builds the batch with ``to_tensors`` (model tokens
trained, tool results and chat markers masked), computes per-episode GRPO advantages and the PPO-clip loss against
the engine's logprobs (``agent_task.grpo_backward``), steps, and sends the new weights (``WeightSender``) as the
next version. Held-out evaluation: ``--eval-k`` episodes per held-out prompt (greedy by default), pass@k and mean@k
through ``rlblocks.reward.summarize``, every ``--eval-every`` steps and before and after RL.

Files: ``runs/<name>/metrics.jsonl`` (one line per step; TensorBoard / W&B with ``--log-to``), ``eval/``,
``summary.json`` (with ``turns_mean``, ``tool_calls``, ``env_errors``, ``prefix_mismatches``), ``ckpt.pt`` and
``journal.jsonl``, ``policy/`` (the trained model and tokenizer); ``python cookbook/plot.py runs/<name>`` draws the
curves. ``--resume`` (or a ``torchrun --max-restarts`` restart) continues from the last checkpoint with the queued
groups, as ``grpo_async.py`` does: every episode received is trained, dropped as stale, lost in a crash (received
after the last checkpoint) or left in the queue, each counted, and the staleness bound holds across the restart.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass

import agent_task as task
import torch
import torch.distributed as dist
from plumbing import (
    Inbox,
    Outbox,
    Reward,
    RolloutEnd,
    RunFiles,
    Stale,
    Stop,
    TaskFlags,
    Weights,
    check_at_least,
    check_task_flags,
    close_dist,
    eval_metrics,
    eval_reward_spec,
    every,
    heldout_figures,
    join_sync_group,
    load_hf,
    load_model_state,
    load_optim_state,
    load_task,
    load_tokenizer,
    load_tools,
    make_engine,
    model_max_len,
    model_state,
    needs_reference,
    on_model,
    opt,
    optim_state,
    parse_flags,
    parse_log_flag,
    pick_port,
    rank0_first,
    recv_control,
    resume_run,
    save_policy,
    save_run_checkpoint,
    seed_rank,
    send_control,
    setup_dist,
)

from rlblocks.errors import ArgumentError
from rlblocks.rollout import EpisodeStats, SamplingParams
from rlblocks.sched import StalenessController, StalenessQueue
from rlblocks.sync import WeightReceiver, WeightSender


@dataclass
class Config(TaskFlags):
    """Bounded-async GRPO on the calculator tool task (flags are generated from these fields; the data, reward,
    evaluation and --log-to flags every loop shares come from plumbing's TaskFlags)."""

    name: str = opt("demo-agent", "run name: files go to <runs-dir>/<name>/")
    runs_dir: str = opt("runs", "where run directories live")
    model: str = opt("", "HF checkpoint directory whose tokenizer has a chat template; empty: the tiny demo model, "
                         "warm-started and cached")
    steps: int = opt(100000, "optimizer steps (= policy versions); the demo stops on --time-limit first")
    time_limit: float = opt(240.0, "stop training after this many seconds of RL (0: no limit)")
    prompts_per_step: int = opt(16, "B: prompt groups per optimizer step")
    group_size: int = opt(8, "K: episodes per prompt")
    max_staleness: int = opt(1, "η: largest version gap of a trained token (0 = synchronous)")
    max_concurrent: int = opt(48, "groups in flight over all rollout ranks")
    lr: float = opt(3e-4, "AdamW learning rate")
    lr_decay: bool = opt(True, "decay lr linearly to a tenth over the budget (steps or time limit, the nearer)")
    grad_clip: float = opt(1.0, "max grad norm")
    eps_clip: float = opt(0.2, "PPO clip offset (both sides)")
    temperature: float = opt(1.0, "sampling temperature")
    prefix_share: bool = opt(True, "trainer forward over the prefix tree of each batch: the episodes of a group "
                             "share their prompt, each turn's row the history before it (same loss up to rounding)")
    eval_every: int = opt(25, "held-out greedy accuracy every N steps, and before and after RL (0: only before "
                              "and after)")
    heldout: int = opt(300, "held-out prompts evaluated: the first this many (the toy task has 300)")
    tools: str = opt("", "the episodes' tools, module:function,... (a Tool, a function returning one, or a plain "
                         "function); empty: the calculator")
    max_turns: int = opt(3, "most model turns of an episode")
    turn_tokens: int = opt(16, "response budget of one turn")
    warmstart_target: float = opt(0.2, "warm start: stop once greedy accuracy on SFT problems reaches this")
    save_every: int = opt(25, "checkpoint every N steps, and after the last (0: after the last only)")
    resume: bool = opt(False, "continue from runs/<name>/ckpt.pt (a torchrun restart does so by itself)")
    seed: int = opt(0, "seed")
    quiet: bool = opt(False, "no per-eval progress lines")


def check_flags(cfg: Config) -> None:
    """Flag values that cannot work (refused before any process group is created)."""
    check_at_least(cfg, 1, "steps", "prompts_per_step", "group_size", "max_concurrent", "heldout", "max_turns",
                   "turn_tokens")
    check_at_least(cfg, 0, "max_staleness", "eval_every", "save_every")
    check_task_flags(cfg)
    if not cfg.chat:
        raise ArgumentError("--no-chat: an episode renders every turn with the tokenizer's chat template; the agent "
                            "loops need --chat")
    if cfg.tools:
        load_tools(cfg.tools)


# ================================================================================================ rollout side
class Rollout:
    """One rollout rank: admission-controlled groups of episodes, weight updates, shipping groups to rank 0."""

    def __init__(self, cfg: Config, rank: int, world: int, sample_group, sync_group, tok, engine, loop_task,
                 reward: Reward, tools: list) -> None:
        self.cfg, self.rank = cfg, rank
        self.sync_group = sync_group
        self.tok, self.engine = tok, engine
        self.task, self.reward, self.tools = loop_task, reward, tools  # what episodes answer, how, with what
        self.ctrl = StalenessController(batch_size=cfg.prompts_per_step, max_staleness=cfg.max_staleness,
                                        max_concurrent=cfg.max_concurrent, dp_size=world - 1)
        self.rng = random.Random(cfg.seed * 1000 + rank)
        self.stats = EpisodeStats()
        self.outbox = Outbox(sample_group)  # to trainer rank 0, by a thread
        self.counter = 0
        self.run_index = 0  # the run's start number (Weights.run): group uids are unique across restarts
        self.stopping = False
        self.first = asyncio.Event()
        self.wake = asyncio.Event()
        self.counts: Counter = Counter()

    async def _group(self, uid: str, gid: int) -> None:
        item = self.task.draw(self.rng)  # a Prompt: a toy problem never held out, or a --prompts row
        sp = SamplingParams(temperature=self.cfg.temperature, max_new_tokens=self.cfg.turn_tokens)
        counts = Counter()
        eps = await task.episodes(self.engine, self.tok, [item] * self.cfg.group_size, tools=self.tools,
                                  reward=self.reward, sampling=sp, stats=self.stats, session_prefix=uid,
                                  group_ids=[gid] * self.cfg.group_size, max_turns=self.cfg.max_turns, counts=counts)
        trajs = [e.trajectory for e in eps]
        versions = [t.oldest_version for t in trajs if t is not None and t.oldest_version is not None]
        self.counts["groups"] += 1
        self.counts["reward_failures"] += counts["reward_failures"]
        rec = {"uid": uid, "rank": self.rank, "problem": item.metadata.get("pair", item.text),
               "reward_failures": counts["reward_failures"], "trajectories": trajs,
               "episodes": [(e.finish_reason, e.num_turns, e.num_tool_calls, e.reward) for e in eps],
               "version": min(versions) if versions else int(self.engine.version)}
        if counts["reward_failures"]:
            # an episode's reward call failed (retries ran out; score_answer read it as 0): the group is failed
            # whole, never trained with a biased baseline; its slot is freed now, and the inbox counts its
            # episodes generated and failed without queueing them
            self.ctrl.on_reject()
            self.counts["groups_failed_reward"] += 1
            self.counts["samples_failed_reward"] += len(eps)
            rec["reward_failed"] = True
        else:
            self.ctrl.on_accept()
        self.outbox.put(rec)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        recv = threading.Thread(target=self._control_thread, args=(loop,), daemon=True)
        recv.start()
        self.outbox.start()
        await self.first.wait()
        tasks: set[asyncio.Task] = set()
        while not self.stopping:
            v = self.engine.version
            while not self.stopping and self.ctrl.try_submit(v):
                # group ids unique over rollout ranks and restarts (advantage groups)
                gid = (self.rank * 1000 + self.run_index) * 10**9 + self.counter
                tasks.add(loop.create_task(self._group(f"r{self.rank}-{self.run_index}-{self.counter}", gid)))
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
        self.outbox.close(RolloutEnd(self.rank, dict(self.counts), episodes=self.stats.stats()))
        recv.join()

    def _control_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        """Receive control messages and weights from trainer rank 0; apply them on the engine's loop."""
        receiver = WeightReceiver(self.sync_group, 0)
        while True:
            msg = recv_control(self.sync_group)
            if isinstance(msg, Stop):
                loop.call_soon_threadsafe(self._stop)
                return
            if isinstance(msg, Stale):
                if n := msg.groups.get(self.rank, 0):
                    loop.call_soon_threadsafe(self._discard, n)
                continue
            version, it = receiver.receive()
            tensors = [(n, t.clone()) for n, t in it]
            asyncio.run_coroutine_threadsafe(self._update(tensors, version, msg), loop).result()

    async def _update(self, tensors, version: int, msg: Weights) -> None:
        """Quiesce, swap, commit, resume: turns in flight come back aborted and are resumed by
        resumable_generate under the new weights; their earlier tokens keep their version. A run's first weights
        (fresh or resumed) restart the admission counters at ``version``, with this rank's groups still queued at
        the trainer counted as accepted (``Weights``)."""
        await self.engine.pause(mode="abort")
        await self.engine.update_weights(tensors, version=version)
        await self.engine.resume()
        if msg.first:
            self.ctrl.on_version_recovered(version)
            if queued := msg.queued.get(self.rank, 0):
                self.ctrl.on_submit(queued)
                self.ctrl.on_accept(queued)
            if msg.run:  # a restarted run: other problems and sampling seeds than the run that crashed drew
                self.run_index = msg.run
                self.rng = random.Random((self.cfg.seed * 1000 + self.rank) * 1009 + msg.run)
                random.seed((self.cfg.seed * 1000 + self.rank) * 1009 + msg.run)
        self.first.set()
        self.wake.set()

    def _discard(self, n: int) -> None:
        """``n`` of this rank's groups were dropped as stale by the trainer: they will never be trained, so they leave
        the accepted count, which frees their admission slots (a replacement submitted outside capacity instead would
        be accepted in turn, and after (η+1)·B drops capacity would stay 0: the run would stall)."""
        self.ctrl.on_discard(n)
        self.counts["groups_dropped_stale"] += n
        self.wake.set()

    def _stop(self) -> None:
        self.stopping = True
        self.wake.set()


def load_loop_task(cfg: Config, tok):
    """The episodes' prompts (the toy problems, or ``--prompts``) and tools (``--tools``, else the calculator)."""
    loop_task = (load_task(tok, cfg, needs_reference=needs_reference(cfg.reward, eval_reward_spec(cfg)),
                           encode_ids=False) if cfg.prompts else task.task())
    return loop_task, (load_tools(cfg.tools) if cfg.tools else task.default_tools())


def rollout_main(cfg: Config, rank: int, world: int, sample_group, path: str, port: int) -> None:
    tok = load_tokenizer(path, chat=True)
    sync_group = join_sync_group(rank, 1, world, port)
    loop_task, tools = load_loop_task(cfg, tok)
    reward = Reward(cfg.reward, tok, reward_model=cfg.reward_model, timeout=cfg.reward_timeout)

    async def main():
        engine = make_engine("torch", path, torch.device("cpu"), max_model_len=model_max_len(path),
                             max_batch_size=4096)
        try:
            await Rollout(cfg, rank, world, sample_group, sync_group, tok, engine, loop_task, reward, tools).run()
        finally:  # inside the event loop: the engine's step task ends cleanly
            await engine.aclose()

    try:
        asyncio.run(main())
    finally:
        reward.close()


# ================================================================================================ trainer side
def trainer_main(cfg: Config, world: int, sample_group, path: str, port: int) -> None:
    """Rank 0: take B fresh groups, one GRPO update over their trajectories, push the weights; repeat."""
    # ---- set-up: run files, policy and its evaluation copy, optimiser, queue + inbox, weight channel
    files = RunFiles(cfg.runs_dir, cfg.name, sinks=parse_log_flag(cfg.log_to), config=cfg)
    tok = load_tokenizer(path, chat=True)
    model = load_hf(path, torch.device("cpu"))[1]
    eval_model = load_hf(path, torch.device("cpu"))[1]
    model.train()
    loop_task, tools = load_loop_task(cfg, tok)
    heldout = loop_task.heldout[: cfg.heldout]
    eval_reward = Reward(eval_reward_spec(cfg), tok, reward_model=cfg.reward_model, timeout=cfg.reward_timeout)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    stale = Counter()  # groups dropped as stale since the last push, by rollout rank
    # fresh run, or resume from the last checkpoint (--resume, or torchrun restarted the group after a rank died)
    recovery = resume_run(files, cfg, rank=0, world=1,
                          required=("step", "model", "optim", "rng", "config", "queue", "counters"))
    ck = recovery.state
    # samples_generated (received), samples_trained, samples_without_trajectory, groups_dropped_stale,
    # samples_lost_in_crash, max_staleness_seen: over every start of the run
    tally = Counter(ck["counters"]) if ck is not None else Counter()
    if ck is not None:
        load_model_state(model, ck["model"])
        load_optim_state(model, optim, ck["optim"], 1)
        eval_reward.load_state_dict(ck["eval_reward"])
    if recovery.received > tally["samples_generated"]:  # received after the checkpoint: died with the crashed run
        tally["samples_lost_in_crash"] += recovery.received - tally["samples_generated"]
        tally["samples_generated"] = recovery.received

    def on_stale(rec: dict, version: int) -> None:  # counted and reported to its rollout rank, never silent
        stale[int(rec["rank"])] += 1

    q = StalenessQueue(max_staleness=cfg.max_staleness, on_stale=on_stale)
    if ck is not None:
        q.load_state_dict(ck["queue"])
    inbox = Inbox(range(1, world), sample_group, q, samples=lambda rec: len(rec["episodes"]),
                  generated=tally["samples_generated"], failed=tally["samples_failed_reward"],
                  journal=recovery.journal)
    sync_group = join_sync_group(0, 1, world, port)
    sender = WeightSender(sync_group, 0)

    def push(version: int, first: bool = False) -> float:
        """The stale groups' count to their ranks (they free those slots), then the weights as ``version``; the
        run's first push also carries each rank's groups still queued here and the run's start number."""
        t0 = time.perf_counter()
        if stale:
            send_control(sync_group, Stale(dict(stale)))
            stale.clear()
        queued = Counter(int(it["rank"]) for it, _, _ in q.state_dict()["items"]) if first else {}
        send_control(sync_group, Weights(version=version, kind="full", first=first, queued=dict(queued),
                                         run=len(recovery.starts) - 1 if first else 0))
        sender.send([(n, p.detach()) for n, p in model.state_dict().items()], version=version)
        return time.perf_counter() - t0

    def save_checkpoint() -> None:
        """The run checkpoint: weights, optimizer, the queue (read with the received count under the inbox's lock,
        so they agree), the counters and the summary's figures so far."""
        with inbox.lock:
            queue, tally["samples_generated"] = q.state_dict(), inbox.generated
            tally["samples_failed_reward"] = inbox.failed
        state = {"step": step, "model": model_state(model, 1), "optim": optim_state(model, optim, 1),
                 "queue": queue, "counters": dict(tally), "episodes": dict(ep_counts),
                 "accuracy_before": acc_before, "accuracy_after": last_acc, "heldout_before": heldout_before,
                 "heldout_after": heldout_after, "eval_reward": eval_reward.state_dict(),
                 "wall_seconds": time.time() - t_start}
        save_run_checkpoint(files, cfg, state, rank=0, world=1)

    eval_stats = EpisodeStats()

    def evaluate(step: int):
        """``--eval-k`` episodes per held-out prompt on a TorchEngine over a copy of the current weights."""
        eval_model.load_state_dict(model.state_dict())
        result = on_model(eval_model, lambda engine: task.eval_episodes(
            engine, tok, heldout, tools=tools, reward=eval_reward, k=cfg.eval_k, temperature=cfg.eval_temperature,
            turn_tokens=cfg.turn_tokens, max_turns=cfg.max_turns, stats=eval_stats, seed=cfg.seed))
        files.write_eval(step, result)
        return result

    step = recovery.step
    push(step, first=True)
    if ck is None:
        eval_before = evaluate(0)
        acc_before = last_acc = eval_before.mean_at_k
        heldout_before = heldout_after = heldout_figures(eval_before)
    else:
        acc_before, last_acc = ck["accuracy_before"], ck["accuracy_after"]
        heldout_before, heldout_after = ck["heldout_before"], ck["heldout_after"]
    print(f"held-out accuracy before RL: {acc_before:.3f} ({len(heldout)} prompts, {loop_task.heldout_source}, "
          f"{cfg.eval_k} episode(s) each)", flush=True)
    t_start = t_rl = time.time()
    failed_calls_logged = 0  # inbox.failed_calls at the last logged step
    if ck is not None:
        t_start -= ck["wall_seconds"]
    ep_counts: Counter = Counter(ck["episodes"]) if ck is not None else Counter()
    while step < cfg.steps:
        # ---- 1. take B groups whose oldest token is at most η versions old
        t0 = time.perf_counter()
        batch: list[dict] = []
        while len(batch) < cfg.prompts_per_step:
            batch += q.get_batch(cfg.prompts_per_step - len(batch), current_version=step, timeout=0.5)
            if len(inbox.ended) == world - 1:
                raise RuntimeError("every rollout rank ended while the trainer still needs groups")
        wait_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        trajs = [t for rec in batch for t in rec["trajectories"] if t is not None]
        tally["samples_without_trajectory"] += sum(t is None for rec in batch for t in rec["trajectories"])
        for rec in batch:
            for reason, turns, calls, _r in rec["episodes"]:
                ep_counts["episodes"] += 1
                ep_counts["turns"] += turns
                ep_counts["tool_calls"] += calls
                ep_counts[f"finish_{reason}"] += 1
        # ---- 2. GRPO over the trajectories: advantages per episode, PPO-clip against the engine's logprobs
        optim.zero_grad(set_to_none=True)
        m = task.grpo_backward(model, trajs, tok.pad_token_id, eps_low=cfg.eps_clip, eps_high=cfg.eps_clip,
                                   prefix_share=cfg.prefix_share)
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        if cfg.lr_decay:
            prog = max(step / cfg.steps, (time.time() - t_rl) / cfg.time_limit if cfg.time_limit else 0.0)
            for g in optim.param_groups:
                g["lr"] = cfg.lr * max(0.1, 1.0 - 0.9 * min(prog, 1.0))
        optim.step()
        ages = Counter(step - v for t in trajs for s in t.segments() for v, r in zip(s.versions, s.roles)
                       if r == "model")
        tally["max_staleness_seen"] = max(tally["max_staleness_seen"], max(ages) if ages else 0)
        train_s = time.perf_counter() - t1
        step += 1
        tally["samples_trained"] += len(trajs)
        tally["groups_dropped_stale"] += sum(stale.values())
        # ---- 3. the new weights to every rollout rank (version = step)
        sync_s = push(step)
        # ---- 4. evaluation, logging, checkpoint
        done = step >= cfg.steps or (cfg.time_limit > 0 and time.time() - t_rl > cfg.time_limit)
        result = evaluate(step) if (every(step, cfg.eval_every) or done) else None
        if result is not None:
            last_acc, heldout_after = result.mean_at_k, heldout_figures(result)
        acc = last_acc if result is not None else None
        rewards = [t.reward for t in trajs]
        # the failed reward calls received since the last step (their groups were failed whole, never in a batch)
        calls, failed_calls_logged = inbox.failed_calls - failed_calls_logged, inbox.failed_calls
        row = {
            "step": step, "version": step, "reward": sum(rewards) / len(rewards),
            "reward_failures": calls, **eval_metrics(result),
            "loss": m["loss"], "approx_kl": m.get("approx_kl"),
            "clipfrac_low": m.get("clipfrac_low"), "clipfrac_high": m.get("clipfrac_high"), "grad_norm": float(gnorm),
            "staleness_hist": {str(k): v for k, v in sorted(ages.items())}, "tokens_trained": m["tokens_trained"],
            "tokens_per_s": m["tokens_trained"] / (time.perf_counter() - t0), "queue_wait_seconds": wait_s,
            "train_seconds": train_s, "sync_seconds": sync_s, "queue_len": len(q),
            "step_seconds": time.perf_counter() - t0, "generate_seconds": None,  # the rollout ranks generate
            "samples_generated": inbox.generated, "samples_trained": tally["samples_trained"],
            "samples_failed_reward": inbox.failed,
            "tool_calls_per_episode": sum(c for r in batch for _, _, c, _ in r["episodes"]) / len(trajs),
            "turns_mean": sum(t for r in batch for _, t, _, _ in r["episodes"]) / len(trajs),
            "lr": optim.param_groups[0]["lr"], "wall_seconds": time.time() - t_start,
            "trained_uids": [r["uid"] for r in batch],
        }
        files.log(row)
        if acc is not None and not cfg.quiet:
            print(f"step {step:4d}  {time.time() - t_rl:5.0f} s  reward {row['reward']:.3f}  held-out {acc:.3f}  "
                  f"tool calls/episode {row['tool_calls_per_episode']:.2f}  queue {len(q)}", flush=True)
        if every(step, cfg.save_every) or done:
            save_checkpoint()
        if done:
            break
    # ---- the end: stop the rollout ranks, collect their counters, write the summary and the policy
    send_control(sync_group, Stop())
    inbox.join()
    rollout = _sum_stats([e.episodes for e in inbox.ended.values()])
    rollout_counts = Counter()
    for e in inbox.ended.values():
        rollout_counts.update(e.counters)
    # every episode received is trained, without a trajectory (its env failed to reset), dropped as stale, failed
    # with its group for its reward, lost in a crash (received after the last checkpoint) or left in the queue
    summary = {
        "accuracy_before": acc_before, "accuracy_after": last_acc, "wall_seconds": time.time() - t_start,
        "rl_seconds_this_run": time.time() - t_rl, "steps": step, "max_staleness": cfg.max_staleness,
        "max_staleness_seen": tally["max_staleness_seen"], "samples_generated": inbox.generated,
        "samples_trained": tally["samples_trained"], "samples_without_trajectory": tally["samples_without_trajectory"],
        "samples_dropped_stale": tally["groups_dropped_stale"] * cfg.group_size,
        "samples_failed_reward": inbox.failed, "groups_failed_reward": rollout_counts["groups_failed_reward"],
        "samples_lost_in_crash": tally["samples_lost_in_crash"], "samples_left_in_queue": len(q) * cfg.group_size,
        "episodes_run_this_start": rollout["episodes"],
        "turns_mean": rollout["turns"] / max(rollout["episodes"], 1), "tool_calls": rollout["tool_calls"],
        "env_errors": rollout["env_errors"] + rollout["env_timeouts"],
        "prefix_mismatches": rollout["prefix_mismatches"],
        "finish_reasons": rollout["finish_reasons"], "trained_episodes": dict(ep_counts),
        "rollout": dict(rollout_counts), "eval_episode_stats": eval_stats.stats(), "config": dataclasses.asdict(cfg),
        "task": loop_task.source, "heldout_prompts": len(heldout), "heldout_before": heldout_before,
        "heldout_after": heldout_after, "reward_failures": rollout_counts["reward_failures"],
        "eval_reward": eval_reward.stats(), **recovery.summary(),
    }
    files.write_summary(summary)
    files.close()
    eval_reward.close()
    model.save_pretrained(files.dir / "policy")  # the trained policy, loadable with from_pretrained
    tok.save_pretrained(files.dir / "policy")
    save_policy(cfg, tok, model)  # --save-hf: the same, where the user asks
    print(f"held-out accuracy before RL: {acc_before:.3f}  after {step} steps: {last_acc:.3f}  "
          f"(+{100 * (last_acc - acc_before):.1f} points, {summary['wall_seconds']:.0f} s of RL)", flush=True)
    print(f"summary: {files.summary}", flush=True)


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
    cfg = parse_flags(Config, argv, check=check_flags)
    # one core per process: a tiny model gains nothing from more threads, and they would contend
    rank, world, _ = setup_dist(threads=1, cpu=True)
    if world < 2:
        raise ArgumentError(f"world: expected >= 2 processes under torchrun (rank 0 trains, the others generate), "
                            f"got {world}")
    sample_group = dist.new_group(list(range(world)), backend="gloo")
    path = cfg.model or rank0_first(rank, lambda: task.warm_start(
        os.path.join(cfg.runs_dir, "warmstart-agent"), task.WarmStart(target_train_accuracy=cfg.warmstart_target),
        log=lambda s: print(s, flush=True)))
    port = pick_port(0, rank)
    seed_rank(cfg.seed, rank)  # after the warm start (it seeds and draws when not cached); the engine's seeds too
    if rank == 0:
        trainer_main(cfg, world, sample_group, path, port)
    else:
        rollout_main(cfg, rank, world, sample_group, path, port)
    dist.barrier(sample_group)
    close_dist()


if __name__ == "__main__":
    main()
