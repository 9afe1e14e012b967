"""Prefix trees of token sequences, flattened into packed rows for a prefix-shared forward.

The samples of a GRPO group repeat their prompt, and the rows of a multi-turn episode (one per turn, or one per
branch) repeat their history. Put every sequence into one trie of token ids and each shared prefix is one path
of nodes: a causal LM run over the trie's nodes, each attending to its ancestors only, computes every node's
hidden state exactly as one row per sequence would (same tokens before it, same positions), with every shared
token forwarded once. Sharing is found from the ids alone: no group ids are needed, and samples that happen to
begin with the same response tokens share those too.

A :class:`PrefixTree` holds ``R`` packed rows of ``N`` slots: per slot the token (``input_ids``), its depth as the
position id (``position_ids``: RoPE sees each token where the unshared row has it) and the ancestor mask in
``O(N)`` memory (``subtree_end``: nodes in depth-first preorder, node ``j`` attends to ``k`` iff
``k <= j < subtree_end[r, k]``); per sequence position its slot (``index``); the compressed trie edges
(``edges``); and, for a ``RolloutBatch``, the slot predicting each response token (``logit_index``). Rows hold at
most ``max_tokens`` nodes, a unit over the budget cut at its shallowest branching, units packed
first-fit-decreasing (:func:`~rlblocks.sched.pack_sequences`); every sequence lies whole in one row, so each
response position has exactly one logit slot. Every field and the packing rule: ``docs/sched.md`` (Prefix trees).

All of it runs on the host (Python and small torch ops, ``O(total tokens + S log S)``); ``PrefixTree.to(device)``
moves the tensors. It lives beside :mod:`.packing` because it is a packing: the rollout side builds trees and the
kernels (:mod:`rlblocks.kernels.prefix_share`) run the forward over them, and neither imports the other.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from rlblocks._checks import check_bool, check_int, check_ndim, check_tensor, shape_str
from rlblocks.errors import ArgumentError

from .packing import pack_sequences

__all__ = ["PrefixTree", "ResponseRows", "build_prefix_tree", "response_prefix_tree"]


@runtime_checkable
class ResponseRows(Protocol):
    """A batch in the ``RolloutBatch`` layout, as far as a prefix tree reads it (a
    :class:`~rlblocks.rollout.batch.RolloutBatch` is one): right-padded ``input_ids [B, L]``, ``prompt_lens [B]``
    and the response-aligned ``response_mask [B, T]``."""

    input_ids: Int[Tensor, "B L"]
    prompt_lens: Int[Tensor, " B"]
    response_mask: Bool[Tensor, "B T"]


@dataclass(frozen=True)
class PrefixTree:
    """Sequences as a prefix trie in packed rows (layout in the module docstring)."""

    input_ids: Int[Tensor, "R N"]
    position_ids: Int[Tensor, "R N"]
    subtree_end: Int[Tensor, "R N"]
    index: Int[Tensor, "S Lmax"]
    row_of: Int[Tensor, " S"]
    lengths: Int[Tensor, " S"]
    row_tokens: Int[Tensor, " R"]
    edges: Int[Tensor, "E 3"]
    members: tuple[tuple[int, ...], ...]
    logit_index: Int[Tensor, "B T"] | None = None

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def row_len(self) -> int:
        """``N``, the slots per row (the longest row, rounded up to ``multiple_of``)."""
        return int(self.input_ids.shape[1])

    @property
    def num_nodes(self) -> int:
        """Distinct prefix nodes, i.e. tokens forwarded (padding excluded)."""
        return int(self.row_tokens.sum())

    @property
    def num_input_tokens(self) -> int:
        """Tokens of the sequences themselves (what one row per sequence, unpadded, would forward)."""
        return int(self.lengths.sum())

    def ancestor_mask(self) -> Bool[Tensor, "R 1 N N"]:
        """The dense boolean attention mask, ``mask[r, 0, j, k] = k <= j < subtree_end[r, k]`` (``R·N²`` bytes;
        for tests and the dense attention path)."""
        n = self.row_len
        ar = torch.arange(n, device=self.subtree_end.device)
        return ((ar[None, None, :] <= ar[None, :, None]) & (ar[None, :, None] < self.subtree_end[:, None, :]))[:, None]

    def to(self, device: torch.device | str) -> PrefixTree:
        """A copy with every tensor on ``device``."""
        return dataclasses.replace(self, **{
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), Tensor)
        })


def build_prefix_tree(
    sequences: ResponseRows | Sequence[Sequence[int] | Tensor],
    *,
    max_tokens: int | None = None,
    pad_id: int = 0,
    multiple_of: int = 1,
    share: bool = True,
) -> PrefixTree:
    """The prefix trie of ``sequences``, flattened into packed rows (layout in the module docstring).

    Args:
        sequences: token sequences (lists of ints or 1-D integer tensors; empty ones are allowed and get no node),
            or a batch in the ``RolloutBatch`` layout (:class:`ResponseRows`), whose rows are taken up to the last
            position that predicts a response token (see :func:`response_prefix_tree`; ``logit_index`` is then set).
        max_tokens: the most nodes in one packed row; ``None``: the largest set of sequences that share a prefix
            (so no shared prefix is repeated). Must be at least the longest sequence.
        pad_id: the token id of padding slots.
        multiple_of: round the row length ``N`` up to a multiple of this (e.g. 128, FlexAttention's block).
        share: ``False`` packs the sequences as they are, each its own chain (plain sequence packing, with the
            same layout; for comparison).

    Raises :class:`~rlblocks.errors.ArgumentError` for an empty list, a non-integer sequence, a negative token
    id, a budget smaller than the longest sequence, or a bad ``pad_id`` / ``multiple_of``.
    """
    if isinstance(sequences, ResponseRows):
        return response_prefix_tree(sequences.input_ids, sequences.prompt_lens, sequences.response_mask,
                                    max_tokens=max_tokens, pad_id=pad_id, multiple_of=multiple_of, share=share)
    if isinstance(sequences, (str, bytes, Tensor)) or not isinstance(sequences, Sequence) or len(sequences) == 0:
        raise ArgumentError(f"sequences: expected a non-empty sequence of token sequences or a RolloutBatch, got "
                            f"{type(sequences).__name__}")
    seqs = [_as_ids(f"sequences[{i}]", s) for i, s in enumerate(sequences)]
    return _build(seqs, max_tokens=max_tokens, pad_id=pad_id, multiple_of=multiple_of, share=share)


def response_prefix_tree(
    input_ids: Int[Tensor, "B L"],
    prompt_lens: Int[Tensor, " B"],
    response_mask: Bool[Tensor, "B T"],
    *,
    max_tokens: int | None = None,
    pad_id: int = 0,
    multiple_of: int = 1,
    share: bool = True,
) -> PrefixTree:
    """The prefix tree of the rows of a ``RolloutBatch``-layout batch, with ``logit_index [B, T]``.

    Response position ``t`` of row ``b`` is the token at sequence position ``P_b + t`` (``P_b = prompt_lens[b]``)
    and is predicted from the hidden state at ``P_b + t − 1``. Row ``b`` enters the trie as
    ``input_ids[b, :P_b + t_last]`` (``t_last`` its last response position): every position that predicts a
    response token, nothing after (the last response token is a label only; right padding never enters). A row
    without a response token enters as an empty sequence. ``logit_index[b, t]`` is the flat slot of position
    ``P_b + t − 1`` of row ``b``, ``-1`` where ``response_mask`` is false. ``max_tokens``, ``pad_id``,
    ``multiple_of`` and ``share`` are :func:`build_prefix_tree`'s.

    Reads the tensors on the host (one device-to-host copy when they are elsewhere). Raises
    :class:`~rlblocks.errors.ArgumentError` for mismatched shapes, non-integer ids, ``prompt_lens < 1`` on a row
    with response tokens, a response position past ``L``, or a budget below the longest row.
    """
    check_ndim("input_ids", input_ids, 2, "[B, L]")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ArgumentError(f"input_ids: expected an integer tensor, got dtype {input_ids.dtype}")
    b, seq_len = input_ids.shape
    check_tensor("prompt_lens", prompt_lens)
    if (prompt_lens.dtype.is_floating_point or prompt_lens.dtype.is_complex or prompt_lens.dtype == torch.bool
            or prompt_lens.shape != (b,)):
        raise ArgumentError(f"prompt_lens: expected an integer tensor of shape [{b}] (B of input_ids), got "
                            f"{prompt_lens.dtype} {shape_str(prompt_lens)}")
    check_ndim("response_mask", response_mask, 2, "[B, T]")
    if response_mask.shape[0] != b:
        raise ArgumentError(f"response_mask: expected shape [{b}, T] (B of input_ids), got {shape_str(response_mask)}")
    if response_mask.dtype.is_complex:
        raise ArgumentError(f"response_mask: expected dtype bool (or 0/1 int/float), got {response_mask.dtype}")
    mask = (response_mask if response_mask.dtype == torch.bool else response_mask != 0).cpu()
    starts = prompt_lens.cpu().long()
    t_len = mask.shape[1]
    any_resp = mask.any(1)
    t_last = torch.where(any_resp, t_len - 1 - mask.flip(1).long().argmax(1), -1)
    need = torch.where(any_resp, starts + t_last, 0)  # tokens that predict a response token
    bad = any_resp & (starts < 1)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ArgumentError(f"prompt_lens: expected values >= 1 on rows with response tokens (a response token is "
                            f"predicted from the previous position), got prompt_lens[{row}]={int(starts[row])}")
    bad = need >= seq_len
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ArgumentError(
            f"response_mask: row {row} marks a response token at sequence position {int(need[row])}, past "
            f"input_ids' length L={seq_len} (prompt_lens[{row}]={int(starts[row])})"
        )
    ids = input_ids.cpu().long()
    if ids.numel() and int(ids.min()) < 0:
        raise ArgumentError(f"input_ids: expected token ids >= 0, got {int(ids.min())}")
    rows = ids.tolist()
    seqs = [r[:n] for r, n in zip(rows, need.tolist())]
    tree = _build(seqs, max_tokens=max_tokens, pad_id=pad_id, multiple_of=multiple_of, share=share,
                  name="input_ids")
    src = (starts[:, None] - 1 + torch.arange(t_len)[None, :]).clamp(0, max(tree.index.shape[1] - 1, 0))
    if tree.index.shape[1] == 0:
        logit = torch.full((b, t_len), -1, dtype=torch.long)
    else:
        logit = torch.where(mask, tree.index.gather(1, src), -1)
    return dataclasses.replace(tree, logit_index=logit)


def _as_ids(name: str, seq: object) -> list[int]:
    if isinstance(seq, Tensor):
        if seq.dim() != 1 or seq.dtype.is_floating_point or seq.dtype.is_complex or seq.dtype == torch.bool:
            raise ArgumentError(f"{name}: expected a 1-D integer tensor of token ids, got dtype {seq.dtype} shape "
                                f"{shape_str(seq)}")
        out = seq.tolist()
    elif isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence):
        raise ArgumentError(f"{name}: expected a sequence of int token ids, got {type(seq).__name__}")
    elif set(map(type, seq)) <= {int}:  # the common case, checked in C
        out = list(seq)
    else:
        out = [check_int(f"{name}[{j}]", v) for j, v in enumerate(seq)]
    if out and min(out) < 0:
        j = out.index(min(out))
        raise ArgumentError(f"{name}[{j}]: expected a token id >= 0, got {out[j]}")
    return out


def _lcp(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix, by bisection on slice equality (the comparisons run in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _units(order: list[int], lens: list[int], lcp: list[int], budget: int | None) -> list[tuple[int, int, int]]:
    """Contiguous runs ``(lo, hi, nodes)`` of the sorted sequences, each of at most ``budget`` nodes (``None``: no
    limit): cut first where neighbours share nothing, then, inside a run over the budget, at its shallowest
    branching, into runs of children merged left to right while they fit (the prefix above the cut is repeated in
    each part)."""
    s = len(order)
    # nodes of a sorted run [lo, hi): len(first) + the sum over the others of (len - LCP with the one before)
    pre = [0] * (s + 1)
    for k in range(s):
        pre[k + 1] = pre[k] + lens[order[k]] - (lcp[k - 1] if k else 0)

    def cost(lo: int, hi: int) -> int:
        return lens[order[lo]] + pre[hi] - pre[lo + 1]

    def split(lo: int, hi: int, out: list[tuple[int, int, int]]) -> None:
        if budget is None or cost(lo, hi) <= budget:
            out.append((lo, hi, cost(lo, hi)))
            return
        m = min(lcp[lo : hi - 1])  # hi - lo >= 2 here: a single sequence fits (checked by the caller)
        bounds = [lo] + [k + 1 for k in range(lo, hi - 1) if lcp[k] == m] + [hi]
        cur: tuple[int, int] | None = None
        for a, b in itertools.pairwise(bounds):
            if cost(a, b) > budget:
                if cur is not None:
                    out.append((*cur, cost(*cur)))
                    cur = None
                split(a, b, out)
            elif cur is None:
                cur = (a, b)
            elif cost(cur[0], b) <= budget:
                cur = (cur[0], b)
            else:
                out.append((*cur, cost(*cur)))
                cur = (a, b)
        if cur is not None:
            out.append((*cur, cost(*cur)))

    out: list[tuple[int, int, int]] = []
    lo = 0
    for k in range(s):
        if k == s - 1 or lcp[k] == 0:
            split(lo, k + 1, out)
            lo = k + 1
    return out


def _build(seqs: list[list[int]], *, max_tokens: int | None, pad_id: int, multiple_of: int, share: bool,
           name: str = "sequences") -> PrefixTree:
    pad_id = check_int("pad_id", pad_id, minimum=0, what="an int token id >= 0")
    multiple_of = check_int("multiple_of", multiple_of, minimum=1)
    share = check_bool("share", share)
    s = len(seqs)
    lens = [len(q) for q in seqs]
    longest = max(range(s), key=lens.__getitem__)
    if share:
        order = sorted(range(s), key=seqs.__getitem__)
        lcp = [_lcp(seqs[order[k]], seqs[order[k + 1]]) for k in range(s - 1)]
    else:  # every sequence its own chain: nothing in common with its neighbour
        order, lcp = list(range(s)), [0] * (s - 1)
    if max_tokens is None:
        units = _units(order, lens, lcp, None)  # cut only where nothing is shared
        budget = max([u[2] for u in units] + [1])
    else:
        budget = check_int("max_tokens", max_tokens, minimum=1)
        if lens[longest] > budget:
            what = "row" if name == "input_ids" else "sequence"
            raise ArgumentError(f"max_tokens: expected >= the longest {what} ({name}[{longest}] needs "
                                f"{lens[longest]} tokens), got {budget}")
        units = _units(order, lens, lcp, budget)
    bins = pack_sequences([u[2] for u in units], max_tokens=budget)

    # one row per bin: its members in sorted order, the trie as chains (each member adds the nodes past its
    # common prefix with the member before it), in depth-first preorder
    row_ids: list[Tensor] = []
    row_pos: list[Tensor] = []
    row_end: list[Tensor] = []
    paths: list[Tensor | None] = [None] * s
    row_of = [0] * s
    edges: list[tuple[int, int, int]] = []
    members: list[tuple[int, ...]] = []
    for r, bin_units in enumerate(bins):
        pos_sorted = sorted(k for u in bin_units for k in range(units[u][0], units[u][1]))
        mem = [order[k] for k in pos_sorted]
        members.append(tuple(sorted(mem)))
        # LCP of consecutive members: the minimum of the sorted neighbours' LCPs between them
        row_lcp = [min(lcp[a:b]) for a, b in itertools.pairwise(pos_sorted)] + [-1]
        offsets = [0]
        for m, sid in enumerate(mem):
            offsets.append(offsets[-1] + lens[sid] - (row_lcp[m - 1] if m else 0))
        total = offsets[-1]
        ids = torch.empty(total, dtype=torch.long)
        pos = torch.empty(total, dtype=torch.long)
        end = torch.empty(total, dtype=torch.long)
        # next strictly smaller LCP to the right (the sentinel -1 at the end is smaller than every depth)
        nxt = [len(row_lcp) - 1] * len(row_lcp)
        stack: list[int] = []
        for k, v in enumerate(row_lcp):
            while stack and row_lcp[stack[-1]] > v:
                nxt[stack.pop()] = k
            stack.append(k)
        prev: Tensor | None = None
        for m, sid in enumerate(mem):
            d0 = row_lcp[m - 1] if m else 0
            o, n = offsets[m], lens[sid]
            c = n - d0
            if c:
                ids[o : o + c] = torch.tensor(seqs[sid][d0:], dtype=torch.long)
                pos[o : o + c] = torch.arange(d0, n)
            new = torch.arange(o, o + c)
            paths[sid] = new if prev is None or d0 == 0 else torch.cat([prev[:d0], new])
            prev = paths[sid]
            row_of[sid] = r
            # subtree ends: a node at depth d of this chain is shared by the members up to the first k >= m
            # whose LCP with its successor is <= d, so its subtree ends where member k + 1's chain starts
            k, hi = m, n
            while True:
                lo = max(row_lcp[k], d0)
                if lo < hi:
                    end[o + lo - d0 : o + hi - d0] = offsets[k + 1]
                    edges.append((r, o + lo - d0, o + hi - d0))
                if row_lcp[k] <= d0:
                    break
                hi = row_lcp[k]
                k = nxt[k]
        row_ids.append(ids)
        row_pos.append(pos)
        row_end.append(end)

    r_count = len(bins)
    width = max([t.numel() for t in row_ids] + [1])
    width = -(-width // multiple_of) * multiple_of
    input_ids = torch.full((r_count, width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((r_count, width), dtype=torch.long)
    subtree_end = torch.arange(1, width + 1, dtype=torch.long).repeat(r_count, 1)  # padding: itself only
    for r in range(r_count):
        n = row_ids[r].numel()
        input_ids[r, :n] = row_ids[r]
        position_ids[r, :n] = row_pos[r]
        subtree_end[r, :n] = row_end[r]
    l_max = max([*lens, 0])
    index = torch.full((s, l_max), -1, dtype=torch.long)
    for sid, p in enumerate(paths):
        if p is not None and p.numel():
            index[sid, : p.numel()] = p + row_of[sid] * width
    return PrefixTree(
        input_ids=input_ids,
        position_ids=position_ids,
        subtree_end=subtree_end,
        index=index,
        row_of=torch.tensor(row_of, dtype=torch.long),
        lengths=torch.tensor(lens, dtype=torch.long),
        row_tokens=torch.tensor([t.numel() for t in row_ids], dtype=torch.long),
        edges=torch.tensor(edges, dtype=torch.long).reshape(-1, 3),
        members=tuple(members),
    )

