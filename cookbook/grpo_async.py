"""Bounded-async, disaggregated GRPO under one torchrun world (AReaL-style; SLIME / ms-swift contracts via flags).

    torchrun --standalone --nproc_per_node 2 cookbook/grpo_async.py --name demo          # CPU demo
    torchrun --nnodes 2 --nproc_per_node 8 ... cookbook/grpo_async.py --model /ckpt --engine vllm --rollout-ranks 8

Ranks ``[0, T)`` train, ranks ``[T, W)`` generate (``T = W - rollout_ranks``).

Rollout rank: an asyncio loop drives an engine (TorchEngine / VLLMEngine / SGLangEngine). It submits prompt groups
as the ``StalenessController`` admits them (AReaL: at most ``(η + v + 1)·B`` groups accepted or running at policy
version v), each sample through ``resumable_generate``. Finished groups are scored (exact match), optionally
filtered by a ``DynamicSampler`` (zero-variance groups are rejected, freeing their slot, at most
``--dynamic-max-rounds`` × B per batch; then the batch proceeds with the groups as they come) and sent to trainer rank 0
with ``send_object_list`` on a gloo group (lossless pickles). A receiver thread waits for weights on a separate
sync group; an update runs *pause → update_weights(version) → resume* on the engine. With ``--partial-rollout``
the interrupted generations are resumed by ``resumable_generate`` under the new weights (tokens keep the version
that produced them); without it they restart from the prompt (their tokens are counted as discarded), so each
sample comes from a single policy version.

Trainer rank 0: a thread per rollout rank receives groups into a ``StalenessQueue`` keyed by the group's OLDEST
token version. Each step takes ``B`` groups with ``current_version − version ≤ η`` (re-checked at consumption;
stale ones are counted and their admission slots refunded to the rollout rank), scatters them over the trainer
ranks, and every trainer rank computes the GRPO loss with ``linear_token_logprobs`` and globally normalised
aggregation (FSDP2 ``fully_shard`` when T > 1). The new weights (``full_tensors``) go to the rollout ranks with
``WeightSender`` (``--sync full``) or as ``DeltaPacket`` s (``--sync delta``). η = 0 is synchronous RL.

Files: ``runs/<name>/metrics.jsonl`` (one line per step), ``summary.json``, ``ckpt.pt`` (``--resume``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import queue as pyqueue
import random
import sys
import threading
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

from rlblocks.rollout import GenerationRequest, SamplingParams, resumable_generate
from rlblocks.sched import DynamicSampler, StalenessController, StalenessQueue
from rlblocks.sync import (
    DeltaDecoder,
    DeltaEncoder,
    GroupDeltaTransport,
    LoraSyncer,
    WeightReceiver,
    WeightSender,
    full_tensors,
    init_sync_group,
    merge_lora,
)
from rlblocks.sync.lora import split_lora_message


@dataclass
class Config:
    """Bounded-async disaggregated GRPO (flags are generated from these fields)."""

    name: str = opt("demo", "run name: files go to <runs-dir>/<name>/")
    runs_dir: str = opt("runs", "where run directories live")
    model: str = opt("", "HF checkpoint directory; empty: the tiny CPU demo model, warm-started and cached")
    engine: str = opt("torch", "rollout engine", ("torch", "vllm", "sglang"))
    sglang_url: str = opt("http://127.0.0.1:30000", "SGLang server base URL (--engine sglang)")
    rollout_ranks: int = opt(1, "ranks that generate; the others train")
    steps: int = opt(5000, "optimizer steps (= policy versions); the CPU demo stops on --time-limit first")
    time_limit: float = opt(470.0, "stop training after this many seconds of RL (0: no limit)")
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
    correction: str = opt("none", "train/rollout mismatch correction", ("tis", "mis", "none"))
    correction_cap: float = opt(2.0, "tis/mis upper bound on π_prox/π_rollout (mis lower = 1/cap)")
    loss: str = opt("ppo", "policy loss", ("ppo", "gspo", "cispo", "decoupled"))
    agg: str = opt("token-mean", "loss aggregation mode (global normalisers)")
    eps_low: float = opt(0.2, "clip offset below 1")
    eps_high: float = opt(0.2, "clip offset above 1")
    kl_coef: float = opt(0.0, "k3 KL penalty to the initial policy (0: no reference model)")
    lr: float = opt(1.5e-4, "AdamW learning rate (demo: 2e-4 dips mid-run, 3e-4 oscillates at η=1)")
    lr_decay: bool = opt(True, "decay lr linearly to 10% over the budget (steps or time limit, whichever is nearer)")
    grad_clip: float = opt(1.0, "max grad norm")
    temperature: float = opt(1.0, "sampling temperature (log-probs use the same)")
    max_new_tokens: int = opt(6, "response budget")
    length_tail: float = opt(0.0, "benchmark: >0 forces lognormal response lengths with this median (p99/p50≈10)")
    eval_every: int = opt(40, "held-out greedy accuracy every N steps (and at the end)")
    save_every: int = opt(20, "checkpoint every N steps (0: never)")
    resume: bool = opt(False, "continue from runs/<name>/ckpt.pt")
    seed: int = opt(0, "seed")
    sync_port: int = opt(0, "port of the weight-sync group's store on rank 0 (0: a free one)")
    quiet: bool = opt(False, "no progress bar")


# ================================================================================================ setup
def setup_dist() -> tuple[int, int, torch.device]:
    """Default group: NCCL on GPUs, gloo on CPU. Returns (rank, world, device)."""
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    return rank, world, device


def policy_path(cfg: Config, rank: int) -> str:
    """The checkpoint every rank loads: ``--model`` or the cached warm start (built once, by rank 0)."""
    if cfg.model:
        return cfg.model
    root = os.path.join(cfg.runs_dir, "warmstart")
    if rank == 0:
        toy.warm_start(root, log=lambda s: print(s, flush=True))
    dist.barrier()
    return toy.warm_start(root)


def length_budget(cfg: Config, rng: random.Random) -> int:
    """Response budget: ``max_new_tokens``, or (benchmark) a lognormal length with median ``length_tail``
    and σ = ln(10)/2.326 (p99/p50 = 10), capped at the model's room."""
    if cfg.length_tail <= 0:
        return cfg.max_new_tokens
    n = round(rng.lognormvariate(math.log(cfg.length_tail), 0.99))
    return max(cfg.max_new_tokens, min(n, 200))


