"""Causal ring attention over a context-parallel process group, zigzag layout, forward and backward.

The sequence (length ``N``, padded at the end to ``2·W·c``) is cut into ``2W`` chunks of ``c`` positions; rank
``r`` of the ``W`` ranks holds chunks ``r`` and ``2W − 1 − r``, concatenated (:func:`zigzag_positions`). Under a
causal mask every rank then has the same work: the early chunk of one rank pairs with the late chunk of another.

Ring schedule (the key/value blocks travel ``r → r + 1``; round ``s`` holds those of rank ``j = r − s mod W``):

- ``s = 0``: the local queries against the local keys under the causal mask (the two chunks are in position
  order, so the plain lower-triangular mask of the concatenation is the right one);
- ``j < r``: chunk ``j`` precedes both local chunks and chunk ``2W − 1 − j`` follows both: every local query
  attends to the first half of the received keys, unmasked;
- ``j > r``: both received chunks lie between the two local chunks: only the second local half attends, to all
  received keys, unmasked.

Each block gives ``(out_b, lse_b)`` and the blocks are merged by online softmax,
``lse = logaddexp(lse, lse_b)``, ``out ← out·e^{lse_old − lse} + out_b·e^{lse_b − lse}`` (in the stable form
``out − σ(lse_b − lse_old)·(out − out_b)``), accumulated in fp32 (fp64 for fp64 inputs). The backward replays the
schedule: each block's gradient uses the merged ``out`` and ``lse`` (``dS = P ∘ (dP − rowsum(dO ∘ O))`` with
``P = exp(S − lse)``), so the block gradients add up to the exact gradient; ``dK``/``dV`` accumulators travel
with their key/value blocks and arrive back at their owner after ``W`` hops. Communication per layer and rank:
``W − 1`` key/value blocks forward (``2·c·2·H_kv·D`` elements each, not expanded for GQA), plus ``W`` gradient
blocks backward, each posted before the block it overlaps is computed.

Block kernels: the fused SDPA kernels that return the log-sum-exp (``aten._scaled_dot_product_flash_attention``
on CUDA for fp16/bf16, its CPU twin for fp32/fp64/bf16 on CPU), else a chunked torch implementation (any device and
dtype; memory ``O(chunk·c)`` per block, never ``[N, N]``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from jaxtyping import Float, Int
from torch import Tensor

from rlblocks.errors import ArgumentError

__all__ = ["ring_attention", "ring_attention_local", "zigzag_positions"]

_MATH_CHUNK_ELEMS = 1 << 24  # score elements per chunk of the torch block kernel (64 MiB of fp32)


def zigzag_chunk(seq_len: int, world: int) -> int:
    """Chunk length ``c = ceil(seq_len / 2W)`` (at least 1): each rank holds ``2c`` positions."""
    return max(1, -(-seq_len // (2 * world)))


def zigzag_positions(seq_len: int, world: int, rank: int,
                     device: torch.device | str | None = None) -> Int[Tensor, " n"]:
    """The sequence positions rank ``rank`` of ``world`` holds in the zigzag layout: chunks ``rank`` and
    ``2·world − 1 − rank`` of ``c = ceil(seq_len / (2·world))`` positions each, in that (increasing) order.

    The positions cover ``[0, 2·world·c)`` exactly once over the ranks; those ``>= seq_len`` are padding at the end
    of the sequence (a causal model's real positions never attend to them). Returns a ``[2c]`` int64 tensor."""
    if not isinstance(world, int) or world < 1:
        raise ArgumentError(f"world: expected an int >= 1, got {world!r}")
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise ArgumentError(f"rank: expected an int in [0, {world}), got {rank!r}")
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ArgumentError(f"seq_len: expected an int >= 1, got {seq_len!r}")
    c = zigzag_chunk(seq_len, world)
    idx = torch.arange(c, device=device)
    return torch.cat([rank * c + idx, (2 * world - 1 - rank) * c + idx])


# ------------------------------------------------------------------------------------------------ block kernels
def _kernel_for(q: Tensor) -> str:
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16):
        return "cpu"
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 \
            and q.shape[-1] <= 256:
        return "cuda"
    return "math"


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _block_fwd(kernel: str, q: Tensor, k: Tensor, v: Tensor, causal: bool,
               scale: float) -> tuple[Tensor, Tensor, tuple]:
    """``(out [B, H, nq, D], lse [B, H, nq], aux)`` of softmax attention of one block (``causal``: lower-triangular,
    square blocks only). ``aux`` is what the CUDA kernel's backward needs back."""
    if kernel == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, ()
    if kernel == "cuda":
        out, lse, cum_q, cum_k, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return out, lse, (cum_q, cum_k, seed, offset)
    return _math_fwd(q, k, v, causal, scale)


