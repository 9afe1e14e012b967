"""Prefix-shared forward vs one row per sample on tiny local HF Llama, Qwen2 and Qwen3 (q/k-norm, GQA).

float64: the log-probs (a float64 log-softmax of the selected hidden states times the LM head) and the gradient
of every parameter agree to 1e-10. HF's RMSNorm upcasts to float32 even in a float64 model, which alone would
leave ~1e-7 between any two batch layouts, so these tests run the norms in the model's dtype. The fused head
(``linear_token_logprobs``) is float32 on every backend; ``causal_lm_logprobs(..., prefix_share=True)`` is
checked against the unshared call in float32, with entropy and sampling-mask replay.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from rlblocks.errors import ArgumentError
from rlblocks.kernels import causal_lm_logprobs
from rlblocks.kernels import prefix_share as ps
from rlblocks.kernels.prefix_share import prefix_shared_hidden_states
from rlblocks.sched import build_prefix_tree, response_prefix_tree

transformers = pytest.importorskip("transformers")

VOCAB = 50
KINDS = ("llama", "qwen2", "qwen3")


def _norm_in_dtype(self, x):
    var = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))


@pytest.fixture
def exact_norms(monkeypatch):
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3 import modeling_qwen3

    for cls in (modeling_llama.LlamaRMSNorm, modeling_qwen2.Qwen2RMSNorm, modeling_qwen3.Qwen3RMSNorm):
        monkeypatch.setattr(cls, "forward", _norm_in_dtype)


def _model(kind: str, impl: str = "sdpa", dtype=torch.float64, seed: int = 0, **over):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, attn_implementation=impl, tie_word_embeddings=False)
    cfg.update(over)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(head_dim=8, **cfg))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=8, **cfg))
    return model.to(dtype).eval()


def _pad(rows, extra=2, garbage=17):
    """Right-padded batch; the padding holds a non-pad token, which must change nothing."""
    t = max(len(r) for _, r in rows)
    seq_len = max(len(p) + len(r) for p, r in rows) + extra
    ids = torch.zeros(len(rows), seq_len, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.bool)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        ids[i, len(p) + len(r) + 1 :] = garbage
        mask[i, : len(r)] = True
    return ids, torch.tensor([len(p) for p, _ in rows]), mask


def _group():
    """A GRPO group: right padding, an empty response, identical samples, samples whose responses share their
    first tokens, a row that shares nothing, and a shorter prompt that is a prefix of the group's."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, VOCAB, (9,), generator=g).tolist()
    other = torch.randint(1, VOCAB, (6,), generator=g).tolist()
    return [(prompt, [3, 4, 5]), (prompt, [3, 4, 6, 7, 8]), (prompt, []), (prompt, [3, 4, 5]), (other, [9, 9]),
            (prompt[:4], [1, 2, 3, 4, 5, 6]), (prompt, [11])]


def _episode():
    """A multi-turn episode that branched: turn 2 continues turn 1's history (tool output in the prompt), two
    turn-3 branches continue turn 2, and a second first-turn reply branches off the system prompt; each row scores
    its own turn's reply only."""
    g = torch.Generator().manual_seed(2)
    system = torch.randint(1, VOCAB, (7,), generator=g).tolist()
    t1, tool1 = [20, 21, 22], [30, 31]
    t2, tool2 = [23, 24], [32]
    h2 = system + t1 + tool1
    h3 = h2 + t2 + tool2
    return [(system, t1), (h2, t2), (h3, [25, 26, 27]), (h3, [25, 28]), (system, [20, 29, 40])]


def _uneven():
    """A shape the segment pieces treat in every way: two task prompts (no common prefix), one with a long
    history that branches at two levels (a turn-2 history shared by three replies, one of which continues to
    turn 3), and a group whose responses range from 1 to 90 tokens; edges of more and fewer than 64 tokens (run
    alone on views, or gathered into padded batches) and rectangles nested three deep."""
    g = torch.Generator().manual_seed(5)

    def toks(n):
        return torch.randint(1, VOCAB, (n,), generator=g).tolist()

    task, other = toks(70), toks(12)
    h2 = task + toks(5) + toks(66)
    r2 = [toks(80), toks(3), toks(20)]
    h3 = h2 + r2[0] + toks(9)
    return [(task, toks(5)), (h2, r2[0]), (h2, r2[1]), (h2, r2[2]), (h3, toks(90)), (h3, toks(1)),
            (other, toks(90)), (other, toks(1)), (other, toks(64)), (other, toks(7))]