# ================================================================================================ rollout side
def make_engine(cfg: Config, path: str, device: torch.device):
    if cfg.engine == "torch":
        from rlblocks.rollout import TorchEngine

        return TorchEngine.from_pretrained(path, device=device, max_batch_size=1024)
    if cfg.engine == "vllm":
        from rlblocks.rollout import VLLMEngine

        args = {"max_model_len": 256}
        if not torch.cuda.is_available():
            args.update(enforce_eager=True, kv_cache_memory_bytes=64 << 20)
        return VLLMEngine.from_pretrained(path, max_staleness=cfg.max_staleness, **args)
    from rlblocks.rollout import SGLangEngine

    return SGLangEngine(cfg.sglang_url)


class Rollout:
    """One rollout rank: admission-controlled group generation, weight updates, and shipping groups out."""

    def __init__(self, cfg: Config, rank: int, n_train: int, sample_group, sync_group, tokenizer, engine) -> None:
        self.cfg, self.rank, self.n_train = cfg, rank, n_train
        self.sample_group, self.sync_group = sample_group, sync_group
        self.tok, self.engine = tokenizer, engine
        self.idx = rank - n_train
        self.ctrl = StalenessController(
            batch_size=cfg.prompts_per_step,
            max_staleness=cfg.max_staleness,
            max_concurrent=cfg.max_concurrent,
            dp_size=cfg.rollout_ranks,
        )
        self.sampler = (DynamicSampler(target_groups=self.ctrl.batch_size, keep_when_insufficient=True)
                        if cfg.dynamic_sampling else None)
        self.window_filled = 0  # groups shipped unfiltered in the sampler's current batch window (round limit hit)
        self.pairs = toy.split_pairs()["rl"]
        self.rng = random.Random(cfg.seed * 1000 + rank)
        self.outbox: pyqueue.Queue = pyqueue.Queue()
        self.refund = 0  # admission slots given back by the trainer (groups dropped as stale there)
        self.counter = 0
        self.stats = Counter()
        self.version_event: asyncio.Event | None = None
        self.stopping = False

    # ---------------------------------------------------------------- generation
    async def _one(self, req: GenerationRequest):
        if self.cfg.partial_rollout:
            res = await resumable_generate(self.engine, req)
            self.stats["resubmissions"] += res.num_submissions - 1
            return res
        while True:  # no partial rollout: an interrupted sample restarts from its prompt under the new weights
            gen = await self.engine.generate(req)
            if gen.finish_reason != "abort":
                return gen
            self.stats["tokens_discarded"] += len(gen.output_ids)
            while getattr(self.engine, "is_paused", False):
                await asyncio.sleep(0.005)

    async def _group(self, uid: str, pair: tuple[int, int]) -> None:
        prompt = toy.encode_prompt(self.tok, *pair)
        budget = length_budget(self.cfg, self.rng)
        stop = (self.tok.eos_token_id,) if self.cfg.length_tail <= 0 else ()
        sp = SamplingParams(temperature=self.cfg.temperature, max_new_tokens=budget, stop_token_ids=stop)
        gens = await asyncio.gather(
            *[self._one(GenerationRequest(f"{uid}/{k}", prompt, sp)) for k in range(self.cfg.group_size)]
        )
        rewards = [toy.reward(self.tok, *pair, _until_eos(g.output_ids, self.tok.eos_token_id)) for g in gens]
        rec = group_record(uid, pair, prompt, gens, rewards, self.rank)
        self.stats["samples_generated"] += len(gens)
        self.stats["tokens_generated"] += sum(len(g.output_ids) for g in gens)
        if self.sampler is not None and not self._keep(uid, rewards, rec):
            self.ctrl.on_reject()
            self.stats["groups_filtered"] += 1
            return
        self.ctrl.on_accept()
        self.outbox.put(rec)

    def _keep(self, uid: str, rewards: list[float], rec: dict) -> bool:
        """Dynamic sampling with a bound. A batch window wants ``target`` (= per-rank B) groups; a zero-variance
        group is discarded (its slot freed, so another group is generated) only while fewer than
        ``dynamic_max_rounds · target`` groups were discarded in this window. Past that bound the window proceeds
        with what it has (``keep_when_insufficient``): its shortfall is filled by the next groups as they finish,
        marked ``zero_variance_fill`` and counted, so the trainer never waits forever and nothing goes unseen."""
        s = self.sampler
        if not s.add_group(uid, rewards):
            discarded_before = s.counts()["filtered"] - 1 - self.window_filled
            if discarded_before < self.cfg.dynamic_max_rounds * s.target_groups:
                return False
            rec["zero_variance_fill"] = True
            self.window_filled += 1
            self.stats["groups_filled_unfiltered"] += 1
        if len(s.finish()) + self.window_filled >= s.target_groups:  # the window's batch is complete
            s.reset()
            self.window_filled = 0
        return True

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.version_event = asyncio.Event()
        recv = threading.Thread(target=self._weights_thread, args=(loop,), daemon=True)
        send = threading.Thread(target=self._send_thread, daemon=True)
        recv.start()
        send.start()
        await self.first_weights.wait()
        tasks: set[asyncio.Task] = set()
        while not self.stopping:
            v = self.engine.version
            while True:  # admit as many groups as the controller (plus refunded slots) allows
                if self.ctrl.try_submit(v):
                    pass
                elif self.refund > 0:
                    self.refund -= 1
                    self.ctrl.on_submit()
                else:
                    break
                if self.sampler is not None:
                    self.sampler.on_submit()
                uid = f"r{self.rank}-{self.counter}"
                self.counter += 1
                t = loop.create_task(self._group(uid, self.rng.choice(self.pairs)))
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
        self.stats["groups_cancelled_at_stop"] = len(tasks)
        self.outbox.put(None)
        send.join()
        recv.join()

    # ---------------------------------------------------------------- threads
    def _send_thread(self) -> None:
        while True:
            rec = self.outbox.get()
            if rec is None:
                dist.send_object_list([{"op": "end", "rank": self.rank, "stats": dict(self.stats)}], dst=0,
                                      group=self.sample_group)
                return
            dist.send_object_list([rec], dst=0, group=self.sample_group)

    def _weights_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        """Receive control messages and weights from trainer rank 0; apply them on the engine's loop."""
        g = self.sync_group
        receiver = WeightReceiver(g, 0)
        transport = GroupDeltaTransport(g, 0)
        decoder: DeltaDecoder | None = None
        lora_base: dict = {}
        while True:
            msg = json.loads(g.broadcast_bytes(None, 0))
            if msg["op"] == "stop":
                loop.call_soon_threadsafe(self._stop)
                return
            if msg["op"] == "refund":
                n = int(msg["counts"].get(str(self.rank), 0))
                if n:
                    loop.call_soon_threadsafe(self._add_refund, n)
                continue
            t0 = time.perf_counter()
            if msg["kind"] == "lora":  # base once, then adapters; merged here for engines without LoRA loading
                version, it = receiver.receive()
                base, adapters, _info = split_lora_message(it)
                if base:
                    lora_base = base
                tensors = list(merge_lora(lora_base.items(), adapters))
            elif msg["kind"] == "full":
                version, it = receiver.receive()
                tensors = [(n, t.clone()) for n, t in it]
                if self.cfg.sync == "delta":  # the chain's base
                    decoder = DeltaDecoder({n: t.clone() for n, t in tensors}, version=version)
            else:
                packet = transport.receive()
                decoder.apply(packet)
                version = decoder.version
                tensors = list(decoder.tensors.items())
            fut = asyncio.run_coroutine_threadsafe(self._update(tensors, version, msg), loop)
            fut.result()
            self.stats["sync_seconds"] += time.perf_counter() - t0

    async def _update(self, tensors, version: int, msg: dict) -> None:
        """Quiesce, swap, commit, resume: in-flight requests come back aborted (partial output kept by
        resumable_generate), the weights are loaded, the version becomes visible, generation resumes."""
        await self.engine.pause(mode="abort")
        await self.engine.update_weights(tensors, version=version)
        await self.engine.resume()
        if msg.get("recovered") is not None:  # first weights of a resumed run: AReaL's accepted = v·B
            self.ctrl.on_version_recovered(version)
            self.refund -= int(msg.get("queued", {}).get(str(self.rank), 0))
        self.first_weights.set()
        self.version_event.set()

    def _add_refund(self, n: int) -> None:
        self.refund += n
        self.version_event.set()

    def _stop(self) -> None:
        self.stopping = True
        self.version_event.set()


