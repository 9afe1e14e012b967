"""The real-model demo (``make demo-real``): GRPO teaches SmolLM2-135M-Instruct a reasoning-gym task, checked strictly.

    python cookbook/real.py --name demo-real --seeds 0 1            # warm start (cached), then one RL run per seed
    python cookbook/real.py --name demo-real --seeds 0 -- --steps 5  # flags after -- go to grpo_sync.py

Task: reasoning-gym's ``basic_arithmetic`` with two terms of two digits and ``+`` / ``-`` (``Calculate 57 - 83.``),
answer format ``<answer>…</answer>`` (reasoning-gym's own tags, asked for by the system prompt :data:`SYSTEM`).
Reward and held-out accuracy: the dataset's own ``score_answer`` on the text inside the last ``<answer>`` tags
(reasoning-gym's ``extract_answer``); a response without the tags scores 0 (:func:`reward`). The last-number
accuracy (:func:`last_number_reward`: the last integer anywhere in the response, tags or not) is reported beside
it, as the lenient measure most quick demos use.

Items (:func:`split`): held-out, warm-start and RL items come from three seeds of the generator; an item whose
question appears in an earlier set is dropped, so the three sets never share a question.

Warm start (:func:`warm_start`): SmolLM2-135M-Instruct never writes the ``<answer>`` tags untaught (0 % strict on
this task; 15 % when its last number is read). A short supervised run on the warm-start items (``<answer>N</answer>``
as the target) teaches the format; it stops once :attr:`WarmStart.target_format` of a probe of warm-start items are
answered in the tags (checked every :attr:`WarmStart.check_every` steps) or after :attr:`WarmStart.max_seconds`.
It is cached as an HF directory under ``runs/warmstart-real/<hash of the settings>/``; "before" is measured on it.

Then ``cookbook/grpo_sync.py`` runs on the cached directory with the recipe's flags (:data:`RECIPE`, see
``docs/cookbook/real_model.md`` for why each), the items written as JSONL prompt files in the run directory, and
``--reward cookbook/real.py:reward``. After each run the per-prompt held-out results (``eval/step_*.jsonl``) are
re-scored with :func:`last_number_reward` and both accuracies go to ``runs/<name>-s<seed>/real_summary.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

TASK = "basic_arithmetic"
TASK_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2, "operators": ["+", "-"],
               "allow_parentheses": False, "allow_negation": False}
SYSTEM = "Answer the question. Give only the final answer between <answer> and </answer> tags."
SEEDS = {"heldout": 1001, "sft": 2002, "rl": 3003}
SIZES = {"heldout": 256, "sft": 2000, "rl": 5000}
DEFAULT_MODEL = "smollm2-135m"

# grpo_sync.py flags of the recipe (docs/cookbook/real_model.md says why each)
RECIPE = ["--engine", "vllm", "--max-model-len", "128", "--max-new-tokens", "16", "--prompts-per-step", "16",
          "--group-size", "8", "--mini-batches", "2", "--lr", "2e-5", "--temperature", "1.0", "--time-limit", "900",
          "--steps", "200", "--eval-every", "10", "--save-every", "0"]


def model_path(value: str) -> str:
    """A ``--model`` value as an HF directory: a name ``plumbing.models`` knows (``smollm2-135m``, converted and
    cached on first use), or a directory as is; empty: :data:`DEFAULT_MODEL`."""
    try:
        from plumbing.models import resolve_model
    except ImportError:  # TEMP until the models module is merged
        return value or DEFAULT_MODEL
    return resolve_model(value or DEFAULT_MODEL)


# ------------------------------------------------------------------------------------------------ task
def dataset(seed: int, size: int):
    """The task's reasoning-gym dataset for ``seed`` (``size`` items)."""
    import reasoning_gym

    return reasoning_gym.create_dataset(TASK, seed=seed, size=size, **TASK_CONFIG)


def split() -> dict[str, list[dict[str, Any]]]:
    """Disjoint ``heldout`` / ``sft`` / ``rl`` item lists (reasoning-gym entries: ``question``, ``answer``,
    ``metadata``); a question already in an earlier list is dropped, so no two lists share one."""
    seen: set[str] = set()
    out = {}
    for name in ("heldout", "sft", "rl"):
        items = []
        for e in dataset(SEEDS[name], SIZES[name]):
            if e["question"] not in seen:
                seen.add(e["question"])
                items.append(e)
        out[name] = items
    return out