CASES = {"group": _group, "episode": _episode, "uneven": _uneven}


def _unshared_hidden(model, ids, plens, mask):
    h = model.model(input_ids=ids).last_hidden_state
    src = (plens[:, None] - 1 + torch.arange(mask.shape[1])).clamp(0, ids.shape[1] - 1)
    h = h.gather(1, src[..., None].expand(*src.shape, h.shape[-1]))
    return torch.where(mask[..., None], h, 0.0)


def _loss_and_grads(model, hidden_fn, ids, plens, mask, coef):
    """float64 log-probs and entropy from the hidden states (h @ Wᵀ, log-softmax), a weighted sum of both, and
    the gradient of every parameter."""
    model.zero_grad(set_to_none=True)
    h = hidden_fn()
    lsm = torch.log_softmax(h @ model.lm_head.weight.T, dim=-1)
    labels = ids.gather(1, (plens[:, None] + torch.arange(mask.shape[1])).clamp(max=ids.shape[1] - 1))
    lp = torch.where(mask, lsm.gather(-1, labels[..., None])[..., 0], 0.0)
    ent = torch.where(mask, -(lsm.exp() * lsm).sum(-1), 0.0)
    ((lp * coef).sum() + 0.3 * ent.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), ent.detach(), grads


@pytest.mark.usefixtures("exact_norms")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("attention", "tight"), [("segments", False), ("segments", True), ("dense", False)])
def test_float64_logprobs_and_every_gradient(kind, case, attention, tight):
    """``tight``: the budget is the longest row, so the group / the episode is cut into several packed rows."""
    model = _model(kind)
    rows = CASES[case]()
    ids, plens, mask = _pad(rows)
    budget = int(response_prefix_tree(ids, plens, mask).lengths.max()) if tight else None
    coef = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    tree = response_prefix_tree(ids, plens, mask, max_tokens=budget)
    assert tree.num_rows * tree.row_len < ids.numel()  # the shared path runs (no fallback)
    assert tree.num_rows > 1 if tight else tree.num_rows <= 2
    want = _loss_and_grads(model, lambda: _unshared_hidden(model, ids, plens, mask), ids, plens, mask, coef)
    got = _loss_and_grads(model, lambda: prefix_shared_hidden_states(
        model.model, ids, plens, mask, attention=attention, max_tokens=budget), ids, plens, mask, coef)
    torch.testing.assert_close(got[0], want[0], atol=1e-10, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=1e-10, rtol=0)
    assert got[2].keys() == want[2].keys() == {n for n, _ in model.named_parameters()}
    for name, g in want[2].items():
        err = (got[2][name] - g).abs().max().item()
        assert err <= 1e-10 * max(1.0, g.abs().max().item()), f"{name}: {err:.3g}"
    assert (got[0][~mask] == 0).all()


