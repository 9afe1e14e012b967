"""Run by test_context_parallel.py: W gloo processes, context-parallel attention and log-probs vs one process.

Usage: python context_parallel_worker.py <init_file> <world>. Every check compares the sharded result (ring
attention over the group, the decoder on zigzag shards, ``causal_lm_logprobs(..., cp_group=)``) with the unsharded
one computed in the same process, and exits non-zero with the failing check printed.

Precision: the models are float64 except the LM head, which stays float32 because the fused log-prob op computes in
fp32 only. So: ring attention and the decoder (hidden states, the gradient of every decoder parameter) are compared
in pure float64 at 1e-9; through the head, each token's log-prob is computed on one rank from the same fp32 inputs
as unsharded, but in a product over that rank's tokens only, and a CPU BLAS may pick another kernel (another
summation order) for another number of rows: everything downstream of the head (log-probs, entropy, losses and
every parameter's gradient) is compared at fp32 rounding (1e-6 relative to the largest value, ``_fp32_tol``); the
float64 decoder alone (``_hidden_case``) stays at 1e-9.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOL = 1e-9


def _check(name, got, want, atol=TOL):
    got, want = got.double(), want.double()
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {list(got.shape)} vs {list(want.shape)}")
    same_inf = torch.equal(torch.isinf(got), torch.isinf(want)) and torch.equal(got[torch.isinf(got)],
                                                                                  want[torch.isinf(want)])
    fin = torch.isfinite(want)
    err = (got[fin] - want[fin]).abs().max().item() if fin.any() else 0.0
    print(name, err, flush=True) if os.environ.get("CP_VERBOSE") else None
    if not same_inf or err > atol:
        raise AssertionError(f"{name}: max abs error {err:.3g} > {atol:.1g} (infinities equal: {same_inf})")


# ------------------------------------------------------------------------------------------------ ring attention
def _ring_case(group, seq_len, heads, kv_heads, kernel, tag):
    """ring_attention on zigzag shards vs causal softmax attention of the whole (end-padded) sequence."""
    from rlblocks.kernels import ring_attention, zigzag_positions

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    pos = zigzag_positions(seq_len, world, rank)
    n_pad = pos.numel() * world
    g = torch.Generator().manual_seed(seq_len * 7 + heads)
    q = torch.randn(2, heads, n_pad, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, kv_heads, n_pad, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, kv_heads, n_pad, 8, generator=g, dtype=torch.float64)
    dout = torch.randn(2, heads, n_pad, 8, generator=g, dtype=torch.float64)
    qf, kf, vf = (x.clone().requires_grad_() for x in (q, k, v))
    rep = heads // kv_heads
    ref = torch.nn.functional.scaled_dot_product_attention(qf, kf.repeat_interleave(rep, 1),
                                                           vf.repeat_interleave(rep, 1), is_causal=True, scale=0.3)
    ref.backward(dout)
    ql, kl, vl = (x[:, :, pos].clone().requires_grad_() for x in (q, k, v))
    out = ring_attention(ql, kl, vl, group, scale=0.3, kernel=kernel)
    out.backward(dout[:, :, pos])
    _check(f"{tag} out", out, ref[:, :, pos])
    _check(f"{tag} dq", ql.grad, qf.grad[:, :, pos])
    _check(f"{tag} dk", kl.grad, kf.grad[:, :, pos])
    _check(f"{tag} dv", vl.grad, vf.grad[:, :, pos])


# ------------------------------------------------------------------------------------------------ HF models
def _tiny(kind: str):
    import transformers

    common = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(3)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif kind == "qwen2":  # q/k/v biases
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:  # q/k RMS norms
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    model = model.double().eval()
    model.lm_head.float()
    return model


def _batch(rows, seq_len=None):
    t = max(len(r) for _, r in rows)
    seq_len = seq_len or max(len(p) + len(r) for p, r in rows)
    ids = torch.zeros(len(rows), seq_len, dtype=torch.long)
    am = torch.zeros(len(rows), seq_len, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.bool)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        am[i, : len(p) + len(r)] = 1
        mask[i, : len(r)] = True
    return ids, am, torch.tensor([len(p) for p, _ in rows]), mask


def _rows(seed, spec):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(1, 61, (p,), generator=g).tolist(), torch.randint(1, 61, (r,), generator=g).tolist())
            for p, r in spec]


def _fp32_tol(want):
    """fp32 rounding of ``want``'s finite values (1e-6 relative to the largest, at least 1e-6)."""
    fin = want[torch.isfinite(want)] if want.is_floating_point() else want
    return 1e-6 * max(1.0, fin.abs().max().item() if fin.numel() else 0.0)