def messages(item: dict[str, Any]) -> list[dict[str, str]]:
    """The chat messages of an item: :data:`SYSTEM`, then the question."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": item["question"]}]


def write_prompts(items: list[dict[str, Any]], path: Path) -> Path:
    """Items as a ``--prompts`` JSONL file: ``prompt`` (chat messages), ``answer`` and ``entry_metadata``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for e in items:
            f.write(json.dumps({"prompt": messages(e), "answer": e["answer"], "entry_metadata": e["metadata"]}) + "\n")
    return path


def extract(text: str) -> str | None:
    """The text inside the last ``<answer>…</answer>`` (reasoning-gym's ``extract_answer``), or None."""
    from reasoning_gym.utils import extract_answer

    return extract_answer(text)


def score(answer: str | None, reference: str, metadata: dict[str, Any] | None = None) -> float:
    """The task's own verifier (reasoning-gym's ``score_answer`` for :data:`TASK`) on ``answer``."""
    import reasoning_gym

    fn = reasoning_gym.get_score_answer_fn(TASK)
    return float(fn(answer, {"answer": str(reference), "metadata": metadata or {}}))


def reward(sample) -> float:
    """``--reward cookbook/real.py:reward``: the verifier on the answer in the requested format (0 without tags)."""
    return score(extract(sample.response), sample.reference, sample.metadata.get("entry_metadata"))


def last_number(text: str) -> str | None:
    """The last integer in ``text`` (commas ignored), or None."""
    found = re.findall(r"-?\d+", text.replace(",", ""))
    return found[-1] if found else None


def last_number_reward(response: str, reference: str) -> float:
    """The lenient measure: the verifier on the last integer of the response, wherever it is."""
    return score(last_number(response), reference)


# ------------------------------------------------------------------------------------------------ warm start
@dataclass(frozen=True)
class WarmStart:
    """Settings of the supervised format warm start (their hash names the cache directory)."""

    model: str = DEFAULT_MODEL
    batch_size: int = 16
    lr: float = 1e-4
    max_steps: int = 200
    max_seconds: float = 180.0
    target_format: float = 0.9
    check_every: int = 5
    probe: int = 32
    seed: int = 0

    def key(self) -> str:
        blob = json.dumps({**asdict(self), "task": [TASK, TASK_CONFIG, SYSTEM, SEEDS, SIZES]}, sort_keys=True)
        return hashlib.sha1(blob.encode()).hexdigest()[:10]


def encode(tok, item: dict[str, Any]) -> list[int]:
    """Prompt ids of an item through the chat template (with the generation prompt)."""
    ids = tok.apply_chat_template(messages(item), add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def target(item: dict[str, Any]) -> str:
    return f"<answer>{item['answer']}</answer>"


def probe_format(model, tok, items: list[dict[str, Any]], max_new_tokens: int = 16) -> tuple[float, float]:
    """``(formatted, strict)``: the fraction of greedy answers with the tags, and the strict accuracy."""
    import torch

    prompts = [encode(tok, e) for e in items]
    width = max(map(len, prompts))
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=(ids != pad).long(), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad, eos_token_id=tok.eos_token_id)[:, width:]
    model.train()
    texts = tok.batch_decode(out, skip_special_tokens=True)
    answers = [extract(t) for t in texts]
    formatted = sum(a is not None for a in answers) / len(items)
    strict = sum(score(a, e["answer"]) for a, e in zip(answers, items)) / len(items)
    return formatted, strict