@pytest.mark.usefixtures("exact_norms")
def test_float64_rows_that_share_nothing_fall_back_and_match():
    """Nothing in common: the packed rows would be as large as the padded batch, so the batch runs unshared."""
    model = _model("qwen3")
    rows = [([1, 2, 3], [4, 5]), ([6, 7], [8, 9, 10]), ([11], [12])]
    ids, plens, mask = _pad(rows, extra=0)
    coef = torch.ones(mask.shape, dtype=torch.float64)
    want = _loss_and_grads(model, lambda: _unshared_hidden(model, ids, plens, mask), ids, plens, mask, coef)
    got = _loss_and_grads(model, lambda: prefix_shared_hidden_states(model.model, ids, plens, mask), ids, plens,
                          mask, coef)
    torch.testing.assert_close(got[0], want[0], atol=1e-12, rtol=0)
    for name, g in want[2].items():
        torch.testing.assert_close(got[2][name], g, atol=1e-12, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_causal_lm_logprobs_prefix_share_float32(kind):
    """The public entry point through the fused head: log-probs, entropy, the sampling-mask replay flags and the
    gradients of every parameter, shared vs unshared, in float32."""
    model = _model(kind, dtype=torch.float32)
    ids, plens, mask = _pad(_group())
    coef = torch.randn(mask.shape, generator=torch.Generator().manual_seed(4))
    out = []
    for share in (False, True):
        m = copy.deepcopy(model)
        lp, ent, outside = causal_lm_logprobs(m, ids, plens, mask, temperature=0.8, top_k=20, top_p=0.95,
                                              return_entropy=True, return_outside=True, prefix_share=share)
        finite = torch.where(torch.isfinite(lp), lp, 0.0)
        ((finite * coef).sum() + ent.sum()).backward()
        out.append((lp.detach(), ent.detach(), outside, {n: p.grad for n, p in m.named_parameters()}))
    (lp0, ent0, out0, g0), (lp1, ent1, out1, g1) = out
    assert torch.equal(out0, out1) and torch.equal(torch.isfinite(lp0), torch.isfinite(lp1))
    torch.testing.assert_close(lp1, lp0, atol=2e-5, rtol=0)
    torch.testing.assert_close(ent1, ent0, atol=2e-5, rtol=0)
    for name, g in g0.items():
        scale = max(1.0, g.abs().max().item())
        assert (g1[name] - g).abs().max().item() <= 2e-5 * scale, name


def test_causal_lm_logprobs_prefix_share_per_token_sampling():
    """Per-token ``top_k`` / ``top_p`` tensors (``[B, T]``, the engine's per-request settings) reach the head at
    the scored positions only; equal to the unshared call, and a tensor of another shape is refused."""
    model = _model("qwen3", dtype=torch.float32)
    ids, plens, mask = _pad(_uneven())
    g = torch.Generator().manual_seed(6)
    top_k = torch.randint(0, 30, mask.shape, generator=g)
    top_p = torch.rand(mask.shape, generator=g) * 0.5 + 0.5
    want = causal_lm_logprobs(model, ids, plens, mask, top_k=top_k, top_p=top_p, return_outside=True)
    got = causal_lm_logprobs(model, ids, plens, mask, top_k=top_k, top_p=top_p, return_outside=True,
                             prefix_share=True)
    assert torch.equal(got[1], want[1]) and torch.equal(torch.isfinite(got[0]), torch.isfinite(want[0]))
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=0)
    assert bool((got[0][~mask] == 0).all())
    with pytest.raises(ArgumentError, match="top_k"):
        causal_lm_logprobs(model, ids, plens, mask, top_k=top_k[:, :3], prefix_share=True)


def test_eager_model_takes_the_dense_mask():
    """An eager model adds the mask to its scores: the dense additive mask (its float32 softmax: float32
    tolerance)."""
    model = _model("llama", impl="eager")
    ids, plens, mask = _pad(_episode())
    want = _unshared_hidden(model, ids, plens, mask)
    got = prefix_shared_hidden_states(model.model, ids, plens, mask)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_segment_attention_matches_dense_sdpa(dtype):
    """The per-edge CPU attention against SDPA with the dense ancestor mask, on a tree with large pieces (run
    alone, on views) and small ones (batched with padding), GQA, output and q/k/v gradients."""
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 9, (70,), generator=g).tolist()
    seqs = [prompt + torch.randint(0, 9, (n,), generator=g).tolist() for n in (65, 3, 5, 6, 0, 40, 2)]
    seqs += [[*prompt[:30], 1, 2, 3], [4, 4, 4, 4, 4]]
    tree = build_prefix_tree(seqs)
    pieces = ps._segment_pieces(tree)
    assert any(isinstance(p, ps._Solo) for p in pieces.triangles)
    assert any(isinstance(p, ps._Batch) and p.query_valid is not None for p in pieces.triangles)
    r, n, h, hk, d = tree.num_rows, tree.row_len, 4, 2, 8
    q = torch.randn(r, n, h, d, generator=g).to(dtype).transpose(1, 2).requires_grad_()  # HF's layout: a view
    k = torch.randn(r, n, hk, d, generator=g).to(dtype).transpose(1, 2).requires_grad_()
    v = torch.randn(r, n, hk, d, generator=g).to(dtype).transpose(1, 2).requires_grad_()
    real = (torch.arange(n)[None, :] < tree.row_tokens[:, None])[:, None, :, None]
    grad = torch.randn(r, h, n, d, generator=g).to(dtype) * real
    mask = ps.TreeAttentionMask(ps._Plan(tree, "segments"), dtype)
    got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    g_got = torch.autograd.grad(got, (q, k, v), grad)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = F.scaled_dot_product_attention(q64, k64.repeat_interleave(2, 1), v64.repeat_interleave(2, 1),
                                          attn_mask=ps._dense_mask(tree, torch.float64))
    g_want = torch.autograd.grad(want, (q64, k64, v64), grad.double())
    tol = 1e-12 if dtype == torch.float64 else 3e-2
    torch.testing.assert_close((got * real).double(), want * real, atol=tol, rtol=0)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a.double(), b, atol=tol, rtol=0)


