"""tinker-cookbook's RL recipe (``tinker_cookbook.rl.train``) on a real model, against rlblocks.tinker on this machine.

``make demo-tinker``: SmolLM2-135M-Instruct (``--model``: the name ``smollm2-135m`` or any HF directory of it) is
served by ``python -m rlblocks.tinker`` in a subprocess; this script then trains it through the official ``tinker``
SDK on a reasoning-gym task (``basic_arithmetic``: by default the sum of two terms at its two-digit level, 0-100,
the answer asked for in ``<answer></answer>`` tags; ``--min-digits``, ``--max-digits`` and ``--operators`` change
it) with the cookbook's own loop (``rl.train.main``: sampling clients, group-centred advantages, ``forward_backward``,
``optim_step``, checkpoints). What is written here is only what a cookbook user writes for a new task: an
``Env`` (the rendered chat prompt; the reward is 1 when the dataset's own ``score_answer`` accepts the text inside
the tags in full, else 0), its group builder and dataset, and an evaluator.

- **Tokenizer and renderer.** The tokenizer is registered from the model's directory
  (``tokenizer_utils.register_tokenizer``). The prompt is rendered by the cookbook's ``qwen3_instruct`` renderer,
  which writes ChatML; with an explicit system message it equals SmolLM2's own chat template token for token (the
  template adds its default system message when none is given, so the prompts always carry it). This is checked
  at startup on the first prompt, and the renderer's stop sequence must be the model's ``<|im_end|>`` id.
- **Warm start.** The instruct model never writes the tags (0 % strict accuracy), so RL would see no reward
  variance. A short supervised warm start through the same server (``cross_entropy`` on ``--warm-steps`` ×
  ``--warm-batch`` items of the task with their answers in tags, items disjoint from the held-out set) teaches the
  format; it is saved with ``save_state`` and RL starts from it (``load_checkpoint_path``). "Before" is measured
  after it.
- **Metric.** Greedy decoding on ``--heldout`` held-out items (never in the warm-start or RL sets, compared by
  question text) through the service: ``accuracy`` = the fraction the dataset's ``score_answer`` scores 1.0 on the
  text inside the ``<answer>`` tags (no tags: 0), next to the verifier's mean score and the last-integer accuracy.

Outputs go to ``runs/<name>/``: ``summary.json``, the cookbook's ``metrics.jsonl`` and checkpoints list, the
server's log and state directory.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import re
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
from plumbing import check_at_least, opt, parse_flags
from tinker_cookbook import renderers
from tinker_cookbook.rl import train
from tinker_cookbook.rl.types import Env, EnvGroupBuilder, RLDataset, RLDatasetBuilder, StepResult
from tinker_cookbook.supervised.data import conversation_to_datum
from tinker_cookbook.tokenizer_utils import get_tokenizer, register_tokenizer

from rlblocks.errors import ArgumentError

MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
RENDERER = "qwen3_instruct"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # the chat template's own default
FORMAT = " Give only the final answer, inside <answer></answer> tags, like <answer>7</answer>."
TASK = "basic_arithmetic"


# ---------------------------------------------------------------------------------------- the task
def task_split(seed: int, heldout: int, train_items: int, warm_items: int, min_digits: int, max_digits: int,
               operators: str) -> dict[str, list]:
    """reasoning-gym items: ``heldout``, ``train`` (RL) and ``warm`` (supervised warm start); the last two never
    hold a question of the held-out set. Also returns the dataset (``"dataset"``), whose ``score_answer`` is the
    verifier."""
    import reasoning_gym

    def make(s: int, size: int):
        return reasoning_gym.create_dataset(TASK, seed=s, size=size, min_terms=2, max_terms=2, min_digits=min_digits,
                                            max_digits=max_digits, operators=tuple(operators), allow_parentheses=False,
                                            allow_negation=False)

    held = make(seed * 1000 + 1, heldout)
    held_items = list(held)
    seen = {e["question"] for e in held_items}

    def disjoint(s: int, n: int, flag: str) -> list[dict]:
        # small operands repeat questions often: draw twice as many as needed, drop the held-out ones
        items = [e for e in make(s, 2 * n + heldout) if e["question"] not in seen][:n]
        if len(items) < n:
            raise ArgumentError(f"{flag}: only {len(items)} items outside the held-out set, {n} needed")
        return items

    return {"dataset": held, "heldout": held_items, "train": disjoint(seed * 1000 + 2, train_items, "train items"),
            "warm": disjoint(seed * 1000 + 3, warm_items, "--warm-steps x --warm-batch")}


def messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question + FORMAT}]


_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_INT = re.compile(r"-?\d+")


def score(dataset, entry: dict, text: str) -> float:
    """The dataset's own verifier on the text inside the last ``<answer>`` tags (0 without tags)."""
    found = _TAG.findall(text)
    return float(dataset.score_answer(found[-1].strip(), entry)) if found else 0.0