def _until_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def rollout_main(cfg: Config, rank: int, n_train: int, device, sample_group, path: str, port: int) -> None:
    tok = load_hf_tokenizer(path)
    sync_group = join_sync_group(cfg, rank, n_train, port)

    async def main():
        engine = make_engine(cfg, path, device)
        r = Rollout(cfg, rank, n_train, sample_group, sync_group, tok, engine)
        r.first_weights = asyncio.Event()
        await r.run()
        if hasattr(engine, "shutdown"):
            res = engine.shutdown()
            if asyncio.iscoroutine(res):
                await res

    asyncio.run(main())


def load_hf_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def join_sync_group(cfg: Config, rank: int, n_train: int, port: int):
    """Trainer rank 0 (sync rank 0) + every rollout rank (sync rank 1 + i), on its own TCPStore at ``port``."""
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    backend = "nccl" if torch.cuda.is_available() and cfg.engine == "torch" else "gloo"
    sync_rank = 0 if rank == 0 else rank - n_train + 1
    return init_sync_group(master_addr=addr, master_port=port, world_size=cfg.rollout_ranks + 1, rank=sync_rank,
                           backend=backend, timeout=600.0)


def pick_sync_port(cfg: Config, rank: int) -> int:
    """Rank 0 picks the weight-sync port (``--sync-port``, or a free one) and tells every rank."""
    port = cfg.sync_port
    if rank == 0 and port == 0:
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
    box = [port]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