def test_tree_mask_behaves_as_the_dense_mask_elsewhere():
    tree = build_prefix_tree([[1, 2, 3], [1, 2, 4]])
    mask = ps.TreeAttentionMask(ps._Plan(tree, "segments"), torch.float32)
    dense = ps._dense_mask(tree, torch.float32)
    assert mask.shape == dense.shape and mask.dtype == torch.float32
    assert torch.equal(mask + 0, dense)
    assert torch.equal(mask[:, :, :2], dense[:, :, :2])
    assert isinstance(mask.to(torch.float64), ps.TreeAttentionMask)


def test_bad_input():
    model = _model("llama", dtype=torch.float32)
    ids, plens, mask = _pad(_group())
    body = model.model
    with pytest.raises(ArgumentError, match="attention: 'flex' needs CUDA"):
        prefix_shared_hidden_states(body, ids, plens, mask, attention="flex")
    with pytest.raises(ArgumentError, match="attention: expected one of"):
        prefix_shared_hidden_states(body, ids, plens, mask, attention="tree")
    with pytest.raises(ArgumentError, match="max_tokens: expected >= the longest row"):
        prefix_shared_hidden_states(body, ids, plens, mask, max_tokens=5)
    with pytest.raises(ArgumentError, match="model_kwargs: 'position_ids'"):
        prefix_shared_hidden_states(body, ids, plens, mask, model_kwargs={"position_ids": ids})
    with pytest.raises(ArgumentError, match="attention_mask: expected the shape of input_ids"):
        prefix_shared_hidden_states(body, ids, plens, mask, attention_mask=torch.ones(2, 2, dtype=torch.bool))
    hole = torch.ones_like(ids, dtype=torch.bool)
    hole[0, 1] = False  # left padding (or a hole) before a scored token
    with pytest.raises(ArgumentError, match=r"attention_mask: expected true .* got false at \[0, 1\]"):
        prefix_shared_hidden_states(body, ids, plens, mask, attention_mask=hole)
    with pytest.raises(ArgumentError, match=r"response_mask: expected shape \[7, T\]"):
        prefix_shared_hidden_states(body, ids, plens, mask[:3])
    with pytest.raises(ArgumentError, match="prefix_share: expected True or False"):
        causal_lm_logprobs(model, ids, plens, mask, prefix_share=1)
    eager = _model("llama", impl="eager", dtype=torch.float32)
    with pytest.raises(ArgumentError, match="'segments' runs the CPU flash-attention kernel of an sdpa model"):
        prefix_shared_hidden_states(eager.model, ids, plens, mask, attention="segments")
    window = _model("qwen2", dtype=torch.float32, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    with pytest.raises(ArgumentError, match="sliding_window=4 is shorter than the longest row"):
        prefix_shared_hidden_states(window.model, ids, plens, mask)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention has no backward on CPU")
@pytest.mark.parametrize("kind", KINDS)
def test_flex_matches_dense_on_cuda(kind):
    """The FlexAttention BlockMask path (rows padded to its 128-token block) against the dense mask, float32."""
    model = _model(kind, dtype=torch.float32).cuda()
    rows = [*_group(), ([5] * 150, [6] * 40), ([5] * 150, [7] * 30)]  # more than one 128-token block
    ids, plens, mask = (x.cuda() for x in _pad(rows))
    out = {}
    for attention in ("dense", "flex"):
        model.zero_grad(set_to_none=True)
        h = prefix_shared_hidden_states(model.model, ids, plens, mask, attention=attention)
        (h * torch.linspace(-1, 1, h.shape[-1], device="cuda")).sum().backward()
        out[attention] = (h.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(out["flex"][0], out["dense"][0], atol=1e-4, rtol=0)
    for name, g in out["dense"][1].items():
        assert (out["flex"][1][name] - g).abs().max().item() <= 1e-4 * max(1.0, g.abs().max().item()), name
