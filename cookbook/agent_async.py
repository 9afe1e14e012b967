"""Bounded-async GRPO on a multi-turn tool task: the policy learns to use a calculator (AReaL-style, under torchrun).

    torchrun --standalone --nproc_per_node 2 cookbook/agent_async.py --name demo-agent     # CPU demo (make demo-agent)

Rank 0 trains, ranks 1.. generate. The task (``cookbook/agent_task.py``): ``a*b`` with three-digit operands, which
the tiny model cannot multiply; it can call ``calc`` with a Hermes tool call, read the ``tool`` turn and answer; at
most 3 turns, reward 1 iff the final answer is exactly ``a*b``. With ``--prompts`` the episodes answer your prompts
instead, with ``--tools`` (default: the calculator) and ``--reward`` on the final answer (``plumbing/``).

The protocol between the ranks is ``plumbing/bounded_async.py``, as in ``grpo_async.py``. Rollout rank
(:class:`Rollout`, a ``RolloutAdmission``): a TorchEngine on an asyncio loop; groups are admitted only while they
stay within η versions of the engine's weights, each is ``K`` concurrent ``run_episode`` calls on one problem
(``ToolEnv`` + calculator), every turn through ``resumable_generate``: a weight update (pause → ``update_weights`` →
resume) interrupts the turns in flight, which resume under the new weights with every token keeping the version that
sampled it. Finished groups (their ``Trajectory`` s: per-token ids, roles, logprobs, versions, turn ids) go to rank 0.

Trainer rank 0 (:func:`trainer_main`; its state in ``agent_async_trainer.py``): its ``TrainerLedger`` queues the
groups by their OLDEST token version; each step takes ``B`` groups whose age is ``≤ η`` (stale ones are counted and
reported back, which frees their slots), computes per-episode GRPO advantages and the PPO-clip loss against the
engine's logprobs over the model tokens (``agent_task.grpo_backward``: tool results and chat markers masked), steps,
and pushes the new weights as the next version. Held-out evaluation: ``--eval-k`` episodes per held-out prompt
(greedy by default), pass@k and mean@k, every ``--eval-every`` steps and before and after RL.

Files: ``runs/<name>/metrics.jsonl`` (one line per step; TensorBoard / W&B with ``--log-to``), ``eval/``,
``summary.json`` (with ``turns_mean``, ``tool_calls``, ``env_errors``, ``prefix_mismatches``), ``ckpt.pt`` and
``journal.jsonl``, ``policy/`` (the trained model and tokenizer); ``python cookbook/plot.py runs/<name>`` draws the
curves. ``--resume`` (or a ``torchrun --max-restarts`` restart) continues from the last checkpoint with the queued
groups, as ``grpo_async.py`` does: every episode received is trained, dropped as stale, lost in a crash (received
after the last checkpoint) or left in the queue, each counted, and the staleness bound holds across the restart.
"""


from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from dataclasses import dataclass

import agent_task as task
import torch
import torch.distributed as dist
from agent_async_trainer import Trainer
from plumbing import (
    Outbox,
    Reward,
    RolloutAdmission,
    RolloutEnd,
    StepLaps,
    TaskFlags,
    check_at_least,
    check_task_flags,
    close_dist,
    eval_reward_spec,
    every,
    join_sync_group,
    load_task,
    load_tokenizer,
    load_tools,
    make_engine,
    model_max_len,
    needs_reference,
    opt,
    parse_flags,
    pick_port,
    rank0_first,
    seed_rank,
    setup_dist,
)

