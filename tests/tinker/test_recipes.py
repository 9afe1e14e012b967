"""tinker-cookbook's ``recipes/rl_loop.py`` and ``recipes/sl_loop.py`` run unchanged against the server.

Only their dataset source is pointed at a small local file: the test replaces ``datasets.load_dataset`` (which the
recipes call with a hub name) by a loader of a local JSON-lines file, and registers the served model's tokenizer
with ``tinker_cookbook.tokenizer_utils.register_tokenizer`` (the cookbook's documented hook for a local tokenizer).
"""

from __future__ import annotations

import json

import pytest
from tinker_testlib import GSM8K_ROWS, MODEL, RL_MODEL

pytest.importorskip("tinker_cookbook")

NO_ROBOTS_ROWS = [
    {"messages": [{"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": f"{w} {w}!"}]}
    for w in ["hi", "ok", "yes", "no", "go", "up"]
]


@pytest.fixture
def local_datasets(tmp_path, monkeypatch, tinker_model_dir, boxed_model_dir):
    import datasets
    from tinker_cookbook import tokenizer_utils
    from transformers import AutoTokenizer

    files = {}
    for hub_name, rows in (("openai/gsm8k", GSM8K_ROWS), ("HuggingFaceH4/no_robots", NO_ROBOTS_ROWS)):
        f = tmp_path / (hub_name.replace("/", "_") + ".jsonl")
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
        files[hub_name] = str(f)
    real = datasets.load_dataset
    asked = []

    def load_local(name, *args, **kwargs):
        asked.append(name)
        return real("json", data_files={"train": files[name]}, cache_dir=str(tmp_path / "hf_cache"))

    monkeypatch.setattr(datasets, "load_dataset", load_local)
    tokenizer_utils.register_tokenizer(MODEL, lambda: AutoTokenizer.from_pretrained(tinker_model_dir))
    tokenizer_utils.register_tokenizer(RL_MODEL, lambda: AutoTokenizer.from_pretrained(boxed_model_dir))
    yield asked
    tokenizer_utils.unregister_tokenizer(MODEL)
    tokenizer_utils.unregister_tokenizer(RL_MODEL)


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "cispo"])
def test_rl_loop_recipe_runs_unchanged(server, local_datasets, tmp_path, loss_fn):
    import tinker
    from tinker_cookbook.recipes import rl_loop

    log = tmp_path / "rl"
    rl_loop.main(rl_loop.Config(base_url=server.base_url, log_path=str(log), model_name=RL_MODEL, batch_size=4,
                                group_size=4, max_tokens=12, max_steps=2, loss_fn=loss_fn, save_every=0, lora_rank=8))
    assert local_datasets == ["openai/gsm8k"]
    metrics = [m for m in _jsonl(log / "metrics.jsonl") if "progress/batch" in m]
    assert [m["progress/batch"] for m in metrics] == [0, 1]
    # the warmed-up model answers in the expected format, so rewards are mixed and the recipe really trained
    assert any(0 < m["reward/total"] < 1 for m in metrics)
    assert any(m.get("grad_norm", 0) > 0 for m in metrics)
    final = _jsonl(log / "checkpoints.jsonl")[-1]
    assert final["name"] == "final"
    rest = tinker.RestClient(base_url=server.base_url)
    run = final["state_path"][len("tinker://"):].split("/")[0]
    listed = {c.tinker_path for c in rest.list_checkpoints(run).result(60).checkpoints}
    assert {final["state_path"], final["sampler_path"]} <= listed


def test_sl_loop_recipe_runs_unchanged(server, local_datasets, tmp_path):
    from tinker_cookbook.recipes import sl_loop

    log = tmp_path / "sl"
    sl_loop.main(sl_loop.Config(base_url=server.base_url, log_path=str(log), model_name=MODEL, batch_size=2,
                                learning_rate=5e-3, max_length=256, save_every=0, lora_rank=8, max_steps=3))
    assert local_datasets == ["HuggingFaceH4/no_robots"]
    metrics = [m for m in _jsonl(log / "metrics.jsonl") if "train_mean_nll" in m]
    assert len(metrics) == 3 and all(m["num_sequences"] == 2 for m in metrics)
    assert _jsonl(log / "checkpoints.jsonl")[-1]["name"] == "final"