# ================================================================================================ trainer side
class Inbox:
    """Trainer rank 0: one thread per rollout rank receives groups into the StalenessQueue (nothing dropped)."""

    def __init__(self, cfg: Config, n_train: int, world: int, sample_group, q: StalenessQueue) -> None:
        self.q, self.generated, self.ended = q, 0, {}
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, args=(r, sample_group), daemon=True)
                        for r in range(n_train, world)]
        for t in self.threads:
            t.start()

    def _loop(self, src: int, group) -> None:
        while True:
            box = [None]
            dist.recv_object_list(box, src=src, group=group)
            rec = box[0]
            if rec.get("op") == "end":
                with self.lock:
                    self.ended[src] = rec["stats"]
                return
            self.q.put(rec, rec["version"])
            with self.lock:
                self.generated += len(rec["samples"])

    def join(self) -> None:
        for t in self.threads:
            t.join()


def trainer_main(cfg: Config, rank: int, world: int, n_train: int, device, groups: dict, path: str,
                 port: int) -> None:
    files = RunFiles(cfg.runs_dir, cfg.name)
    is0 = rank == 0
    tok, lm = load_hf(path, device)
    lm.train()
    peft_model = None
    if cfg.sync == "lora":  # LoRA training: adapters on every decoder linear; the HF modules are wrapped in place
        from peft import LoraConfig, get_peft_model

        if n_train > 1:
            raise ValueError("sync: 'lora' is supported with one trainer rank here (no FSDP2 of peft modules)")
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        peft_model = get_peft_model(lm, LoraConfig(r=cfg.lora_rank, lora_alpha=2 * cfg.lora_rank,
                                                   target_modules=targets, lora_dropout=0.0))
    ckpt = None
    if cfg.resume and files.ckpt.exists():
        ckpt = torch.load(files.ckpt, weights_only=False)
        missing, unexpected = lm.load_state_dict(ckpt["model"], strict=False)
        if unexpected or any(k in dict(lm.named_parameters()) for k in missing):
            raise ValueError(f"{files.ckpt}: parameters missing {missing} or unexpected {unexpected}")
    elif is0 and not cfg.resume:
        files.fresh()
    dist.barrier(groups["train"])
    eval_lm = None
    if n_train > 1:
        from torch.distributed.fsdp import fully_shard

        if is0:  # an unsharded copy for held-out evaluation, refreshed from the gathered weights
            eval_lm = load_hf(path, device)[1]
        policy = PolicyLogprobs(lm, cfg.temperature)
        for layer in lm.model.layers:
            fully_shard(layer, mesh=groups["mesh"])
        fully_shard(policy, mesh=groups["mesh"])
    else:
        policy = PolicyLogprobs(lm, cfg.temperature)
        eval_lm = lm
    ref = None
    if cfg.kl_coef > 0:
        ref = PolicyLogprobs(load_hf(path, device)[1].eval(), cfg.temperature).requires_grad_(False)
    optim = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
    step = 0
    counters = Counter()
    if ckpt is not None:
        step = ckpt["step"]
        counters.update(ckpt["counters"])
        if n_train > 1:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(policy, optim, ckpt["optim"], options=StateDictOptions(full_state_dict=True))
        else:
            optim.load_state_dict(ckpt["optim"])

    # --- rank 0: queue, inbox, weight channel
    q = sender = transport = encoder = inbox = syncer = None
    stale_refunds: Counter = Counter()
    stale_uids: list[str] = list(ckpt["stale_uids"]) if ckpt is not None else []

    def on_stale(item: dict, version: int) -> None:  # counted and refunded to its rollout rank, never silent
        stale_refunds.update({str(item["rank"]): 1})
        stale_uids.append(item["uid"])

    if is0:
        q = StalenessQueue(max_staleness=cfg.max_staleness, on_stale=on_stale)
        if ckpt is not None:
            q.load_state_dict(ckpt["queue"])
        sync_group = join_sync_group(cfg, rank, n_train, port)
        sender, transport = WeightSender(sync_group, 0, bucket_bytes=64 << 20), GroupDeltaTransport(sync_group, 0)
        syncer = LoraSyncer(sender.send, keep=cfg.max_staleness + 1)
        inbox = Inbox(cfg, n_train, world, groups["sample"], q)
        inbox.generated = counters["samples_generated"]

    def push_weights(version: int, first: bool) -> tuple[list, float]:
        """All trainer ranks gather full tensors (FSDP collective); rank 0 sends them. Returns (tensors, secs)."""
        nonlocal encoder
        t0 = time.perf_counter()
        tensors = [(n.removeprefix("lm."), t) for n, t in full_tensors(policy)]
        if not is0:
            return tensors, 0.0
        kind = "lora" if cfg.sync == "lora" else "full" if (first or cfg.sync == "full") else "delta"
        msg = {"op": "weights", "version": version, "kind": kind}
        if first:
            msg["recovered"] = version
            queued = Counter(str(item["rank"]) for item, _, _ in q.state_dict()["items"])
            msg["queued"] = dict(queued)
        sync_group.broadcast_bytes(json.dumps(msg).encode(), 0)
        if kind == "lora":
            syncer.sync(peft_model, version)
        elif kind == "full":
            sender.send(tensors, version)
            if cfg.sync == "delta":
                encoder = DeltaEncoder(tensors, version=version)
        else:
            transport.send(encoder.encode(tensors, version))
        return tensors, time.perf_counter() - t0

    def evaluate(tensors) -> float:
        if eval_lm is not lm:
            eval_lm.load_state_dict(dict(tensors), strict=False)
        return toy.heldout_accuracy(eval_lm, tok)

    tensors, _ = push_weights(step, first=True)
    acc_before = None
    if is0:
        acc_before = ckpt["accuracy_before"] if ckpt is not None else evaluate(tensors)
        print(f"held-out accuracy before RL: {acc_before:.3f} (version {step})", flush=True)
    bar = Progress(cfg.steps, step, enabled=is0 and not cfg.quiet)
    t_start = time.time() - (ckpt["wall_seconds"] if ckpt is not None else 0.0)
    t_rl = time.time()
    max_age_seen = counters["max_staleness_seen"]
    last_acc = acc_before
    while step < cfg.steps:
        # ---- rank 0 takes B fresh groups (oldest first), then scatters them over the trainer ranks
        t0 = time.perf_counter()
        shards = [None] * n_train
        if is0:
            batch: list = []
            while len(batch) < cfg.prompts_per_step:
                batch += q.get_batch(cfg.prompts_per_step - len(batch), current_version=step, timeout=0.5)
                if stale_refunds:
                    counts, _ = dict(stale_refunds), stale_refunds.clear()
                    counters["samples_dropped_stale"] += sum(counts.values()) * cfg.group_size
                    sync_group.broadcast_bytes(json.dumps({"op": "refund", "counts": counts}).encode(), 0)
                if len(inbox.ended) == cfg.rollout_ranks:
                    raise RuntimeError("every rollout rank ended while the trainer still needs samples")
            shards = [batch[i::n_train] for i in range(n_train)]
        wait_s = time.perf_counter() - t0
        box = [None]
        dist.scatter_object_list(box, shards if is0 else None, src=0, group=groups["train"])
        my_groups = box[0]
        # ---- loss, backward, step
        t1 = time.perf_counter()
        bt = batch_tensors(my_groups, tok.pad_token_id, device)
        counts = global_counts(bt, groups["train"])
        loss, m = grpo_loss(cfg, policy, bt, global_counts=counts, ref_policy=ref, grad_scale=float(n_train))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip)
        if cfg.lr_decay:  # progress is broadcast from rank 0 so every trainer rank uses the same lr
            prog = torch.tensor([max(step / cfg.steps, (time.time() - t_rl) / cfg.time_limit if cfg.time_limit else 0)])
            dist.broadcast(prog, src=0, group=groups["train"])
            for pg in optim.param_groups:
                pg["lr"] = cfg.lr * max(0.1, 1.0 - 0.9 * min(float(prog.item()), 1.0))
        optim.step()
        # ---- staleness of what was trained (token version gap against the version being trained)
        ages = (step - bt["versions"][bt["mask"]]).tolist()
        hist = Counter(ages)
        if n_train > 1:  # the histogram of the whole batch, not just this rank's shard
            parts = [None] * n_train
            dist.all_gather_object(parts, dict(hist), group=groups["train"])
            hist = sum((Counter(p) for p in parts), Counter())
        stats = torch.tensor([bt["rewards"].sum().item(), bt["rewards"].numel(), bt["mask"].sum().item(),
                              max(ages) if ages else 0], dtype=torch.float64)
        mx = stats[3:].clone()
        all_reduce(stats[:3], group=groups["train"])
        all_reduce(mx, op=dist.ReduceOp.MAX, group=groups["train"])
        train_s = time.perf_counter() - t1
        step += 1
        tensors, sync_s = push_weights(step, first=False)
        max_age_seen = max(max_age_seen, int(mx.item()))
        counters["samples_trained"] += int(stats[1].item())
        # ---- rank 0: eval, metrics, checkpoint
        done = step >= cfg.steps or (cfg.time_limit > 0 and time.time() - t_rl > cfg.time_limit)
        flag = torch.tensor([1 if done else 0])
        dist.broadcast(flag, src=0, group=groups["train"])
        done = bool(flag.item())
        if is0:
            acc = evaluate(tensors) if (step % cfg.eval_every == 0 or done) else None
            last_acc = acc if acc is not None else last_acc
            step_s = time.perf_counter() - t0
            rec = {
                "step": step, "version": step, "reward": stats[0].item() / max(stats[1].item(), 1),
                "heldout_acc": acc, "loss": m["loss"], "kl_k3": m.get("mismatch_kl_k3"),
                "kl_k1": m.get("mismatch_kl_k1"),
                "approx_kl": m.get("approx_kl"), "clipfrac_low": m.get("clipfrac_low"),
                "clipfrac_high": m.get("clipfrac_high"), "grad_norm": float(gnorm),
                "staleness_hist": {str(k): v for k, v in sorted(hist.items())},
                "tokens_trained": int(stats[2].item()), "tokens_per_s": stats[2].item() / step_s,
                "step_seconds": step_s, "train_seconds": train_s, "sync_seconds": sync_s,
                "queue_wait_seconds": wait_s, "queue_len": len(q), "samples_generated": inbox.generated,
                "samples_trained": counters["samples_trained"], "wall_seconds": time.time() - t_start,
                "trained_uids": [g["uid"] for g in batch], "lr": optim.param_groups[0]["lr"],
                "groups_filled_unfiltered": sum(1 for g in batch if g.get("zero_variance_fill")),
                **{k: v for k, v in m.items() if k.startswith("correction_")},
            }
            files.log(rec)
            bar.update({"reward": rec["reward"], "acc": last_acc, "stale": max(ages) if ages else 0})
        if is0 or n_train > 1:
            save_now = cfg.save_every and (step % cfg.save_every == 0 or done)
            if save_now:
                optim_state = _optim_state(policy, optim, n_train)
                if is0:
                    counters["samples_generated"] = inbox.generated
                    counters["max_staleness_seen"] = max_age_seen
                    files.save({"model": dict(tensors), "optim": optim_state, "step": step, "queue": q.state_dict(),
                                "counters": dict(counters), "accuracy_before": acc_before, "stale_uids": stale_uids,
                                "wall_seconds": time.time() - t_start})
        if done:
            break
    bar.close()
    if is0:
        sync_group.broadcast_bytes(json.dumps({"op": "stop"}).encode(), 0)
        inbox.join()
        acc_after = last_acc
        rollout_stats = Counter()
        for s in inbox.ended.values():
            rollout_stats.update(s)
        summary = {
            "accuracy_before": acc_before, "accuracy_after": acc_after, "wall_seconds": time.time() - t_start,
            "rl_seconds_this_run": time.time() - t_rl, "steps": step, "max_staleness": cfg.max_staleness,
            "max_staleness_seen": max_age_seen, "samples_generated": inbox.generated,
            "samples_trained": counters["samples_trained"], "samples_dropped_stale": counters["samples_dropped_stale"],
            "samples_left_in_queue": len(q) * cfg.group_size, "rollout": dict(rollout_stats),
            "stale_uids": stale_uids, "left_uids": [item["uid"] for item, _, _ in q.state_dict()["items"]],
            "config": dataclasses.asdict(cfg),
        }
        files.write_summary(summary)
        print(f"held-out accuracy before RL: {acc_before:.3f}  after {step} steps: {acc_after:.3f}  "
              f"(+{100 * (acc_after - acc_before):.1f} points, {summary['wall_seconds']:.0f} s)", flush=True)
        print(f"summary: {files.summary}", flush=True)


