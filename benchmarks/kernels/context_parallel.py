"""Context parallelism: peak activation memory per rank and forward+backward time of ONE long sequence, CP = 1, 2, 4
side by side in one run (``causal_lm_logprobs`` without / with ``cp_group``).

    .venv/bin/python benchmarks/kernels/context_parallel.py                       # CPU: tiny decoder, 8k-32k tokens
    .venv/bin/python benchmarks/kernels/context_parallel.py --lengths 8192 --cp 1,2 --json out.json
    python3 benchmarks/kernels/context_parallel.py --device cuda --model qwen3-0.6b --lengths 32768   # GPU

Each CP size runs as its own set of processes (gloo on CPU, NCCL on GPUs, one GPU per rank); CP = 1 is the
unsharded path in one process. The sequence is one row: a 64-token prompt and a response over the rest, every
response token scored, ``loss = Σ c_t·logp_t`` backpropagated to every parameter. Per rank:

- peak activation memory: the peak, above what is live before the step, of the torch allocator during one
  forward+backward (CUDA: ``max_memory_allocated``; CPU: the running sum of the allocation events recorded by
  ``torch.profiler(profile_memory=True)``; memory that MKL/oneDNN allocate themselves is not seen);
- time: the wall time of the next forward+backward, between barriers (the slowest rank; CPU: one thread per rank,
  ``--threads``).

The CP rows also give the largest |logp − logp(CP = 1)| of the sequence. With one CUDA device and ``--cp`` > 1,
the ranks cannot run (NCCL needs a device per rank): the script then runs the one-device shard math instead,
``ring_attention_local`` on the model's attention shapes at the full length (every rank's rounds in turn, with
the CUDA flash kernels and merged log-sum-exps), against ``scaled_dot_product_attention``: its error and time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PROMPT = 64
ATTENTION = {"tiny": (2, 1, 32), "qwen3-0.6b": (16, 8, 128)}  # heads, KV heads, head_dim (the shard math's shapes)


def model_config(name: str, max_len: int):
    """The tiny decoder of the tests and the CPU demo (2 layers, hidden 64, 2 heads, 1 KV head, head_dim 32,
    vocabulary 64), or Qwen3-0.6B's shapes (28 layers, hidden 1024, 16 heads, 8 KV heads, head_dim 128,
    vocabulary 151936, q/k norms, tied embeddings)."""
    import transformers

    if name == "tiny":
        return transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                        max_position_embeddings=max_len, tie_word_embeddings=False)
    if name == "qwen3-0.6b":
        return transformers.Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                        head_dim=128, max_position_embeddings=max_len, tie_word_embeddings=True)
    raise SystemExit(f"--model: expected tiny or qwen3-0.6b, got {name!r}")


def build_model(name: str, max_len: int, device: torch.device, dtype: torch.dtype):
    """Random weights (seed 0) of :func:`model_config`'s model, in training mode."""
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(model_config(name, max_len))
    return model.to(dtype=dtype).train()


def _inputs(seq_len: int, vocab: int, device: torch.device):
    g = torch.Generator().manual_seed(seq_len)
    ids = torch.randint(0, vocab, (1, seq_len), generator=g)
    coef = torch.randn(1, seq_len - PROMPT, generator=g) / (seq_len - PROMPT)
    mask = torch.ones(1, seq_len - PROMPT, dtype=torch.bool)
    return ids.to(device), torch.tensor([PROMPT], device=device), mask.to(device), coef.to(device)


def _cpu_peak(run) -> int:
    from torch.profiler import ProfilerActivity, profile

    saved = [os.dup(1), os.dup(2)]  # the profiler's native start/stop lines go to /dev/null
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def _rank(rank: int, world: int, args, init_file: str, out_dir: str) -> None:
    from rlblocks.kernels import causal_lm_logprobs

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    torch.set_num_threads(args.threads)
    group = None
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world)
        group = dist.group.WORLD
    try:
        dtype = torch.bfloat16 if cuda else torch.float32
        model = build_model(args.model, args.seq_len + 1, device, dtype)
        ids, plens, mask, coef = _inputs(args.seq_len, model.config.vocab_size, device)

        def step():
            model.zero_grad(set_to_none=False)  # the gradients stay allocated: the peak is the step's own memory
            lp = causal_lm_logprobs(model, ids, plens, mask, cp_group=group)
            (lp * coef).sum().backward()
            return lp.detach()

        def sync():
            if cuda:
                torch.cuda.synchronize()
            if group is not None:
                dist.barrier()

        for p in model.parameters():  # the gradient buffers exist before the measurement (not activations)
            p.grad = torch.zeros_like(p)
        if cuda:
            step()  # warm-up: Triton compilation and autotuning, cuBLAS handles (CPU: the profiled step is the first)
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            lp = step()
            peak = torch.cuda.max_memory_allocated(device) - base
        else:
            box = []
            peak = _cpu_peak(lambda: box.append(step()))
            lp = box[0]
        times = []
        for _ in range(args.reps):
            sync()
            t0 = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t0)
        res = {"rank": rank, "peak_bytes": int(peak), "seconds": statistics.median(times)}
        if rank == 0:
            torch.save(lp.float().cpu(), os.path.join(out_dir, "logp.pt"))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    finally:
        if group is not None:
            dist.destroy_process_group()