def last_integer_correct(entry: dict, text: str) -> float:
    found = _INT.findall(text)
    return float(bool(found) and found[-1] == entry["answer"])


def check_renderer(renderer, tokenizer) -> None:
    """The renderer's prompt must equal the model's chat template token for token, and it must stop at EOS."""
    msgs = messages("Calculate 1 + 2.")
    ours = renderer.build_generation_prompt(msgs).to_ints()
    theirs = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    theirs = list(theirs["input_ids"] if hasattr(theirs, "keys") else theirs)
    if ours != theirs:
        raise SystemExit(f"renderer {RENDERER!r} does not match the model's chat template:\n  {ours}\n  {theirs}")
    if renderer.get_stop_sequences() != [tokenizer.eos_token_id]:
        raise SystemExit(f"renderer {RENDERER!r} stops at {renderer.get_stop_sequences()}, the model's EOS is "
                         f"{tokenizer.eos_token_id}")


# ---------------------------------------------------------------------------------------- the task, as a cookbook Env
class ArithmeticEnv(Env):
    """One question; reward = 1 when the dataset's ``score_answer`` on the tagged answer is 1, else 0 (its partial
    credit for an answer that contains the right one is gamed by padding answers with digits)."""

    def __init__(self, renderer, dataset, entry: dict) -> None:
        self.renderer, self.dataset, self.entry = renderer, dataset, entry

    async def initial_observation(self):
        return self.renderer.build_generation_prompt(messages(self.entry["question"])), \
            self.renderer.get_stop_sequences()

    async def step(self, action, *, extra=None) -> StepResult:
        msg, _ = self.renderer.parse_response(list(action))
        text = renderers.get_text_content(msg)
        r = float(score(self.dataset, self.entry, text) == 1.0)
        return StepResult(reward=r, episode_done=True, next_observation=tinker.ModelInput.empty(),
                          next_stop_condition=self.renderer.get_stop_sequences(),
                          metrics={"correct": r, "tagged": float(bool(_TAG.search(text)))})


