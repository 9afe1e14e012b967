"""The main demo (``make demo``: seed 0; ``make demo-real``: seeds 0 and 1): GRPO teaches SmolLM2-135M-Instruct a
reasoning-gym task, checked strictly.

    python cookbook/real.py --name demo-real --seeds 0 1             # warm start (cached), then one RL run per seed
    python cookbook/real.py --name demo-real --seeds 0 -- --steps 5   # flags after -- go to grpo_sync.py

Task (:data:`SPEC`, through the loops' ``--prompts rg:...``, ``cookbook/rgym.py``): reasoning-gym's
``basic_arithmetic``, the sum of two terms at its two-digit level (``num_digits=2``: 0-100; ``Calculate 57 + 83.``), 256
held-out items, the answer asked for in ``<answer>...</answer>`` by reasoning-gym's ``direct`` system prompt. Reward:
``--reward rg-exact``, 1 when the dataset's own ``score_answer`` on the text inside the last ``<answer>`` tags is 1,
else 0 (its partial credit for an answer that contains the right one is gamed by padding answers with digits); the
held-out accuracy counts the greedy answers it scores 1. The last-number accuracy (the last number anywhere in the
response, tags or not) is reported beside it.

Warm start (:func:`warm_start`): SmolLM2-135M-Instruct never writes the tags untaught (0 % strict on this task; 15 %
when its last number is read). A short supervised run teaches the format on :data:`SFT_SPEC`'s items (another seed,
minus every held-out question), ``<answer>N</answer>`` as the target, and stops once
:attr:`WarmStart.target_format` of a probe of those items are answered in the tags (checked every
:attr:`WarmStart.check_every` steps), or after :attr:`WarmStart.max_steps` steps / :attr:`WarmStart.max_seconds`.
It is cached as an HF directory under ``runs/warmstart-real/<hash of the settings>/``, and the RL runs' "before"
is measured on it.

Then ``cookbook/grpo_sync.py`` runs on it once per seed with the recipe's flags (:data:`RECIPE`;
``docs/cookbook/real_model.md`` says why each); the figures of each run go to
``runs/<name>-s<seed>/real_summary.json`` and a table is printed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# The task: reasoning-gym's basic_arithmetic, two two-digit terms added (parse_qsl reads "+" as a space: %2B);
# the first eval_size items of seed 1 are held out, the training items are the rest (never a held-out question)
SPEC = ('rg:basic_arithmetic?min_terms=2&max_terms=2&min_digits=2&max_digits=2&operators=["%2B"]'
        '&allow_parentheses=false&seed=1&size=5000&eval_size=256')
# the warm start's items: another seed of the same generator, minus every held-out question
SFT_SPEC = SPEC.replace("seed=1&size=5000", "seed=2&size=2000")
ANSWER_FORMAT, RG_SYSTEM = "answer", "direct"  # <answer> tags, asked for by reasoning-gym's "direct" system prompt
DEFAULT_MODEL = "smollm2-135m"

# grpo_sync.py flags of the recipe (docs/cookbook/real_model.md says why each)
RECIPE = ["--prompts", SPEC, "--reward", "rg-exact", "--answer-format", ANSWER_FORMAT, "--rg-system", RG_SYSTEM,
          "--engine", "torch", "--max-model-len", "128", "--max-new-tokens", "16", "--prompts-per-step", "8",
          "--group-size", "8", "--mini-batches", "1", "--lora-rank", "16", "--lr", "5e-5", "--temperature", "0.7",
          "--time-limit", "900", "--steps", "200", "--eval-every", "10", "--save-every", "0"]


def model_path(value: str) -> str:
    """A ``--model`` value as an HF directory: a name ``plumbing.models`` knows (``smollm2-135m``, converted and
    cached on first use), or a directory as is; empty: :data:`DEFAULT_MODEL`."""
    from plumbing.models import resolve_model

    return resolve_model(value or DEFAULT_MODEL)


def sft_items() -> list[dict[str, Any]]:
    """The warm start's reasoning-gym items: :data:`SFT_SPEC`'s, none of them a held-out question of :data:`SPEC`."""
    import rgym

    items, _held, _dropped = rgym.split(rgym.parse_spec(SFT_SPEC), rgym.parse_spec(SPEC))
    return items


def prompts(tok, items: list[dict[str, Any]]):
    """Items as ``plumbing.Prompt`` s, rendered exactly as ``--prompts rg:...`` renders them in the loops."""
    import rgym
    from plumbing.data import make_prompts

    rows = rgym.rows(items, answer_format=ANSWER_FORMAT, system=RG_SYSTEM, chat=True, where="warm start")
    return make_prompts(tok, rows, prompt_field="prompt", answer_field="answer", chat=True, needs_reference=True)


def score(text: str, item: dict[str, Any]) -> float:
    """The task's own verifier (``score_answer``) on the answer in the requested format (0 without it)."""
    import rgym
    from reasoning_gym import get_score_answer_fn

    answer = rgym.extract(text, ANSWER_FORMAT)
    return 0.0 if answer is None else float(get_score_answer_fn(item["metadata"]["source_dataset"])(answer, item))


