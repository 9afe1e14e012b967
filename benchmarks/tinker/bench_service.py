"""rlblocks.tinker service overhead at the demo size, measured side by side in one run.

    .venv/bin/python benchmarks/tinker/bench_service.py [--reps 5] [--model HF_DIR]

1. **Training**: one ``forward_backward`` (``importance_sampling``, 256 datums of a two-digit addition and its
   answer, the demo's batch) + ``optim_step`` per iteration, (a) in-process on the server's own training host
   (``rlblocks.tinker.training.TrainingHost``: the same compute, no HTTP) and (b) through the official SDK against
   ``python -m rlblocks.tinker`` in another process. Reported: seconds per iteration (median over ``--reps`` rounds
   of ``--iters`` iterations, the two interleaved) and the service's added time as a fraction of (a).
2. **Sampling**: 256 samples (T = 1, seeded, up to 6 tokens, EOS stops) of the demo prompts, (a) from a
   ``TorchEngine`` called directly in-process and (b) through the SDK: 256 ``sample`` calls of one sample each (what
   ``tinker_cookbook.rl.train`` sends: one per environment) and 16 calls of 16 samples (``recipes/rl_loop.py``'s
   pattern). Reported: sampled tokens/s and the ratio to (a).

Every process runs torch with one intra-op thread (the server too: ``--threads 1``). The client (SDK) runs in this
process, so on a 2-core machine the client's and the server's CPU time compete; the load average is printed with
the figures. Without ``--model`` the demo's model is used (``cookbook/toy.py``'s cached warm start, trained first if
missing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "cookbook"))  # the demo's task helpers (toy.py)

import toy  # noqa: E402

NAME = "rlblocks/toy-addition"


def start_server(model_dir: str, state_dir: str):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "rlblocks.tinker", "--model", f"{NAME}={model_dir}", "--port", "0",
                             "--state-dir", state_dir, "--threads", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    while True:
        line = lines.get(timeout=300)
        if line.startswith("rlblocks.tinker: serving"):
            return proc, line.split(" at ")[1].split()[0]


def batch(tokenizer, n: int = 256):
    """``n`` datums: prompt + answer + EOS of RL pairs, IS inputs (sampler logprobs, advantages) on the answer."""
    from tinker import types

    from rlblocks.tinker import WireDatum

    g = torch.Generator().manual_seed(0)
    out, wire = [], []
    for a, b in toy.split_pairs()["rl"][:n]:
        p = toy.encode_prompt(tokenizer, a, b)
        o = [*tokenizer.encode(toy.answer_text(a, b), add_special_tokens=False), tokenizer.eos_token_id]
        seq = p + o
        k = len(seq) - 1
        adv = [0.0] * (len(p) - 1) + [float(torch.randn(1, generator=g))] * len(o)
        lp = [0.0] * (len(p) - 1) + [-1.0] * len(o)
        inputs = {"target_tokens": seq[1:], "logprobs": lp, "advantages": adv}
        out.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=inputs))
        wire.append(WireDatum(seq[:-1], {"target_tokens": torch.tensor(seq[1:]), "logprobs": torch.tensor(lp),
                                         "advantages": torch.tensor(adv)}))
        assert k == len(seq[1:])
    return out, wire


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--lora-rank", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("TINKER_API_KEY", "tml-bench")
    model_dir = args.model or toy.warm_start(ROOT / "runs" / "warmstart")
    tok = toy.build_tokenizer()
    data, wire = batch(tok)

    import tinker

    from rlblocks.rollout import GenerationRequest, SamplingParams
    from rlblocks.rollout.engines import TorchEngine
    from rlblocks.tinker import LoraSpec, TrainingHost

    host = TrainingHost(NAME, model_dir, device=torch.device("cpu"), dtype=torch.float32)
    host.create("local", LoraSpec(args.lora_rank, seed=0))
    cfg: dict[str, float] = {}  # importance_sampling takes no loss_fn_config
    adam = tinker.types.AdamParams(learning_rate=1e-4).model_dump()  # the fields optim_step passes on
    engine = TorchEngine.from_pretrained(model_dir, device="cpu")
    prompts = [toy.encode_prompt(tok, a, b) for a, b in toy.split_pairs()["rl"][:256]]

    loop = asyncio.new_event_loop()  # the direct engine's loop
    with tempfile.TemporaryDirectory() as state:
        proc, url = start_server(model_dir, state)
        try:
            sc = tinker.ServiceClient(base_url=url)
            tc = sc.create_lora_training_client(base_model=NAME, rank=args.lora_rank, seed=0).result()
            sampler = sc.create_sampling_client(base_model=NAME).result()
            params = tinker.SamplingParams(max_tokens=6, seed=1, stop=[tok.eos_token_id])

            def local_train():
                host.forward_backward("local", wire, "importance_sampling", cfg, False)
                host.optim_step("local", adam)

            def service_train():
                fb = tc.forward_backward(data, "importance_sampling")
                op = tc.optim_step(tinker.types.AdamParams(learning_rate=1e-4))
                fb.result()
                op.result()

            async def direct(rep):
                gens = await asyncio.gather(*(engine.generate(GenerationRequest(
                    f"d{rep}-{i}", p, SamplingParams(max_new_tokens=6, seed=i, stop_token_ids=(tok.eos_token_id,))))
                    for i, p in enumerate(prompts)))
                return sum(len(g.output_ids) for g in gens)

            def service_sample(per_call: int) -> int:
                calls = [sampler.sample(tinker.ModelInput.from_ints(p), per_call, params)
                         for p in prompts[: 256 // per_call]]
                return sum(len(s.tokens) for f in calls for s in f.result().sequences)

            def timed(fn, *a):
                t = time.perf_counter()
                r = fn(*a)
                return time.perf_counter() - t, r

            local_train(), service_train(), loop.run_until_complete(direct(-1)), service_sample(1)  # warm up
            res: dict[str, list[float]] = {k: [] for k in ("train_local", "train_service", "sample_direct",
                                                           "sample_service_1", "sample_service_16")}
            for rep in range(args.reps):
                res["train_local"].append(timed(lambda: [local_train() for _ in range(args.iters)])[0] / args.iters)
                res["train_service"].append(timed(lambda: [service_train() for _ in range(args.iters)])[0]
                                            / args.iters)
                dt, n = timed(loop.run_until_complete, direct(rep))
                res["sample_direct"].append(n / dt)
                for per in (1, 16):
                    dt, n = timed(service_sample, per)
                    res[f"sample_service_{per}"].append(n / dt)
            sc.close("success").result()
        finally:
            proc.terminate()
            proc.wait(timeout=60)
            loop.run_until_complete(engine.aclose())
            loop.close()
    med = {k: statistics.median(v) for k, v in res.items()}
    load = os.getloadavg()[0]
    summary = {
        "train_seconds_per_step_in_process": med["train_local"],
        "train_seconds_per_step_service": med["train_service"],
        "train_service_overhead": med["train_service"] / med["train_local"] - 1,
        "sampled_tokens_per_s_direct": med["sample_direct"],
        "sampled_tokens_per_s_service_1_per_call": med["sample_service_1"],
        "sampled_tokens_per_s_service_16_per_call": med["sample_service_16"],
        "sampling_ratio_1_per_call": med["sample_service_1"] / med["sample_direct"],
        "sampling_ratio_16_per_call": med["sample_service_16"] / med["sample_direct"],
        "reps": args.reps, "iters": args.iters, "load_average_1min": load,
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