def _hidden_case(group, kind, rows, tag):
    """The decoder alone, all float64: this rank's zigzag shard through the body (ring attention, true positions)
    vs the unsharded body at the same positions, and the parameter gradients of a random upstream gradient."""
    from rlblocks.kernels.context_parallel import cp_forward

    rank = dist.get_rank(group)
    ref_model = _tiny(kind)
    cp_model = copy.deepcopy(ref_model)
    ids, am, _, _ = _batch(rows)
    want = ref_model.model(input_ids=ids, attention_mask=am, use_cache=False).last_hidden_state
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * am[..., None]
    (want * g).sum().backward()
    hidden, pos = cp_forward(cp_model, cp_model.model, ids, group, {})
    real = pos < ids.shape[1]
    at = pos.clamp(max=ids.shape[1] - 1)
    valid = am[:, at].bool() & real[None, :]  # padding positions of a row are not compared (never used)
    _check(f"[{tag} rank{rank}] hidden", hidden[valid], want[:, at][valid])
    (hidden * torch.where(valid[..., None], g[:, at], 0.0)).sum().backward()
    for (n, p), (_, pr) in zip(cp_model.named_parameters(), ref_model.named_parameters()):
        if pr.grad is None:
            continue
        gr = p.grad.clone()
        dist.all_reduce(gr, group=group)
        _check(f"[{tag} rank{rank}] decoder grad {n}", gr, pr.grad)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _model_case(group, kind, rows, tag, *, sampling=False, entropy=True):
    from rlblocks.kernels import causal_lm_logprobs

    rank = dist.get_rank(group)
    ref_model = _tiny(kind)
    cp_model = copy.deepcopy(ref_model)
    ids, am, plens, mask = _batch(rows)
    mask[0, 1] = False  # a hole in a response: that token is not scored
    g = torch.Generator().manual_seed(11)
    c1, c2 = torch.randn(mask.shape, generator=g, dtype=torch.float64), torch.randn(mask.shape, generator=g,
                                                                                     dtype=torch.float64)
    kw = dict(attention_mask=am, temperature=0.7, return_entropy=entropy)
    if sampling:
        k = torch.full(mask.shape, 7)
        p = torch.full(mask.shape, 0.9, dtype=torch.float64)
        k[:, ::3], p[:, 1::3] = -1, 1.0
        kw.update(top_k=k, top_p=p, return_outside=True)

    def run(model, cp):
        out = causal_lm_logprobs(model, ids, plens, mask, cp_group=cp, **kw)
        out = out if isinstance(out, tuple) else (out,)
        lp = out[0]
        loss = (torch.where(torch.isinf(lp), 0.0, lp) * c1).sum()
        if entropy:
            loss = loss + (out[1] * c2).sum()
        loss.backward()
        return out

    want = run(ref_model, None)
    got = run(cp_model, group)
    names = ["logp", "entropy"][: 1 + entropy] + (["outside"] if sampling else [])
    for name, x, y in zip(names, got, want):
        if x.dtype == torch.bool:
            if not torch.equal(x, y):
                raise AssertionError(f"[{tag} rank{rank}] {name} flags differ")
        else:
            _check(f"[{tag} rank{rank}] {name}", x, y, _fp32_tol(y))  # through the fp32 head
    if sampling and not want[-1].any():
        raise AssertionError(f"[{tag}] the sampling case has no token outside the kept set")
    ref_g, cp_g = _grads(ref_model), _grads(cp_model)
    for n, gr in cp_g.items():
        dist.all_reduce(gr, group=group)  # each rank holds its tokens' share: the sum is the gradient
        _check(f"[{tag} rank{rank}] grad {n}", gr, ref_g[n], _fp32_tol(ref_g[n]))
    # the model's own implementation still serves calls without cp_group (delegation), mask included
    with torch.no_grad():
        plain = causal_lm_logprobs(cp_model, ids, plens, mask, **kw)
    _check(f"[{tag} rank{rank}] logp without cp_group after enabling", plain[0] if sampling or entropy else plain,
           want[0], _fp32_tol(want[0]))
    if not cp_model.config._attn_implementation.startswith("rlblocks_cp_"):
        raise AssertionError(f"[{tag}] attention implementation is {cp_model.config._attn_implementation}")


