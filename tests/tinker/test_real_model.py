"""The Tinker server serving a real pretrained model (SmolLM2-135M-Instruct: BPE tokenizer, ChatML template, tied
embeddings) to the official SDK: forward log-probs equal a float64 transformers reference of the same weights (a
fresh LoRA adapter is the identity), and the log-probs of sampled sequences equal a forward of them. One server and
one float64 reference for the module; a few short chat sequences only (135M forwards on a 2-core CPU)."""

from __future__ import annotations

import pytest
import torch
from tinker_testlib import ref_logprobs

REAL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TIMEOUT = 300
SYSTEM = {"role": "system", "content": "You are a helpful AI assistant named SmolLM, trained by Hugging Face"}


@pytest.fixture(scope="module")
def real_server(smollm2_dir, tinker_env, tmp_path_factory):
    from rlblocks.tinker import ServerThread

    with ServerThread({REAL: smollm2_dir}, state_dir=str(tmp_path_factory.mktemp("tinker_real"))) as srv:
        yield srv


@pytest.fixture(scope="module")
def real_client(real_server):
    import tinker

    sc = tinker.ServiceClient(base_url=real_server.base_url)
    tc = sc.create_lora_training_client(base_model=REAL, rank=8, seed=0).result(TIMEOUT)
    yield sc, tc
    sc.close("success").result(TIMEOUT)


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def ref64(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float64).eval()


def _chat(tok, messages, **kw) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _datum(tokens):
    from tinker import types

    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def test_forward_logprobs_equal_a_float64_transformers_reference(real_client, tok, ref64):
    _, tc = real_client
    info = tc.get_info()
    assert info.model_name == REAL and info.model_data.arch == "LlamaForCausalLM"
    assert tc.get_tokenizer().get_vocab() == tok.get_vocab()
    seqs = [_chat(tok, [SYSTEM, {"role": "user", "content": "Calculate 17 + 25."},
                        {"role": "assistant", "content": "<answer>42</answer>"}]),
            _chat(tok, [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}])]
    out = tc.forward([_datum(s) for s in seqs], "cross_entropy").result(TIMEOUT)
    for s, o in zip(seqs, out.loss_fn_outputs):
        got = o["logprobs"].to_torch().double()
        want = ref_logprobs(ref64, s[:-1], s[1:])
        assert got.shape == want.shape and want.min() < -5  # a real distribution: some targets are unlikely
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_sampled_logprobs_equal_a_forward_of_the_sequence(real_client, tok, ref64):
    from tinker import types

    _, tc = real_client
    sampler = tc.save_weights_and_get_sampling_client().result(TIMEOUT)
    prompt = _chat(tok, [SYSTEM, {"role": "user", "content": "Calculate 6 + 7."}], add_generation_prompt=True)
    res = sampler.sample(types.ModelInput.from_ints(prompt), 2,
                         types.SamplingParams(max_tokens=10, seed=5, temperature=1.0)).result(TIMEOUT)
    assert len(res.sequences) == 2
    full = [prompt + list(s.tokens) for s in res.sequences]
    fwd = tc.forward([_datum(f) for f in full], "cross_entropy").result(TIMEOUT).loss_fn_outputs
    for s, f, o in zip(res.sequences, full, fwd):
        sampled = torch.tensor(s.logprobs, dtype=torch.float64)
        forward = o["logprobs"].to_torch().double()[len(prompt) - 1:]
        assert s.stop_reason == ("stop" if s.tokens[-1] == tok.eos_token_id else "length")
        torch.testing.assert_close(sampled, forward, rtol=0, atol=2e-4)
        torch.testing.assert_close(sampled, ref_logprobs(ref64, f[:-1], f[1:])[len(prompt) - 1:], rtol=0, atol=2e-4)


def test_after_a_step_on_the_tied_head_sampler_and_trainer_agree(real_server, tok):
    """SmolLM2 ties its LM head to the input embedding; an adapter on the head (train_unembed) must change the head
    only, in the trainer (merged head weight) and in the sampler (its untied copy) alike."""
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(base_url=real_server.base_url)
    tc = sc.create_lora_training_client(base_model=REAL, rank=4, seed=1, train_mlp=False,
                                        train_attn=False).result(TIMEOUT)
    prompt = _chat(tok, [SYSTEM, {"role": "user", "content": "Say yes."}], add_generation_prompt=True)
    target = prompt + tok.encode("Yes!", add_special_tokens=False) + [tok.eos_token_id]
    before = tc.forward([_datum(target)], "cross_entropy").result(TIMEOUT).loss_fn_outputs[0]["logprobs"].to_torch()
    tc.forward_backward([_datum(target)], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=2e-2)).result(TIMEOUT)
    sampler = tc.save_weights_and_get_sampling_client().result(TIMEOUT)
    res = sampler.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=6, seed=2)).result(
        TIMEOUT)
    full = [prompt + list(s.tokens) for s in res.sequences] + [target]
    fwd = tc.forward([_datum(f) for f in full], "cross_entropy").result(TIMEOUT).loss_fn_outputs
    assert (fwd[-1]["logprobs"].to_torch() - before).abs().max() > 0.05  # the head really moved
    for s, o in zip(res.sequences, fwd):
        torch.testing.assert_close(torch.tensor(s.logprobs), o["logprobs"].to_torch()[len(prompt) - 1:], rtol=0,
                                   atol=2e-4)
    sc.close("success").result(TIMEOUT)
