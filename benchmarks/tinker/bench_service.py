"""rlblocks.tinker service overhead, at the demo size or a real model's, measured side by side in one run.

    PYTHONPATH=$PWD python benchmarks/tinker/bench_service.py                        # demo model (toy)
    PYTHONPATH=$PWD python benchmarks/tinker/bench_service.py --model smollm2-135m   # a real 135M model
    PYTHONPATH=$PWD python benchmarks/tinker/bench_service.py --quick                # CI: runs, outputs agree

1. **Training**: one ``forward_backward`` (``importance_sampling`` over ``--datums`` datums of a two-digit addition
   and its answer; the demo's batch: 256) + ``optim_step`` per iteration, (a) in-process on the server's own training
   host (``rlblocks.tinker.training.TrainingHost``: the same compute, no HTTP) and (b) through the official SDK
   against ``python -m rlblocks.tinker`` in another process. Reported: seconds per iteration (median over ``--reps``
   rounds of ``--iters`` iterations, the two interleaved) and the service's added time as a fraction of (a).
2. **Sampling**: ``--samples`` samples (T = 1, seeded, up to ``--max-tokens`` tokens, EOS stops) of the prompts,
   (a) from a ``TorchEngine`` called directly in-process and (b) through the SDK: one ``sample`` call per sample
   (what ``tinker_cookbook.rl.train`` sends: one per environment) and calls of 16 samples of one prompt
   (``recipes/rl_loop.py``'s pattern). (a) runs the same requests as each (b), all at once: ``--samples``
   distinct prompts, or ``--samples / 16`` prompts 16 times each (whose identical prefills the engine computes
   once, through the service or not). Reported: sampled tokens/s and the ratio to the matching (a).

Before timing, the run checks that both paths agree: the first ``forward_backward`` of a fresh adapter gives the
same loss and per-token log-probs in-process and through the service, so does the one after an ``optim_step`` (the
same update applied), and a greedy sample through the service equals the engine's. ``--quick`` runs these checks
and one short timing round on a tiny random model and prints ``quick: ok``.

``--model`` takes an HF directory or a named model (``smollm2-135m``: SmolLM2-135M-Instruct, resolved by
``cookbook/plumbing/models.py``'s ``resolve_model``; its prompts go through the chat template; defaults: 16 datums,
32 samples of up to 16 tokens, 3 rounds of 1 iteration). Without ``--model`` the demo's model is used
(``cookbook/toy.py``'s cached warm start, trained first if missing).

Every process runs torch with one intra-op thread (the server too: ``--threads 1``). The client (SDK) runs in this
process, so on a 2-core machine the client's and the server's CPU time compete; the 1-minute load average at the
start and the end is printed with the figures. Next to the wall-clock figures, the CPU seconds of this process plus
the server's (``/proc``) per training step and the sampled tokens per CPU second are reported: on a loaded machine
the wall-clock ratios carry tens of percent of noise, the CPU-time ratios much less (the in-process path's CPU
includes the idle SDK client's background thread, so its figures lean slightly toward the service).
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


# a named model's workload: datums per forward_backward, samples, tokens per sample, rounds, iterations per round
NAMED = {"smollm2-135m": {"datums": 16, "samples": 32, "max_tokens": 16, "reps": 3, "iters": 1}}
DEMO = {"datums": 256, "samples": 256, "max_tokens": 6, "reps": 5, "iters": 3}
QUICK = {"datums": 8, "samples": 32, "max_tokens": 4, "reps": 1, "iters": 1}


def start_server(name: str, model_dir: str, state_dir: str):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "rlblocks.tinker", "--model", f"{name}={model_dir}", "--port", "0",
                             "--state-dir", state_dir, "--threads", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    while True:
        line = lines.get(timeout=600)
        if proc.poll() is not None and lines.empty():
            raise SystemExit(f"the server exited with {proc.returncode} before serving")
        if line.startswith("rlblocks.tinker: serving"):
            return proc, line.split(" at ")[1].split()[0]


def _proc_stat(pid: int | str) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (Linux; empty elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def server_cpu(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used (Linux ``/proc``; 0 elsewhere)."""
    fields = _proc_stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else 0.0


def minor_faults(pid: int | None = None) -> int:
    """Minor page faults (a page mapped in, zeroed, on first touch) of process ``pid`` (this one: None) so far
    (Linux ``/proc``; 0 elsewhere): freshly mapped memory costs about a microsecond per 4 KiB page."""
    fields = _proc_stat(pid or "self")
    return int(fields[7]) if fields else 0


