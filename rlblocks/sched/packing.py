"""Sequence packing, token-budget micro-batches, DP length balancing, and padded <-> packed layouts.

Index functions take ``lengths`` (a sequence of ints >= 0, or a 1-D integer tensor) and return lists of indices into
it; every index appears exactly once. Within each returned bin / micro-batch / partition indices are in ascending
order. They run on the host (pure Python).

Layouts: *padded* ``x[b, t]`` with a right-padded ``mask[b, t]`` (``True`` for the first ``len_b`` positions of row
``b``); *packed* ``flat[n]`` holds the valid tokens of all rows back to back, with ``cu_seqlens`` (int32,
``[B + 1]``, ``cu_seqlens[0] = 0``, ``cu_seqlens[b + 1] - cu_seqlens[b] = len_b``), the flash-attention varlen
convention.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch
from jaxtyping import Bool, Int, Shaped
from torch import Tensor

from rlblocks._checks import check_bool, check_int, check_int_list, check_ndim, check_tensor, shape_str
from rlblocks.errors import ArgumentError


def _as_lengths(lengths: Sequence[int] | Tensor, name: str = "lengths") -> list[int]:
    if isinstance(lengths, Tensor):
        if lengths.dim() != 1 or lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
            raise ArgumentError(f"{name}: expected a 1-D integer tensor, got dtype {lengths.dtype} shape "
                             f"{shape_str(lengths)}")
        out = [int(v) for v in lengths.tolist()]
    else:
        # A length is a token count: a float would be truncated and True read as 1, so neither is accepted.
        out = check_int_list(name, lengths)
    for i, v in enumerate(out):
        if v < 0:
            raise ArgumentError(f"{name}[{i}]: expected a length >= 0, got {v}")
    return out


def _check_budget(max_tokens: int, lengths: list[int]) -> int:
    max_tokens = check_int("max_tokens", max_tokens, minimum=1)
    if lengths:
        i = max(range(len(lengths)), key=lengths.__getitem__)
        if lengths[i] > max_tokens:
            raise ArgumentError(
                f"max_tokens: expected >= the longest sequence (lengths[{i}] = {lengths[i]}), got {max_tokens}"
            )
    return max_tokens


def pack_sequences(lengths: Sequence[int] | Tensor, *, max_tokens: int) -> list[list[int]]:
    """First-fit-decreasing bin packing of sequences into bins of at most ``max_tokens`` tokens.

    Sequences are taken longest first (ties: lower index first) and each goes into the first (oldest) bin with
    room for it, else a new bin. FFD uses at most ``11/9 OPT + 6/9`` bins. The first bin with room is found with a
    max-segment-tree over remaining capacities, so packing costs ``O(n log n)``. Returns bins in creation order,
    indices ascending within a bin.
    """
    lens = _as_lengths(lengths)
    max_tokens = _check_budget(max_tokens, lens)
    n = len(lens)
    if n == 0:
        return []
    size = 1
    while size < n:
        size *= 2
    # tree[size + b] = remaining room of bin b (bins not opened yet have full room max_tokens).
    tree = [max_tokens] * (2 * size)
    bins: list[list[int]] = []
    for i in sorted(range(n), key=lambda j: (-lens[j], j)):
        need = lens[i]
        node = 1
        while node < size:  # descend to the leftmost leaf with room >= need (the root always has room: n bins)
            node = 2 * node if tree[2 * node] >= need else 2 * node + 1
        b = node - size
        if b == len(bins):
            bins.append([])
        bins[b].append(i)
        tree[node] -= need
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    for b in bins:
        b.sort()
    return bins


def token_budget_microbatches(
    lengths: Sequence[int] | Tensor, *, max_tokens: int, padded: bool = False
) -> list[list[int]]:
    """Split sequences, in their given order, into consecutive micro-batches within a token budget.

    Order-preserving greedy: a micro-batch is closed when adding the next sequence would exceed ``max_tokens``.
    The cost of a micro-batch is ``sum(lengths)`` (packed layout) or, with ``padded=True``,
    ``count * max(lengths)`` (right-padded layout). Sort the lengths first (or use :func:`pack_sequences`) for
    fewer micro-batches; this function never reorders.
    """
    lens = _as_lengths(lengths)
    max_tokens = _check_budget(max_tokens, lens)
    padded = check_bool("padded", padded)
    out: list[list[int]] = []
    cur: list[int] = []
    total = longest = 0
    for i, length in enumerate(lens):
        if cur:
            cost = max(longest, length) * (len(cur) + 1) if padded else total + length
            if cost > max_tokens:
                out.append(cur)
                cur, total, longest = [], 0, 0
        cur.append(i)
        total += length
        longest = max(longest, length)
    if cur:
        out.append(cur)
    return out


def balance_partitions(lengths: Sequence[int] | Tensor, k: int, *, equal_size: bool = False) -> list[list[int]]:
    """Split sequences into ``k`` partitions with nearly equal token totals (Karmarkar–Karp, largest differencing).

    Each sequence starts as a ``k``-way partial solution (itself in one subset, the others empty). Repeatedly the
    two partial solutions with the largest spread (max subset sum − min subset sum) are merged, pairing the
    heaviest subset of one with the lightest of the other, until one solution remains. With ``equal_size=True``
    (``len(lengths)`` must be a multiple of ``k``) the sequences sorted by length are first cut into chunks of ``k``
    whose members seed different subsets, so every partition gets ``len(lengths) / k`` sequences (a common DP
    requirement). Returns ``k`` lists of indices, ascending within each, heaviest partition first; some may be
    empty if ``len(lengths) < k``. Use :func:`inverse_permutation` to put per-partition results back in the
    original order.
    """
    lens = _as_lengths(lengths)
    k = check_int("k", k, minimum=1)
    equal_size = check_bool("equal_size", equal_size)
    n = len(lens)
    if equal_size and n % k != 0:
        raise ArgumentError(f"lengths: equal_size=True needs a multiple of k={k} sequences, got {n}")
    # A partial solution: k subsets sorted by sum descending, each (sum, members) where members is a cheap tree
    # (None, an index, or a pair of trees) so a merge costs O(k), not O(subset size); heap key = -(spread), id.
    seeds: list[list[tuple[int, object]]] = []
    if equal_size:
        order = sorted(range(n), key=lambda j: (lens[j], j))
        for c in range(0, n, k):
            seeds.append(sorted(((lens[j], j) for j in order[c : c + k]), key=lambda s: -s[0]))
    else:
        for j in range(n):
            seeds.append([(lens[j], j)] + [(0, None)] * (k - 1))
    heap = [(-(s[0][0] - s[-1][0]), i, s) for i, s in enumerate(seeds)]
    heapq.heapify(heap)
    next_id = len(seeds)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(a[i][0] + b[k - 1 - i][0], (a[i][1], b[k - 1 - i][1])) for i in range(k)]
        merged.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), next_id, merged))
        next_id += 1
    if not heap:
        return [[] for _ in range(k)]
    return [_flatten(members) for _, members in heap[0][2]]


def _flatten(tree: object) -> list[int]:
    out: list[int] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        if isinstance(node, tuple):
            stack.extend(node)
        else:
            out.append(node)
    out.sort()
    return out


def inverse_permutation(groups: Sequence[Sequence[int]]) -> list[int]:
    """For index lists covering ``0..n-1`` once (e.g. from :func:`balance_partitions`), the inverse of their
    concatenation: if ``flat = [i for g in groups for i in g]`` and ``y[j]`` is the result for ``flat[j]``, then
    ``y[inv[i]]`` is the result for original index ``i`` (``torch.cat(results)[inv]`` restores the order).

    Indices must be genuine integers (numpy / 0-d torch ints fine): ``1.5`` or ``True`` raises ``ArgumentError``
    naming ``groups[g][k]`` instead of being truncated or read as 1."""
    if isinstance(groups, (str, bytes)) or not hasattr(groups, "__iter__"):
        raise ArgumentError(f"groups: expected a sequence of index lists, got {type(groups).__name__}")
    flat = [i for g, group in enumerate(groups) for i in check_int_list(f"groups[{g}]", group)]
    n = len(flat)
    inv = [-1] * n
    for pos, i in enumerate(flat):
        if not 0 <= i < n or inv[i] != -1:
            raise ArgumentError(f"groups: expected each of 0..{n - 1} exactly once, got {i!r} at position {pos}")
        inv[i] = pos
    return inv


def pad_to_packed(
    x: Shaped[Tensor, "batch seq *rest"],
    mask: Bool[Tensor, "batch seq"],
    *,
    validate: bool = True,
) -> tuple[Shaped[Tensor, "total *rest"], Int[Tensor, "batch_plus_1"]]:
    """Padded ``x[B, T, ...]`` and right-padded ``mask[B, T]`` -> ``(flat[N, ...], cu_seqlens[B + 1] int32)``.

    ``flat`` keeps the masked tokens row by row, ``N = mask.sum()``; ``cu_seqlens = [0, cumsum(mask.sum(1))]``.
    With ``validate=True`` (default) a mask that is not right-padded (a ``False`` followed by a ``True`` in a row,
    e.g. left padding or holes) raises ``ValueError``, because a packed sequence must be contiguous; this reads the
    mask on the host (one sync). With ``validate=False`` any mask is accepted and each row's masked tokens are
    concatenated in order (left-padded rows therefore pack correctly; :func:`packed_to_pad` returns them
    right-padded). ``mask`` may be bool or 0/1 integers/floats (non-zero = valid).
    """
    check_ndim("x", x, tuple(range(2, 9)), "[B, T, ...]")
    check_tensor("mask", mask)
    if mask.shape != x.shape[:2]:
        raise ArgumentError(f"mask: expected shape [B, T] = {list(x.shape[:2])} (the first two dims of x), "
                         f"got {shape_str(mask)}")
    m = mask if mask.dtype == torch.bool else mask != 0
    seqlens = m.sum(dim=1)
    if check_bool("validate", validate):
        ar = torch.arange(m.shape[1], device=m.device)
        right = ar.unsqueeze(0) < seqlens.unsqueeze(1)
        bad = (right != m).any(dim=1)
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            raise ArgumentError(
                f"mask: expected right-padded rows (valid tokens first, then padding), row {row} is not "
                f"(pass validate=False to pack non-contiguous or left-padded masks row by row)"
            )
    cu = torch.zeros(m.shape[0] + 1, dtype=torch.int32, device=m.device)
    cu[1:] = torch.cumsum(seqlens, dim=0).to(torch.int32)
    return x[m], cu


def packed_to_pad(
    flat: Shaped[Tensor, "total *rest"],
    cu_seqlens: Int[Tensor, "batch_plus_1"],
    *,
    max_len: int | None = None,
    pad_value: float | int | bool = 0,
) -> tuple[Shaped[Tensor, "batch seq *rest"], Bool[Tensor, "batch seq"]]:
    """Packed ``flat[N, ...]`` with ``cu_seqlens[B + 1]`` -> right-padded ``(x[B, T, ...], mask[B, T])``.

    ``T = max_len`` if given (must be >= the longest sequence) else the longest sequence. Padding positions hold
    ``pad_value``. ``cu_seqlens`` must be a 1-D integer tensor starting at 0, non-decreasing, ending at ``N``;
    checking this reads it on the host (one sync).
    """
    check_ndim("flat", flat, tuple(range(1, 8)), "[N, ...]")
    check_ndim("cu_seqlens", cu_seqlens, 1, "[B + 1]")
    if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
        raise ArgumentError(f"cu_seqlens: expected an integer tensor, got dtype {cu_seqlens.dtype}")
    if cu_seqlens.numel() < 1:
        raise ArgumentError("cu_seqlens: expected at least one entry (0), got an empty tensor")
    cu = cu_seqlens.to(device=flat.device, dtype=torch.int64)
    seqlens = cu[1:] - cu[:-1]
    first, last = int(cu[0]), int(cu[-1])
    if first != 0 or last != flat.shape[0] or bool((seqlens < 0).any()):
        raise ArgumentError(
            f"cu_seqlens: expected non-decreasing offsets from 0 to flat.shape[0]={flat.shape[0]}, "
            f"got first={first}, last={last}"
        )
    longest = int(seqlens.max()) if seqlens.numel() else 0
    if max_len is None:
        max_len = longest
    else:
        max_len = check_int("max_len", max_len, minimum=longest, what=f"an int >= the longest sequence ({longest})")
    b = seqlens.numel()
    mask = torch.arange(max_len, device=flat.device).unsqueeze(0) < seqlens.unsqueeze(1)
    out = flat.new_full((b, max_len, *flat.shape[1:]), pad_value)
    out[mask] = flat
    return out, mask