def run_cp(args, seq_len: int, cp: int) -> dict:
    """One (length, CP) configuration in its own ``cp`` processes; returns the per-rank maxima and the logp."""
    with tempfile.TemporaryDirectory() as d:
        args.seq_len = seq_len
        mp.spawn(_rank, args=(cp, args, os.path.join(d, "pg"), d), nprocs=cp, join=True)
        ranks = [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(cp)]
        lp = torch.load(os.path.join(d, "logp.pt"))
    return {"seq_len": seq_len, "cp": cp, "peak_mib_per_rank": max(r["peak_bytes"] for r in ranks) / 2**20,
            "seconds": max(r["seconds"] for r in ranks), "logp": lp}


def shard_math(args, seq_len: int, worlds: list[int]) -> list[dict]:
    """One device, CP > 1: ``ring_attention_local`` on the model's attention shapes (bf16) at the full length vs
    ``scaled_dot_product_attention``, forward and backward."""
    from rlblocks.kernels import ring_attention_local

    dev = torch.device(args.device)
    h, hkv, d = ATTENTION[args.model]
    rows = []
    for w in worlds:
        n = -(-seq_len // (2 * w)) * 2 * w
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(1, h, n, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
        k, v = (torch.randn(1, hkv, n, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
                for _ in range(2))
        dout = torch.randn(1, h, n, d, device=dev, dtype=torch.bfloat16, generator=g)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        ref_g = torch.autograd.grad(ref, (q, k, v), dout)
        torch.cuda.synchronize(dev) if dev.type == "cuda" else None
        t0 = time.perf_counter()
        out = ring_attention_local(q, k, v, w)
        got_g = torch.autograd.grad(out, (q, k, v), dout)
        torch.cuda.synchronize(dev) if dev.type == "cuda" else None
        secs = time.perf_counter() - t0
        errs = [(a.float() - b.float()).abs().max().item() for a, b in zip((out, *got_g), (ref, *ref_g))]
        rows.append({"seq_len": n, "cp": w, "mode": "shard math (one device)", "seconds": secs,
                     "max_err_out": errs[0], "max_err_dq": errs[1], "max_err_dk": errs[2], "max_err_dv": errs[3]})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny | qwen3-0.6b")
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--lengths", default="8192,16384,32768")
    ap.add_argument("--cp", default="1,2,4", help="CP sizes (1 = unsharded, always the baseline)")
    ap.add_argument("--reps", type=int, default=1, help="timed forward+backward passes per configuration")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    ap.add_argument("--json", default="", help="also write the rows here")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    cps = sorted({1, *(int(x) for x in args.cp.split(","))})
    devices = torch.cuda.device_count() if args.device == "cuda" else 0
    try:
        import transformers  # noqa: F401
    except ImportError:  # a bare GPU machine: the model rows need transformers, the shard math does not
        if args.device != "cuda":
            raise
        print("transformers is not installed: no model rows, the shard math only", flush=True)
        devices = 0
    print(f"load average before: {os.getloadavg()}", flush=True)
    rows: list[dict] = []
    for seq_len in lengths:
        base = None
        for cp in cps:
            if args.device == "cuda" and cp > devices:  # not enough devices for real ranks
                continue
            r = run_cp(args, seq_len, cp)
            lp = r.pop("logp")
            if base is None:
                base, base_lp = r, lp
            r["mem_vs_cp1"] = r["peak_mib_per_rank"] / base["peak_mib_per_rank"]
            r["time_vs_cp1"] = r["seconds"] / base["seconds"]
            r["max_abs_dlogp_vs_cp1"] = (lp - base_lp).abs().max().item()
            rows.append(r)
            print(f"T={seq_len:6d} CP={cp}  peak {r['peak_mib_per_rank']:9.1f} MiB/rank (x{r['mem_vs_cp1']:.3f})  "
                  f"fwd+bwd {r['seconds']:8.2f} s (x{r['time_vs_cp1']:.2f})  "
                  f"max|dlogp| {r['max_abs_dlogp_vs_cp1']:.2e}", flush=True)
        simulated = [c for c in cps if args.device == "cuda" and c > devices and c > 1]
        if simulated:
            rows += shard_math(args, seq_len, simulated)
    load_after = os.getloadavg()
    print(f"load average after: {load_after}")
    print(f"\n{'tokens':>7s} {'CP':>3s} {'peak MiB/rank':>14s} {'x CP1':>6s} {'fwd+bwd s':>10s} {'x CP1':>6s} "
          f"{'max|dlogp|':>10s}")
    for r in rows:
        if "mode" in r:
            print(f"{r['seq_len']:7d} {r['cp']:3d} {r['mode']}: {r['seconds']:.2f} s, max err out "
                  f"{r['max_err_out']:.2e} dq {r['max_err_dq']:.2e} dk {r['max_err_dk']:.2e} dv {r['max_err_dv']:.2e}")
        else:
            print(f"{r['seq_len']:7d} {r['cp']:3d} {r['peak_mib_per_rank']:14.1f} {r['mem_vs_cp1']:6.3f} "
                  f"{r['seconds']:10.2f} {r['time_vs_cp1']:6.2f} {r['max_abs_dlogp_vs_cp1']:10.2e}")
    if args.json:
        meta = {"model": args.model, "device": args.device, "threads_per_rank": args.threads, "reps": args.reps,
                "load_after": load_after, "cpu_count": os.cpu_count()}
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
