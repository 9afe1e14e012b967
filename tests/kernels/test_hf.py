"""causal_lm_logprobs on a tiny local HF Llama vs the model's own logits.log_softmax in float64."""

from __future__ import annotations

import copy

import pytest
import torch

from rlblocks.kernels import causal_lm_logprobs

transformers = pytest.importorskip("transformers")

TEMP = 0.8
# (prompt, response) token ids of three rows of different lengths (ids 4.. are the tiny tokenizer's characters)
ROWS = [([5, 9, 12], [20, 21, 22, 23]), ([7, 8, 9, 10, 11], [30, 31]), ([6, 40], [41, 42, 43, 44, 45, 46])]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.conftest import build_tiny_hf_dir

    path = build_tiny_hf_dir(tmp_path_factory.mktemp("tiny_llama_kernels"))
    model = transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    return model, copy.deepcopy(model).double()


def _reference(model64, rows, temperature):
    """Per row, unpadded: the model's own logits in float64 → log_softmax → the log-prob of each response token
    (predicted from the previous position) and the entropy there."""
    out = []
    for prompt, resp in rows:
        seq = torch.tensor([prompt + resp])
        lsm = torch.log_softmax(model64(seq).logits[0] / temperature, dim=-1)
        p = len(prompt)
        idx = torch.arange(p - 1, p - 1 + len(resp))
        lp = lsm[idx, torch.tensor(resp)]
        ent = -(lsm[idx].exp() * lsm[idx]).sum(-1)
        out.append((lp, ent))
    return out


def _batch(rows, pad=0):
    t = max(len(r) for _, r in rows)
    seq_len = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), seq_len), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.bool)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        mask[i, : len(r)] = True
    return ids, torch.tensor([len(p) for p, _ in rows]), mask


def test_matches_model_log_softmax_fp64(models):
    model, model64 = models
    ids, plens, mask = _batch(ROWS)
    with torch.no_grad():
        lp, ent = causal_lm_logprobs(model, ids, plens, mask, temperature=TEMP, return_entropy=True)
        want = _reference(model64, ROWS, TEMP)
    assert lp.shape == mask.shape and lp.dtype == torch.float32
    for i, (w_lp, w_ent) in enumerate(want):
        n = len(ROWS[i][1])
        torch.testing.assert_close(lp[i, :n].double(), w_lp, atol=2e-5, rtol=0)
        torch.testing.assert_close(ent[i, :n].double(), w_ent, atol=2e-5, rtol=0)
        assert (lp[i, n:] == 0).all() and (ent[i, n:] == 0).all()


def test_gradients_match_fp64(models):
    model, model64 = models
    model = copy.deepcopy(model)
    m64 = copy.deepcopy(model64)
    ids, plens, mask = _batch(ROWS)
    c = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    lp = causal_lm_logprobs(model, ids, plens, mask, temperature=TEMP)
    (lp.double() * c).sum().backward()
    ref = 0.0
    for i, (w_lp, _) in enumerate(_reference(m64, ROWS, TEMP)):
        ref = ref + (w_lp * c[i, : len(w_lp)]).sum()
    ref.backward()
    for name in ("lm_head.weight", "model.layers.1.self_attn.q_proj.weight", "model.embed_tokens.weight"):
        got = dict(model.named_parameters())[name].grad.double()
        want = dict(m64.named_parameters())[name].grad
        err = (got - want).abs().max().item()
        assert err <= 1e-4 * max(1.0, want.abs().max().item()), (name, err)


def test_aligned_with_rollout_batch(models):
    """Generations whose rollout_logp are the fp64 model's own log-probs: build_batch, then causal_lm_logprobs on
    the batch tensors gives the same numbers position by position."""
    from rlblocks.rollout import build_batch
    from rlblocks.rollout.types import Generation

    model, model64 = models
    with torch.no_grad():
        want = _reference(model64, ROWS, 1.0)
    gens = [
        Generation(f"r{i}", p, list(r), [float(x) for x in want[i][0]], [3] * len(r))
        for i, (p, r) in enumerate(ROWS)
    ]
    batch = build_batch(gens, pad_id=0)
    with torch.no_grad():
        lp = causal_lm_logprobs(model, batch.input_ids, batch.prompt_lens, batch.response_mask,
                                attention_mask=batch.attention_mask)  # fmt: skip
    torch.testing.assert_close(lp, batch.rollout_logp, atol=2e-5, rtol=0)
    assert (lp[~batch.response_mask] == 0).all()