class Workload:
    """Prompts and answers of the two-digit additions: the demo's character-level ``"a+b="`` (toy tokenizer), or
    for a real model the question through its chat template and the sum as the answer."""

    def __init__(self, tokenizer, chat: bool):
        self.tok, self.chat = tokenizer, chat

    def prompt(self, a: int, b: int) -> list[int]:
        if not self.chat:
            return toy.encode_prompt(self.tok, a, b)
        from cookbook.plumbing.models import chat_ids

        return chat_ids(self.tok, f"Calculate {a} + {b}. Answer with the number only.")

    def answer(self, a: int, b: int) -> list[int]:
        return [*self.tok.encode(toy.answer_text(a, b), add_special_tokens=False), self.tok.eos_token_id]


def batch(work: Workload, n: int):
    """``n`` datums: prompt + answer + EOS of RL pairs, IS inputs (sampler logprobs, advantages) on the answer."""
    from tinker import types

    from rlblocks.tinker import WireDatum

    g = torch.Generator().manual_seed(0)
    out, wire = [], []
    for a, b in toy.split_pairs()["rl"][:n]:
        p, o = work.prompt(a, b), work.answer(a, b)
        seq = p + o
        adv = [0.0] * (len(p) - 1) + [float(torch.randn(1, generator=g))] * len(o)
        lp = [0.0] * (len(p) - 1) + [-1.0] * len(o)
        inputs = {"target_tokens": seq[1:], "logprobs": lp, "advantages": adv}
        out.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=inputs))
        wire.append(WireDatum(seq[:-1], {"target_tokens": torch.tensor(seq[1:]), "logprobs": torch.tensor(lp),
                                         "advantages": torch.tensor(adv)}))
    return out, wire