def warm_start(cache_root: str | os.PathLike = "runs/warmstart-real", cfg: WarmStart = WarmStart(), log=print) -> str:
    """The cached warm-start directory (trained first when absent; written to a temporary directory, then
    renamed). Full fine-tuning, AdamW, bf16 autocast over fp32 weights; loss on the answer tokens only."""
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(cache_root) / cfg.key()
    if (out / "config.json").exists():
        return str(out)
    t0 = time.time()
    base = model_path(cfg.model)
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    items = split()["sft"]
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    probe, train = items[: cfg.probe], items[cfg.probe:]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    model.train()
    step, formatted, strict = 0, 0.0, 0.0
    while step < cfg.max_steps and time.time() - t0 < cfg.max_seconds:
        seqs, labels = [], []
        for e in rng.sample(train, cfg.batch_size):
            p = encode(tok, e)
            o = [*tok.encode(target(e), add_special_tokens=False), tok.eos_token_id]
            seqs.append(p + o)
            labels.append([-100] * len(p) + o)
        width = max(map(len, seqs))
        ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
        lab = torch.tensor([s + [-100] * (width - len(s)) for s in labels])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=(lab != -100) | (ids != tok.pad_token_id), labels=lab).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if step % cfg.check_every == 0:
            formatted, strict = probe_format(model, tok, probe)
            log(f"warm start: step {step} loss {loss.item():.3f} formatted {formatted:.2f} strict {strict:.2f} "
                f"({time.time() - t0:.0f} s)")
            if formatted >= cfg.target_format:
                break
    model.eval()
    tmp = Path(cache_root) / f".tmp-{cfg.key()}-{os.getpid()}"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "warmstart.json").write_text(json.dumps({**asdict(cfg), "steps": step, "seconds": time.time() - t0,
                                                    "probe_formatted": formatted, "probe_strict": strict}))
    try:
        tmp.rename(out)
    except OSError:  # another process finished first: keep theirs
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


# ------------------------------------------------------------------------------------------------ demo
def rescore(run_dir: Path) -> dict[str, Any]:
    """Strict and last-number held-out accuracy of each ``eval/step_*.jsonl`` of a run."""
    rows = {}
    for path in sorted((run_dir / "eval").glob("step_*.jsonl")):
        recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        recs = [r for r in recs if not r.get("totals")]
        strict = sum(r["mean"] for r in recs) / len(recs)
        lenient = sum(sum(last_number_reward(s, r["reference"]) for s in r["responses"]) / len(r["responses"])
                      for r in recs) / len(recs)
        rows[int(path.stem.split("_")[1])] = {"strict": strict, "last_number": lenient, "n": len(recs)}
    return rows


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description="GRPO on SmolLM2-135M-Instruct, a reasoning-gym task, strict verifier")
    ap.add_argument("--name", default="demo-real")
    ap.add_argument("--runs-dir", default="runs")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="the instruct model's HF directory")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = ap.parse_args(argv)
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    import grpo_sync

    path = warm_start(Path(args.runs_dir) / "warmstart-real", WarmStart(model=args.model))
    print(f"warm start: {path} ({json.loads((Path(path) / 'warmstart.json').read_text())})", flush=True)
    items = split()
    data = Path(args.runs_dir) / f"{args.name}-data"
    train = write_prompts(items["rl"], data / "train.jsonl")
    held = write_prompts(items["heldout"], data / "heldout.jsonl")
    results = {}
    for seed in args.seeds:
        name = f"{args.name}-s{seed}"
        t0 = time.time()
        grpo_sync.main(["--name", name, "--runs-dir", args.runs_dir, "--model", path, "--prompts", str(train),
                        "--eval-prompts", str(held), "--reward", f"{here / 'real.py'}:reward", "--seed", str(seed),
                        *RECIPE, *extra])
        run = Path(args.runs_dir) / name
        evals = rescore(run)
        first, last = evals[min(evals)], evals[max(evals)]
        summary = json.loads((run / "summary.json").read_text())
        res = {"seed": seed, "steps": summary["steps"], "rl_seconds": summary["wall_seconds"],
               "seconds": time.time() - t0, "before": first, "after": last, "evals": evals,
               "load_after": os.getloadavg()}
        (run / "real_summary.json").write_text(json.dumps(res, indent=1))
        results[seed] = res
    print("seed  steps  RL s   strict before → after   last-number before → after")
    for seed, r in results.items():
        print(f"{seed:4d}  {r['steps']:5d}  {r['rl_seconds']:4.0f}   {r['before']['strict']:.3f} → "
              f"{r['after']['strict']:.3f} ({100 * (r['after']['strict'] - r['before']['strict']):+.1f})   "
              f"{r['before']['last_number']:.3f} → {r['after']['last_number']:.3f}")
    gains = [r["after"]["strict"] - r["before"]["strict"] for r in results.values()]
    print(f"mean strict gain: {100 * sum(gains) / len(gains):+.1f} points over {len(gains)} seed(s)")


if __name__ == "__main__":
    main()