def test_bad_input(models):
    model, _ = models
    ids, plens, mask = _batch(ROWS)
    with pytest.raises(ValueError, match=r"prompt_lens: expected values >= 1"):
        causal_lm_logprobs(model, ids, torch.tensor([0, 5, 2]), mask)
    with pytest.raises(ValueError, match=r"response_mask: row 1 .* past input_ids' length"):
        causal_lm_logprobs(model, ids, torch.tensor([3, 8, 2]), mask)
    with pytest.raises(ValueError, match=r"prompt_lens: expected an integer tensor of shape \[3\]"):
        causal_lm_logprobs(model, ids, plens.float(), mask)
    with pytest.raises(ValueError, match=r"response_mask: expected shape \[3, T\]"):
        causal_lm_logprobs(model, ids, plens, mask[:2])
    with pytest.raises(ValueError, match=r"temperature"):
        causal_lm_logprobs(model, ids, plens, mask, temperature=0.0)


def test_sampling_replay_matches_processed_fp64(models, ref):
    """top_k / top_p reach linear_token_logprobs: the log-probs are those of the model's own logits / T, top-k,
    top-p, renormalised (float64 reference); tokens outside the kept set are flagged and −inf."""
    model, model64 = models
    ids, plens, mask = _batch(ROWS)
    with torch.no_grad():
        lp, outside = causal_lm_logprobs(model, ids, plens, mask, temperature=TEMP, top_k=12, top_p=0.9,
                                         return_outside=True)  # fmt: skip
    n_out = 0
    for i, (prompt, resp) in enumerate(ROWS):
        with torch.no_grad():
            z = model64(torch.tensor([prompt + resp])).logits[0] / TEMP
        p = len(prompt)
        rows = z[p - 1 : p - 1 + len(resp)]
        lsm = ref.processed(rows, torch.full((len(resp),), 12), torch.full((len(resp),), 0.9))
        want = lsm[torch.arange(len(resp)), torch.tensor(resp)]
        n = len(resp)
        assert torch.equal(outside[i, :n], torch.isneginf(want)) and not outside[i, n:].any()
        fin = torch.isfinite(want)
        torch.testing.assert_close(lp[i, :n][fin].double(), want[fin], atol=2e-5, rtol=0)
        n_out += int((~fin).sum())
    assert 0 < n_out < int(mask.sum())  # the check sees both kinds of tokens


def test_unknown_keyword_is_refused_and_model_kwargs_reach_the_model(models):
    """A misspelt option raises, naming it and the valid keywords, instead of vanishing into the model's
    ``**kwargs``; inputs for the model travel in ``model_kwargs`` and do reach it (every token at position 0 changes
    the log-probs of a RoPE model, which sees relative positions; the default positions written out reproduce the
    plain call exactly)."""
    model, _ = models
    ids, plens, mask = _batch(ROWS)
    with pytest.raises(ValueError, match=r"topp: not an argument of causal_lm_logprobs \(did you mean 'top_p'\?\)"
                                         r".*expected one of .*top_p.*model_kwargs"):
        causal_lm_logprobs(model, ids, plens, mask, topp=0.9)
    with pytest.raises(ValueError, match=r"position_ids: not an argument.*model_kwargs=\{\.\.\.\}"):
        causal_lm_logprobs(model, ids, plens, mask, position_ids=torch.zeros_like(ids))
    with pytest.raises(ValueError, match=r"model_kwargs: 'attention_mask' is set by causal_lm_logprobs"):
        causal_lm_logprobs(model, ids, plens, mask, model_kwargs={"attention_mask": torch.ones_like(ids)})
    with pytest.raises(ValueError, match=r"model_kwargs: expected a dict"):
        causal_lm_logprobs(model, ids, plens, mask, model_kwargs=[("position_ids", ids)])
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        plain = causal_lm_logprobs(model, ids, plens, mask)
        same = causal_lm_logprobs(model, ids, plens, mask, model_kwargs={"position_ids": pos})
        flat = causal_lm_logprobs(model, ids, plens, mask, model_kwargs={"position_ids": torch.zeros_like(pos)})
    assert torch.equal(plain, same)
    assert (flat[mask] - plain[mask]).abs().max() > 1e-3


