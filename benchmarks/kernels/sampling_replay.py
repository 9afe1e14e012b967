"""Cost of sampling-mask replay (top-k / top-p) in ``linear_token_logprobs`` against the unfiltered op, side by side.

    PYTHONPATH=. .venv/bin/python benchmarks/kernels/sampling_replay.py            # T=4096 H=512 V=32768, a few minutes
    PYTHONPATH=. .venv/bin/python benchmarks/kernels/sampling_replay.py --T 512 --H 64 --V 16384 --samples 5

Variants, run interleaved (the order rotates every sample) on the same inputs:

- ``unfiltered``: ``linear_token_logprobs(h, w, y)``, the baseline;
- ``top_k+top_p``: ``top_k=20, top_p=0.8`` (the kept set is settled by each row's 64 largest logits);
- ``top_p``: ``top_p=0.95`` alone; with random weights most nuclei are wider than 64 candidates, so rows are sorted
  whole — the worst case of the threshold search (real LM heads are much more peaked).

Mode ``full`` (forward + backward of ``Σ c·logp`` over the kept labels) or ``nograd``. Logits are ``z ~ N(0, s²)``
per entry (``--logit-std``, default 3), labels are each row's most probable token (always kept). Prints p20/p50/p80
wall time per variant and the ratio of medians to ``unfiltered``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, default=4096, help="tokens (rows)")
    p.add_argument("--H", type=int, default=512, help="hidden size")
    p.add_argument("--V", type=int, default=32768, help="vocabulary size")
    p.add_argument("--mode", choices=("full", "nograd"), default="full")
    p.add_argument("--samples", type=int, default=5, help="interleaved samples per variant")
    p.add_argument("--logit-std", type=float, default=3.0, help="standard deviation of the random logits")
    p.add_argument("--variants", default="unfiltered,top_k+top_p,top_p", help="comma-separated subset")
    p.add_argument("--backend", default=None, help="None (auto), torch or triton")
    args = p.parse_args(argv)

    from rlblocks.kernels import linear_token_logprobs

    torch.manual_seed(0)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    h = torch.randn(args.T, args.H, device=dev)
    w = torch.randn(args.V, args.H, device=dev) * (args.logit_std / args.H**0.5)
    with torch.no_grad():
        y = torch.cat([(h[r : r + 512] @ w.T).argmax(1) for r in range(0, args.T, 512)])
    c = torch.randn(args.T, device=dev) / args.T
    params = {"unfiltered": {}, "top_k+top_p": {"top_k": 20, "top_p": 0.8}, "top_p": {"top_p": 0.95}}
    names = [n for n in args.variants.split(",") if n]
    for n in names:
        if n not in params:
            p.error(f"--variants: unknown {n!r}; choose from {', '.join(params)}")

    def once(name: str) -> float:
        hh = h.detach().requires_grad_(args.mode == "full")
        ww = w.detach().requires_grad_(args.mode == "full")
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.set_grad_enabled(args.mode == "full"):
            lp, out = linear_token_logprobs(hh, ww, y, return_outside=True, backend=args.backend, **params[name])
            if args.mode == "full":
                (torch.where(out, 0.0, lp) * c).sum().backward()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for n in names:  # warm-up (allocator, first-call costs), untimed
        once(n)
    times: dict[str, list[float]] = {n: [] for n in names}
    for s in range(args.samples):
        order = names[s % len(names) :] + names[: s % len(names)]
        for n in order:
            times[n].append(once(n))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"T={args.T} H={args.H} V={args.V} fp32 mode={args.mode} device={dev.type} samples={args.samples} "
          f"torch={torch.__version__} threads={torch.get_num_threads()} cpus={os.cpu_count()} "
          f"load1={load:.1f} {platform.processor() or platform.machine()}")  # fmt: skip
    base = statistics.median(times["unfiltered"]) if "unfiltered" in times else None
    for n in names:
        ts = sorted(times[n])
        q = [ts[min(len(ts) - 1, int(f * len(ts)))] for f in (0.2, 0.5, 0.8)]
        med = statistics.median(ts)
        ratio = f"  x {med / base:.2f} of unfiltered" if base else ""
        print(f"  {n:<12} p20/p50/p80 {q[0] * 1e3:9.1f} {med * 1e3:9.1f} {q[2] * 1e3:9.1f} ms{ratio}")


if __name__ == "__main__":
    main()
