"""Sampling-mask replay: the token set the engine sampled from, as one logit threshold per row (host side, torch).

The engines sample from ``z = logits / temperature`` restricted by top-k, then top-p, renormalised over the kept set
(vLLM's sampler order, ``vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p``, and the convention of
``rlblocks.rollout.types``; ``rlblocks.rollout.engines.TorchEngine.processed_logprobs`` follows it):

- top-k keeps ``z_j >= z_(k)``, the k-th largest value (ties with it are kept); ``k <= 0`` or ``k >= V``: off;
- top-p then takes the top-k-renormalised probabilities ``q`` and drops a token when the mass of the tokens ranked
  strictly above it is already ``>= p`` (vLLM: sort ascending, drop where the inclusive cumulative sum is
  ``<= 1 − p``; the same set in exact arithmetic). The most probable token is always kept; ``p = 1``: off.

Both filters keep an upper set of the sorted logits, so the kept set is ``{j : z_j >= tau}`` for one threshold
``tau`` per row (``−inf`` when nothing is filtered). ``tau`` is placed halfway between the smallest kept value and
the largest dropped one, so a recomputation of the same logits with another summation order (the backward's
GEMM, a Triton tile against a cuBLAS chunk) selects the same set unless that gap is below fp32 rounding.

Thresholds come from each row's largest values (``resolve_thresholds``): the ``C`` largest (``torch.topk``) settle
every row whose kept set, and the first dropped value after it, lie among them; the other rows (a nucleus wider than
the candidates) get a second, wider top-k (``WIDE_CANDIDATES``), and what that does not settle is sorted whole
(``select``). Cumulative masses are summed in float64, so the
kept set is the exact-arithmetic one of these logits; the engine's fp32 cumulative sum can differ only for a token
whose preceding mass is within fp32 rounding of ``p``. Ties straddling the top-p boundary are all kept here, where
vLLM's sort keeps some of them in an arbitrary order. With a vocab-parallel head, ``group_thresholds`` takes the
candidates from every rank's shard.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from rlblocks._checks import as_int, shape_str
from rlblocks.errors import ArgumentError

NEG_INF = float("-inf")
# Candidates per row taken first (``torch.topk``); rows whose kept set reaches past them are sorted whole.
DENSE_CANDIDATES = 64
# Second, wider candidate count for the rows the first does not settle (top-p alone over a flat distribution).
WIDE_CANDIDATES = 1024


class SamplingMask:
    """Flat per-row filter parameters: ``k`` (int64, 0 = off) and ``p`` (fp32, 1 = off); ignored rows are off."""

    def __init__(self, k: Int[Tensor, " N"], p: Float[Tensor, " N"]):
        self.k = k
        self.p = p

    def rows(self, sl) -> SamplingMask:
        return SamplingMask(self.k[sl], self.p[sl])

    def max_k(self) -> int:
        """Largest active ``k`` (one host sync)."""
        return int(self.k.max()) if self.k.numel() else 0


def _as_param(name: str, x, lead: torch.Size, device: torch.device, integer: bool) -> Tensor | float | int | None:
    if x is None:
        return None
    if isinstance(x, Tensor):
        if integer and (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool):
            raise ArgumentError(f"{name}: expected an int or an integer tensor of the labels' shape, got dtype "
                                f"{x.dtype}")  # fmt: skip
        if not integer and not x.dtype.is_floating_point:
            raise ArgumentError(f"{name}: expected a float or a floating tensor of the labels' shape, got dtype "
                                f"{x.dtype}")  # fmt: skip
        if x.dim() == 0:
            return x.to(device)
        if x.shape != lead:
            raise ArgumentError(f"{name}: expected a scalar or the shape of labels [{', '.join(map(str, lead))}], "
                                f"got {shape_str(x)}")  # fmt: skip
        if x.device != device:
            raise ArgumentError(f"{name}: expected the device of the inputs ({device}), got {x.device}")
        return x
    # host scalars: Python or numpy numbers (a numpy int is an int; a bool, or a float top-k, is a mistake)
    if integer and as_int(x) is not None:
        return as_int(x)
    if not integer and not isinstance(x, bool) and isinstance(x, numbers.Real):  # numpy bools are not Real
        return float(x)
    want = "an int (<= 0 disables top-k)" if integer else "a float in (0, 1] (1 disables top-p)"
    raise ArgumentError(f"{name}: expected {want}, or a tensor of the labels' shape, got {x!r}")


def check_sampling(
    top_k, top_p, lead: torch.Size, vocab: int, valid: Bool[Tensor, " N"], *, validate: bool = True
) -> SamplingMask | None:
    """Validate ``top_k`` / ``top_p`` (scalars or tensors of shape ``lead``) and flatten them per row.

    Returns ``None`` when neither filters anything (``None``, ``top_k <= 0`` or ``>= vocab``, ``top_p == 1``): the
    unfiltered path then runs unchanged. ``top_p`` must lie in ``(0, 1]`` on valid rows (a tensor is checked with
    one host sync, skipped under ``torch.compile`` and with ``validate=False``); values at ignored rows are never
    read.
    """
    device = valid.device
    k = _as_param("top_k", top_k, lead, device, integer=True)
    p = _as_param("top_p", top_p, lead, device, integer=False)
    if isinstance(p, float | int) and not (0.0 < float(p) <= 1.0):
        raise ArgumentError(f"top_p: expected a value in (0, 1], got {p!r}")
    k_off = k is None or (isinstance(k, int) and (k <= 0 or k >= vocab))
    p_off = p is None or (isinstance(p, float | int) and float(p) == 1.0)
    if k_off and p_off:
        return None
    n = valid.numel()
    if k_off:
        kt = torch.zeros(n, dtype=torch.long, device=device)
    else:
        kt = torch.as_tensor(k, device=device).long().expand(lead).reshape(-1)
        kt = torch.where(valid & (kt > 0) & (kt < vocab), kt, 0)
    if p_off:
        pt = torch.ones(n, dtype=torch.float32, device=device)
    else:
        pt = torch.as_tensor(p, device=device).float().expand(lead).reshape(-1)
        if isinstance(p, Tensor) and validate and not torch.compiler.is_compiling() and n > 0:
            bad = valid & ~((pt > 0) & (pt <= 1))
            if bool(bad.any()):
                raise ArgumentError(f"top_p: expected values in (0, 1] at valid positions, got {float(pt[bad][0])}")
        pt = torch.where(valid, pt, 1.0)
    return SamplingMask(kt.contiguous(), pt.contiguous())


def resolve_thresholds(
    cand: Float[Tensor, "R C"],
    mask: SamplingMask,
    m: Float[Tensor, " R"] | None = None,
    s: Float[Tensor, " R"] | None = None,
    *,
    complete: bool,
) -> tuple[Float[Tensor, " R"], Bool[Tensor, " R"]]:
    """Thresholds ``tau`` from each row's largest logits, and the rows they do not settle.

    ``cand``: the ``C`` largest values of ``z`` per row, sorted descending (fp32; ``−inf`` allowed). ``complete``:
    ``cand`` is the whole row (then ``m``, ``s`` are not needed and every row is settled). Otherwise
    ``m = max z`` and ``s = Σ_j exp(z_j − m)`` over the whole row give the normaliser of top-p without top-k, and a
    row is unsettled when its top-k set or its kept set reaches the last candidate (then the first dropped value,
    or the top-k normaliser, lies past the candidates); its ``tau`` is then meaningless.

    ``tau`` lies strictly between the smallest kept value ``lo`` and the largest dropped one ``hi`` (their fp32
    midpoint, or ``lo`` itself when the midpoint rounds onto ``hi``); ``−inf`` when nothing is dropped.

    A row holding a NaN logit has no kept set: its ``tau`` is NaN (settled), and every kept test is written
    ``~(z < tau)``, which keeps everything against a NaN threshold, so the NaN reaches the row's normaliser and its
    outputs are NaN instead of a finite log-prob of an arbitrary set (``torch.topk`` and ``sort`` rank NaN above
    every number, so it is always among the candidates).
    """
    r, c = cand.shape
    k, p = mask.k, mask.p
    use_k = k > 0
    use_p = p < 1.0
    kth = cand.gather(1, (k.clamp(1, c) - 1).unsqueeze(1)).squeeze(1)
    tau_k = torch.where(use_k, kth, torch.full_like(kth, NEG_INF))
    in_k = cand >= tau_k.unsqueeze(1)  # ties with the k-th value are kept
    n_in_k = in_k.sum(1)
    n_keep = n_in_k
    if bool(use_p.any()):
        cd = cand.double()
        top = cd[:, 0]
        top_safe = torch.where(torch.isfinite(top), top, 0.0)
        e = torch.where(in_k, torch.exp(cd - top_safe.unsqueeze(1)), 0.0)
        norm = e.sum(1)
        if not complete and m is not None:
            full = s.double() * torch.exp(m.double() - top_safe)
            norm = torch.where(use_k, norm, full)
        q = e / norm.unsqueeze(1)
        before = torch.cumsum(q, dim=1) - q  # mass ranked strictly above each candidate
        keep = (before < p.double().unsqueeze(1)) & in_k
        keep[:, 0] = True  # the most probable token is always kept
        n_p = keep.sum(1)
        # ties with the smallest kept value are kept too (the kept set is an upper set of values)
        lo_p = cand.gather(1, (n_p - 1).clamp(0, c - 1).unsqueeze(1))
        n_keep = torch.where(use_p, (cand >= lo_p).sum(1), n_in_k)
    lo = cand.gather(1, (n_keep - 1).clamp(0, c - 1).unsqueeze(1)).squeeze(1)
    hi = cand.gather(1, n_keep.clamp(0, c - 1).unsqueeze(1)).squeeze(1)
    hi = torch.where(n_keep < c, hi, torch.full_like(hi, NEG_INF))
    mid = (0.5 * (lo.double() + hi.double())).float()
    tau = torch.where(torch.isfinite(hi), torch.where(mid > hi, mid, lo), lo)
    active = use_k | use_p
    nan_row = torch.isnan(cand).any(1)
    nan = torch.full_like(tau, float("nan"))
    if complete:
        # nothing after the kept set (or only −inf logits, which have probability 0 either way)
        tau = torch.where(active & torch.isfinite(hi), tau, torch.full_like(tau, NEG_INF))
        return torch.where(active & nan_row, nan, tau), torch.zeros(r, dtype=torch.bool, device=cand.device)
    unres = active & ((use_k & (n_in_k >= c)) | (n_keep >= c)) & ~nan_row
    tau = torch.where(active, torch.where(nan_row, nan, tau), torch.full_like(tau, NEG_INF))
    return tau, unres


def num_candidates(mask: SamplingMask, v: int) -> int:
    """Candidates per row: ``k + 1`` when every filtered row has a top-k (its kept set lies in its top-k, and the
    next value is the first dropped one), else at least ``DENSE_CANDIDATES``. One host sync."""
    k_max = mask.max_k()
    p_alone = bool(((mask.p < 1.0) & (mask.k <= 0)).any())
    c = max(DENSE_CANDIDATES, k_max + 1) if p_alone or k_max == 0 else k_max + 1
    return min(v, c)


class Selection(NamedTuple):
    """The kept set of a row block. ``tau [R]``: thresholds (``z >= tau`` is kept). When ``sparse``, every valid row's
    kept set lies among its ``C`` candidates: ``vals [R, C]`` holds their ``z`` (``−inf`` where not kept, and on
    ignored rows) and ``idx [R, C]`` their token ids; otherwise both are ``None``."""

    tau: Float[Tensor, " R"]
    vals: Float[Tensor, "R C"] | None
    idx: Int[Tensor, "R C"] | None

    @property
    def sparse(self) -> bool:
        return self.vals is not None


def select(z: Float[Tensor, "R V"], mask: SamplingMask, valid: Bool[Tensor, " R"], c: int) -> Selection:
    """Kept set of a materialised fp32 block ``z = logits / T`` from its ``c`` largest values per row
    (``torch.topk``); rows the candidates do not settle are sorted whole (then the block is not sparse). A row
    with no filter (top-k and top-p off) keeps its whole vocabulary, so a block holding one is not sparse either.
    One host sync."""
    r, v = z.shape
    if r == 0:
        return Selection(torch.empty(0, dtype=torch.float32, device=z.device), None, None)
    if c >= v:
        tau = resolve_thresholds(torch.sort(z, dim=1, descending=True).values, mask, complete=True)[0]
        return Selection(tau, None, None)
    cand, idx = torch.topk(z, c, dim=1, sorted=True)
    m = s = None
    if bool(((mask.p < 1.0) & (mask.k <= 0)).any()):  # top-p over the whole row needs its normaliser
        m = z.amax(dim=1)
        s = torch.exp(z - torch.where(torch.isfinite(m), m, 0.0).unsqueeze(1)).sum(dim=1)
    tau, unres = resolve_thresholds(cand, mask, m, s, complete=False)
    active = (mask.k > 0) | (mask.p < 1.0)
    if bool(unres.any()):
        rows = unres.nonzero().squeeze(1)
        zr = z.index_select(0, rows)
        if c < WIDE_CANDIDATES < v:
            # a wide nucleus: a larger top-k (partial selection, O(V + C log C)) settles most rows before a sort
            sub = mask.rows(rows)
            t2, u2 = resolve_thresholds(torch.topk(zr, WIDE_CANDIDATES, dim=1, sorted=True).values, sub,
                                        m[rows] if m is not None else None, s[rows] if s is not None else None,
                                        complete=False)  # fmt: skip
            tau[rows] = t2
            rows, zr = rows[u2], zr[u2]
        if rows.numel():
            full = torch.sort(zr, dim=1, descending=True).values
            tau[rows] = resolve_thresholds(full, mask.rows(rows), complete=True)[0]
        return Selection(tau, None, None)
    if bool((valid & ~active).any()):
        return Selection(tau, None, None)
    keep = valid.unsqueeze(1) & ~(cand < tau.unsqueeze(1))
    return Selection(tau, torch.where(keep, cand, NEG_INF), idx)


def group_thresholds(
    z: Float[Tensor, "R Vl"], mask: SamplingMask, group, c: int
) -> Float[Tensor, " R"]:
    """Thresholds of rows whose logits are vocab-sharded over ``group`` (``z``: this rank's ``[R, V_local]`` block of
    ``logits / T``; the same rows on every rank). Each rank's ``c`` largest values are all-gathered and the global
    ``c`` largest taken from them; top-p alone gets the global normaliser from an all-reduce of ``(max, Σexp)``.
    Rows these do not settle gather their whole rows and are sorted. Every rank computes the same thresholds from
    the same gathered values, so the collectives agree on which rows need the full gather."""
    import torch.distributed as dist

    from rlblocks.kernels._common import allreduce_stats

    vl = z.shape[1]
    world = dist.get_world_size(group=group)
    loc = torch.topk(z, min(c, vl), dim=1, sorted=False).values.contiguous()
    parts = [torch.empty_like(loc) for _ in range(world)]
    dist.all_gather(parts, loc, group=group)
    allc = torch.cat(parts, dim=1)
    cand = torch.topk(allc, min(c, allc.shape[1]), dim=1, sorted=True).values
    m = s = None
    if bool(((mask.p < 1.0) & (mask.k <= 0)).any()):
        ml = z.amax(dim=1)
        sl = torch.exp(z - torch.where(torch.isfinite(ml), ml, 0.0).unsqueeze(1)).sum(dim=1)
        m, s, _, _ = allreduce_stats(ml, sl, None, None, group)
    complete = cand.shape[1] >= vl * world
    tau, unres = resolve_thresholds(cand, mask, m, s, complete=complete)
    if not complete and bool(unres.any()):
        rows = unres.nonzero().squeeze(1)
        zr = z.index_select(0, rows).contiguous()
        full = [torch.empty_like(zr) for _ in range(world)]
        dist.all_gather(full, zr, group=group)
        srt = torch.sort(torch.cat(full, dim=1), dim=1, descending=True).values
        tau[rows] = resolve_thresholds(srt, mask.rows(rows), complete=True)[0]
    return tau


def dense_thresholds(
    z: Float[Tensor, "R V"], mask: SamplingMask, candidates: int | None = None
) -> Float[Tensor, " R"]:
    """Exact per-row thresholds of a materialised fp32 block ``z = logits / T`` (``select``'s ``tau``)."""
    c = candidates if candidates is not None else num_candidates(mask, z.shape[1])
    return select(z, mask, torch.zeros(z.shape[0], dtype=torch.bool, device=z.device), c).tau


def sparse_stats(
    vals: Float[Tensor, "R C"], zy: Float[Tensor, " R"], tau: Float[Tensor, " R"], valid: Bool[Tensor, " R"],
    has_ent: bool,
) -> tuple[Float[Tensor, " R"], Float[Tensor, " R"], Float[Tensor, " R"] | None]:
    """``(lse, logp, entropy)`` of the distribution renormalised over the kept candidates ``vals`` (``−inf`` where
    not kept): ``lse = logsumexp(vals)``, ``logp = z_y − lse`` (``−inf`` when ``z_y < tau``: the label is outside),
    ``H = lse − Σ p·z``. 0 on ignored rows (their lse is 0). fp32."""
    # shifted by the row max (the first candidate, always kept), so H = log s − Σ e·d / s has no cancellation
    top = torch.where(valid, vals[:, 0], 0.0)
    d = vals - top.unsqueeze(1)
    e = torch.exp(d)
    sm = e.sum(1)
    log_s = torch.log(torch.where(valid, sm, 1.0))
    lse = torch.where(valid, top + log_s, 0.0)
    lp = torch.where(valid, torch.where(zy < tau, NEG_INF, zy - lse), 0.0)
    ent = None
    if has_ent:
        a = (e * torch.where(e == 0, 0.0, d)).sum(1)
        ent = torch.where(valid, log_s - a / torch.where(valid, sm, 1.0), 0.0)
    return lse, lp, ent


def sparse_grad(
    vals: Float[Tensor, "R C"], lse: Float[Tensor, " R"], ent: Float[Tensor, " R"] | None,
    g: Float[Tensor, " R"], k: Float[Tensor, " R"] | None,
) -> Float[Tensor, "R C"]:
    """``∂L/∂z`` at the kept candidates, without the label term: ``−g·p − k·p·(log p + H)`` (``p = 0`` and no
    ``0·(−inf)`` where not kept). The caller adds ``g`` at the label."""
    lp = vals - lse.unsqueeze(1)
    p = torch.exp(lp)
    gz = -g.unsqueeze(1) * p
    if k is not None:
        gz = gz - k.unsqueeze(1) * p * torch.where(p == 0, 0.0, lp + ent.unsqueeze(1))
    return gz


def mask_below(z: Float[Tensor, "R V"], tau: Float[Tensor, " R"]) -> Float[Tensor, "R V"]:
    """``z`` with every entry below its row's threshold set to ``−inf`` (in place; returns ``z``)."""
    return z.masked_fill_(z < tau.unsqueeze(1), NEG_INF)


class Replay(NamedTuple):
    """What an op's backward needs of the forward's kept sets: ``tau [N]`` for every row; ``vals``/``idx`` ``[N, C]``
    (the kept candidates, as in ``Selection``) and ``sparse [N]`` (rows whose kept set is in ``vals``), or ``None``
    when no row is sparse. A sparse row's gradient is nonzero only at its ``C`` candidates, so its backward needs
    no recomputation of the logits."""

    tau: Float[Tensor, " N"]
    vals: Float[Tensor, "N C"] | None
    idx: Int[Tensor, "N C"] | None
    sparse: Bool[Tensor, " N"] | None


def new_replay(n: int, c: int, device: torch.device) -> Replay:
    """An empty ``Replay`` of ``n`` rows and ``c`` candidates, filled chunk by chunk by the torch paths."""
    return Replay(
        torch.full((n,), NEG_INF, dtype=torch.float32, device=device),
        torch.full((n, c), NEG_INF, dtype=torch.float32, device=device),
        torch.zeros((n, c), dtype=torch.long, device=device),
        torch.zeros(n, dtype=torch.bool, device=device),
    )


class ChunkedSelection(NamedTuple):
    """``chunked_select``'s result: thresholds of every row, and (when every block was sparse) the kept candidates
    ``vals``/``idx`` of every row and the label logits ``zy``."""

    tau: Float[Tensor, " N"]
    vals: Float[Tensor, "N C"] | None
    idx: Int[Tensor, "N C"] | None
    zy: Float[Tensor, " N"] | None


def chunked_select(
    make_z, n: int, v: int, mask: SamplingMask, valid: Bool[Tensor, " N"], label_idx: Int[Tensor, " N"], rows: int
) -> ChunkedSelection:
    """``select`` over all ``n`` rows, one row chunk of logits at a time, for the Triton paths: ``make_z(r0, r1)``
    returns the fp32 ``z = logits / T`` of rows ``[r0, r1)`` (a temporary of ``rows × v``); ``label_idx``: each
    row's label column (0 where ignored). When every chunk is sparse, the op needs no Triton kernel at all (the
    kept sets are known); otherwise its kernels take ``tau`` and keep ``z >= tau``."""
    c = num_candidates(mask, v)
    taus, vals, idxs, zys = [], [], [], []
    sparse = True
    for r0 in range(0, n, rows):
        r1 = min(r0 + rows, n)
        z = make_z(r0, r1)
        sel = select(z, mask.rows(slice(r0, r1)), valid[r0:r1], c)
        taus.append(sel.tau)
        sparse = sparse and sel.sparse
        if sparse:
            vals.append(sel.vals)
            idxs.append(sel.idx)
            zys.append(z.gather(1, label_idx[r0:r1].unsqueeze(1)).squeeze(1))
    tau = torch.cat(taus).contiguous()
    if not sparse:
        return ChunkedSelection(tau, None, None, None)
    return ChunkedSelection(tau, torch.cat(vals), torch.cat(idxs), torch.cat(zys))