def test_peft_lora_on_the_lm_head_counts_fp64(models):
    """A LoRA adapter on the LM head (and a decoder layer): log-probs and the adapter's gradients equal the PEFT
    model's own float64 logits, i.e. the head's delta B @ A is applied (a PEFT layer's .weight is the base alone)."""
    peft = pytest.importorskip("peft")
    model, _ = models

    def lora(dtype):
        torch.manual_seed(0)
        cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["lm_head", "q_proj"])
        m = peft.get_peft_model(copy.deepcopy(model).to(dtype), cfg).eval()
        with torch.no_grad():
            for name, p in m.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.5)
        return m

    m32, m64 = lora(torch.float32), lora(torch.float64)
    ids, plens, mask = _batch(ROWS)
    c = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    lp = causal_lm_logprobs(m32, ids, plens, mask, temperature=TEMP)
    (lp.double() * c).sum().backward()
    want = _reference(m64, ROWS, TEMP)
    ref = 0.0
    for i, (w_lp, _) in enumerate(want):
        n = len(ROWS[i][1])
        torch.testing.assert_close(lp[i, :n].detach().double(), w_lp, atol=2e-5, rtol=0)
        ref = ref + (w_lp * c[i, :n]).sum()
    ref.backward()
    grads64 = {n: p.grad for n, p in m64.named_parameters() if p.requires_grad}
    checked = 0
    for name, p in m32.named_parameters():
        if "lora_" in name and "lm_head" in name:
            want_g = grads64[name]
            assert want_g.abs().max() > 0
            assert (p.grad.double() - want_g).abs().max() <= 1e-4 * max(1.0, want_g.abs().max().item()), name
            checked += 1
    assert checked == 2
    # with the adapters disabled, the base head again (a disabled adapter must not count)
    with m32.disable_adapter(), torch.no_grad():
        base = causal_lm_logprobs(m32, ids, plens, mask, temperature=TEMP)
        plain = causal_lm_logprobs(model, ids, plens, mask, temperature=TEMP)
    torch.testing.assert_close(base, plain, atol=1e-6, rtol=0)


def test_head_runs_on_scored_positions_only(models, monkeypatch):
    """The LM head sees one row per true entry of response_mask (not B·T: the response padding and a position the
    mask drops inside a response cost nothing), and the outputs equal the float64 reference there, 0 elsewhere."""
    import rlblocks.kernels._scored_head as scored_head

    model, model64 = models
    seen = []
    real = scored_head.linear_token_logprobs

    def spy(hidden, *args, **kwargs):
        seen.append(hidden.shape[0])
        return real(hidden, *args, **kwargs)

    monkeypatch.setattr(scored_head, "linear_token_logprobs", spy)
    ids, plens, mask = _batch(ROWS)
    mask[2, 1] = False  # a token inside a response that is not scored (e.g. a tool output)
    with torch.no_grad():
        for share in (False, True):
            lp = causal_lm_logprobs(model, ids, plens, mask, temperature=TEMP, prefix_share=share)
            for i, (w_lp, _) in enumerate(_reference(model64, ROWS, TEMP)):
                n = len(ROWS[i][1])
                keep = mask[i, :n]
                torch.testing.assert_close(lp[i, :n][keep].double(), w_lp[keep], atol=2e-5, rtol=0)
            assert (lp[~mask] == 0).all()
    assert seen == [int(mask.sum())] * 2 and seen[0] < mask.numel()
