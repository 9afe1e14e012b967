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


def test_lora_versions_retention_and_no_swap_under_running_request(vllm_engine, hf_model, run, tmp_path):
    from rlblocks.sync import lora_state

    a, b, c = (make_adapter(hf_model, s) for s in (11, 12, 13))
    v = vllm_engine.version
    base = run(vllm_engine.generate(req("lora-base", 24)))
    try:
        run(vllm_engine.update_lora(lora_state(a), version=v + 1))
        assert vllm_engine.version == v + 1
        ga = run(vllm_engine.generate(req("lora-a", 32)))
        assert set(ga.output_versions) == {v + 1}
        assert ga.output_ids != base.output_ids
        check_policy(a, PROMPT, ga.output_ids, ga.output_logprobs)

        async def swap_while_running():
            running = asyncio.ensure_future(vllm_engine.generate(req("lora-a-long", 150)))
            await asyncio.sleep(0.3)
            assert not running.done()
            await vllm_engine.update_lora(lora_state(b), version=v + 2)
            fresh = await vllm_engine.generate(req("lora-b", 32))
            # max_staleness=1: v+1 must stay while its request runs, even after v+3 arrives.
            b_dir = tmp_path / "adapter_c"
            c.save_pretrained(str(b_dir))
            await vllm_engine.update_lora(str(b_dir), version=v + 3)
            assert v + 1 in vllm_engine.registered_lora_versions()
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
        run(asyncio.sleep(0.1))  # let the deferred removal of v+1 run
        assert vllm_engine.registered_lora_versions() == [v + 2, v + 3]
        ids = run(vllm_engine.llm.list_loras())
        assert set(ids) == {v + 3, v + 4}  # lora_int_id = version + 1

        with pytest.raises(ValueError, match="version"):
            run(vllm_engine.update_lora(lora_state(a), version=v))
        with pytest.raises(ValueError, match="adapter_config"):
            run(vllm_engine.update_lora(str(tmp_path), version=v + 4))
    finally:
        run(vllm_engine.update_lora(None, version=v + 4))
    back = run(vllm_engine.generate(req("lora-back", 24)))
    assert back.output_ids == base.output_ids
    assert set(back.output_versions) == {v + 4}
