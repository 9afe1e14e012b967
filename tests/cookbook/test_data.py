"""The data, reward, evaluation and tracking plumbing every loop shares: prompts from JSONL, Parquet and HF
``datasets`` directories (fields by flag, chat templates, refused rows named), rewards by name or
``module:function``, tools, the per-prompt evaluation files, TensorBoard and W&B files read back, the progress
line, the smoothed curves."""

from __future__ import annotations

import asyncio
import io
import json
import re
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import toy
from plumbing import (
    COMMON_KEYS,
    Progress,
    Reward,
    RunFiles,
    TaskFlags,
    check_fits,
    check_task_flags,
    encode_prompt,
    load_task,
    load_tools,
    parse_log_flag,
)

from rlblocks.errors import ArgumentError

ROOT = Path(__file__).resolve().parents[2]
GSM8K = ROOT / "tests" / "cookbook" / "data" / "gsm8k_style.jsonl"

# a deprecated rlblocks name (the library's DeprecationWarnings all start with "rlblocks:") fails the test
pytestmark = pytest.mark.filterwarnings("error:rlblocks:DeprecationWarning")


def flags(**kw) -> SimpleNamespace:
    """A loop's TaskFlags with its defaults, ``kw`` changed."""
    return SimpleNamespace(**{**asdict(TaskFlags()), **kw})


@pytest.fixture(scope="module")
def bpe_tok(bpe_chat_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bpe_chat_dir)


# ------------------------------------------------------------------------------------------------ prompts
def test_exact_match_verifier_is_the_toy_reward():
    tok = toy.build_tokenizer()
    pairs = toy.split_pairs()["rl"][:6]
    prompts = toy.prompts(tok, pairs)
    eos = tok.eos_token_id
    outs = []
    for a, b in pairs:  # right, right but cut by the budget (no EOS), wrong, empty
        right = tok.encode(str(a + b), add_special_tokens=False)
        outs += [[*right, eos], right, [*tok.encode(str(a + b + 1), add_special_tokens=False), eos], []]
    rows = [p for p in prompts for _ in range(4)]
    reward = Reward("verifier", tok)
    got, failed = asyncio.run(reward.scores(rows, outs))
    assert got == [toy.reward(tok, *p.metadata["pair"], o) for p, o in zip(rows, outs)]
    assert got[:4] == [1.0, 0.0, 0.0, 0.0] and failed == 0
    assert [list(p.ids) for p in prompts] == [toy.encode_prompt(tok, a, b) for a, b in pairs]
    assert [p.ids for p in toy.task(tok).heldout] == [tuple(toy.encode_prompt(tok, *ab))
                                                      for ab in toy.split_pairs()["heldout"]]


