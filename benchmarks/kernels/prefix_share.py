"""Prefix-shared training forward against one row per sample and plain packing, side by side in one run.

    PYTHONPATH=. .venv/bin/python benchmarks/kernels/prefix_share.py                 # CPU: the three cases
    PYTHONPATH=. .venv/bin/python benchmarks/kernels/prefix_share.py --cases group16 --samples 3
    PYTHONPATH=. python3 benchmarks/kernels/prefix_share.py --preset qwen3-0.6b      # CUDA: bf16, FlexAttention

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
ratio to ``padded``, and the largest log-prob difference to ``padded``.
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


def _ways(model, ids, plens, mask, labels, coef, budget, dtype):
    """``run(way)``: the ``[B, T]`` log-probs one way; ``fwd_bwd(way)``: their forward and backward."""
    from rlblocks.kernels import causal_lm_logprobs, linear_token_logprobs
    from rlblocks.kernels.prefix_share import prefix_shared_hidden_states

    def run(way: str) -> torch.Tensor:
        if way == "padded":
            return causal_lm_logprobs(model, ids, plens, mask)
        if way == "shared":
            return causal_lm_logprobs(model, ids, plens, mask, prefix_share=True)
        h = prefix_shared_hidden_states(model.model, ids, plens, mask, share=False, max_tokens=budget)
        return linear_token_logprobs(h.to(dtype), model.lm_head.weight, labels, mask=mask)

    def fwd_bwd(way: str) -> None:
        model.zero_grad(set_to_none=True)
        (run(way).float() * coef).sum().backward()

    return run, fwd_bwd


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
    args = p.parse_args(argv)

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

        run, fwd_bwd = _ways(model, ids, plens, mask, labels, coef, budget, dtype)
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
        for s in range(args.samples):
            for w in ways[s % len(ways):] + ways[: s % len(ways)]:
                _sync(device)
                t0 = time.perf_counter()
                fwd_bwd(w)
                _sync(device)
                times[w].append(time.perf_counter() - t0)
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
        print(f"\n## {case}: {len(rows)} rows, {real} tokens in the samples, longest {ids.shape[1]}, "
              f"response tokens {int(mask.sum())}, shared tree {trees['shared'].num_nodes} nodes in "
              f"{trees['shared'].num_rows} row(s)")
        print(f"{'way':<8} {'tokens':>8} {'x fewer':>8} {'fwd+bwd ms':>11} {'speedup':>8} {'peak MiB':>9} "
              f"{'mem ratio':>9} {'max dlogp':>9}")
        base_t = statistics.median(times["padded"]) if "padded" in times else None
        for w in ways:
            t = statistics.median(times[w])
            row = dict(case=case, way=w, tokens=slots[w], fewer=slots["padded"] / slots[w], ms=t * 1e3,
                       speedup=(base_t / t) if base_t else None, peak_mib=mem[w],
                       mem_ratio=(mem[w] / mem["padded"]) if mem.get("padded") else None, max_dlogp=errs[w],
                       preset=preset, device=device.type)
            results.append(row)
            sp = f"{row['speedup']:.2f}x" if row["speedup"] else "-"
            mr = f"{row['mem_ratio']:.2f}" if row["mem_ratio"] else "-"
            print(f"{w:<8} {slots[w]:>8} {row['fewer']:>7.2f}x {t * 1e3:>11.1f} {sp:>8} {mem[w]:>9.1f} {mr:>9} "
                  f"{errs[w]:>9.2g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
