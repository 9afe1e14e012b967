"""Run by test_vocab_parallel.py: 2 gloo processes, vocab-sharded linear_token_logprobs vs the unsharded result.

Usage: python vocab_parallel_worker.py <init_file>. Exits non-zero (with the failing check printed) on mismatch.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _check(name, got, want, atol):
    err = (got.double() - want.double()).abs().max().item()
    scale = max(1.0, want.double().abs().max().item())
    if err > atol * scale:
        raise AssertionError(f"{name}: max abs error {err:.3g} > {atol:.3g} x {scale:.3g}")


def _case(backend, rank, n, hdim, vocab, entropy):
    from rlblocks.kernels import linear_token_logprobs

    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(n, hdim, generator=g)
    weight = torch.randn(vocab, hdim, generator=g) / hdim**0.5 * 2
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.2] = -100
    c1, c2 = torch.randn(n, generator=g), torch.randn(n, generator=g)
    shard = vocab // WORLD

    def run(w_full_or_shard, group, reduce=True):
        h = hidden.clone().requires_grad_()
        w = w_full_or_shard.clone().requires_grad_()
        out = linear_token_logprobs(h, w, labels, temperature=0.8, return_entropy=entropy,
                                    process_group=group, allreduce_grad_hidden=reduce, backend=backend)
        lp, ent = out if entropy else (out, None)
        loss = (lp * c1).sum() + ((ent * c2).sum() if entropy else 0)
        loss.backward()
        return lp.detach(), ent, h.grad, w.grad

    lp, ent, gh, gw = run(weight[rank * shard : (rank + 1) * shard], dist.group.WORLD)
    lp_ref, ent_ref, gh_ref, gw_ref = run(weight, None)
    tag = f"[{backend} rank{rank} entropy={entropy}]"
    _check(f"{tag} logp", lp, lp_ref, 1e-5)
    if entropy:
        _check(f"{tag} entropy", ent.detach(), ent_ref.detach(), 1e-5)
    _check(f"{tag} grad hidden", gh, gh_ref, 1e-5)
    _check(f"{tag} grad weight shard", gw, gw_ref[rank * shard : (rank + 1) * shard], 1e-5)
    # A caller whose hidden state went through megatron's copy-to-TP region (its backward all-reduces) passes
    # allreduce_grad_hidden=False: each rank then returns its shard's contribution, and their SUM is the gradient.
    _, _, gh_local, _ = run(weight[rank * shard : (rank + 1) * shard], dist.group.WORLD, reduce=False)
    if (gh_local - gh_ref).abs().max() < 1e-3:
        raise AssertionError(f"{tag} allreduce_grad_hidden=False still returned the reduced gradient")
    summed = gh_local.clone()
    dist.all_reduce(summed)
    _check(f"{tag} grad hidden, reduced by the caller", summed, gh_ref, 1e-5)
    if entropy:  # the fused-loss path: the same gradients, formed in the forward
        from rlblocks.kernels import linear_token_logprobs_loss

        h = hidden.clone().requires_grad_()
        w = weight[rank * shard : (rank + 1) * shard].clone().requires_grad_()
        res = linear_token_logprobs_loss(h, w, labels, c1, entropy_coef=c2, temperature=0.8,
                                         process_group=dist.group.WORLD, backend=backend)
        res.loss.backward()
        _check(f"{tag} fused logp", res.logp, lp_ref, 1e-5)
        _check(f"{tag} fused grad hidden", h.grad, gh_ref, 1e-5)
        _check(f"{tag} fused grad weight shard", w.grad, gw_ref[rank * shard : (rank + 1) * shard], 1e-5)


def _sampling_case(backend, rank, n, hdim, vocab):
    """Sampling-mask replay with a vocab-sharded head: the same kept sets, log-probs, outside flags, entropy and
    gradients as unsharded. Per-token parameters: top-k + top-p, top-p alone (wide nuclei, the full-row gather),
    and unfiltered rows."""
    from rlblocks.kernels import linear_token_logprobs

    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(n, hdim, generator=g)
    weight = torch.randn(vocab, hdim, generator=g) / hdim**0.5 * 2
    with torch.no_grad():
        z = hidden @ weight.T
    labels = z.argmax(1)
    labels[1::4] = torch.randint(0, vocab, (len(labels[1::4]),), generator=g)  # mostly outside the kept sets
    labels[::9] = -100
    k = torch.full((n,), 9)
    p = torch.full((n,), 0.85)
    k[2::3], p[2::3] = -1, 0.999  # top-p alone over a wide nucleus
    k[::5], p[::5] = -1, 1.0  # unfiltered
    c1, c2 = torch.randn(n, generator=g), torch.randn(n, generator=g)
    shard = vocab // WORLD

    def run(w_full_or_shard, group):
        h = hidden.clone().requires_grad_()
        w = w_full_or_shard.clone().requires_grad_()
        lp, ent, out = linear_token_logprobs(h, w, labels, temperature=0.8, top_k=k, top_p=p, return_entropy=True,
                                             return_outside=True, process_group=group, backend=backend)
        ((torch.where(out, 0.0, lp) * c1).sum() + (ent * c2).sum()).backward()
        return lp.detach(), ent.detach(), out, h.grad, w.grad

    lp, ent, out, gh, gw = run(weight[rank * shard : (rank + 1) * shard], dist.group.WORLD)
    lp_ref, ent_ref, out_ref, gh_ref, gw_ref = run(weight, None)
    tag = f"[{backend} rank{rank} sampling]"
    if not torch.equal(out, out_ref) or not out.any():
        bad = (out != out_ref).nonzero().squeeze(1)[:5].tolist()
        raise AssertionError(f"{tag} outside flags differ from the unsharded ones (or none outside): "
                             f"{int(out.sum())} vs {int(out_ref.sum())}, rows {bad}, lp {lp[bad].tolist()} vs "
                             f"{lp_ref[bad].tolist()}")
    keep = ~out
    _check(f"{tag} logp", lp[keep], lp_ref[keep], 1e-5)
    _check(f"{tag} entropy", ent, ent_ref, 1e-5)
    _check(f"{tag} grad hidden", gh, gh_ref, 1e-5)
    _check(f"{tag} grad weight shard", gw, gw_ref[rank * shard : (rank + 1) * shard], 1e-5)
    # the fused-loss path with the same replay: the same loss terms and gradients, formed in the forward
    from rlblocks.kernels import linear_token_logprobs_loss

    h = hidden.clone().requires_grad_()
    w = weight[rank * shard : (rank + 1) * shard].clone().requires_grad_()
    res = linear_token_logprobs_loss(h, w, labels, c1, entropy_coef=c2, temperature=0.8, top_k=k, top_p=p,
                                     process_group=dist.group.WORLD, backend=backend)
    res.loss.backward()
    if not torch.equal(torch.isneginf(res.logp), out_ref):
        raise AssertionError(f"{tag} fused: outside labels differ from the unsharded ones")
    _check(f"{tag} fused logp", res.logp[keep], lp_ref[keep], 1e-5)
    _check(f"{tag} fused grad hidden", h.grad, gh_ref, 1e-5)
    _check(f"{tag} fused grad weight shard", w.grad, gw_ref[rank * shard : (rank + 1) * shard], 1e-5)


def _worker(rank, init_file, backends):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        for backend in backends:
            n, hdim, vocab = (150, 32, 1000) if backend == "torch" else (21, 32, 256)
            for entropy in (False, True):
                _case(backend, rank, n, hdim, vocab, entropy)
            _sampling_case(backend, rank, n, hdim, vocab)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    backends = sys.argv[2].split(",")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    mp.spawn(_worker, args=(sys.argv[1], backends), nprocs=WORLD, join=True)
    print("vocab-parallel OK", backends)
