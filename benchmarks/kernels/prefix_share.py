"""Prefix-shared training forward against one row per sample and plain packing, side by side in one run.

    PYTHONPATH=. .venv/bin/python benchmarks/kernels/prefix_share.py                 # CPU: the three cases
    PYTHONPATH=. .venv/bin/python benchmarks/kernels/prefix_share.py --cases group16 --samples 3
    PYTHONPATH=. python3 benchmarks/kernels/prefix_share.py --preset qwen3-0.6b      # CUDA: bf16, FlexAttention
    PYTHONPATH=. .venv/bin/python benchmarks/kernels/prefix_share.py --quick         # CI: runs and agrees

SmolLM2-135M's shape on a CPU (4 of its 30 layers, random weights, fp32; ``--body`` also times the decoder alone):

    PYTHONPATH=. .venv/bin/python benchmarks/kernels/prefix_share.py --model smollm2-135m --layers 4 \
        --cases group16,agent3,group8_4k --samples 5 --body

Three ways to get the same ``[B, T]`` log-probs (and the gradient of every parameter) of a tiny random Qwen3-like
decoder (q/k-norm, GQA; ``--preset qwen3-0.6b``: the Qwen3-0.6B shape, random weights, bf16) through the fused
``linear_token_logprobs`` head:

- ``padded``: one row per sample, right-padded to the longest (``causal_lm_logprobs``);
- ``packed``: the samples' tokens packed back to back into rows of ``--pack-tokens`` (each sample attends to
  itself only; ``prefix_shared_hidden_states(..., share=False)``), the usual sequence packing;
- ``shared``: the prefix tree of the samples, every shared prefix forwarded once
  (``causal_lm_logprobs(..., prefix_share=True)``).

Cases (``--cases``): ``group16``: a GRPO group of 16, prompt 1024 tokens, responses lognormal in [64, 256];
``group8_4k``: a group of 8 with a 4096-token prompt; ``agent3``: 4 episodes of a 3-turn tool-use agent from one
task prompt (512 tokens), one row per turn, each row the history so far (tool outputs 32–96 tokens) and scoring
its own turn's reply. Each case reports the token slots forwarded (padding included), the fwd+bwd wall time
(median of ``--samples``, the three ways interleaved, rotating order), the peak memory of one fwd+bwd above the
inputs (CUDA: ``max_memory_allocated``; CPU: the peak running sum of the torch allocator's events), each also as a
ratio to ``padded``, the speed-up as a fraction of the token saving (``frac`` = speed-up / x fewer), and the
largest log-prob difference to ``padded``. ``--body`` adds the decoder's fwd+bwd alone (its hidden states at the
scored positions, no LM head; ``body ms``, ``body frac``): the LM head scores the same tokens every way, so the
whole step's speed-up stays below the token saving by the head's share of the shared step.

The machine's load average (``os.getloadavg``) is printed before and after each case: on a shared machine the
absolute times are noise, the ratios of ways run interleaved in one process much less so.

``--micro-batch ROWS``: ``padded`` runs its fwd+bwd that many rows at a time, each slice cut to its own longest
row, the gradients accumulated, as a trainer does when the batch does not fit (all 30 layers of SmolLM2 at
``group16`` need ~27 GB in one batch of rows).

``--quick``: the tiny preset at 1/20 of every length, one sample; checks that shared and packed give the padded
log-probs and parameter gradients (fp32 rounding; padded in slices of 3 rows) and prints ``quick: ok``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time

import torch

PRESETS = {
    # a tiny decoder for CPU runs (head_dim 32, 2:1 GQA; decoder : head parameters about 3 : 1, as in Qwen3-0.6B)
    "tiny": dict(vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    # the shape of Qwen3-0.6B (random weights)
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    # the shape of SmolLM2-135M (Llama, random weights, tied embeddings; 4 of its 30 layers unless --layers)
    "smollm2-135m": dict(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                         rope_theta=100000.0, tie_word_embeddings=True),
}


def _model(cfg: dict):
    """A randomly initialised causal LM of a preset's shape (sdpa attention)."""
    import transformers

    cfg = dict(cfg)
    arch = cfg.pop("arch", "qwen3")
    tied = cfg.pop("tie_word_embeddings", False)
    if arch == "llama":
        theta = cfg.pop("rope_theta")
        config = transformers.LlamaConfig(**cfg, max_position_embeddings=8192, attn_implementation="sdpa",
                                          tie_word_embeddings=tied,
                                          rope_parameters={"rope_type": "default", "rope_theta": theta})
        return transformers.LlamaForCausalLM(config)
    config = transformers.Qwen3Config(**cfg, max_position_embeddings=8192, attn_implementation="sdpa",
                                      tie_word_embeddings=tied)
    return transformers.Qwen3ForCausalLM(config)


