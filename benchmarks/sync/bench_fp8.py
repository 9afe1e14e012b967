"""Blockwise FP8 on the way to the engine: wire bytes, quantise / dequantise speed next to memcpy, and the
train/rollout mismatch an FP8 rollout policy adds.

Run: .venv/bin/python benchmarks/sync/bench_fp8.py [--reps 7] [--checkpoint HF_DIR] [--sequences 64]

1. wire bytes: bf16 vs FP8 (``quantize_named``, default rules) of every weight of a few model shapes, built on the
   meta device (no memory): the FP8 stream's bytes, its share of the bf16 bytes, and what stays bf16.
2. speed: ``quantize_fp8`` and ``dequantize_fp8`` (to bf16) of one 4096 x 4096 bf16 weight on this CPU, each timed
   next to a memcpy of the same bf16 bytes within a rep; x/memcpy = the median over reps of memcpy time / x time.
3. mismatch: a policy (the HF checkpoint given, else a random 2-layer Llama with hidden 256 and a 10x-scaled LM head
   so that its next-token distributions are peaked) and its FP8 round trip (``dequantize_named(quantize_named(...))``,
   the weights an FP8 engine computes with); sequences are sampled from the FP8 policy (temperature 1), and
   ``rlblocks.losses.mismatch_metrics(trainer logp, FP8 logp)`` reports k1 / k3 KL(rollout || trainer) and the
   fraction of tokens whose ratio lies in [0.9, 1.1]. The same for a bf16 round trip of an fp32 policy, for scale.
The load average is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def load() -> str:
    a, b, c = os.getloadavg()
    return f"{a:.2f} {b:.2f} {c:.2f}"


def wire_bytes() -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from rlblocks.sync import quantized_specs
    from rlblocks.sync.buckets import tensor_spec

    shapes = {
        "toy demo (Llama h64 L2)": LlamaConfig(vocab_size=48, hidden_size=64, intermediate_size=256,
                                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                               head_dim=32),
        "Qwen2.5-0.5B shapes": Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                           num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                           tie_word_embeddings=True),
        "Llama-3-8B shapes": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
    }
    print(f"{'model':<26}{'bf16 MB':>10}{'FP8 MB':>10}{'FP8/bf16':>10}{'FP8 tensors':>13}{'kept bf16 MB':>14}")
    for label, cfg in shapes.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
        specs = [tensor_spec(n, t) for n, t in model.state_dict().items()
                 if not (cfg.tie_word_embeddings and n == "lm_head.weight")]  # a tied head travels once
        bf16 = sum(s.nbytes for s in specs)
        fp8 = quantized_specs(specs)
        quantised = {s.name for s in fp8 if s.dtype == torch.float8_e4m3fn}
        kept = sum(s.nbytes for s in specs if s.name not in quantised)
        total = sum(s.nbytes for s in fp8)
        print(f"{label:<26}{bf16 / 1e6:>10.2f}{total / 1e6:>10.2f}{total / bf16:>10.3f}{len(quantised):>13}"
              f"{kept / 1e6:>14.2f}")


def speed(reps: int) -> None:
    from rlblocks.sync import dequantize_fp8, quantize_fp8

    w = (torch.randn(4096, 4096) * 0.02).bfloat16()
    dst = torch.empty_like(w)
    q, s = quantize_fp8(w)
    times: dict[str, list[float]] = {"memcpy": [], "quantize": [], "dequantize": []}
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(4):
            dst.copy_(w)
        times["memcpy"].append((time.perf_counter() - t0) / 4)
        t0 = time.perf_counter()
        quantize_fp8(w)
        times["quantize"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dequantize_fp8(q, s, dtype=torch.bfloat16)
        times["dequantize"].append(time.perf_counter() - t0)
    nbytes = w.numel() * w.element_size()
    print(f"4096 x 4096 bf16 ({nbytes / 1e6:.0f} MB), torch threads {torch.get_num_threads()}, best of {reps} "
          f"(GB/s of bf16 bytes) and x/memcpy:")
    for k, ts in times.items():
        ratio = statistics.median(m / t for m, t in zip(times["memcpy"], ts))
        print(f"  {k:<11}{nbytes / min(ts) / 1e9:>7.2f} GB/s   x/memcpy {ratio:.3f}")


@torch.no_grad()
def mismatch(checkpoint: str | None, sequences: int, length: int) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from rlblocks.losses import mismatch_metrics
    from rlblocks.sync import dequantize_named, quantize_named

    if checkpoint:
        policy = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        label = checkpoint
    else:
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256)
        policy = LlamaForCausalLM(cfg).eval()
        policy.lm_head.weight.mul_(10.0)
        label = "random Llama h256 L2 (LM head x10)"

    def copy_with(sd):
        m = AutoModelForCausalLM.from_config(policy.config).float().eval()
        m.load_state_dict({n: t.float() for n, t in sd}, strict=False)
        return m

    bf16_sd = [(n, t.bfloat16()) for n, t in policy.state_dict().items()]
    fp8_policy = copy_with(dequantize_named(list(quantize_named(bf16_sd)), dtype=torch.float32))
    bf16_policy = copy_with(bf16_sd)
    trainer = copy_with([(n, t.float()) for n, t in bf16_sd])  # the trainer's bf16 weights, computed in fp32
    vocab = policy.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, vocab, (sequences, 8), generator=g)
    print(f"policy: {label}; {sequences} sequences of {length} tokens sampled from each rollout policy")
    for name, rollout, ref in (("FP8 rollout vs bf16 trainer", fp8_policy, trainer),
                               ("bf16 rollout vs fp32 trainer", bf16_policy, policy)):
        ids = prompts.clone()
        for _ in range(length):  # sample from the rollout policy (temperature 1)
            probs = rollout(ids).logits[:, -1].float().softmax(-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)], 1)
        tgt = ids[:, 8:]

        def logp(model, ids=ids, tgt=tgt):
            lp = model(ids).logits[:, 7:-1].double().log_softmax(-1)
            return lp.gather(-1, tgt[..., None])[..., 0]

        mm = mismatch_metrics(logp(ref), logp(rollout), torch.ones_like(tgt, dtype=torch.bool))
        print(f"  {name:<30} kl_k1 {float(mm['kl_k1']):.2e}  kl_k3 {float(mm['kl_k3']):.2e}  "
              f"ratio in [0.9, 1.1] {float(mm['ratio_in_band_frac']):.3f}  ess {float(mm['ess']):.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--checkpoint", default=None, help="an HF checkpoint directory for the mismatch part")
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--length", type=int, default=32)
    a = ap.parse_args()
    print(f"load average {load()} (1/5/15 min) at start")
    wire_bytes()
    speed(a.reps)
    mismatch(a.checkpoint, a.sequences, a.length)
    print(f"load average {load()} at the end")


if __name__ == "__main__":
    main()