def _block_bwd(kernel: str, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
               scale: float, aux: tuple) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of one block given the MERGED ``out`` and ``lse`` of its query rows (so the blocks' gradients
    sum to the gradient of the whole softmax)."""
    if kernel == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    if kernel == "cuda":
        cum_q, cum_k, seed, offset = aux
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale)
        return dq, dk, dv
    return _math_bwd(dout, q, k, v, out, lse, causal, scale)


def _row_chunk(q: Tensor, nk: int) -> int:
    b, h, nq, _ = q.shape
    return max(1, min(nq, _MATH_CHUNK_ELEMS // max(1, b * h * nk)))


def _scores(q: Tensor, k: Tensor, i0: int, causal: bool, scale: float, acc: torch.dtype) -> Tensor:
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if causal:
        rows = torch.arange(i0, i0 + q.shape[2], device=q.device)[:, None]
        s = s.masked_fill(torch.arange(k.shape[2], device=q.device)[None, :] > rows, float("-inf"))
    return s


def _math_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor, tuple]:
    acc = _acc_dtype(q.dtype)
    outs, lses = [], []
    step = _row_chunk(q, k.shape[2])
    for i0 in range(0, q.shape[2], step):
        s = _scores(q[:, :, i0 : i0 + step], k, i0, causal, scale, acc)
        lse = torch.logsumexp(s, dim=-1)
        outs.append(torch.matmul(torch.exp(s - lse[..., None]), v.to(acc)))
        lses.append(lse)
    return torch.cat(outs, 2).to(q.dtype), torch.cat(lses, 2), ()


def _math_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
              scale: float) -> tuple[Tensor, Tensor, Tensor]:
    acc = _acc_dtype(q.dtype)
    kf, vf = k.to(acc), v.to(acc)
    dk = torch.zeros_like(kf)
    dv = torch.zeros_like(vf)
    dqs = []
    step = _row_chunk(q, k.shape[2])
    for i0 in range(0, q.shape[2], step):
        sl = slice(i0, i0 + step)
        qc, doc = q[:, :, sl].to(acc), dout[:, :, sl].to(acc)
        p = torch.exp(_scores(q[:, :, sl], k, i0, causal, scale, acc) - lse[:, :, sl, None].to(acc))
        dv += torch.matmul(p.transpose(-1, -2), doc)
        delta = (doc * out[:, :, sl].to(acc)).sum(-1, keepdim=True)
        ds = p * (torch.matmul(doc, vf.transpose(-1, -2)) - delta) * scale
        dqs.append(torch.matmul(ds, kf))
        dk += torch.matmul(ds.transpose(-1, -2), qc)
    return torch.cat(dqs, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ------------------------------------------------------------------------------------------------ ring
class _Ring:
    """Point-to-point shifts along the ring of a group: send to rank + 1, receive from rank − 1 (async)."""

    def __init__(self, group) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world)

    def shift(self, t: Tensor, tag: int) -> tuple[list, Tensor]:
        t = t.contiguous()
        buf = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag),
               dist.P2POp(dist.irecv, buf, self.prev, self.group, tag)]
        return dist.batch_isend_irecv(ops), buf

    @staticmethod
    def wait(pending: tuple[list, Tensor]) -> Tensor:
        reqs, buf = pending
        for r in reqs:
            r.wait()
        return buf


def _expand(x: Tensor, groups: int) -> Tensor:
    """GQA: key/value head ``h`` serves query heads ``h·G … h·G + G − 1`` (HF's ``repeat_kv``)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold(dx: Tensor, groups: int) -> Tensor:
    if groups == 1:
        return dx
    b, h, n, d = dx.shape
    return dx.view(b, h // groups, groups, n, d).sum(2)


def _blocks(s: int, rank: int, world: int, half: int) -> tuple[slice, slice, bool]:
    """``(query rows, key rows, causal)`` of round ``s`` on ``rank`` (the module docstring's schedule)."""
    if s == 0:
        return slice(None), slice(None), True
    if (rank - s) % world < rank:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


def _merge(out: Tensor, lse: Tensor, o_b: Tensor, l_b: Tensor) -> tuple[Tensor, Tensor]:
    # the stable form of the online-softmax merge (no exp of a large difference)
    o_b, l_b = o_b.to(out.dtype), l_b.to(lse.dtype)
    new_out = out - torch.sigmoid(l_b - lse)[..., None] * (out - o_b)
    new_lse = lse - torch.nn.functional.logsigmoid(lse - l_b)
    return new_out, new_lse


class _DistKV:
    """The key/value blocks one rank holds round by round, and the travelling gradient accumulators (a ring of
    ``torch.distributed`` point-to-point shifts; ``ring=None``: one rank)."""

    def __init__(self, ring: _Ring | None, k: Tensor, v: Tensor) -> None:
        self.ring, self.k_shape = ring, k.shape
        self.world, self.rank = (ring.world, ring.rank) if ring is not None else (1, 0)
        self.kv = torch.stack([k, v])
        self.dkv: Tensor | None = None
        self.pending_dkv = None

    def rounds(self):
        kv = self.kv
        for s in range(self.world):
            pending = self.ring.shift(kv, 0) if s + 1 < self.world else None  # next round's block, in flight
            yield s, kv
            if pending is not None:
                kv = self.ring.wait(pending)

    def add_grad(self, s: int, dkv_b: Tensor, ks: slice) -> None:
        """Add this rank's gradient of the block held at round ``s`` to its accumulator (received from the ranks
        that held it before; none at ``s = 0``) and pass it on; after ``W`` hops it is back at its owner."""
        dkv = torch.zeros((2, *self.k_shape), dtype=dkv_b.dtype, device=dkv_b.device) if s == 0 \
            else self.ring.wait(self.pending_dkv)
        dkv[:, :, :, ks] += dkv_b
        if self.ring is None:
            self.dkv = dkv
        else:
            self.pending_dkv = self.ring.shift(dkv, 1)

    def own_grad(self) -> Tensor:
        return self.dkv if self.ring is None else self.ring.wait(self.pending_dkv)


class _LocalKV:
    """Rank ``rank``'s rounds when every rank's shards are in this process (:func:`ring_attention_local`): the block
    of round ``s`` is rank ``rank − s``'s, and its gradients add up in ``dkv[rank − s]``."""

    def __init__(self, kv: Tensor, dkv: Tensor | None, rank: int) -> None:
        self.kv, self.dkv, self.rank, self.world = kv, dkv, rank, kv.shape[0]

    def rounds(self):
        for s in range(self.world):
            yield s, self.kv[(self.rank - s) % self.world]

    def add_grad(self, s: int, dkv_b: Tensor, ks: slice) -> None:
        self.dkv[(self.rank - s) % self.world][:, :, :, ks] += dkv_b


def _rank_fwd(q: Tensor, src, scale: float, kernel: str) -> tuple[Tensor, Tensor, tuple]:
    """One rank's forward: its queries against the key/value block of every round, merged by online softmax."""
    world, rank = src.world, src.rank
    half = q.shape[2] // 2
    acc = _acc_dtype(q.dtype)
    out = lse = aux0 = None
    for s, kv in src.rounds():
        groups = q.shape[1] // kv.shape[2]
        qs, ks, causal = _blocks(s, rank, world, half)
        o_b, l_b, aux = _block_fwd(kernel, q[:, :, qs].contiguous(), _expand(kv[0][:, :, ks], groups).contiguous(),
                                   _expand(kv[1][:, :, ks], groups).contiguous(), causal, scale)
        if s == 0:
            out, lse, aux0 = o_b.to(acc), l_b.to(acc), aux
        else:
            out[:, :, qs], lse[:, :, qs] = _merge(out[:, :, qs], lse[:, :, qs], o_b, l_b)
    return out.to(q.dtype), lse, aux0


def _rank_bwd(dout: Tensor, q: Tensor, out: Tensor, lse: Tensor, src, scale: float, kernel: str,
              aux: tuple) -> Tensor:
    """One rank's backward: its ``dq``; the key/value gradients go to ``src.add_grad`` block by block."""
    world, rank = src.world, src.rank
    half = q.shape[2] // 2
    acc = _acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    for s, kv in src.rounds():
        groups = q.shape[1] // kv.shape[2]
        qs, ks, causal = _blocks(s, rank, world, half)
        dq_b, dk_b, dv_b = _block_bwd(
            kernel, dout[:, :, qs].contiguous(), q[:, :, qs].contiguous(),
            _expand(kv[0][:, :, ks], groups).contiguous(), _expand(kv[1][:, :, ks], groups).contiguous(),
            out[:, :, qs].contiguous(), lse[:, :, qs].contiguous(), causal, scale, aux)
        dq[:, :, qs] += dq_b.to(acc)
        src.add_grad(s, torch.stack([_fold(dk_b.to(acc), groups), _fold(dv_b.to(acc), groups)]), ks)
    return dq.to(q.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, kernel):
        ring = _Ring(group) if group is not None and dist.get_world_size(group) > 1 else None
        out, lse, aux = _rank_fwd(q, _DistKV(ring, k, v), scale, kernel)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale, ctx.kernel, ctx.aux = ring, scale, kernel, aux
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        src = _DistKV(ctx.ring, k, v)
        dq = _rank_bwd(dout, q, out, lse, src, ctx.scale, ctx.kernel, ctx.aux)
        dkv = src.own_grad()
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


class _LocalRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, kernel):  # [W, B, H, n, D] and [W, B, H_kv, n, D]: every rank's shard
        kv = torch.stack([k, v], 1)
        res = [_rank_fwd(q[r], _LocalKV(kv, None, r), scale, kernel) for r in range(q.shape[0])]
        out, lse = torch.stack([x[0] for x in res]), torch.stack([x[1] for x in res])
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.kernel, ctx.aux = scale, kernel, [x[2] for x in res]
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        kv = torch.stack([k, v], 1)
        dkv = torch.zeros(kv.shape, dtype=_acc_dtype(k.dtype), device=k.device)
        dq = torch.stack([_rank_bwd(dout[r], q[r], out[r], lse[r], _LocalKV(kv, dkv, r), ctx.scale, ctx.kernel,
                                    ctx.aux[r]) for r in range(q.shape[0])])  # fmt: skip
        return dq, dkv[:, 0].to(k.dtype), dkv[:, 1].to(v.dtype), None, None


def _check_qkv(query: Tensor, key: Tensor, value: Tensor, kernel: str | None, scale: float | None) -> float:
    if query.dim() != 4 or key.dim() != 4 or value.shape != key.shape:
        raise ArgumentError(f"query, key, value: expected [B, H, n, D] and two equal [B, H_kv, n, D], got "
                            f"{list(query.shape)}, {list(key.shape)}, {list(value.shape)}")
    b, h, n, d = query.shape
    if key.shape[0] != b or key.shape[2] != n or key.shape[3] != d or h % key.shape[1]:
        raise ArgumentError(f"key: expected [{b}, H_kv, {n}, {d}] with H_kv dividing {h}, got {list(key.shape)}")
    if kernel not in (None, "math"):
        raise ArgumentError(f"kernel: expected None or 'math', got {kernel!r}")
    scale = d**-0.5 if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ArgumentError(f"scale: expected a finite float, got {scale!r}")
    return scale


def ring_attention(
    query: Float[Tensor, "B H n D"],
    key: Float[Tensor, "B Hkv n D"],
    value: Float[Tensor, "B Hkv n D"],
    group: dist.ProcessGroup | None,
    *,
    scale: float | None = None,
    kernel: str | None = None,
) -> Float[Tensor, "B H n D"]:
    """Causal softmax attention of a zigzag-sharded sequence over ``group``; every rank passes its own shard.

    Formula: ``out_i = Σ_{j ≤ i} softmax_j(q_i·k_j·scale) v_j`` over the WHOLE sequence, for the local rows ``i``;
    positions are the zigzag ones of :func:`zigzag_positions` (rank ``r`` holds chunks ``r`` and ``2W − 1 − r``).
    Blocks merge by online softmax in fp32 (fp64 for fp64 inputs); the backward is exact (see the module
    docstring) and sends each key/value gradient back to the rank that holds the keys. GQA: ``H`` a multiple of
    ``H_kv``, query head ``h`` reads key/value head ``h // (H / H_kv)`` (HF's ``repeat_kv``).

    Args:
        query: ``[B, H, n, D]`` this rank's queries (``n = 2c``, the two chunks concatenated).
        key: ``[B, H_kv, n, D]`` this rank's keys.
        value: ``[B, H_kv, n, D]`` this rank's values.
        group: a ``torch.distributed`` process group (gloo or NCCL) whose ranks hold the other shards, or
            ``None`` for one rank (plain causal attention).
        scale: the score scale (default ``D ** -0.5``).
        kernel: block kernel, ``None`` (the fused SDPA kernel where one applies, else torch), ``"math"`` (the
            chunked torch kernel, any device and dtype).

    Raises ``ArgumentError`` for shapes that do not fit (odd ``n``, head counts, mismatched ``B``/``n``/``D``).
    """
    scale = _check_qkv(query, key, value, kernel, scale)
    if query.shape[2] % 2:
        raise ArgumentError(f"query: expected an even local length (two zigzag chunks), got n={query.shape[2]}")
    return _RingAttention.apply(query, key, value, group, scale, kernel or _kernel_for(query))


def ring_attention_local(
    query: Float[Tensor, "B H N D"],
    key: Float[Tensor, "B Hkv N D"],
    value: Float[Tensor, "B Hkv N D"],
    world: int,
    *,
    scale: float | None = None,
    kernel: str | None = None,
) -> Float[Tensor, "B H N D"]:
    """Every rank's part of :func:`ring_attention` computed in turn in this process: the same zigzag shards, block
    kernels, schedule, merge and backward, without a process group (the one-device check of the ring's math and
    of the kernels a device would run, e.g. the CUDA flash kernels with merged log-sum-exps).

    ``query``/``key``/``value`` are the WHOLE sequence, ``N`` a multiple of ``2·world`` (pad at the end);
    the result is the whole causal attention output in sequence order (and differentiable), which equals
    ``scaled_dot_product_attention(..., is_causal=True)`` up to rounding."""
    scale = _check_qkv(query, key, value, kernel, scale)
    if not isinstance(world, int) or world < 1 or query.shape[2] % (2 * world):
        raise ArgumentError(f"world: expected an int >= 1 with 2·world dividing N={query.shape[2]}, got {world!r}")
    n_len = query.shape[2]
    pos = torch.stack([zigzag_positions(n_len, world, r, device=query.device) for r in range(world)])  # [W, n]
    q, k, v = (x[:, :, pos].movedim(2, 0) for x in (query, key, value))  # [W, B, H, n, D]
    out = _LocalRingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), scale, kernel or _kernel_for(query))
    inverse = torch.empty_like(pos.flatten())
    inverse[pos.flatten()] = torch.arange(pos.numel(), device=pos.device)
    return out.movedim(0, 2).flatten(2, 3)[:, :, inverse]
