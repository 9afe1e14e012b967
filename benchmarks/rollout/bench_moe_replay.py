"""Routing replay (R3) overhead, measured side by side in one run on a tiny random Qwen3-MoE (CPU by default).

    .venv/bin/python benchmarks/rollout/bench_moe_replay.py
    .venv/bin/python benchmarks/rollout/bench_moe_replay.py --layers 8 --experts 64 --top-k 8 --batch 8 --seq 256

Measures
--------
1. recording, per forward: one decode step ``[batch, 1]`` with and without a ``RoutingRecorder`` around it and a
   ``take()`` after it (what an engine does every step), mean of 50 steps, median of ``--reps``; and the
   recorder's own cost per step measured alone (entering and leaving the context, taking one step's rows);
2. recording, end to end: TorchEngine output tokens/s at 1 and 8 concurrent requests, with and without a recorder
   around the engine's forwards (noisy on a shared machine: prefer 1. for the hooks' cost);
3. replay: the wall time of a training forward + backward over ``[batch, seq]`` tokens, with and without
   ``replay_routing`` (the routing recorded by a plain forward); median of ``--reps``;
4. record size: bytes per token of the compact record (uint8/uint16) against int64 indices.

Ratios are printed as ``with / without``; both sides run interleaved in the same process. 1. and 3. time the CPU
time of this process (``time.process_time``, one torch thread), which a shared machine disturbs less than wall
time; 2. is wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from rlblocks.rollout import GenerationRequest, SamplingParams
from rlblocks.rollout.engines import TorchEngine
from rlblocks.rollout.moe_replay import RoutingRecorder, replay_routing, routing_dtype


def build(args):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         moe_intermediate_size=args.hidden // 2, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4,
                         num_experts=args.experts, num_experts_per_tok=args.top_k, max_position_embeddings=1024)
    return Qwen3MoeForCausalLM(cfg).eval()


def engine_tokens_per_s(model, concurrency: int, new_tokens: int, record: bool) -> float:
    engine = TorchEngine(model)
    recorder = RoutingRecorder(model)

    async def run() -> int:
        reqs = [GenerationRequest(f"r{i}", list(range(4, 20)), SamplingParams(max_new_tokens=new_tokens, seed=i))
                for i in range(concurrency)]
        gens = await asyncio.gather(*(engine.generate(r) for r in reqs))
        return sum(g.num_output_tokens for g in gens)

    t0 = time.perf_counter()
    if record:
        with recorder:
            n = asyncio.run(run())
        recorder.take()
    else:
        n = asyncio.run(run())
    return n / (time.perf_counter() - t0)


def decode_step_seconds(model, ids, recorder) -> float:
    t0 = time.process_time()
    with torch.inference_mode():
        for _ in range(50):
            if recorder is None:
                model(ids)
            else:
                with recorder:
                    model(ids)
                recorder.take()
    return (time.process_time() - t0) / 50


def train_step_seconds(model, ids, routed) -> float:
    model.zero_grad(set_to_none=True)
    t0 = time.process_time()
    if routed is None:
        model(ids).logits.float().logsumexp(-1).mean().backward()
    else:
        with replay_routing(model, routed):
            model(ids).logits.float().logsumexp(-1).mean().backward()
    return time.process_time() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = build(args)

    print(f"Qwen3-MoE hidden {args.hidden}, {args.layers} MoE layers, {args.experts} experts, top-{args.top_k}")
    step = torch.randint(0, 256, (args.batch, 1), generator=torch.Generator().manual_seed(1))
    recorder = RoutingRecorder(model)
    times = {False: [], True: []}
    for _ in range(args.reps):
        for record in (False, True):
            times[record].append(decode_step_seconds(model, step, recorder if record else None))
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"recording, one forward [{args.batch}, 1] + take(), CPU time: {off * 1e3:.2f} ms without, "
          f"{on * 1e3:.2f} ms with -> ratio {on / off:.3f}")
    per_layer = [torch.zeros(args.batch, args.top_k, dtype=torch.long) for _ in range(args.layers)]

    def recorder_only() -> float:
        t0 = time.process_time()
        for _ in range(200):
            with recorder:
                pass
            for rows, r in zip(recorder._records, per_layer):  # what the hooks append during one forward
                rows.append(r)
            recorder.take()
        return (time.process_time() - t0) / 200

    alone = statistics.median(recorder_only() for _ in range(args.reps))
    print(f"recorder alone per step (enter + exit + take), CPU time: {alone * 1e6:.0f} us = "
          f"{alone / off:.1%} of one forward")
    for conc in (1, 8):
        rates = {False: [], True: []}
        for _ in range(args.reps):
            for record in (False, True):
                rates[record].append(engine_tokens_per_s(model, conc, args.new_tokens, record))
        off, on = statistics.median(rates[False]), statistics.median(rates[True])
        print(f"recording, TorchEngine, {conc} concurrent (wall): {off:.0f} tokens/s without, {on:.0f} with "
              f"-> ratio {on / off:.3f}")

    ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    recorder = RoutingRecorder(model)
    with torch.no_grad(), recorder:
        model(ids)
    routed = recorder.take().view(args.batch, args.seq, args.layers, args.top_k)
    model.train()
    times = {False: [], True: []}
    train_step_seconds(model, ids, None)  # warm-up
    for _ in range(args.reps):
        for replay in (False, True):
            times[replay].append(train_step_seconds(model, ids, routed if replay else None))
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"replay, forward+backward [{args.batch}, {args.seq}], CPU time: {off * 1e3:.1f} ms without, "
          f"{on * 1e3:.1f} ms with -> ratio {on / off:.3f}")
    per_token = args.layers * args.top_k * torch.empty((), dtype=routing_dtype(args.experts)).element_size()
    print(f"record: {per_token} bytes/token ({routing_dtype(args.experts)}) vs {args.layers * args.top_k * 8} as int64")


if __name__ == "__main__":
    main()