def _lognormal_lengths(g: torch.Generator, n: int, lo: int, hi: int) -> list[int]:
    """``n`` lengths, lognormal with median at the geometric mean of ``lo`` and ``hi``, clipped to [lo, hi]."""
    mu = (torch.log(torch.tensor(float(lo))) + torch.log(torch.tensor(float(hi)))) / 2
    x = torch.exp(mu + 0.5 * torch.randn(n, generator=g))
    return x.round().clamp(lo, hi).long().tolist()


def make_case(name: str, vocab: int, scale: float = 1.0, seed: int = 0):
    """(prompt, response) token lists of a case; ``scale`` shrinks every length (for a toy run)."""
    g = torch.Generator().manual_seed(seed)

    def toks(n: int) -> list[int]:
        return torch.randint(1, vocab, (max(1, round(n * scale)),), generator=g).tolist()

    if name in ("group16", "group8_4k"):
        n, prompt_len = (16, 1024) if name == "group16" else (8, 4096)
        prompt = toks(prompt_len)
        return [(prompt, toks(r)) for r in _lognormal_lengths(g, n, 64, 256)]
    if name == "agent3":
        task = toks(512)
        rows = []
        for _ in range(4):
            history = list(task)
            for turn in range(3):
                reply = toks(_lognormal_lengths(g, 1, 32, 128)[0])
                rows.append((list(history), reply))
                if turn < 2:
                    history += reply + toks(int(torch.randint(32, 97, (1,), generator=g)))
        return rows
    raise SystemExit(f"--cases: unknown case {name!r}; choose from group16, group8_4k, agent3")


def _pad(rows, device):
    t = max(len(r) for _, r in rows)
    seq_len = max(len(p) + len(r) for p, r in rows)
    ids = torch.zeros(len(rows), seq_len, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.bool)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        mask[i, : len(r)] = True
    return ids.to(device), torch.tensor([len(p) for p, _ in rows], device=device), mask.to(device)


def _ways(model, ids, plens, mask, labels, coef, budget, dtype, micro=None):
    """``run(way)``: the ``[B, T]`` log-probs one way; ``fwd_bwd(way)``: their forward and backward. ``micro``:
    ``padded``'s fwd+bwd takes that many rows at a time, each slice cut to its own longest row, the gradients
    accumulated (what a trainer does when the whole batch does not fit)."""
    from rlblocks.kernels import causal_lm_logprobs, linear_token_logprobs
    from rlblocks.kernels.prefix_share import prefix_shared_hidden_states

    ends = plens + mask.sum(1)  # one past each row's last token

    def run(way: str) -> torch.Tensor:
        if way == "padded":
            return causal_lm_logprobs(model, ids, plens, mask)
        if way == "shared":
            return causal_lm_logprobs(model, ids, plens, mask, prefix_share=True)
        h = prefix_shared_hidden_states(model.model, ids, plens, mask, share=False, max_tokens=budget)
        return linear_token_logprobs(h.to(dtype), model.lm_head.weight, labels, mask=mask)

    def fwd_bwd(way: str) -> None:
        model.zero_grad(set_to_none=True)
        if way == "padded" and micro is not None and micro < ids.shape[0]:
            for s in range(0, ids.shape[0], micro):
                r = slice(s, s + micro)
                part = ids[r, : int(ends[r].max())]
                (causal_lm_logprobs(model, part, plens[r], mask[r]).float() * coef[r]).sum().backward()
            return
        (run(way).float() * coef).sum().backward()

    return run, fwd_bwd


