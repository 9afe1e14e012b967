"""VLLMEngine's LoRA path on real vLLM (CPU): adapters per version, retention, no swap under a running request.

The reference is peft's own forward of the same adapter on the HF model (unmerged), independent of vLLM.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from rlblocks.rollout import GenerationRequest, SamplingParams

pytestmark = pytest.mark.vllm

PROMPT = [1, 12, 13, 14, 40, 41, 7]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def req(rid: str, n: int) -> GenerationRequest:
    return GenerationRequest(rid, list(PROMPT), SamplingParams(max_new_tokens=n, temperature=0.0))


def make_adapter(base, seed: int):
    """A peft LoRA (r=4) with random non-zero A and B, so that it changes the policy."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False, lora_dropout=0.0)
    model = get_peft_model(copy.deepcopy(base), cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    return model


@torch.no_grad()
def check_policy(model, prompt, output, logprobs):
    """``output`` is ``model``'s greedy choice at every step (up to fp32 near-ties), with matching logprobs."""
    ids = torch.tensor([list(prompt) + list(output)])
    lp = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double().log_softmax(-1)
    chosen = lp.gather(-1, torch.tensor(output)[:, None])[:, 0]
    assert (lp.max(-1).values - chosen).max().item() < 1e-4
    assert (torch.tensor(logprobs, dtype=torch.float64) - chosen).abs().max().item() < 1e-3


def test_lora_versions_retention_and_no_swap_under_running_request(vllm_engine, hf_model, run, tmp_path, wait_tokens):
    from rlblocks.sync import lora_state

    a, b, c = (make_adapter(hf_model, s) for s in (11, 12, 13))
    long_n = 240  # PROMPT + 240 < max_model_len
    v = vllm_engine.version
    base = run(vllm_engine.generate(req("lora-base", 24)))
    try:
        run(vllm_engine.update_lora(lora_state(a), version=v + 1))
        assert vllm_engine.version == v + 1
        ga = run(vllm_engine.generate(req("lora-a", 32)))
        assert set(ga.output_versions) == {v + 1}
        assert ga.output_ids != base.output_ids
        check_policy(a, PROMPT, ga.output_ids, ga.output_logprobs)

        c_dir = tmp_path / "adapter_c"
        c.save_pretrained(str(c_dir))

        async def swap_while_running():
            running = asyncio.ensure_future(vllm_engine.generate(req("lora-a-long", long_n)))
            await wait_tokens(vllm_engine, running, "lora-a-long", 2)  # running under a
            await vllm_engine.update_lora(lora_state(b), version=v + 2)
            fresh = await vllm_engine.generate(req("lora-b", 32))  # runs beside lora-a-long
            # max_staleness=1: v+1 must stay while its request runs, even after v+3 arrives. Frozen, the request
            # is still in flight when v+3 is registered, however slowly this process ran meanwhile.
            await vllm_engine.pause(mode="keep")
            assert not running.done() and vllm_engine.num_output_tokens("lora-a-long") < long_n
            await vllm_engine.update_lora(str(c_dir), version=v + 3)
            assert v + 1 in vllm_engine.registered_lora_versions()
            await vllm_engine.resume()
            return await running, fresh

        long_a, gb = run(swap_while_running())
        # The running request finished under the adapter it started with; the new one used the new adapter.
        assert long_a.finish_reason == "length" and set(long_a.output_versions) == {v + 1}
        check_policy(a, PROMPT, long_a.output_ids, long_a.output_logprobs)
        assert set(gb.output_versions) == {v + 2}
        check_policy(b, PROMPT, gb.output_ids, gb.output_logprobs)

        gc = run(vllm_engine.generate(req("lora-c", 32)))
        assert set(gc.output_versions) == {v + 3}
        check_policy(c, PROMPT, gc.output_ids, gc.output_logprobs)

        async def removed():  # v+1 is removed once its last request returned, in a task of its own
            while True:
                ids = await vllm_engine.llm.list_loras()
                if vllm_engine.registered_lora_versions() == [v + 2, v + 3] and set(ids) == {v + 3, v + 4}:
                    return
                await asyncio.sleep(0.01)

        run(removed())  # lora_int_id = version + 1; run's timeout is the hang guard

        with pytest.raises(ValueError, match="version"):
            run(vllm_engine.update_lora(lora_state(a), version=v))
        with pytest.raises(ValueError, match="adapter_config"):
            run(vllm_engine.update_lora(str(tmp_path), version=v + 4))
    finally:
        run(vllm_engine.update_lora(None, version=v + 4))
    back = run(vllm_engine.generate(req("lora-back", 24)))
    assert back.output_ids == base.output_ids
    assert set(back.output_versions) == {v + 4}