def _optim_state(policy, optim, n_train: int):
    if n_train > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(policy, optim, options=StateDictOptions(full_state_dict=True,
                                                                                 cpu_offload=True))
    return optim.state_dict()


# ================================================================================================ main
def main(argv: list[str] | None = None) -> None:
    cfg = parse_flags(Config, argv)
    rank, world, device = setup_dist()
    n_train = world - cfg.rollout_ranks
    if n_train < 1 or cfg.rollout_ranks < 1:
        raise ValueError(f"rollout_ranks: expected 1..{world - 1} for a world of {world}, got {cfg.rollout_ranks}")
    if cfg.dynamic_max_rounds < 0:
        raise ValueError(f"dynamic_max_rounds: expected an int >= 0, got {cfg.dynamic_max_rounds}")
    if cfg.prompts_per_step % n_train or cfg.prompts_per_step % cfg.rollout_ranks:
        raise ValueError(f"prompts_per_step: expected a multiple of the trainer ({n_train}) and rollout "
                         f"({cfg.rollout_ranks}) rank counts, got {cfg.prompts_per_step}")
    torch.manual_seed(cfg.seed + rank)
    random.seed(cfg.seed + rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    # every rank creates every group, in the same order
    train_ranks = list(range(n_train))
    groups = {
        "train": dist.new_group(train_ranks),
        "sample": dist.new_group(list(range(world)), backend="gloo"),
    }
    if n_train > 1:
        from torch.distributed.device_mesh import DeviceMesh

        groups["mesh"] = DeviceMesh(device.type, train_ranks)
    path = policy_path(cfg, rank)
    port = pick_sync_port(cfg, rank)
    if rank < n_train:
        trainer_main(cfg, rank, world, n_train, device, groups, path, port)
    else:
        rollout_main(cfg, rank, n_train, device, groups["sample"], path, port)
    dist.barrier(groups["sample"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
