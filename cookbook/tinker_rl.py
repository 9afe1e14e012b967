"""tinker-cookbook's RL recipe (``tinker_cookbook.rl.train``) on the toy task, against rlblocks.tinker on this machine.

``make demo-tinker``: the CPU demo model (``toy.warm_start``, the same cached warm start as ``make demo``) is
served by ``python -m rlblocks.tinker`` in a subprocess; this script then runs the cookbook's own RL training loop
(``rl.train.main``: sampling clients, group-centred advantages, ``importance_sampling`` forward_backward,
``optim_step``, checkpoints) through the official ``tinker`` SDK. What is written here is only what a cookbook user
writes for a new task: an ``Env`` (the prompt tokens of ``"a+b="``, the exact-match reward of ``toy.reward``), its
group builder and dataset, and an evaluator.

Metric: greedy exact-match accuracy on the 500 held-out pairs, before and after, computed by ``toy.heldout_accuracy``
(the code ``make demo`` reports) on the warm start and on the warm start with the final LoRA adapter merged in
(``rlblocks.sync.merge_lora``); the same metric through the service (greedy samples of the served snapshots) is
printed next to it. Outputs go to ``runs/<name>/``: ``summary.json``, the cookbook's ``metrics.jsonl`` and
checkpoints list, the server's log and state directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import chz
import tinker
import torch
import toy
from plumbing import check_at_least, opt, parse_flags
from tinker_cookbook.eval.evaluators import SamplingClientEvaluator
from tinker_cookbook.rl import train
from tinker_cookbook.rl.types import Env, EnvGroupBuilder, RLDataset, RLDatasetBuilder, StepResult
from tinker_cookbook.tokenizer_utils import register_tokenizer

from rlblocks.errors import ArgumentError

MODEL_NAME = "rlblocks/toy-addition"


# ---------------------------------------------------------------------------------------- the task, as a cookbook Env
class AdditionEnv(Env):
    """One ``"a+b="`` prompt; reward 1 for the exact sum followed by EOS (``toy.reward``)."""

    def __init__(self, tokenizer, a: int, b: int) -> None:
        self.tokenizer, self.a, self.b = tokenizer, a, b

    async def initial_observation(self):
        prompt = toy.encode_prompt(self.tokenizer, self.a, self.b)
        return tinker.ModelInput.from_ints(prompt), [self.tokenizer.eos_token_id]

    async def step(self, action, *, extra=None) -> StepResult:
        r = toy.reward(self.tokenizer, self.a, self.b, list(action))
        return StepResult(reward=r, episode_done=True, next_observation=tinker.ModelInput.empty(),
                          next_stop_condition=[self.tokenizer.eos_token_id], metrics={"correct": r})


class AdditionGroup(EnvGroupBuilder):
    def __init__(self, a: int, b: int, group_size: int) -> None:
        self.a, self.b, self.group_size = a, b, group_size

    async def make_envs(self) -> Sequence[Env]:
        tok = toy.build_tokenizer()
        return [AdditionEnv(tok, self.a, self.b) for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return ["addition"]


class AdditionDataset(RLDataset):
    """The RL pairs of ``toy.split_pairs()`` (never the held-out ones), shuffled, ``groups_per_batch`` per batch."""

    def __init__(self, pairs: list[tuple[int, int]], groups_per_batch: int, group_size: int) -> None:
        self.pairs, self.groups_per_batch, self.group_size = pairs, groups_per_batch, group_size

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        start = index * self.groups_per_batch
        return [AdditionGroup(a, b, self.group_size) for a, b in self.pairs[start: start + self.groups_per_batch]]

    def __len__(self) -> int:
        return len(self.pairs) // self.groups_per_batch


@chz.chz
class AdditionDatasetBuilder(RLDatasetBuilder):
    groups_per_batch: int = 16
    group_size: int = 16
    seed: int = 0

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        import random

        pairs = list(toy.split_pairs()["rl"])
        random.Random(self.seed).shuffle(pairs)
        return AdditionDataset(pairs, self.groups_per_batch, self.group_size), None


class HeldoutAccuracy(SamplingClientEvaluator):
    """Greedy exact-match accuracy on the held-out pairs through a sampling client (``max_tokens`` 6, as
    ``toy.heldout_accuracy``)."""

    def __init__(self, pairs: list[tuple[int, int]] | None = None) -> None:
        self.pairs = toy.split_pairs()["heldout"] if pairs is None else pairs
        self.tokenizer = toy.build_tokenizer()

    async def __call__(self, sampling_client: tinker.SamplingClient) -> dict[str, float]:
        tok = self.tokenizer
        params = tinker.SamplingParams(max_tokens=6, temperature=0.0, stop=[tok.eos_token_id])

        async def one(a: int, b: int) -> float:
            prompt = tinker.ModelInput.from_ints(toy.encode_prompt(tok, a, b))
            res = await sampling_client.sample_async(prompt, 1, params)
            return toy.reward(tok, a, b, list(res.sequences[0].tokens))

        scores = await asyncio.gather(*(one(a, b) for a, b in self.pairs))
        return {"heldout/accuracy": sum(scores) / len(scores)}


# ------------------------------------------------------------------------------------------------ the server
class Server:
    """``python -m rlblocks.tinker`` in a subprocess, ready once it prints its URL (its output goes to ``log``)."""

    def __init__(self, model_dir: str, state_dir: Path, log: Path, threads: int) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
        self.log = log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "rlblocks.tinker", "--model", f"{MODEL_NAME}={model_dir}",
                                      "--port", "0", "--state-dir", str(state_dir), "--threads", str(threads)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        lines: queue.Queue = queue.Queue()

        def pump() -> None:
            for line in self.proc.stdout:
                self.log.write(line)
                self.log.flush()
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        while True:
            line = lines.get()
            if line is None:
                raise SystemExit(f"the rlblocks.tinker server exited during startup; see {log}")
            if line.startswith("rlblocks.tinker: serving"):
                self.base_url = line.split(" at ")[1].split()[0]
                return

    def cpu_seconds(self) -> float:
        """User + system CPU seconds the server process has used (Linux /proc)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()


