"""Weight updates on a model with tied input/output embeddings (SmolLM2, Qwen2.5-0.5B, Llama-3.2-1B tie them).

vLLM's in-place reload processes only the layers that weights are loaded into; a tied checkpoint names the tensor
once (``model.embed_tokens.weight``), so on CPU the LM head kept the GEMM handle it pre-packed at start-up and
sampled from the new body with the initial head. Here a tiny tied Llama is updated twice (a complete state dict with
both aliases, then a partial update that names only the ``lm_head.weight`` alias, as a merged LoRA or a delta does)
and after each update the engine's log-probs of a sampled sequence must equal an HF transformers fp32 forward of the
updated model to fp32 rounding, and differ clearly from the prediction of a model with the initial head. TorchEngine
runs the same sequence of updates.
"""

from __future__ import annotations

import pytest
import torch

from rlblocks.rollout import GenerationRequest, SamplingParams
from tests.conftest import build_tiny_hf_dir

pytestmark = pytest.mark.vllm

PROMPT = [1, 10, 11, 12, 30, 31, 5]
FP32_TOL = 1e-4  # |Δ log p| of two fp32 forwards of the same weights (observed: ~1e-6)
STALE_GAP = 1e-2  # the initial head's prediction must be at least this far from the engine's (observed: ~0.1)


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory) -> str:
    """A tiny random Llama (head_dim 32) with ``tie_word_embeddings=True``. The embedding is drawn with std 0.05:
    next-token entropy ~3.5 nats of the 4.16 of uniform, so every log-prob informs (a larger std makes the tied head
    predict the input token again with p ~ 1, whose log-prob ~ 0 cannot tell two heads apart)."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    base = build_tiny_hf_dir(tmp_path_factory.mktemp("tiny_llama_base"))
    path = tmp_path_factory.mktemp("tiny_llama_tied")
    cfg = AutoConfig.from_pretrained(base)
    cfg.tie_word_embeddings = True
    torch.manual_seed(5)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 0.05)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(base).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tied_vllm(tied_dir, vllm_loop):
    from rlblocks.rollout.engines.vllm_engine import VLLMEngine

    async def start():
        return VLLMEngine.from_pretrained(tied_dir, enforce_eager=True, kv_cache_memory_bytes=16 << 20,
                                          max_model_len=128, dtype="float32", seed=0)

    engine = vllm_loop.run_until_complete(start())
    yield engine
    vllm_loop.run_until_complete(engine.aclose())


def _perturb(model, seed: int, scale: float = 0.2) -> None:
    """A training-step-like change of every parameter (the tied embedding included): noise of ``scale`` times the
    parameter's own standard deviation (norm weights: of 0.1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            std = float(p.std()) if p.numel() > 1 and float(p.std()) > 0 else 0.1
            p.add_(torch.randn(p.shape, generator=g) * scale * std)


@torch.no_grad()
def _reference(model, head: torch.Tensor, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log p(output[i] | prompt + output[:i]) of the HF decoder of ``model`` with LM head ``head`` (fp32 forward,
    log-softmax in float64)."""
    ids = torch.tensor([prompt + output])
    hidden = model.model(ids).last_hidden_state[0, len(prompt) - 1 : -1]
    logits = (hidden @ head.T).double()
    return logits.log_softmax(-1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def _updates(model):
    """The two updates, applied to ``model`` in place: ``[(named tensors, partial)]`` (a generator, so that each
    update is built after the previous one was checked)."""
    _perturb(model, seed=1)  # every parameter; a complete state dict names the tied tensor twice
    yield list(model.state_dict().items()), False
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.add_(torch.randn(emb.shape, generator=g) * 0.2 * float(emb.std()))
    yield [("lm_head.weight", model.lm_head.weight.detach().clone())], True  # the tied tensor by its head alias


def _check_engine_follows_tied_updates(engine, tied_dir, run) -> list[tuple[float, float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tied_dir, dtype=torch.float32).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    head0 = model.lm_head.weight.detach().clone()
    gaps = []
    for k, (named, partial) in enumerate(_updates(model), start=1):
        run(engine.update_weights(named, version=engine.version + 1, partial=partial))
        sp = SamplingParams(max_new_tokens=32, temperature=1.0, seed=10 + k)
        g = run(engine.generate(GenerationRequest(f"tied-{k}", PROMPT, sp)))
        assert g.num_output_tokens == 32
        got = g.logprobs_tensor().double()
        fresh = _reference(model, model.lm_head.weight, PROMPT, g.output_ids)
        stale = _reference(model, head0, PROMPT, g.output_ids)
        err, gap = (got - fresh).abs().max().item(), (got - stale).abs().max().item()
        assert err < FP32_TOL, f"update {k}: engine vs trainer max |Δ log p| = {err:.3g}"
        assert gap > STALE_GAP, f"update {k}: the initial head's prediction is only {gap:.3g} away"
        gaps.append((err, gap))
    return gaps


def test_vllm_update_refreshes_a_tied_lm_head(tied_vllm, tied_dir, run):
    _check_engine_follows_tied_updates(tied_vllm, tied_dir, run)


def test_torch_engine_update_of_a_tied_lm_head(tied_dir, run):
    from rlblocks.rollout import TorchEngine

    engine = TorchEngine.from_pretrained(tied_dir, device="cpu", max_model_len=128)
    _check_engine_follows_tied_updates(engine, tied_dir, run)
