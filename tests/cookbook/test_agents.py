"""The agent loops on the shared plumbing: the gateway loop repeats for a seed, and a checkpoint whose tokenizer
cannot render chat turns is refused with a message naming ``--model``."""

from __future__ import annotations

import json

import pytest
import torch

# a deprecated rlblocks name (the library's DeprecationWarnings all start with "rlblocks:") fails the test
pytestmark = pytest.mark.filterwarnings("error:rlblocks:DeprecationWarning")

TIMING = ("generate_seconds", "step_seconds", "wall_seconds", "train_seconds", "sync_seconds", "tokens_per_s")


@pytest.fixture(scope="module")
def agent_model_dir(tmp_path_factory) -> str:
    """``agent_task.warm_start`` at the demo's target (20 % greedy accuracy on SFT problems, ~20 s): it calls the
    calculator in most episodes, so the gateway sessions are multi-turn and some answers are right."""
    import agent_task as task

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return task.warm_start(tmp_path_factory.mktemp("agent_ws"), task.WarmStart(target_train_accuracy=0.2),
                               log=lambda s: None)
    finally:
        torch.set_num_threads(threads)


def _gateway_run(model: str, runs, name: str, *extra: str) -> tuple[list[dict], dict, dict]:
    import agent_gateway
    from safetensors.torch import load_file

    threads = torch.get_num_threads()
    try:
        summary = agent_gateway.main(["--model", model, "--runs-dir", str(runs), "--name", name, "--steps", "3",
                                      "--prompts-per-step", "4", "--group-size", "4", "--heldout", "16", *extra])
    finally:
        torch.set_num_threads(threads)  # the loop runs one thread (the pytest process keeps its own setting)
    rows = [{k: v for k, v in json.loads(x).items() if k not in TIMING}
            for x in (runs / name / "metrics.jsonl").read_text().splitlines()]
    return rows, summary, load_file(runs / name / "policy" / "model.safetensors")


@pytest.mark.slow
def test_gateway_loop_repeats_for_a_seed(agent_model_dir, tmp_path):
    # every request carries a seed drawn from --seed and the trainer takes the sessions in order; with
    # --batch-invariant a sequence's log-probs do not depend on which requests shared an engine step, so two runs
    # of one seed train the same weights to the last bit; another seed samples other episodes
    a_rows, a_sum, a_w = _gateway_run(agent_model_dir, tmp_path, "a", "--batch-invariant", "--seed", "3")
    b_rows, b_sum, b_w = _gateway_run(agent_model_dir, tmp_path, "b", "--batch-invariant", "--seed", "3")
    c_rows, _, _ = _gateway_run(agent_model_dir, tmp_path, "c", "--batch-invariant", "--seed", "4")
    assert [r["step"] for r in a_rows] == [1, 2, 3]
    assert a_rows == b_rows  # rewards, losses, grad norms, tokens, tool calls: bit for bit
    assert a_w.keys() == b_w.keys() and all(torch.equal(a_w[k], b_w[k]) for k in a_w)
    assert (a_sum["accuracy_before"], a_sum["accuracy_after"]) == (b_sum["accuracy_before"], b_sum["accuracy_after"])
    assert a_sum["gateway"]["sessions_finished"] == b_sum["gateway"]["sessions_finished"] == 3 * 16
    assert sum(r["tool_calls_per_episode"] for r in a_rows) > 0  # multi-turn sessions: tool results re-sent
    assert [(r["tokens_trained"], r["tool_calls_per_episode"]) for r in a_rows] != \
        [(r["tokens_trained"], r["tool_calls_per_episode"]) for r in c_rows]


def test_a_tokenizer_without_a_chat_template_is_refused_naming_model(tiny_hf_dir, tmp_path):
    import agent_gateway
    from plumbing import load_tokenizer

    from rlblocks.errors import ArgumentError

    with pytest.raises(ArgumentError, match="--model: expected a checkpoint whose tokenizer has a chat template"):
        agent_gateway.main(["--model", tiny_hf_dir, "--runs-dir", str(tmp_path), "--name", "x", "--steps", "1"])
    assert not (tmp_path / "x").exists()  # refused before anything was written
    with pytest.raises(ArgumentError, match="--model"):
        load_tokenizer(tiny_hf_dir, chat=True)
    assert load_tokenizer(tiny_hf_dir).chat_template is None  # without chat=True it loads as it is
