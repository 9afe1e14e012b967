"""Context parallelism: zigzag layout, ring attention and ``causal_lm_logprobs(..., cp_group=)``.

The multi-rank checks run in context_parallel_worker.py (gloo, 2 and 4 processes, float64 models with tiny Llama,
Qwen2 and Qwen3: GQA, q/k/v biases, q/k norms; right padding, responses crossing shard boundaries, lengths not
divisible by 2·W, a sequence shorter than the 2·W shards, sampling-mask replay, the loss side, bad input). The
one-process checks here: the block kernels against plain softmax attention, the layout, the one-rank ring, the
delegation of calls without ``cp_group`` after the attention is switched, and argument errors.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlblocks.errors import ArgumentError
from rlblocks.kernels import (
    causal_lm_logprobs,
    enable_context_parallel,
    ring_attention,
    ring_attention_local,
    zigzag_positions,
)
from rlblocks.kernels.ring import _block_bwd, _block_fwd

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_ranks_match_unsharded(tmp_path, world):
    worker = Path(__file__).with_name("context_parallel_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    res = subprocess.run([sys.executable, str(worker), str(tmp_path / "pg_init"), str(world)],
                         capture_output=True, text=True, timeout=900, env=env)  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert f"context-parallel OK {world}" in res.stdout


def _softmax_attention(q, k, v, causal, scale):
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


@pytest.mark.parametrize("kernel", ["cpu", "math"])
@pytest.mark.parametrize("causal,nq,nk", [(True, 9, 9), (False, 5, 12)])
def test_block_kernels_match_softmax_attention_fp64(kernel, causal, nq, nk):
    g = torch.Generator().manual_seed(nq + nk)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g, dtype=torch.float64, requires_grad=True) for n in (nq, nk, nk))
    out, lse = _softmax_attention(q, k, v, causal, 0.4)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out.backward(dout)
    o_b, l_b, aux = _block_fwd(kernel, q.detach(), k.detach(), v.detach(), causal, 0.4)
    torch.testing.assert_close(o_b, out.detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(l_b, lse.detach(), atol=1e-12, rtol=0)
    # the backward of a block takes the merged out / lse of its rows (here: the block is the whole softmax)
    dq, dk, dv = _block_bwd(kernel, dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), causal,
                            0.4, aux)  # fmt: skip
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_math_kernel_chunks_rows(monkeypatch):
    """The torch kernel bounds its score buffer by chunking query rows; chunked and whole results agree."""
    import rlblocks.kernels.ring as ra

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 20, 4, generator=g, dtype=torch.float64) for _ in range(3))
    whole = ra._math_fwd(q, k, v, True, 0.5)
    monkeypatch.setattr(ra, "_MATH_CHUNK_ELEMS", 2 * 20 * 3)  # 3 rows per chunk
    chunked = ra._math_fwd(q, k, v, True, 0.5)
    torch.testing.assert_close(chunked[0], whole[0], atol=1e-14, rtol=0)
    torch.testing.assert_close(chunked[1], whole[1], atol=1e-14, rtol=0)
    dout = torch.randn(q.shape, generator=g, dtype=torch.float64)
    a = ra._math_bwd(dout, q, k, v, whole[0], whole[1], True, 0.5)
    monkeypatch.setattr(ra, "_MATH_CHUNK_ELEMS", 1 << 24)
    b = ra._math_bwd(dout, q, k, v, whole[0], whole[1], True, 0.5)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=1e-14, rtol=0)


@pytest.mark.parametrize("seq_len,world", [(13, 2), (8, 4), (3, 4), (1, 1), (100, 3)])
def test_zigzag_positions_partition_the_padded_sequence(seq_len, world):
    parts = [zigzag_positions(seq_len, world, r) for r in range(world)]
    c = max(1, -(-seq_len // (2 * world)))
    assert all(p.numel() == 2 * c for p in parts)
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(2 * world * c))
    for r, p in enumerate(parts):  # chunks r and 2W − 1 − r, in increasing order
        assert p[0] == r * c and p[c] == (2 * world - 1 - r) * c and bool((p.diff() > 0).all())


def test_one_rank_ring_is_causal_attention_with_gqa():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 10, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 10, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = ring_attention(q, k, v, None, scale=0.25)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           is_causal=True, scale=0.25)  # fmt: skip
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@pytest.mark.parametrize("kernel", [None, "math"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_rank_of_the_ring_in_one_process_is_causal_attention(world, kernel):
    """ring_attention_local runs each rank's rounds in turn (the distributed schedule, merge and backward with
    the blocks of the other ranks taken from memory): the whole output and gradients equal causal attention."""
    g = torch.Generator().manual_seed(world)
    n = 2 * world * 3
    q = torch.randn(2, 4, n, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, n, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = ring_attention_local(q, k, v, world, scale=0.3, kernel=kernel)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           is_causal=True, scale=0.3)  # fmt: skip
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@pytest.fixture(scope="module")
def tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=64, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_switched_model_serves_calls_without_cp_group_unchanged(tiny_llama):
    """After enable_context_parallel, a forward without a shard (left padding, a mask) and generate() give what
    the model's own implementation gives: the switch delegates to it, mask included."""
    ref = tiny_llama
    model = enable_context_parallel(copy.deepcopy(ref))
    assert model.config._attn_implementation == f"rlblocks_cp_{ref.config._attn_implementation}"
    assert enable_context_parallel(model) is model  # idempotent
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8]])
    am = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=am).logits,
                                   ref(input_ids=ids, attention_mask=am).logits, atol=0, rtol=0)
        a = model.generate(ids, attention_mask=am, max_new_tokens=4, do_sample=False, pad_token_id=0)
        b = ref.generate(ids, attention_mask=am, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b)


def test_eager_models_delegate_to_their_own_eager_attention(tiny_llama):
    ref = copy.deepcopy(tiny_llama)
    ref.set_attn_implementation("eager")
    model = enable_context_parallel(copy.deepcopy(ref))
    assert model.config._attn_implementation == "rlblocks_cp_eager"
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, atol=0, rtol=0)


def test_cp_group_errors_name_the_argument(tiny_llama):
    ids, plens, mask = torch.tensor([[3, 4, 5, 6]]), torch.tensor([2]), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ArgumentError, match="cp_group"):
        causal_lm_logprobs(tiny_llama, ids, plens, mask, cp_group=object())
    with pytest.raises(ArgumentError, match=r"cp_grup.*did you mean 'cp_group'"):
        causal_lm_logprobs(tiny_llama, ids, plens, mask, cp_grup=None)
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ArgumentError, match="even local length"):
        ring_attention(q, q, q, None)
    with pytest.raises(ArgumentError, match="key"):
        ring_attention(torch.zeros(1, 3, 4, 4), torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 4), None)
    with pytest.raises(ArgumentError, match="rank"):
        zigzag_positions(10, 2, 2)
    with pytest.raises(ArgumentError, match="world"):
        ring_attention_local(torch.zeros(1, 2, 6, 4), torch.zeros(1, 2, 6, 4), torch.zeros(1, 2, 6, 4), 2)


def test_models_with_other_sequence_layers_are_refused():
    cfg = transformers.Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True,
                                   sliding_window=4, max_window_layers=1)  # fmt: skip
    model = transformers.Qwen2ForCausalLM(cfg)
    with pytest.raises(ArgumentError, match="layer_types"):
        enable_context_parallel(model)