def merged_accuracy(model_dir: str, adapter_dir: Path | None) -> float:
    """``toy.heldout_accuracy`` of the warm start, with ``adapter_dir``'s LoRA merged in when given."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlblocks.sync import merge_lora

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        state = {"tensors": load_file(str(adapter_dir / "adapter_model.safetensors")),
                 "config": json.loads((adapter_dir / "adapter_config.json").read_text())}
        model.load_state_dict(dict(merge_lora(model.state_dict().items(), state)))
    return toy.heldout_accuracy(model, toy.build_tokenizer())


@dataclass
class Config:
    """tinker-cookbook's RL recipe (rl.train) on the toy task, against rlblocks.tinker on this machine."""

    name: str = opt("demo-tinker", "run name: outputs go to <runs-dir>/<name>/")
    runs_dir: str = opt("runs", "directory of run folders")
    steps: int = opt(600, "most RL steps")
    time_limit: float = opt(480.0, "RL wall seconds (0: none); training runs in chunks of --chunk steps, each "
                                   "resumed from the cookbook's last checkpoint (weights and Adam state), while the "
                                   "next chunk still fits")
    chunk: int = opt(50, "RL steps per cookbook run (each resumes from the last checkpoint)")
    groups_per_batch: int = opt(16, "groups (prompts) per sampled batch")
    group_size: int = opt(8, "samples per prompt")
    lr: float = opt(1.5e-3, "Adam learning rate of the LoRA adapter")
    lora_rank: int = opt(32, "LoRA rank of the trained adapter")
    loss_fn: str = opt("ppo", "Tinker loss of forward_backward", choices=("importance_sampling", "ppo", "cispo", "dro"))
    substeps: int = opt(2, "optimizer steps per sampled batch (cookbook num_substeps)")
    off_policy: int = opt(-1, "cookbook async mode: sampling runs up to N steps ahead of training (AsyncConfig "
                              "max_steps_off_policy, trained with --loss-fn); -1: synchronous")
    eval_every: int = opt(0, "cookbook evaluations of the held-out metric every N steps (0: off)")
    threads: int = opt(1, "torch threads of the server process")
    seed: int = opt(0, "dataset shuffling seed")