class ArithmeticGroup(EnvGroupBuilder):
    def __init__(self, renderer, dataset, entry: dict, group_size: int) -> None:
        self.renderer, self.dataset, self.entry, self.group_size = renderer, dataset, entry, group_size

    async def make_envs(self) -> Sequence[Env]:
        return [ArithmeticEnv(self.renderer, self.dataset, self.entry) for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return [TASK]


class ArithmeticDataset(RLDataset):
    def __init__(self, renderer, dataset, items: list[dict], groups_per_batch: int, group_size: int) -> None:
        self.renderer, self.dataset, self.items = renderer, dataset, items
        self.groups_per_batch, self.group_size = groups_per_batch, group_size

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        start = index * self.groups_per_batch
        return [ArithmeticGroup(self.renderer, self.dataset, e, self.group_size)
                for e in self.items[start: start + self.groups_per_batch]]

    def __len__(self) -> int:
        return len(self.items) // self.groups_per_batch


@chz.chz
class ArithmeticDatasetBuilder(RLDatasetBuilder):
    groups_per_batch: int = 8
    group_size: int = 8
    seed: int = 0
    heldout: int = 200
    train_items: int = 4000
    min_digits: int = 2
    max_digits: int = 2
    operators: str = "+"

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        split = task_split(self.seed, self.heldout, self.train_items, 0, self.min_digits, self.max_digits,
                           self.operators)
        renderer = renderers.get_renderer(RENDERER, get_tokenizer(MODEL_NAME))
        return ArithmeticDataset(renderer, split["dataset"], split["train"], self.groups_per_batch,
                                 self.group_size), None


async def heldout_eval(client: tinker.SamplingClient, renderer, dataset, items: list[dict],
                       max_tokens: int) -> dict[str, float]:
    """Greedy answers to ``items`` through a sampling client: accuracy (verifier score 1.0), mean verifier score,
    fraction with tags, last-integer accuracy, and the first three answers."""
    params = tinker.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=renderer.get_stop_sequences())

    async def one(entry: dict) -> tuple[float, float, float, str]:
        res = await client.sample(renderer.build_generation_prompt(messages(entry["question"])), 1, params)
        msg, _ = renderer.parse_response(list(res.sequences[0].tokens))
        text = renderers.get_text_content(msg)
        return score(dataset, entry, text), float(bool(_TAG.search(text))), last_integer_correct(entry, text), text

    rows = await asyncio.gather(*(one(e) for e in items))
    n = len(rows)
    return {"accuracy": sum(r[0] == 1.0 for r in rows) / n, "score": sum(r[0] for r in rows) / n,
            "tagged": sum(r[1] for r in rows) / n, "last_integer_accuracy": sum(r[2] for r in rows) / n,
            "examples": [f"{e['question']} -> {r[3]!r}" for e, r in zip(items[:3], rows[:3])]}


def warm_start(sc: tinker.ServiceClient, renderer, items: list[dict], cfg) -> tuple[str, tinker.TrainingClient]:
    """Supervised warm start on the answer format (``cross_entropy`` on the assistant turn); returns the saved
    state's path and the training client."""
    tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=cfg.lora_rank, seed=cfg.seed).result()
    adam = tinker.AdamParams(learning_rate=cfg.warm_lr)
    for step in range(cfg.warm_steps):
        batch = items[step * cfg.warm_batch: (step + 1) * cfg.warm_batch]
        data = [conversation_to_datum([*messages(e["question"]),
                                       {"role": "assistant", "content": f"<answer>{e['answer']}</answer>"}],
                                      renderer, None) for e in batch]
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(adam).result()
        fb.result()
    return tc.save_state("warmstart").result().path, tc


# ------------------------------------------------------------------------------------------------ the server
class Server:
    """``python -m rlblocks.tinker`` in a subprocess, ready once it prints its URL (its output goes to ``log``)."""

    def __init__(self, model_dir: str, state_dir: Path, log: Path, threads: int) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
        # two glibc heaps: a training step's activations freed in one thread are reused by the next instead of each
        # thread keeping its own (with the default, one per thread, an unshared 64-datum run grew past 14 GB)
        env.setdefault("MALLOC_ARENA_MAX", "2")
        self.log = log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "rlblocks.tinker", "--model", f"{MODEL_NAME}={model_dir}",
                                      "--port", "0", "--state-dir", str(state_dir), "--threads", str(threads),
                                      "--stable-reinforce-as", "ppo"],
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