def tiny_model(path: Path) -> str:
    """``--quick``'s model: a tiny random Llama over the demo's tokenizer, saved as an HF directory."""
    tok = toy.build_tokenizer()
    toy.build_tiny_model(tok, seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def agree(name: str, a, b, tol: float) -> None:
    """Fail unless ``a`` and ``b`` (numbers or arrays) agree within ``tol`` (absolute + relative)."""
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or not np.allclose(a, b, rtol=tol, atol=tol):
        diff = float(np.abs(a - b).max()) if a.shape == b.shape else f"shapes {a.shape} vs {b.shape}"
        raise SystemExit(f"check: {name} differ in-process vs through the service (max abs diff {diff})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF directory or named model (smollm2-135m); default: the demo's")
    ap.add_argument("--quick", action="store_true", help="CI: a tiny random model, the checks, one short round")
    ap.add_argument("--reps", type=int, default=None, help="rounds (default 5; 3 for a named model)")
    ap.add_argument("--iters", type=int, default=None, help="training iterations per round (default 3; 1 named)")
    ap.add_argument("--datums", type=int, default=None, help="datums per forward_backward (default 256; 16 named)")
    ap.add_argument("--samples", type=int, default=None, help="samples per round (default 256; 32 named)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per sample at most (default 6; 16 named)")
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--out", default=None, help="also write the summary JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("TINKER_API_KEY", "tml-bench")
    load_start = os.getloadavg()[0]
    tmp = tempfile.TemporaryDirectory()
    if args.quick:
        name, model_dir, defaults = NAME, tiny_model(Path(tmp.name) / "tiny"), QUICK
    elif args.model:
        sys.path.insert(0, str(ROOT))
        from cookbook.plumbing.models import resolve_model

        model_dir = resolve_model(args.model)
        name = args.model if args.model in NAMED else Path(model_dir).name
        defaults = NAMED.get(args.model, NAMED["smollm2-135m"])
    else:
        name, model_dir, defaults = NAME, toy.warm_start(ROOT / "runs" / "warmstart"), DEMO
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.samples < 16 or args.samples % 16:
        raise SystemExit(f"--samples: expected a multiple of 16, got {args.samples}")
    if args.quick or not args.model:
        work = Workload(toy.build_tokenizer(), chat=False)
    else:
        from transformers import AutoTokenizer

        tk = AutoTokenizer.from_pretrained(model_dir)
        work = Workload(tk, chat=tk.chat_template is not None)
    tok = work.tok
    data, wire = batch(work, args.datums)

    import numpy as np
    import tinker

    from rlblocks.rollout import GenerationRequest, SamplingParams
    from rlblocks.rollout.engines import TorchEngine
    from rlblocks.tinker import LoraSpec, TrainingHost

    host = TrainingHost(name, model_dir, device=torch.device("cpu"), dtype=torch.float32)
    host.create("local", LoraSpec(args.lora_rank, seed=0))
    cfg: dict[str, float] = {}  # importance_sampling takes no loss_fn_config
    adam = tinker.types.AdamParams(learning_rate=1e-4).model_dump()  # the fields optim_step passes on
    engine = TorchEngine.from_pretrained(model_dir, device="cpu")
    pairs = toy.split_pairs()["rl"]
    prompts = [work.prompt(a, b) for a, b in pairs[: args.samples]]
    eos = tok.eos_token_id

    loop = asyncio.new_event_loop()  # the direct engine's loop
    try:
        proc, url = start_server(name, model_dir, tmp.name)
        try:
            sc = tinker.ServiceClient(base_url=url)
            tc = sc.create_lora_training_client(base_model=name, rank=args.lora_rank, seed=0).result()
            sampler = sc.create_sampling_client(base_model=name).result()
            params = tinker.SamplingParams(max_tokens=args.max_tokens, seed=1, stop=[eos])

            def local_fb():
                runs, metrics = host.forward_backward("local", wire, "importance_sampling", cfg, False)
                return metrics["loss:sum"], np.concatenate([r.fields["logprobs"] for r in runs])

            def service_fb():
                out = tc.forward_backward(data, "importance_sampling").result()
                return out.metrics["loss:sum"], np.concatenate([o["logprobs"].to_numpy() for o in
                                                               out.loss_fn_outputs])

            def local_train():
                local_fb()
                host.optim_step("local", adam)

            def service_train():
                fb = tc.forward_backward(data, "importance_sampling")
                op = tc.optim_step(tinker.types.AdamParams(learning_rate=1e-4))
                fb.result()
                op.result()

            async def direct(rep, n=None, temperature=1.0, per_prompt=1):
                # the requests of service_sample(per_prompt): n // per_prompt prompts, each per_prompt times
                n = n or args.samples
                reqs = [p for p in prompts[: n // per_prompt] for _ in range(per_prompt)]
                gens = await asyncio.gather(*(engine.generate(GenerationRequest(
                    f"d{rep}-{per_prompt}-{i}", p, SamplingParams(max_new_tokens=args.max_tokens, seed=i,
                                                                 temperature=temperature, stop_token_ids=(eos,))))
                    for i, p in enumerate(reqs)))
                return gens

            def service_sample(per_call: int) -> int:
                calls = [sampler.sample(tinker.ModelInput.from_ints(p), per_call, params)
                         for p in prompts[: args.samples // per_call]]
                return sum(len(s.tokens) for f in calls for s in f.result().sequences)

            cpu: dict[str, list[float]] = {}
            faults: dict[str, list[int]] = {}

            def timed(fn, *a, key=None):
                """Wall seconds and result of ``fn(*a)``; with ``key``, also the CPU seconds this process and the
                server spent meanwhile (a load-robust measure of the work each path does)."""
                c0, s0 = time.process_time(), server_cpu(proc.pid)
                f0 = minor_faults() + minor_faults(proc.pid)
                t = time.perf_counter()
                r = fn(*a)
                dt = time.perf_counter() - t
                if key is not None:
                    cpu.setdefault(key, []).append(time.process_time() - c0 + server_cpu(proc.pid) - s0)
                    faults.setdefault(key, []).append(minor_faults() + minor_faults(proc.pid) - f0)
                return dt, r

            # the checks: a fresh adapter (B = 0) gives the same loss and log-probs both ways; after one optim_step
            # each, so does the next forward_backward (the same update applied); a greedy sample is the engine's
            for step in ("fresh adapter", "after one optim_step"):
                (l_loss, l_lp), (s_loss, s_lp) = local_fb(), service_fb()
                agree(f"forward_backward loss ({step})", l_loss, s_loss, 1e-4)
                agree(f"forward_backward logprobs ({step})", l_lp, s_lp, 1e-4)
                host.optim_step("local", adam)
                tc.optim_step(tinker.types.AdamParams(learning_rate=1e-4)).result()
            want = [g.output_ids for g in loop.run_until_complete(direct("greedy", 2, 0.0))]
            greedy = tinker.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, stop=[eos])
            got = [list(sampler.sample(tinker.ModelInput.from_ints(p), 1, greedy).result().sequences[0].tokens)
                   for p in prompts[:2]]
            if [list(w) for w in want] != got:
                raise SystemExit(f"check: greedy samples differ: engine {want}, service {got}")
            print(f"checks: forward_backward loss and logprobs agree (fresh and after optim_step, {len(l_lp)} "
                  "tokens); greedy samples equal", flush=True)

            local_train(), service_train(), loop.run_until_complete(direct(-1)), service_sample(1)  # warm up
            res: dict[str, list[float]] = {k: [] for k in ("train_local", "train_service", "sample_direct_1",
                                                           "sample_service_1", "sample_direct_16",
                                                           "sample_service_16")}
            for rep in range(args.reps):
                res["train_local"].append(timed(lambda: [local_train() for _ in range(args.iters)],
                                                key="train_local")[0] / args.iters)
                res["train_service"].append(timed(lambda: [service_train() for _ in range(args.iters)],
                                                  key="train_service")[0] / args.iters)
                for per in (1, 16):
                    dt, gens = timed(loop.run_until_complete, direct(rep, per_prompt=per), key=f"sample_direct_{per}")
                    n = sum(len(g.output_ids) for g in gens)
                    res[f"sample_direct_{per}"].append(n / dt)
                    cpu[f"sample_direct_{per}"][-1] = n / cpu[f"sample_direct_{per}"][-1]
                    dt, n = timed(service_sample, per, key=f"sample_service_{per}")
                    res[f"sample_service_{per}"].append(n / dt)
                    cpu[f"sample_service_{per}"][-1] = n / cpu[f"sample_service_{per}"][-1]
            sc.close("success").result()
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    finally:
        loop.run_until_complete(engine.aclose())
        loop.close()
        tmp.cleanup()
    med = {k: statistics.median(v) for k, v in res.items()}
    mc = {k: statistics.median(v) for k, v in cpu.items()}
    summary = {
        "model": args.model or ("tiny random (quick)" if args.quick else "demo warm start"),
        "datums": args.datums, "samples": args.samples, "max_tokens": args.max_tokens,
        "train_tokens": int(sum(len(d.tokens) for d in wire)),
        "train_seconds_per_step_in_process": med["train_local"],
        "train_seconds_per_step_service": med["train_service"],
        "train_service_overhead": med["train_service"] / med["train_local"] - 1,
        "sampled_tokens_per_s_direct_1_per_prompt": med["sample_direct_1"],
        "sampled_tokens_per_s_service_1_per_call": med["sample_service_1"],
        "sampled_tokens_per_s_direct_16_per_prompt": med["sample_direct_16"],
        "sampled_tokens_per_s_service_16_per_call": med["sample_service_16"],
        "sampling_ratio_1_per_call": med["sample_service_1"] / med["sample_direct_1"],
        "sampling_ratio_16_per_call": med["sample_service_16"] / med["sample_direct_16"],
        # CPU seconds (this process + the server) per step, sampled tokens per CPU second: what each path costs,
        # whatever share of the cores the processes got
        "train_cpu_seconds_per_step_in_process": mc["train_local"] / args.iters,
        "train_cpu_seconds_per_step_service": mc["train_service"] / args.iters,
        "train_cpu_overhead": mc["train_service"] / mc["train_local"] - 1,
        # minor page faults of both processes per step: memory mapped in afresh (freed and handed back, then
        # touched again), about a microsecond each
        "train_minor_faults_per_step_in_process": statistics.median(faults["train_local"]) / args.iters,
        "train_minor_faults_per_step_service": statistics.median(faults["train_service"]) / args.iters,
        "sampled_tokens_per_cpu_s_direct_1_per_prompt": mc["sample_direct_1"],
        "sampled_tokens_per_cpu_s_service_1_per_call": mc["sample_service_1"],
        "sampled_tokens_per_cpu_s_direct_16_per_prompt": mc["sample_direct_16"],
        "sampled_tokens_per_cpu_s_service_16_per_call": mc["sample_service_16"],
        "sampling_cpu_ratio_1_per_call": mc["sample_service_1"] / mc["sample_direct_1"],
        "sampling_cpu_ratio_16_per_call": mc["sample_service_16"] / mc["sample_direct_16"],
        "reps": args.reps, "iters": args.iters, "per_round": res, "per_round_cpu": cpu, "per_round_faults": faults,
        "load_average_1min_start": load_start, "load_average_1min_end": os.getloadavg()[0],
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    if args.quick:
        if not all(v > 0 for v in med.values()):
            raise SystemExit(f"quick: a measurement is not positive: {med}")
        print("quick: ok")


if __name__ == "__main__":
    main()