def _loss_side_case(group, tag):
    """Per-token losses on the local shard (cp_shard_mask) with whole-batch counts: the per-rank aggregates add up
    to the whole-batch aggregate, and so do the gradients."""
    from rlblocks.kernels import causal_lm_logprobs, cp_shard_mask
    from rlblocks.losses import aggregate

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ref_model = _tiny("qwen3")
    cp_model = copy.deepcopy(ref_model)
    ids, am, plens, mask = _batch(_rows(5, [(3, 9), (6, 5), (2, 12)]))
    adv = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)[:, None]
    local = cp_shard_mask(mask, plens, ids.shape[1], group)
    cover = local.long()
    dist.all_reduce(cover, group=group)
    if not torch.equal(cover, mask.long()):
        raise AssertionError(f"[{tag}] cp_shard_mask does not partition the response mask over the group")
    counts = {"num_tokens": mask.sum(), "num_seqs": (mask.sum(-1) > 0).sum(), "max_len": mask.sum(-1).max()}
    for mode in ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        for m in (ref_model, cp_model):
            m.zero_grad(set_to_none=True)
        lp_ref = causal_lm_logprobs(ref_model, ids, plens, mask, attention_mask=am)
        want = aggregate(-adv * lp_ref, mask, mode=mode, **counts)
        want.backward()
        lp = causal_lm_logprobs(cp_model, ids, plens, mask, attention_mask=am, cp_group=group)
        mine = aggregate(-adv * lp, mask & local, mode=mode, **counts)
        mine.backward()
        total = mine.detach().clone()
        dist.all_reduce(total, group=group)
        _check(f"[{tag} rank{rank} {mode}] sum of shard losses", total, want.detach(), _fp32_tol(want.detach()))
        for (n, p), (_, pr) in zip(cp_model.named_parameters(), ref_model.named_parameters()):
            gr = p.grad.clone()
            dist.all_reduce(gr, group=group)
            _check(f"[{tag} rank{rank} {mode}] grad {n}", gr, pr.grad, _fp32_tol(pr.grad))
    del world


def _bad_input_case(group, tag):
    from rlblocks.errors import ArgumentError
    from rlblocks.kernels import causal_lm_logprobs

    rank = dist.get_rank(group)
    model = _tiny("llama")
    ids, am, plens, mask = _batch(_rows(9, [(3, 4), (2, 6)]))
    left = am.flip(1)  # left padding: refused by name

    def refused(fn, words):
        try:
            fn()
        except ArgumentError as e:
            if not all(w in str(e) for w in words):
                raise AssertionError(f"[{tag}] error does not name {words}: {e}") from e
            return
        raise AssertionError(f"[{tag}] expected ArgumentError naming {words}")

    refused(lambda: causal_lm_logprobs(model, ids, plens, mask, attention_mask=left, cp_group=group),
            ["attention_mask", "right padding"])
    other = ids.clone()
    other[0, 1] += rank  # rank 0 keeps the batch, the others change one token
    refused(lambda: causal_lm_logprobs(model, other, plens, mask, cp_group=group), ["cp_group", "same full batch"])
    refused(lambda: causal_lm_logprobs(model, ids, plens, mask, cp_group=group,
                                       model_kwargs={"position_ids": torch.arange(ids.shape[1])[None]}),
            ["model_kwargs", "position_ids"])
    refused(lambda: causal_lm_logprobs(model, ids, plens, mask, cp_group="group"), ["cp_group", "ProcessGroup"])


def _worker(rank, init_file, world):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD
        for seq_len in (13, 2 * world, 3):  # not divisible by 2W, divisible, shorter than the 2W chunks
            _ring_case(group, seq_len, 4, 2, None, f"ring W={world} L={seq_len}")
        _ring_case(group, 11, 2, 1, "math", f"ring W={world} math kernel")
        if world == 4:  # an odd group: ranks 0..2 (every rank creates every group)
            sub = dist.new_group([0, 1, 2])
            if rank < 3:
                _ring_case(sub, 17, 4, 4, None, "ring W=3")
        # responses crossing shard boundaries (L = 19 or 23, chunk 5 / 3), right padding, a short row
        rows = _rows(1, [(4, 15), (7, 9), (2, 3)]) if world == 2 else _rows(1, [(3, 20), (9, 10), (5, 2)])
        # every architecture at W = 2; at W = 4 the GQA + q/k-norm one (the rest does not depend on W)
        for kind in ("llama", "qwen2", "qwen3") if world == 2 else ("qwen3",):
            _hidden_case(group, kind, rows, f"{kind} W={world}")
            _model_case(group, kind, rows, f"{kind} W={world}")
        if world == 2:
            _model_case(group, "llama", rows, f"sampling W={world}", sampling=True)
        # a sequence shorter than the 2W shards: a correct result (the rest is end padding)
        _model_case(group, "qwen3", _rows(2, [(1, 2), (2, 1)]), f"short W={world}", entropy=False)
        _loss_side_case(group, f"loss W={world}")
        _bad_input_case(group, f"bad W={world}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    world = int(sys.argv[2])
    mp.spawn(_worker, args=(sys.argv[1], world), nprocs=world, join=True)
    print("context-parallel OK", world)