from rlblocks.errors import ArgumentError
from rlblocks.rollout import SamplingParams
from rlblocks.rollout.agents import EpisodeStats
from rlblocks.sync import WeightReceiver


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
class Rollout(RolloutAdmission):
    """One rollout rank: groups of K episodes on one problem, shipped to rank 0; the admission, stale reports and
    weight commits are ``RolloutAdmission``'s."""

    def __init__(self, cfg: Config, rank: int, world: int, sample_group, sync_group, tok, engine, loop_task,
                 reward: Reward, tools: list) -> None:
        super().__init__(rank, batch_size=cfg.prompts_per_step, max_staleness=cfg.max_staleness,
                         max_concurrent=cfg.max_concurrent, dp_size=world - 1, outbox=Outbox(sample_group),
                         seed=cfg.seed, sync_group=sync_group)
        self.cfg, self.tok, self.engine = cfg, tok, engine
        self.task, self.reward, self.tools = loop_task, reward, tools  # what episodes answer, how, with what
        self.stats = EpisodeStats()
        self.receiver: WeightReceiver | None = None  # made on the control thread, at the first push

    def version(self) -> int:
        return self.engine.version

    async def group(self, uid: str, gid: int) -> None:
        """K episodes of one problem; the group is failed whole if a reward call failed, else shipped."""
        item = self.task.draw(self.rng)  # a Prompt: a toy problem never held out, or a --prompts row
        sp = SamplingParams(temperature=self.cfg.temperature, max_new_tokens=self.cfg.turn_tokens)
        counts = Counter()
        stats = EpisodeStats()  # this group's episodes, folded into the rank's once the group has ended
        try:
            eps = await task.episodes(self.engine, self.tok, [item] * self.cfg.group_size, tools=self.tools,
                                      reward=self.reward, sampling=sp, stats=stats, session_prefix=uid,
                                      group_ids=[gid] * self.cfg.group_size, max_turns=self.cfg.max_turns,
                                      counts=counts)
        except asyncio.CancelledError:  # cancelled at Stop: its finished episodes never reach the trainer
            self.counters["episodes_cancelled_at_stop"] += stats.stats()["episodes"]
            raise
        finally:
            self.stats.merge(stats)
        trajs = [e.trajectory for e in eps]
        versions = [t.oldest_version for t in trajs if t is not None and t.oldest_version is not None]
        self.counters["groups"] += 1
        self.counters["reward_failures"] += counts["reward_failures"]
        rec = {"uid": uid, "rank": self.rank, "problem": item.metadata.get("pair", item.text),
               "reward_failures": counts["reward_failures"], "trajectories": trajs,
               "episodes": [(e.finish_reason, e.num_turns, e.num_tool_calls, e.reward) for e in eps],
               "version": min(versions) if versions else int(self.engine.version)}
        if counts["reward_failures"]:  # score_answer read the failed call as 0: never train on a biased baseline
            self.failed(rec, len(eps))
        else:
            self.finished(uid, rec)

    def receive(self, msg) -> tuple[list, int]:
        """The full weights announced by ``msg``, received on the control thread."""
        if self.receiver is None:
            self.receiver = WeightReceiver(self.sync_group, 0)
        version, it = self.receiver.receive()
        return [(n, t.clone()) for n, t in it], version

    async def load(self, tensors: list, version: int) -> None:
        """Quiesce, swap, resume: turns in flight come back aborted and are resumed by resumable_generate under the
        new weights; their earlier tokens keep their version."""
        await self.engine.pause(mode="abort")
        await self.engine.update_weights(tensors, version=version)
        await self.engine.resume()

    def end(self) -> RolloutEnd:
        """The rank's counters and its episodes' statistics."""
        return RolloutEnd(self.rank, dict(self.counters), episodes=self.stats.stats())


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
    tok = load_tokenizer(path, chat=True)
    t = Trainer(cfg, world, sample_group, path, port, tok, *load_loop_task(cfg, tok))  # pushes version 0, evaluates
    model, optim = t.model, t.optim
    while t.step < cfg.steps:
        # ---- 1. take B groups whose oldest token is at most η versions old
        laps = StepLaps()
        batch = t.ledger.take(cfg.prompts_per_step, t.step)
        laps.lap("wait")
        trajs = [tr for rec in batch for tr in rec["trajectories"] if tr is not None]
        t.count_episodes(batch)
        # ---- 2. GRPO over the trajectories: advantages per episode, PPO-clip against the engine's logprobs
        optim.zero_grad(set_to_none=True)
        m = task.grpo_backward(model, trajs, t.tok.pad_token_id, eps_low=cfg.eps_clip, eps_high=cfg.eps_clip,
                               prefix_share=cfg.prefix_share)
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        if cfg.lr_decay:  # linearly to a tenth over the budget (steps or time limit, the nearer)
            prog = max(t.step / cfg.steps, (time.time() - t.t_rl) / cfg.time_limit if cfg.time_limit else 0.0)
            for g in optim.param_groups:
                g["lr"] = cfg.lr * max(0.1, 1.0 - 0.9 * min(prog, 1.0))
        optim.step()
        ages = Counter(t.step - v for tr in trajs for s in tr.segments() for v, r in zip(s.versions, s.roles)
                       if r == "model")
        laps.lap("train")
        t.step += 1
        t.ledger.trained(len(trajs), max(ages) if ages else 0,
                         without_trajectory=sum(tr is None for rec in batch for tr in rec["trajectories"]))
        # ---- 3. the new weights to every rollout rank (version = step)
        t.push()
        done = t.step >= cfg.steps or (cfg.time_limit > 0 and time.time() - t.t_rl > cfg.time_limit)
        laps.lap("sync")
        # ---- 4. evaluation, logging, checkpoint
        t.log_step(batch, trajs, m, gnorm, ages, laps, done)
        if every(t.step, cfg.save_every) or done:
            t.save_checkpoint()
        if done:
            break
    t.finish()  # stop the rollout ranks, collect their counters, write the summary and the policy


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
