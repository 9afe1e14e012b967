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


@pytest.fixture(autouse=True)
def recipe_clients(monkeypatch):
    """The recipes leave their ``ServiceClient`` open (their process ends with them); each one a test makes is
    closed at its end, so that no session heartbeat outlives the server it beats against."""
    import tinker

    made = []

    class Recorded(tinker.ServiceClient):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(tinker, "ServiceClient", Recorded)
    yield made
    for sc in made:
        sc.close("success").result(60)


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
def test_rl_loop_recipe_runs_unchanged(server, local_datasets, recipe_clients, tmp_path, loss_fn):
    import tinker
    from tinker_cookbook.recipes import rl_loop

    log = tmp_path / "rl"
    rl_loop.main(rl_loop.Config(base_url=server.base_url, log_path=str(log), model_name=RL_MODEL, batch_size=4,
                                group_size=4, max_tokens=12, max_steps=2, loss_fn=loss_fn, save_every=0, lora_rank=8))
    assert local_datasets == ["openai/gsm8k"] and len(recipe_clients) == 1  # the recipe's client, closed at the end
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


@pytest.fixture(scope="module")
def mapped_server(tinker_model_dir, boxed_model_dir, tinker_env, tmp_path_factory):
    """A second server whose operator maps stable_reinforce to ppo (the session's server keeps refusing it)."""
    from rlblocks.tinker import ServerThread

    srv = ServerThread({MODEL: tinker_model_dir, RL_MODEL: boxed_model_dir},
                       state_dir=str(tmp_path_factory.mktemp("tinker_mapped")), stable_reinforce_as="ppo")
    with srv:
        yield srv


MAPPED = "loss_fn_mapped/stable_reinforce->ppo:max"


def test_stable_reinforce_runs_as_the_operators_objective_and_says_so(mapped_server):
    """Mapped to ppo: the same loss and gradient as a ppo request (two clients from one seed, one step each), the
    mapping in the capabilities answer and in the metrics of every forward_backward and optim_step answer."""
    import httpx
    import tinker
    from tinker import types

    caps = httpx.get(f"{mapped_server.base_url}/api/v1/get_server_capabilities").json()
    assert caps["loss_fn_mappings"] == {"stable_reinforce": "ppo"}
    sc = tinker.ServiceClient(base_url=mapped_server.base_url)
    seqs = [[1, 40, 41, 42, 43, 2], [1, 50, 51, 52, 53, 54, 2]]
    data = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]),
                        loss_fn_inputs={"target_tokens": s[1:], "logprobs": [-2.0] * (len(s) - 1),
                                        "advantages": [0.5 * (-1) ** i] * (len(s) - 1)}) for i, s in enumerate(seqs)]
    runs = {}
    for loss_fn in ("stable_reinforce", "ppo"):
        tc = sc.create_lora_training_client(base_model=MODEL, rank=4, seed=3).result(60)
        fb = tc.forward_backward(data, loss_fn).result(60)
        step = tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(60)
        after = tc.forward(data, "ppo").result(60)
        runs[loss_fn] = (fb, step, [o["logprobs"].to_torch() for o in after.loss_fn_outputs])
    (fb_s, step_s, lp_s), (fb_p, step_p, lp_p) = runs["stable_reinforce"], runs["ppo"]
    assert fb_s.metrics["loss:sum"] == fb_p.metrics["loss:sum"] and step_s.metrics["grad_norm"] > 0
    assert step_s.metrics["grad_norm"] == step_p.metrics["grad_norm"]
    assert all(bool((x == y).all()) for x, y in zip(lp_s, lp_p))
    assert fb_s.metrics[MAPPED] == 1.0 and step_s.metrics[MAPPED] == 1.0
    assert fb_p.metrics[MAPPED] == 0.0 and step_p.metrics[MAPPED] == 0.0
    # sampling clients asking for stability information (as stable_reinforce recipes do) are served
    sampler = sc.create_sampling_client(base_model=MODEL, record_stability_info=True).result(60)
    assert len(sampler.sample(types.ModelInput.from_ints([1, 40]), 2,
                              types.SamplingParams(max_tokens=3)).result(60).sequences) == 2
    sc.close("success").result(60)


def test_rl_loop_recipe_with_its_default_stable_reinforce_runs_when_mapped(mapped_server, local_datasets, tmp_path):
    """rl_loop.py unchanged, with its default loss_fn (stable_reinforce: stability-recording samplers and datums
    with provenance spans), trains on a server that maps stable_reinforce; the mapping shows in its metrics log."""
    from tinker_cookbook.recipes import rl_loop

    log = tmp_path / "rl_default"
    cfg = rl_loop.Config(base_url=mapped_server.base_url, log_path=str(log), model_name=RL_MODEL, batch_size=4,
                         group_size=4, max_tokens=12, max_steps=2, save_every=0, lora_rank=8)
    assert cfg.loss_fn == "stable_reinforce"
    rl_loop.main(cfg)
    metrics = [m for m in _jsonl(log / "metrics.jsonl") if "progress/batch" in m]
    assert [m["progress/batch"] for m in metrics] == [0, 1]
    trained = [m for m in metrics if m.get("grad_norm", 0) > 0]
    assert trained and all(m[MAPPED] == 1.0 for m in trained)