def check_flags(cfg: Config) -> None:
    """Refuse flag values the loop cannot run with (exit status 2, naming the flag)."""
    check_at_least(cfg, 1, "steps", "chunk", "groups_per_batch", "group_size", "lora_rank", "substeps", "threads")
    check_at_least(cfg, 0, "eval_every", "seed")
    check_at_least(cfg, -1, "off_policy")
    if cfg.lr <= 0:
        raise ArgumentError(f"--lr: expected a float > 0, got {cfg.lr}")
    if cfg.time_limit < 0:
        raise ArgumentError(f"--time-limit: expected seconds >= 0 (0: no limit), got {cfg.time_limit}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_flags(Config, argv, check=check_flags)
    torch.set_num_threads(1)
    out = Path(args.runs_dir) / args.name
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model_dir = toy.warm_start(Path(args.runs_dir) / "warmstart")
    register_tokenizer(MODEL_NAME, toy.build_tokenizer)
    os.environ.setdefault("TINKER_API_KEY", "tml-local")
    state = out / "state"
    server = Server(model_dir, state, out / "server.log", args.threads)
    try:
        evaluator = HeldoutAccuracy()
        sc = tinker.ServiceClient(base_url=server.base_url)
        before_service = asyncio.run(evaluator(sc.create_sampling_client(base_model=MODEL_NAME).result()))
        t_train = time.time()
        log_path = out / "cookbook"
        if log_path.exists():  # a fresh run: the cookbook would otherwise resume the previous one
            import shutil

            shutil.rmtree(log_path)
        config = train.Config(
            learning_rate=args.lr, model_name=MODEL_NAME, recipe_name="rlblocks_toy_addition", max_tokens=6,
            dataset_builder=AdditionDatasetBuilder(groups_per_batch=args.groups_per_batch,
                                                   group_size=args.group_size, seed=args.seed),
            log_path=str(log_path), base_url=server.base_url, lora_rank=args.lora_rank,
            **({"async_config": train.AsyncConfig(max_steps_off_policy=args.off_policy,
                                                  groups_per_batch=args.groups_per_batch, loss_fn=args.loss_fn)}
               if args.off_policy >= 0 else {"loss_fn": args.loss_fn}),
            max_steps=args.steps, eval_every=args.eval_every, num_substeps=args.substeps, save_every=0,
            num_groups_to_log=0,
            rollout_json_export=False, evaluator_builders=[HeldoutAccuracy] if args.eval_every else [],
            ttl_seconds=None)
        server_cpu0, client_cpu0 = server.cpu_seconds(), time.process_time()
        done, per_step = 0, None
        while done < args.steps:
            n = min(args.chunk, args.steps - done)
            if args.time_limit and per_step is not None:
                n = min(n, int((t_train + args.time_limit - time.time()) / per_step))
                if n < 1:
                    break
            t_chunk = time.time()
            asyncio.run(train.main(chz.replace(config, max_steps=done + n)))  # resumes from the last checkpoint
            done += n
            per_step = (time.time() - t_chunk) / n
        train_s = time.time() - t_train
        server_cpu, client_cpu = server.cpu_seconds() - server_cpu0, time.process_time() - client_cpu0
        final = [json.loads(x) for x in (log_path / "checkpoints.jsonl").read_text().splitlines() if x.strip()][-1]
        after_service = asyncio.run(evaluator(sc.create_sampling_client(model_path=final["sampler_path"]).result()))
        run, kind, name = final["sampler_path"][len("tinker://"):].split("/")
        adapter_dir = state / "runs" / run / kind / name
        sc.close("success").result()
    finally:
        server.stop()
    before, after = merged_accuracy(model_dir, None), merged_accuracy(model_dir, adapter_dir)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    summary = {
        "heldout_accuracy_before": before, "heldout_accuracy_after": after, "gain_points": 100 * (after - before),
        "service_greedy_accuracy_before": before_service["heldout/accuracy"],
        "service_greedy_accuracy_after": after_service["heldout/accuracy"],
        "steps": done, "groups_per_batch": args.groups_per_batch, "group_size": args.group_size,
        "lr": args.lr, "lora_rank": args.lora_rank, "loss_fn": args.loss_fn, "substeps": args.substeps,
        "off_policy": args.off_policy,
        "rl_seconds": train_s,
        "total_seconds": time.time() - t0, "load_average_1min_at_end": load,
        "rl_cpu_seconds_server": server_cpu, "rl_cpu_seconds_client": client_cpu,
        "final_sampler_path": final["sampler_path"],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"held-out accuracy {before:.3f} -> {after:.3f} ({summary['gain_points']:+.1f} points; through the "
          f"service {before_service['heldout/accuracy']:.3f} -> {after_service['heldout/accuracy']:.3f}); RL "
          f"{train_s:.0f} s for {done} steps ({server_cpu:.0f} / {client_cpu:.0f} CPU s server / client), "
          f"{summary['total_seconds']:.0f} s in all, load average {load:.1f}; {out}/summary.json")
    return summary


if __name__ == "__main__":
    main()