@dataclass
class Config:
    """tinker-cookbook's RL recipe (rl.train) on SmolLM2-135M-Instruct and a reasoning-gym task, against
    rlblocks.tinker on this machine."""

    name: str = opt("demo-tinker", "run name: outputs go to <runs-dir>/<name>/")
    runs_dir: str = opt("runs", "directory of run folders")
    model: str = opt("smollm2-135m", "SmolLM2-135M-Instruct: the cookbook's model name or its HF directory")
    steps: int = opt(60, "RL steps")
    groups_per_batch: int = opt(8, "groups (questions) per sampled batch")
    group_size: int = opt(8, "samples per question")
    lr: float = opt(5e-5, "Adam learning rate of the LoRA adapter in RL")
    lora_rank: int = opt(16, "LoRA rank of the trained adapter (alpha 32 on this server)")
    loss_fn: str = opt("ppo", "Tinker loss of forward_backward (stable_reinforce runs as ppo on this server)",
                       choices=("importance_sampling", "ppo", "cispo", "stable_reinforce"))
    temperature: float = opt(1.0, "sampling temperature of RL rollouts")
    max_tokens: int = opt(16, "most new tokens of an answer")
    min_digits: int = opt(2, "fewest digits of each term")
    max_digits: int = opt(2, "most digits of each term")
    operators: str = opt("+", "the operators of the questions, as one string (e.g. '+-')")
    warm_steps: int = opt(24, "supervised warm-start steps on the answer format (0: none)")
    warm_batch: int = opt(16, "items per warm-start step")
    warm_lr: float = opt(5e-4, "Adam learning rate of the warm start")
    heldout: int = opt(200, "held-out items evaluated before and after")
    threads: int = opt(2, "torch threads of the server process")
    seed: int = opt(0, "task split and LoRA seed")


def check_flags(cfg: Config) -> None:
    """Refuse flag values the loop cannot run with (exit status 2, naming the flag)."""
    check_at_least(cfg, 1, "steps", "groups_per_batch", "group_size", "lora_rank", "max_tokens", "min_digits",
                   "max_digits", "warm_batch", "heldout", "threads")
    if cfg.max_digits < cfg.min_digits:
        raise ArgumentError(f"--max-digits: expected >= --min-digits ({cfg.min_digits}), got {cfg.max_digits}")
    if not cfg.operators or set(cfg.operators) - set("+-*/"):
        raise ArgumentError(f"--operators: expected a non-empty string of '+', '-', '*', '/', got {cfg.operators!r}")
    check_at_least(cfg, 0, "warm_steps", "seed")
    for flag in ("lr", "warm_lr"):
        if getattr(cfg, flag) <= 0:
            raise ArgumentError(f"--{flag.replace('_', '-')}: expected a float > 0, got {getattr(cfg, flag)}")
    if cfg.temperature <= 0:
        raise ArgumentError(f"--temperature: expected a float > 0, got {cfg.temperature}")


def model_dir(value: str) -> str:
    """An HF directory as is; a model name through the cookbook's named-model cache (converted on first use)."""
    if os.path.isdir(value):
        return value
    from plumbing.models import resolve_model

    return resolve_model(value)