def _body_fwd_bwd(model, ids, plens, mask, coef, budget):
    """``body(way)``: fwd+bwd of the decoder alone, its hidden states at the scored positions (no LM head)."""
    from rlblocks.kernels.prefix_share import prefix_shared_hidden_states

    w = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(2)).to(coef)

    def body(way: str) -> None:
        model.zero_grad(set_to_none=True)
        if way == "padded":
            h = model.model(input_ids=ids, use_cache=False).last_hidden_state
            src = (plens[:, None] - 1 + torch.arange(mask.shape[1], device=ids.device)).clamp(0, ids.shape[1] - 1)
            h = torch.where(mask[..., None], h.gather(1, src[..., None].expand(*src.shape, h.shape[-1])), 0.0)
        else:
            h = prefix_shared_hidden_states(model.model, ids, plens, mask, share=way == "shared",
                                            max_tokens=None if way == "shared" else budget)
        ((h.float() @ w) * coef).sum().backward()

    return body


def _check_grads(model, fwd_bwd, ways) -> None:
    """Every way's parameter gradients equal the padded one's (fp32 rounding: 1e-4 of the largest entry)."""
    grads = {}
    for w in ways:
        fwd_bwd(w)
        grads[w] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    ref = grads[ways[0]]
    for w in ways[1:]:
        for n, g in ref.items():
            err = (grads[w][n] - g).abs().max().item()
            if not err <= 1e-4 * max(1.0, g.abs().max().item()):
                raise SystemExit(f"quick: {w}: gradient of {n} differs from {ways[0]} by {err:.3g}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="group16,group8_4k,agent3", help="comma-separated subset")
    p.add_argument("--preset", "--model", dest="preset", choices=sorted(PRESETS), default=None,
                   help="model shape (default: tiny on CPU, qwen3-0.6b on CUDA)")
    p.add_argument("--layers", type=int, default=None, help="override the number of decoder layers")
    p.add_argument("--samples", type=int, default=5, help="interleaved fwd+bwd samples per way")
    p.add_argument("--pack-tokens", type=int, default=8192, help="token budget of a packed row (packed)")
    p.add_argument("--scale", type=float, default=1.0, help="shrink every length (toy runs)")
    p.add_argument("--ways", default="padded,packed,shared", help="comma-separated subset")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--body", action="store_true", help="also time the decoder alone (no LM head)")
    p.add_argument("--micro-batch", type=int, default=None, metavar="ROWS",
                   help="padded: fwd+bwd this many rows at a time, each slice cut to its longest row, gradients "
                        "accumulated (a deep model's whole batch of rows may not fit in memory)")
    p.add_argument("--quick", action="store_true", help="CI: tiny shapes, one sample; checks agreement, not speed")
    args = p.parse_args(argv)
    if args.micro_batch is not None and args.micro_batch < 1:
        p.error(f"--micro-batch: expected a number of rows >= 1, got {args.micro_batch}")
    if args.quick:  # padded in slices of 3 rows: its accumulated gradients are the reference the others must equal
        args.preset, args.scale, args.samples = args.preset or "tiny", 0.05, 1
        args.micro_batch = args.micro_batch or 3

    from bench import _cpu_peak_bytes  # benchmarks/kernels/bench.py: this script's folder is first on sys.path

    from rlblocks.sched import response_prefix_tree

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    preset = args.preset or ("qwen3-0.6b" if device.type == "cuda" else "tiny")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = dict(PRESETS[preset])
    if args.layers is not None:
        cfg["num_hidden_layers"] = args.layers
    torch.manual_seed(0)
    model = _model(cfg).to(device, dtype)
    ways = [w for w in args.ways.split(",") if w]
    for w in ways:
        if w not in ("padded", "packed", "shared"):
            p.error(f"--ways: unknown {w!r}; choose from padded, packed, shared")

    print(f"# prefix_share benchmark: {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
          f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, preset {preset} "
          f"({cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, vocab {cfg['vocab_size']}), {dtype}, "
          f"{args.samples} samples")
    results = []
    for case in [c for c in args.cases.split(",") if c]:
        rows = make_case(case, cfg["vocab_size"], args.scale)
        ids, plens, mask = _pad(rows, device)
        coef = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)).to(device) / mask.sum()
        pos = (plens[:, None] + torch.arange(mask.shape[1], device=device)).clamp(max=ids.shape[1] - 1)
        labels = ids.gather(1, pos)
        longest = max(len(pr) + len(r) - 1 for pr, r in rows)
        budget = max(args.pack_tokens, longest)
        trees = {"padded": None, "packed": response_prefix_tree(ids, plens, mask, max_tokens=budget, share=False),
                 "shared": response_prefix_tree(ids, plens, mask)}

        load0 = os.getloadavg()[0]
        run, fwd_bwd = _ways(model, ids, plens, mask, labels, coef, budget, dtype, args.micro_batch)
        if args.quick:
            _check_grads(model, fwd_bwd, ways)
        slots = {"padded": ids.numel()}
        for w in ("packed", "shared"):
            slots[w] = trees[w].num_rows * trees[w].row_len
        # the same log-probs every way, float32 / bf16 rounding apart (reported: max |logp − logp_padded|)
        with torch.no_grad():
            ref = run("padded").float()
            errs = {w: (run(w).float() - ref).abs().max().item() for w in ways}
        for w in ways:  # warm-up (first-call costs: compilation, allocator growth)
            fwd_bwd(w)
        times: dict[str, list[float]] = {w: [] for w in ways}
        body_times: dict[str, list[float]] = {w: [] for w in ways}
        body = _body_fwd_bwd(model, ids, plens, mask, coef, budget) if args.body else None
        if body is not None:
            for w in ways:
                body(w)
        for s in range(args.samples):
            for w in ways[s % len(ways):] + ways[: s % len(ways)]:
                _sync(device)
                t0 = time.perf_counter()
                fwd_bwd(w)
                _sync(device)
                times[w].append(time.perf_counter() - t0)
                if body is not None:
                    t0 = time.perf_counter()
                    body(w)
                    _sync(device)
                    body_times[w].append(time.perf_counter() - t0)
        mem = {}
        for w in ways:
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
                fwd_bwd(w)
                _sync(device)
                mem[w] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
            else:
                mem[w] = _cpu_peak_bytes(functools.partial(fwd_bwd, w)) / 2**20
        real = sum(len(pr) + len(r) for pr, r in rows)
        load1 = os.getloadavg()[0]
        print(f"\n## {case}: {len(rows)} rows, {real} tokens in the samples, longest {ids.shape[1]}, "
              f"response tokens {int(mask.sum())}, shared tree {trees['shared'].num_nodes} nodes in "
              f"{trees['shared'].num_rows} row(s); load average {load0:.1f} -> {load1:.1f}")
        print(f"{'way':<8} {'tokens':>8} {'x fewer':>8} {'fwd+bwd ms':>11} {'speedup':>8} {'frac':>5} "
              f"{'body ms':>9} {'body frac':>9} {'peak MiB':>9} {'mem ratio':>9} {'max dlogp':>9}")
        base_t = statistics.median(times["padded"]) if "padded" in times else None
        base_b = statistics.median(body_times["padded"]) if body_times.get("padded") else None
        for w in ways:
            t = statistics.median(times[w])
            tb = statistics.median(body_times[w]) if body_times[w] else None
            fewer = slots["padded"] / slots[w]
            row = dict(case=case, way=w, tokens=slots[w], fewer=fewer, ms=t * 1e3,
                       speedup=(base_t / t) if base_t else None, body_ms=tb * 1e3 if tb else None,
                       body_speedup=(base_b / tb) if base_b and tb else None, peak_mib=mem[w],
                       mem_ratio=(mem[w] / mem["padded"]) if mem.get("padded") else None, max_dlogp=errs[w],
                       preset=preset, layers=cfg["num_hidden_layers"], device=device.type, load=(load0, load1),
                       times_ms=[x * 1e3 for x in times[w]])
            results.append(row)
            sp = f"{row['speedup']:.2f}x" if row["speedup"] else "-"
            fr = f"{row['speedup'] / fewer:.2f}" if row["speedup"] else "-"
            bms = f"{tb * 1e3:.1f}" if tb else "-"
            bfr = f"{row['body_speedup'] / fewer:.2f}" if row["body_speedup"] else "-"
            mr = f"{row['mem_ratio']:.2f}" if row["mem_ratio"] else "-"
            print(f"{w:<8} {slots[w]:>8} {fewer:>7.2f}x {t * 1e3:>11.1f} {sp:>8} {fr:>5} {bms:>9} {bfr:>9} "
                  f"{mem[w]:>9.1f} {mr:>9} {errs[w]:>9.2g}")
        if args.quick:
            bad = {w: e for w, e in errs.items() if not e <= 1e-4}
            if bad:
                raise SystemExit(f"quick: {case}: log-probs differ from padded by {bad}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.quick:
        print("quick: ok (shared and packed log-probs and gradients equal the padded ones)")


if __name__ == "__main__":
    main()