def test_jsonl_prompts_are_read_split_and_refused_with_the_line(tmp_path):
    tok = toy.build_tokenizer()
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"{i}+1=", "answer": i + 1, "src": "x"}) for i in range(30))
                    + "\n\n")
    task = load_task(tok, flags(prompts=str(path)))
    assert len(task.heldout) == 3 and len(task.train) == 27  # a tenth held out
    assert task.source == task.heldout_source == str(path)
    assert {p.text for p in task.train}.isdisjoint({p.text for p in task.heldout})
    assert all(p.reference == int(p.text.split("+")[0]) + 1 and p.metadata == {"src": "x"} for p in task.train)
    assert list(task.train[0].ids) == [tok.bos_token_id, *tok.encode(task.train[0].text, add_special_tokens=False)]
    held = tmp_path / "h.jsonl"
    held.write_text(json.dumps({"prompt": "5+5=", "answer": "10"}) + "\n")
    task = load_task(tok, flags(prompts=str(path), eval_prompts=str(held)))
    assert len(task.train) == 30 and [p.text for p in task.heldout] == ["5+5="]
    assert task.source == str(path) and task.heldout_source == str(held)  # what the loops print beside it
    bad = tmp_path / "bad.jsonl"
    for text, flag, needle in [('{"prompt": "1+1=", "answer": "2"}\nnot json', "--prompts", ":2:"),
                               ('{"prompt": "1+1=", "answer": "2"}\n[1, 2]', "--prompts", ":2:"),
                               ('{"prompt": "1+1="}\n{"prompt": "2+2=", "answer": 4}', "--answer-field", ":1:"),
                               ('{"prompt": "1+1=", "answer": null}\n{"prompt": "2+2=", "answer": 4}',
                                "--answer-field", "null"),
                               ('{"prompt": "", "answer": "1"}\n{"prompt": "2+2=", "answer": 4}', "--prompt-field",
                                "'prompt'"),
                               ('{"question": "1+1=", "answer": "1"}\n{"prompt": "2+2=", "answer": 4}',
                                "--prompt-field", "fields: answer, question"),
                               ("", "--prompts", "got none")]:
        bad.write_text(text)
        with pytest.raises(ArgumentError, match=flag) as e:
            load_task(tok, flags(prompts=str(bad)))
        assert needle in str(e.value), (text, str(e.value))
    # a learned reward model needs no reference: the answer field may be absent
    bad.write_text('{"prompt": "1+1="}\n{"prompt": "2+2="}\n')
    assert [p.reference for p in load_task(tok, flags(prompts=str(bad)), needs_reference=False).train] == [None]
    with pytest.raises(ArgumentError, match="no such file"):
        check_task_flags(flags(prompts=str(tmp_path / "missing.jsonl")))
    with pytest.raises(ArgumentError, match="--eval-prompts"):
        check_task_flags(flags(eval_prompts=str(held)))
    long = tmp_path / "long.jsonl"
    long.write_text("\n".join(json.dumps({"prompt": "1" * n, "answer": "1"}) for n in (3, 70)))
    with pytest.raises(ArgumentError, match="64 positions"):
        check_fits(load_task(tok, flags(prompts=str(long))), 64)
    # the demo tokenizers know a few characters: text they cannot encode is refused, naming --model
    words = tmp_path / "words.jsonl"
    words.write_text("\n".join(json.dumps({"prompt": "what is 1+1?", "answer": 2}) for _ in range(3)))
    with pytest.raises(ArgumentError, match="--model"):
        load_task(tok, flags(prompts=str(words)))


def test_parquet_with_chat_messages_and_nested_fields(tmp_path, bpe_tok):
    # verl's layout: the prompt a list of chat messages, the reference nested under reward_model.ground_truth
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": [{"role": "system", "content": "Answer with a number."},
                        {"role": "user", "content": f"What is {i} plus {i}?"}],
             "reward_model": {"ground_truth": str(2 * i), "style": "rule"}, "data_source": "sums"}
            for i in range(20)]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    task = load_task(bpe_tok, flags(prompts=str(path), answer_field="reward_model.ground_truth"))
    assert len(task.train) == 18 and len(task.heldout) == 2
    p = task.train[0]
    i = int(p.reference) // 2
    assert p.text == f"What is {i} plus {i}?" and p.metadata == {"data_source": "sums"}
    want = bpe_tok.apply_chat_template(list(p.messages), add_generation_prompt=True, tokenize=False)
    assert bpe_tok.decode(list(p.ids)) == want and p.messages[0]["role"] == "system"
    with pytest.raises(ArgumentError, match="--chat"):  # messages need the template
        load_task(bpe_tok, flags(prompts=str(path), answer_field="reward_model.ground_truth", chat=False))
    # --no-chat on a string prompt: BOS (none here) and the text's tokens
    assert encode_prompt(bpe_tok, "2+2=", chat=False) == bpe_tok.encode("2+2=", add_special_tokens=False)