def main(argv: list[str] | None = None) -> dict:
    args = parse_flags(Config, argv, check=check_flags)
    torch.set_num_threads(1)
    # the SDK warns on every `try_again`, the long poll's normal answer while a request runs (each pending sample
    # future gets one every 20 s): not a problem, so not printed
    logging.getLogger("tinker.lib.api_future_impl").setLevel(logging.ERROR)
    out = Path(args.runs_dir) / args.name
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    path = model_dir(args.model)
    from transformers import AutoTokenizer

    register_tokenizer(MODEL_NAME, lambda: AutoTokenizer.from_pretrained(path))
    tokenizer = get_tokenizer(MODEL_NAME)
    renderer = renderers.get_renderer(RENDERER, tokenizer)
    check_renderer(renderer, tokenizer)
    split = task_split(args.seed, args.heldout, 4000, args.warm_steps * args.warm_batch, args.min_digits,
                       args.max_digits, args.operators)
    os.environ.setdefault("TINKER_API_KEY", "tml-local")
    state = out / "state"
    server = Server(path, state, out / "server.log", args.threads)
    try:
        sc = tinker.ServiceClient(base_url=server.base_url)

        def evaluate(client) -> dict[str, float]:
            return asyncio.run(heldout_eval(client, renderer, split["dataset"], split["heldout"], args.max_tokens))

        t_eval = time.time()
        base = evaluate(sc.create_sampling_client(base_model=MODEL_NAME).result())
        eval_s = time.time() - t_eval
        t_warm = time.time()
        warm_path, warm_tc = (warm_start(sc, renderer, split["warm"], args) if args.warm_steps else (None, None))
        warm_s = time.time() - t_warm
        before = evaluate(warm_tc.save_weights_and_get_sampling_client().result()) if warm_tc else base
        log_path = out / "cookbook"
        if log_path.exists():  # a fresh run: the cookbook would otherwise resume the previous one
            import shutil

            shutil.rmtree(log_path)
        config = train.Config(
            learning_rate=args.lr, model_name=MODEL_NAME, renderer_name=RENDERER, recipe_name="rlblocks_rg_arithmetic",
            max_tokens=args.max_tokens, temperature=args.temperature,
            dataset_builder=ArithmeticDatasetBuilder(groups_per_batch=args.groups_per_batch,
                                                     group_size=args.group_size, seed=args.seed,
                                                     heldout=args.heldout, min_digits=args.min_digits,
                                                     max_digits=args.max_digits, operators=args.operators),
            log_path=str(log_path), base_url=server.base_url, lora_rank=args.lora_rank, loss_fn=args.loss_fn,
            load_checkpoint_path=warm_path, max_steps=args.steps, eval_every=0, save_every=0, num_groups_to_log=0,
            rollout_json_export=False, ttl_seconds=None)
        server_cpu0, client_cpu0 = server.cpu_seconds(), time.process_time()
        t_train = time.time()
        asyncio.run(train.main(config))
        train_s = time.time() - t_train
        server_cpu, client_cpu = server.cpu_seconds() - server_cpu0, time.process_time() - client_cpu0
        final = [json.loads(x) for x in (log_path / "checkpoints.jsonl").read_text().splitlines() if x.strip()][-1]
        after = evaluate(sc.create_sampling_client(model_path=final["sampler_path"]).result())
        sc.close("success").result()
    finally:
        server.stop()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    summary = {
        "task": f"reasoning-gym {TASK}: 2 terms of {args.min_digits}-{args.max_digits} digits, operators "
                f"{args.operators!r}, <answer> tags",
        "heldout_items": args.heldout, "base": base, "before": before, "after": after,
        "gain_points": 100 * (after["accuracy"] - before["accuracy"]),
        "steps": args.steps, "groups_per_batch": args.groups_per_batch, "group_size": args.group_size,
        "lr": args.lr, "lora_rank": args.lora_rank, "loss_fn": args.loss_fn, "temperature": args.temperature,
        "warm_steps": args.warm_steps, "warm_batch": args.warm_batch, "warm_lr": args.warm_lr,
        "warm_seconds": warm_s, "eval_seconds": eval_s, "rl_seconds": train_s,
        "rl_seconds_per_step": train_s / args.steps,
        "total_seconds": time.time() - t0, "load_average_1min_at_end": load,
        "rl_cpu_seconds_server": server_cpu, "rl_cpu_seconds_client": client_cpu,
        "final_sampler_path": final["sampler_path"],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"held-out accuracy (<answer> tags, score_answer = 1) {before['accuracy']:.3f} -> {after['accuracy']:.3f} "
          f"({summary['gain_points']:+.1f} points; base model {base['accuracy']:.3f}; last-integer "
          f"{before['last_integer_accuracy']:.3f} -> {after['last_integer_accuracy']:.3f}); warm start {warm_s:.0f} s, "
          f"RL {train_s:.0f} s for {args.steps} steps, {summary['total_seconds']:.0f} s in all, load average "
          f"{load:.1f}; {out}/summary.json")
    return summary


if __name__ == "__main__":
    main()
