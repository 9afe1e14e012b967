"""Bounded-async, disaggregated GRPO under one torchrun world (AReaL-style; SLIME / ms-swift contracts via flags).

    torchrun --standalone --nproc_per_node 2 cookbook/grpo_async.py --name demo          # CPU demo
    torchrun --nnodes 2 --nproc_per_node 8 ... cookbook/grpo_async.py --model /ckpt --engine vllm --rollout-ranks 8
    ... --rollout-ranks 8 --cp 4     # long traces: the 8 trainer ranks as 2 DP × 4 CP (ring attention)

Ranks ``[0, T)`` train, ranks ``[T, W)`` generate (``T = W - rollout_ranks``). The protocol between them is
``plumbing/bounded_async.py``: a rollout rank (:class:`Rollout`, a ``RolloutAdmission``) admits prompt groups only
while they stay within η versions of its engine's weights, generates each sample through ``resumable_generate``,
scores the group (``--reward``) and ships it to trainer rank 0, whose ``TrainerLedger`` queues it by its OLDEST
token version. Each step (:func:`trainer_main`) takes B groups of age ≤ η (stale ones are counted and reported back,
which frees their admission slots), scatters them over the trainer ranks (DP × ``--cp``), and every trainer rank runs
``grpo_step`` (``cookbook/grpo.py``: GRPO advantages, π_old once, ``--ppo-epochs`` × ``--mini-batches`` updates of the
clipped loss; FSDP2 when T > 1). The new weights go to the rollout ranks (``plumbing/weight_sync.py``: ``--sync
full|delta|lora``, ``--rollout-dtype fp8``); a rollout rank loads them between two engine steps and commits the
version (``--partial-rollout``: requests in flight resume under the new weights, each token keeping the version that
produced it; without it they restart from the prompt). η = 0 is synchronous RL.

Files: ``runs/<name>/metrics.jsonl``, ``summary.json``, ``eval/``, ``ckpt.pt`` and ``journal.jsonl``. ``--resume`` (or
a ``torchrun --max-restarts`` restart) continues from the last checkpoint, the queued groups included; every sample
generated is trained, dropped stale, failed for its reward, lost in the crash or left in the queue, each counted.
Lines a user changes for a real model or task are marked ``REAL MODEL:``; what every loop shares is in ``plumbing/``.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import toy
from grpo import grpo_step
from grpo_async_trainer import Trainer
from plumbing import (
    EngineFlags,
    Outbox,
    Progress,
    Reward,
    RolloutAdmission,
    RolloutClock,
    StepLaps,
    TaskFlags,
    TimedEngine,
    batch_tensors,
    broadcast_flag,
    check_at_least,
    check_engine_flags,
    check_fits,
    check_loss_flags,
    check_max_model_len,
    check_task_flags,
    close_dist,
    eval_reward_spec,
    every,
    group_record,
    join_sync_group,
    length_budget,
    load_task,
    load_tokenizer,
    make_engine,
    needs_reference,
    opt,
    parse_flags,
    pick_port,
    prompts_per_rank,
    rank0_first,
    resolve_engine_dtype,
    resolve_max_model_len,
    save_policy,
    seed_rank,
    setup_dist,
    trainer_groups,
    until_eos,
)
from plumbing.bounded_async import DynamicSamplingFlags
from plumbing.losses import LossFlags
from plumbing.weight_sync import (
    WeightPuller,
    WeightSyncFlags,
    check_weight_sync_flags,
    engine_checkpoint,
    sync_backend,
)

from rlblocks.errors import ArgumentError
from rlblocks.rollout import GenerationRequest, SamplingParams, resumable_generate


@dataclass
class Config(TaskFlags, EngineFlags, LossFlags, WeightSyncFlags, DynamicSamplingFlags):
    """Bounded-async disaggregated GRPO (flags are generated from these fields; the data, reward, evaluation,
    --log-to, engine, loss, weight-sync and dynamic-sampling flags come from plumbing)."""

    name: str = opt("demo", "run name: files go to <runs-dir>/<name>/")
    runs_dir: str = opt("runs", "where run directories live")
    model: str = opt("", "HF checkpoint directory; empty: the tiny CPU demo model, warm-started and cached")
    engine: str = opt("torch", "rollout engine", ("torch", "vllm", "sglang"))
    sglang_url: str = opt("http://127.0.0.1:30000", "SGLang server base URL (--engine sglang)")
    max_model_len: int = opt(0, "prompt + response positions the engine's KV cache is sized for; 0: the model's "
                                "own positions (a real model: set it to your prompt + response budget)")
    rollout_ranks: int = opt(1, "ranks that generate; the others train")
    steps: int = opt(1200, "batches trained (= policy versions); a step count, so the result does not depend on "
                           "how loaded the machine is")
    time_limit: float = opt(0.0, "also stop after this many seconds of RL (0: no limit)")
    prompts_per_step: int = opt(16, "B: prompt groups per optimizer step (global)")
    group_size: int = opt(16, "K: samples per prompt")
    max_staleness: int = opt(1, "η: largest version gap of a trained token (0 = synchronous)")
    max_concurrent: int = opt(256, "groups in flight over all rollout ranks")
    partial_rollout: bool = opt(True, "resume interrupted generations under new weights (else restart them)")
    ppo_epochs: int = opt(2, "passes over each batch (π_old fixed at the first; > 1 makes ratios move and clip)")
    mini_batches: int = opt(2, "optimizer updates per pass, each on a random 1/mini_batches of the batch's samples")
    agg: str = opt("token-mean", "loss aggregation mode (global normalisers)")
    kl_coef: float = opt(0.0, "k3 KL penalty to the initial policy (0: no reference model)")
    lr: float = opt(1.5e-4, "AdamW learning rate")
    lr_decay: bool = opt(True, "decay lr linearly to 10% over the budget (steps or time limit, whichever is nearer)")
    grad_clip: float = opt(1.0, "max grad norm")
    temperature: float = opt(1.0, "sampling temperature (log-probs use the same)")
    prefix_share: bool = opt(True, "trainer forward over the prefix tree of each batch: a group's prompt is "
                             "forwarded once (same log-probs and gradients up to float rounding)")
    max_new_tokens: int = opt(6, "response budget")
    length_tail: float = opt(0.0, "benchmark: >0 forces lognormal response lengths with this median (p99/p50≈10)")
    eval_every: int = opt(50, "held-out greedy accuracy every N steps, and before and after RL (0: only before "
                              "and after)")
    save_every: int = opt(20, "checkpoint every N steps (0: never)")
    resume: bool = opt(False, "continue from runs/<name>/ckpt.pt (a torchrun restart does so by itself)")
    seed: int = opt(0, "seed")
    quiet: bool = opt(False, "no progress bar")
    cp: int = opt(1, "context-parallel trainer ranks per sequence (trainer ranks = DP × CP): each sequence's "
                     "positions are split over CP ranks with ring attention, for long traces; 1: off")


def check_flags(cfg: Config) -> None:
    """Flag combinations that cannot work (raised before any process group is created)."""
    check_engine_flags(cfg)  # first: resolves --correction auto
    check_loss_flags(cfg)
    check_task_flags(cfg)
    check_at_least(cfg, 0, "dynamic_max_rounds", "eval_every", "save_every")
    check_at_least(cfg, 1, "cp")
    check_max_model_len(cfg.max_model_len)
    check_weight_sync_flags(cfg)


def load_loop_task(cfg: Config, tok, max_model_len: int):
    """The task every rank of the run reads: the toy additions, or ``--prompts`` (with its held-out prompts)."""
    task = (load_task(tok, cfg, needs_reference=needs_reference(cfg.reward, eval_reward_spec(cfg)))
            if cfg.prompts else toy.task(tok))
    check_fits(task, max_model_len)
    return task


# ================================================================================================ rollout side
class Rollout(RolloutAdmission):
    """One rollout rank: groups of K samples from the engine, scored and shipped; the admission, stale reports and
    weight commits are ``RolloutAdmission``'s, the weight payloads ``WeightPuller``'s."""

    def __init__(self, cfg: Config, rank: int, n_train: int, sample_group, sync_group, tokenizer, engine,
                 max_model_len: int, task, reward: Reward) -> None:
        super().__init__(rank, batch_size=cfg.prompts_per_step, max_staleness=cfg.max_staleness,
                         max_concurrent=cfg.max_concurrent, dp_size=cfg.rollout_ranks, outbox=Outbox(sample_group),
                         seed=cfg.seed, dynamic_sampling=cfg.dynamic_sampling,
                         dynamic_max_rounds=cfg.dynamic_max_rounds, sync_group=sync_group)
        self.cfg, self.n_train, self.tok, self.engine = cfg, n_train, tokenizer, engine
        self.max_model_len, self.task, self.reward = max_model_len, task, reward  # prompts (toy or --prompts)
        self.clock = RolloutClock(engine)  # where this rank's time goes, reported at every weight commit
        self.timed = TimedEngine(engine, self.clock)
        self.weights = WeightPuller(cfg, sync_group)

    def version(self) -> int:
        return self.engine.version

    async def _one(self, req: GenerationRequest):
        if self.cfg.partial_rollout:
            res = await resumable_generate(self.timed, req)
            self.counters["resubmissions"] += res.num_submissions - 1
            return res
        while True:  # no partial rollout: an interrupted sample restarts from its prompt under the new weights
            gen = await self.timed.generate(req)
            if gen.finish_reason != "abort":
                return gen
            self.counters["tokens_discarded"] += len(gen.output_ids)
            while getattr(self.engine, "is_paused", False):
                await asyncio.sleep(0.005)

    async def group(self, uid: str, gid: int) -> None:
        """K samples of one prompt, scored together; failed whole if a reward call failed, else filtered/shipped."""
        item = self.task.draw(self.rng)  # a Prompt: the toy task's, or a --prompts row (ids through the template)
        prompt, cfg = list(item.ids), self.cfg
        budget = length_budget(cfg.max_new_tokens, cfg.length_tail, self.max_model_len - len(prompt), self.rng)
        stop = (self.tok.eos_token_id,) if cfg.length_tail <= 0 else ()
        sp = SamplingParams(temperature=cfg.temperature, max_new_tokens=budget, stop_token_ids=stop)
        gens = await asyncio.gather(*[self._one(GenerationRequest(f"{uid}/{k}", prompt, sp))
                                      for k in range(cfg.group_size)])
        self.settle()  # scored from here on, so shipped even if Stop comes now
        rewards, keep, failed = await self.reward.group_scores(
            [item] * len(gens), [until_eos(g.output_ids, self.tok.eos_token_id) for g in gens], len(gens))
        self.counters["samples_generated"] += len(gens)
        self.counters["tokens_generated"] += sum(len(g.output_ids) for g in gens)
        self.counters["reward_failures"] += failed
        rec = group_record(uid, item.metadata.get("pair", item.text), prompt, gens, rewards, self.rank)
        rec["reward_failures"] = failed  # the trainer logs them with the step that trains the group
        if keep[0]:
            self.finished(uid, rec, rewards)
        else:
            self.failed(rec, len(gens))

    def receive(self, msg) -> tuple[list, int]:
        """The payload announced by ``msg`` (``WeightPuller``: full, delta or LoRA, FP8 or not)."""
        return self.weights.receive(msg)

    async def load(self, tensors: list, version: int) -> None:
        """Quiesce, swap, resume. With ``--partial-rollout`` the requests stay in the engine: ``update_weights``
        freezes them between two steps, loads, drops their KV (computed under the old weights) and resumes them,
        re-prefilling prompt + tokens so far (aborting them first would cost a round trip per request, for nothing).
        Without partial rollout they come back aborted and restart from the prompt."""
        self.clock.load_started()
        if not self.cfg.partial_rollout:
            await self.engine.pause(mode="abort")
        await self.engine.update_weights(tensors, version=version)
        if not self.cfg.partial_rollout:
            await self.engine.resume()
        self.clock.load_ended(self.timed.in_flight_tokens() if self.cfg.partial_rollout else 0)
        self.outbox.put(self.clock.report(self.rank, version))
        self.counters["fp8_weights_loaded"] += sum(1 for _, x in tensors if x.dtype == torch.float8_e4m3fn)


def rollout_main(cfg: Config, rank: int, n_train: int, device, sample_group, path: str, port: int) -> None:
    tok = load_tokenizer(path)
    sync_group = join_sync_group(rank, n_train, cfg.rollout_ranks + n_train, port, backend=sync_backend(cfg))
    max_model_len = resolve_max_model_len(cfg.max_model_len, path)
    task = load_loop_task(cfg, tok, max_model_len)
    reward = Reward(cfg.reward, tok, reward_model=cfg.reward_model, device=device, timeout=cfg.reward_timeout)

    async def main(engine_path: str):
        engine = make_engine(cfg.engine, engine_path, device, max_model_len=max_model_len,
                             max_staleness=cfg.max_staleness, sglang_url=cfg.sglang_url,
                             dtype=resolve_engine_dtype(cfg), kv_cache_mb=cfg.kv_cache_mb)
        try:
            await Rollout(cfg, rank, n_train, sample_group, sync_group, tok, engine, max_model_len, task,
                          reward).run()
        finally:  # inside the event loop: the engine's own tasks (step loop, vLLM's output handler) end cleanly
            await engine.aclose()

    try:
        with engine_checkpoint(cfg, path) as engine_path:  # --rollout-dtype fp8 --engine vllm: a block-FP8 copy
            asyncio.run(main(engine_path))
    finally:
        reward.close()


# ================================================================================================ trainer side
def trainer_main(cfg: Config, rank: int, world: int, n_train: int, device, groups: dict, path: str,
                 port: int) -> None:
    """Every trainer rank: take B fresh groups (rank 0), one ``grpo_step``, push the weights; repeat."""
    t = Trainer(cfg, rank, world, n_train, device, groups, path, port,
                load_task=lambda tok: load_loop_task(cfg, tok, resolve_max_model_len(cfg.max_model_len, path)))
    tensors = t.push(first=True)
    t.evaluate_before(tensors)
    bar = Progress(cfg.steps, t.step, enabled=t.is0 and not cfg.quiet)
    t.t_rl = time.time()
    while t.step < cfg.steps:
        laps = StepLaps()
        # ---- 1. B groups whose oldest token is at most η versions old, scattered over the trainer ranks
        groups_here, batch = t.take_batch()
        laps.lap("wait")
        # ---- 2. the GRPO update (cookbook/grpo.py) on this rank's share
        bt = batch_tensors(groups_here, t.tok.pad_token_id, device)
        t.set_lr()
        m = grpo_step(cfg, t.policy, t.optim, bt, ref_policy=t.ref, group=t.tg.dp, grad_scale=float(n_train),
                      step=t.step, max_staleness=cfg.max_staleness)
        stats = t.batch_stats(bt, version=t.step)  # token ages against the version that was trained
        laps.lap("train")
        t.step += 1  # one new policy version per batch
        # ---- 3. the new weights to every rollout rank (version = step); accounting
        tensors = t.push()
        if t.is0:
            t.ledger.trained(stats["samples"], stats["max_age"])
        done = t.step >= cfg.steps or (cfg.time_limit > 0 and time.time() - t.t_rl > cfg.time_limit)
        done = broadcast_flag(done, group=t.group, device=device)  # rank 0's clock decides for every trainer rank
        laps.lap("sync")
        # ---- 4. evaluation, logging, checkpoint
        if t.is0:
            t.log_step(tensors, stats, m, batch, laps, done)
            bar.update({"reward": stats["reward"], "acc": t.last_acc, "stale": stats["max_age"]})
        if cfg.save_every and (every(t.step, cfg.save_every) or done):
            t.save_checkpoint()
        if done:
            break
    bar.close()
    save_policy(cfg, t.tok, t.lm, peft_model=t.peft_model, policy=t.policy, world=n_train, rank=rank,
                base=path)  # --save-hf
    if t.is0:
        t.finish(tensors)


# ================================================================================================ main
def main(argv: list[str] | None = None) -> None:
    cfg = parse_flags(Config, argv, check=check_flags)
    rank, world, device = setup_dist()
    if world < 2:
        raise ArgumentError(f"world: expected >= 2 processes under torchrun (trainer ranks, then --rollout-ranks "
                            f"rollout ranks), got {world}")
    n_train = world - cfg.rollout_ranks
    if n_train < 1 or cfg.rollout_ranks < 1:
        raise ArgumentError(f"--rollout-ranks: expected 1..{world - 1} for a world of {world} (trainer ranks and "
                            f"rollout ranks under one torchrun), got {cfg.rollout_ranks}")
    # every rank creates every group, in the same order
    train_ranks = list(range(n_train))
    groups = {"train": dist.new_group(train_ranks), "sample": dist.new_group(list(range(world)), backend="gloo")}
    groups["tg"] = trainer_groups(train_ranks, cfg.cp, rank, train_group=groups["train"])  # DP × CP
    prompts_per_rank(cfg, groups["tg"].dp_size, rollout_ranks=cfg.rollout_ranks)
    if n_train > 1:
        from torch.distributed.device_mesh import DeviceMesh

        groups["mesh"] = DeviceMesh(device.type, train_ranks)
    path = cfg.model or rank0_first(rank, lambda: toy.warm_start(os.path.join(cfg.runs_dir, "warmstart"),
                                                                 log=lambda s: print(s, flush=True)))
    port = pick_port(cfg.sync_port, rank)
    seed_rank(cfg.seed, rank)  # after the warm start (it seeds and draws when not cached); the engine's seeds too
    if rank < n_train:
        trainer_main(cfg, rank, world, n_train, device, groups, path, port)
    else:
        rollout_main(cfg, rank, n_train, device, groups["sample"], path, port)
    dist.barrier(groups["sample"])
    close_dist()


if __name__ == "__main__":
    main()