def test_datasets_directories_and_their_splits(tmp_path, bpe_tok):
    import datasets

    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:30]),
                               "test": datasets.Dataset.from_list(rows[30:])})
    dd.save_to_disk(str(tmp_path / "gsm"))
    cfg = flags(prompts=str(tmp_path / "gsm"), prompt_field="question")
    task = load_task(bpe_tok, cfg)  # the DatasetDict's test split is the held-out set
    assert [p.text for p in task.train] == [r["question"] for r in rows[:30]]
    assert [p.text for p in task.heldout] == [r["question"] for r in rows[30:]]
    assert task.heldout[0].reference == rows[30]["answer"]
    with pytest.raises(ArgumentError, match="--split"):
        load_task(bpe_tok, flags(prompts=str(tmp_path / "gsm"), prompt_field="question", split="validation"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))  # a Dataset: a tenth held out
    task = load_task(bpe_tok, flags(prompts=str(tmp_path / "one"), prompt_field="question"))
    assert (len(task.train), len(task.heldout)) == (36, 4)
    (tmp_path / "plain").mkdir()
    with pytest.raises(ArgumentError, match="save_to_disk"):
        load_task(bpe_tok, flags(prompts=str(tmp_path / "plain")))


# ------------------------------------------------------------------------------------------------ rewards
REWARDS_PY = '''
import asyncio

from rlblocks.reward import RewardResult


def by_length(sample):
    """1 when the response has a multiple of 3 characters (runs in worker processes: a plain function)."""
    return float(len(sample.response) % 3 == 0)


async def by_reference(sample):
    """The reference's length, and a failure for the reference 'fail' (runs on the event loop)."""
    await asyncio.sleep(0)
    if sample.reference == "fail":
        return RewardResult.failure("no")
    return RewardResult(float(len(str(sample.reference))), details={"meta": dict(sample.metadata)})


def broken(sample):
    raise ValueError("a bug in the reward")


def double(x: int) -> int:
    """Twice x."""
    return 2 * x


NOT_CALLABLE = 3
'''


def test_module_function_rewards_sync_async_and_failing(tmp_path, bpe_tok):
    (tmp_path / "my_rewards.py").write_text(REWARDS_PY)
    prompts = toy.prompts(bpe_tok, [(1, 2), (3, 4)])
    outs = [bpe_tok.encode(t, add_special_tokens=False) for t in ("abc", "abcd")]
    texts = [bpe_tok.decode(o, skip_special_tokens=True) for o in outs]
    sync = Reward(f"{tmp_path / 'my_rewards.py'}:by_length", bpe_tok, timeout=60)
    try:
        got, failed = asyncio.run(sync.scores(prompts, outs))
    finally:
        sync.close()
    assert got == [float(len(t) % 3 == 0) for t in texts] == [1.0, 0.0] and failed == 0
    assert sync.stats()["pool"]["ok"] == 2
    # now importable by name (its directory went onto sys.path): the module:function form
    prompts = [*prompts, toy.prompts(bpe_tok, [(5, 6)])[0]]
    prompts[2] = type(prompts[2])("x", "fail", prompts[2].ids)
    areward = Reward("my_rewards:by_reference", bpe_tok)
    got, failed = asyncio.run(areward.scores(prompts, [*outs, outs[0]]))
    assert got == [1.0, 1.0, 0.0] and failed == 1 and areward.failures == 1  # "3", "7", and the failure
    bad = Reward("my_rewards:broken", bpe_tok, timeout=60)
    try:
        got, failed = asyncio.run(bad.scores(prompts[:1], outs[:1]))
    finally:
        bad.close()
    assert got == [0.0] and failed == 1  # raised twice (one retry): a failure scoring 0, counted
    for spec, needle in [("nosuchmodule_xyz:f", "could not import"), ("my_rewards:missing", "has no 'missing'"),
                         ("my_rewards:NOT_CALLABLE", "a function of a Sample"), ("exact", "verifier|math|code|rm"),
                         (f"{tmp_path / 'none.py'}:f", "Python file")]:
        with pytest.raises(ArgumentError, match="--reward") as e:
            check_task_flags(flags(reward=spec))
        assert needle in str(e.value), (spec, str(e.value))
    with pytest.raises(ArgumentError, match="--reward-model"):
        check_task_flags(flags(reward="rm"))
    with pytest.raises(ArgumentError, match="--eval-k"):
        check_task_flags(flags(eval_k=0))