# ------------------------------------------------------------------------------------------------ warm start
@dataclass(frozen=True)
class WarmStart:
    """Settings of the supervised format warm start (their hash names the cache directory)."""

    model: str = DEFAULT_MODEL
    batch_size: int = 8
    lr: float = 1e-4
    max_steps: int = 200
    max_seconds: float = 180.0
    target_format: float = 0.9
    check_every: int = 4
    probe: int = 32
    seed: int = 0

    def key(self) -> str:
        blob = json.dumps({**asdict(self), "task": [SFT_SPEC, SPEC, ANSWER_FORMAT, RG_SYSTEM]}, sort_keys=True)
        return hashlib.sha1(blob.encode()).hexdigest()[:10]


def probe_format(model, tok, items: list[dict[str, Any]], max_new_tokens: int = 16) -> tuple[float, float]:
    """``(formatted, correct)`` of greedy answers to ``items``: the fraction in the requested format, and the
    fraction the verifier scores 1 (batched HF ``generate``, left padding)."""
    import rgym
    import torch

    ids_list = [list(p.ids) for p in prompts(tok, items)]
    width = max(map(len, ids_list))
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in ids_list])
    # from the lengths: the pad id is also <|im_end|>, which every chat prompt holds
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids_list])
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad, eos_token_id=tok.eos_token_id)[:, width:]
    model.train()
    texts = tok.batch_decode(out, skip_special_tokens=True)
    formatted = sum(rgym.extract(t, ANSWER_FORMAT) is not None for t in texts) / len(items)
    correct = sum(score(t, e) == 1.0 for t, e in zip(texts, items)) / len(items)
    return formatted, correct


def warm_start(cache_root: str | os.PathLike = "runs/warmstart-real", cfg: WarmStart = WarmStart(), log=print) -> str:
    """The cached warm-start directory (trained first when absent; written to a temporary directory, then
    renamed). Full fine-tuning in fp32, AdamW; loss on the answer tokens only."""
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
    items = sft_items()
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    probe, train = items[: cfg.probe], items[cfg.probe:]
    encoded = {id(e): list(p.ids) for e, p in zip(train, prompts(tok, train))}
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    model.train()
    step, formatted, strict = 0, 0.0, 0.0
    while step < cfg.max_steps and time.time() - t0 < cfg.max_seconds:
        seqs, labels = [], []
        for e in rng.sample(train, cfg.batch_size):
            p = encoded[id(e)]
            o = [*tok.encode(f"<answer>{e['answer']}</answer>", add_special_tokens=False), tok.eos_token_id]
            seqs.append(p + o)
            labels.append([-100] * len(p) + o)
        width = max(map(len, seqs))
        ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
        lab = torch.tensor([s + [-100] * (width - len(s)) for s in labels])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])  # pad id = <|im_end|>
        loss = model(input_ids=ids, attention_mask=mask, labels=lab).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if step % cfg.check_every == 0:
            formatted, strict = probe_format(model, tok, probe)
            log(f"warm start: step {step} loss {loss.item():.3f} formatted {formatted:.2f} correct {strict:.2f} "
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
def figures(heldout: dict[str, Any]) -> dict[str, float]:
    """``strict`` (greedy answers the verifier scores 1, in the requested format) and ``last_number`` (the last
    number of the response equals the answer, format or not) of a summary's held-out figures."""
    return {"strict": heldout["pass@1"], "last_number": heldout["last_number"]}


def parser() -> argparse.ArgumentParser:
    """The driver's own flags (those after ``--`` go to ``grpo_sync.py``, after the recipe's)."""
    ap = argparse.ArgumentParser(description="GRPO on SmolLM2-135M-Instruct, a reasoning-gym task, strict verifier")
    ap.add_argument("--name", default="demo-real")
    ap.add_argument("--runs-dir", default="runs")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="the instruct model's HF directory")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    return ap


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    args = parser().parse_args(argv)
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    import grpo_sync

    path = warm_start(Path(args.runs_dir) / "warmstart-real", WarmStart(model=args.model))
    print(f"warm start: {path} ({json.loads((Path(path) / 'warmstart.json').read_text())})", flush=True)
    results = {}
    for seed in args.seeds:
        name = f"{args.name}-s{seed}"
        t0 = time.time()
        load_before = os.getloadavg()
        grpo_sync.main(["--name", name, "--runs-dir", args.runs_dir, "--model", path, "--seed", str(seed),
                        *RECIPE, *extra])
        run = Path(args.runs_dir) / name
        summary = json.loads((run / "summary.json").read_text())
        res = {"seed": seed, "steps": summary["steps"], "rl_seconds": summary["wall_seconds"],
               "seconds": time.time() - t0, "heldout_n": summary["heldout_prompts"],
               "before": figures(summary["heldout_before"]), "after": figures(summary["heldout_after"]),
               "load_before": load_before, "load_after": os.getloadavg()}
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