def test_code_references_become_tests():
    from plumbing.rewards import code_tests

    want = [{"input": "1 2", "output": "3"}, {"input": "2 2", "output": "4"}]
    assert code_tests({"inputs": ["1 2", "2 2"], "outputs": ["3", "4"]}) == want
    assert code_tests(json.dumps({"inputs": ["1 2", "2 2"], "outputs": ["3", "4"]})) == want
    assert code_tests(json.dumps(want)) == want and code_tests(want) == want
    assert code_tests("not json") == "not json"  # refused by the code reward itself, as an error result


def test_tools_from_module_functions(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text(REWARDS_PY)
    monkeypatch.syspath_prepend(str(tmp_path))
    tools = load_tools("rlblocks.rollout.agents:calculator_tool, my_tools:double")
    assert [t.name for t in tools] == ["calc", "double"]
    assert tools[1].schema()["function"]["parameters"]["properties"] == {"x": {"type": "integer"}}
    assert asyncio.run(tools[1]({"x": 4})) == "8"
    with pytest.raises(ArgumentError, match="more than once"):
        load_tools("my_tools:double,my_tools:double")
    with pytest.raises(ArgumentError, match="--tools"):
        load_tools("my_tools:NOT_CALLABLE")


# ------------------------------------------------------------------------------------------------ tracking
def record(step: int, **kw) -> dict:
    rec = dict.fromkeys(COMMON_KEYS)
    rec.update(step=step, version=step, reward=0.25 * step, loss=-0.5 * step, staleness_hist={"0": 10 * step, "1": 2},
               tokens_per_s=100.0 + step, **kw)
    return rec


def test_metrics_go_to_jsonl_tensorboard_and_offline_wandb(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "online")  # forced offline all the same
    files = RunFiles(str(tmp_path), "run", sinks=parse_log_flag("tensorboard,wandb"), config={"lr": 3e-4})
    files.fresh()
    for s in (1, 2, 3):
        files.log(record(s, trained_uids=["a", "b"], heldout_acc=0.5 if s == 3 else None))
    files.write_summary({"accuracy_after": 0.5, "steps": 3})
    files.close()
    rows = [json.loads(x) for x in files.metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["trained_uids"] == ["a", "b"]
    ea = EventAccumulator(str(files.dir / "tensorboard"))
    ea.Reload()
    scalars = ea.Tags()["scalars"]
    assert "reward" in scalars and "staleness_hist/0" in scalars and "trained_uids" not in scalars
    assert [(e.step, e.value) for e in ea.Scalars("reward")] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [(e.step, e.value) for e in ea.Scalars("staleness_hist/0")] == [(1, 10.0), (2, 20.0), (3, 30.0)]
    assert [e.step for e in ea.Scalars("heldout_acc")] == [3]  # None (not measured) is left out
    runs = list((files.dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, "W&B ran online or not at all"
    # the .wandb log is written by W&B's own service process, which can still be writing it when finish()
    # returns on a loaded machine: wait for the records (bounded), do not read the file once
    keys = (b"reward", b"staleness_hist/0", b"tokens_per_s", b"accuracy_after")
    deadline, data = time.monotonic() + 120, b""
    while time.monotonic() < deadline:
        data = b"".join(p.read_bytes() for p in runs[0].glob("run-*.wandb"))
        if all(k in data for k in keys):
            break
        time.sleep(0.2)
    for key in keys:
        assert key in data, key
    # a fresh run removes the old run's tracker files
    files = RunFiles(str(tmp_path), "run", sinks=parse_log_flag("tensorboard"))
    files.fresh()
    assert not (files.dir / "wandb").exists() and not (files.dir / "tensorboard").exists()


def test_every_loop_logs_the_common_keys_and_bad_sinks_are_refused(tmp_path):
    files = RunFiles(str(tmp_path), "r")
    rec = record(1)
    del rec["lr"]
    with pytest.raises(ArgumentError, match="lr"):
        files.log(rec)
    assert parse_log_flag("jsonl") == ("jsonl",) and parse_log_flag("tensorboard") == ("jsonl", "tensorboard")
    with pytest.raises(ArgumentError, match=r"--log-to.*mlflow"):
        parse_log_flag("jsonl,mlflow")


def test_the_common_keys_are_documented_once():
    # the cookbook's documentation lists every common key, and only those, in the first table of its Metrics
    # section (loop-specific keys follow in tables of their own)
    text = (ROOT / "docs" / "cookbook" / "index.md").read_text()
    section = text.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    table = re.search(r"^\|.*?(?=\n(?!\|))", section, flags=re.M | re.S).group(0)
    keys = re.findall(r"^\| `([a-z_@]+)` \|", table, flags=re.M)
    assert sorted(keys) == sorted(COMMON_KEYS)


def test_per_prompt_evaluation_files(tmp_path):
    from rlblocks.reward import summarize

    files = RunFiles(str(tmp_path), "r")
    result = summarize([[1.0, 0.0], [0.0, 0.0]], 2, prompts=["a", "b"], references=["1", "2"],
                       responses=[["1", "x"], ["y", "z"]])
    path = files.write_eval(7, result)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert path.name == "step_000007.jsonl" and len(lines) == 3
    assert lines[0]["responses"] == ["1", "x"] and lines[0]["pass_at_k"] == 1.0 and lines[1]["correct"] == 0
    assert lines[2] == {"totals": True, "step": 7, "k": 2, "n": 2, "pass@2": 0.5, "mean@2": 0.25, "failures": 0}


# ------------------------------------------------------------------------------------------------ progress, plot
class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_progress_prints_a_line_every_few_seconds_off_a_terminal():
    out, clock = io.StringIO(), Clock()
    bar = Progress(10, stream=out, clock=clock, every=5.0, desc="grpo")
    for i in range(10):
        clock.t = 2.0 * (i + 1)  # a step every 2 s
        bar.update({"reward": 0.5, "stale": 1})
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    # at 6 s (3 steps), 12 s (6), 18 s (9), and the last step
    assert [re.search(r"step (\d+)/10", x).group(1) for x in lines] == ["3", "6", "9", "10"]
    assert lines[0] == "grpo: step 3/10 (30%) reward=0.500 stale=1 6 s"


def test_progress_draws_a_bar_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()
    bar = Progress(3, stream=out, clock=Clock())
    for _ in range(3):
        bar.update({"acc": 0.25})
    bar.close()
    assert "\r" in out.getvalue() and "3/3" in out.getvalue()


def test_smoothing_is_the_debiased_moving_average():
    import plot

    xs = [3.0, None, 1.0, 4.0, None, 1.0, 5.0]
    w = 0.6
    got = plot.smooth(xs, w)
    vals = [x for x in xs if x is not None]
    # closed form: s_t = Σ_i w^(t−i)(1−w) x_i / (1 − w^t) over the t values seen so far
    want = [sum(w ** (t - i) * (1 - w) * vals[i - 1] for i in range(1, t + 1)) / (1 - w**t)
            for t in range(1, len(vals) + 1)]
    assert [g for g in got if g is not None] == pytest.approx(want, rel=1e-12)
    assert [g is None for g in got] == [x is None for x in xs]
    assert plot.smooth(xs, 0.0) == xs and got[0] == pytest.approx(3.0, rel=1e-15)  # debiased: starts at x_1
    assert plot.smoothing_weight(10) == 0.0 and plot.smoothing_weight(1200) == pytest.approx(1 - 25 / 1200)
