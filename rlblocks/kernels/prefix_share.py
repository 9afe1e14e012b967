"""Prefix-shared forward of an HF decoder: each shared token forwarded once, the hidden states of one row per sample.

``prefix_shared_hidden_states(body, input_ids, prompt_lens, response_mask)`` puts the rows of a
``RolloutBatch``-layout batch into a prefix trie (:func:`rlblocks.sched.response_prefix_tree`: a GRPO group's
prompt, an episode's history, any common prefix found from the ids), runs the decoder body once over the trie's
nodes in packed rows — position ids = depth in the tree, every node attending to its ancestors only — and returns
the hidden state that predicts each response token, ``[B, T, H]``, equal to what one row per sample gives (same
tokens before each node, same positions; only the order of floating-point sums differs). Gradients flow to every
parameter of the body. ``causal_lm_logprobs(..., prefix_share=True)`` puts the LM head on it.

The model runs unchanged, through its own forward and weights: the packed rows go in as ``input_ids`` and
``position_ids`` with a 4-D attention mask, which HF's mask preparation hands to the attention layers as it is.
What that mask is depends on the model's attention implementation and on ``attention``:

- ``"segments"`` (the default on CPU, for ``sdpa`` models): a :class:`TreeAttentionMask`, a tensor that knows the
  tree; attention runs per compressed trie edge with the CPU flash-attention kernel (no masked-out pair computed),
  the pieces merged with their log-sum-exps, with a backward per piece;
- ``"flex"`` (the default on CUDA): FlexAttention with a ``BlockMask`` built from the tree, compiled;
- ``"dense"`` (any device; the reference): the materialised additive mask, the only choice for ``eager`` models.

Exactness needs full attention over every position (no sliding window shorter than a sequence: refused). Padding
slots of a packed row attend to themselves only and are never read. When the packed rows would hold as many
slots as the padded batch (nothing is shared), the batch runs unshared, so prefix sharing never forwards more
tokens than one row per sample.

Under ``torch.compile`` the prefix-shared forward is not traced (the tree is built on the host). Each attention path in
detail: ``docs/kernels.md`` (Prefix-shared training). One file: the three attention paths over the tree (segments
with their backward, FlexAttention, the dense reference) serve this forward alone and are chosen per call.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn
from torch.utils._pytree import tree_map_only

from rlblocks._checks import check_ndim, check_optional_int, shape_str
from rlblocks.errors import ArgumentError
from rlblocks.kernels._scored_head import scored_head_logprobs
from rlblocks.sched.prefix_tree import PrefixTree, response_prefix_tree

__all__ = ["ATTENTION_BACKENDS", "TreeAttentionMask", "prefix_shared_hidden_states", "prefix_shared_rows"]

ATTENTION_BACKENDS = ("segments", "flex", "dense")
"""The values of ``attention`` (``None`` picks ``"flex"`` on CUDA, ``"segments"`` elsewhere; ``"dense"`` for a
model whose attention implementation is ``eager``)."""

FLEX_BLOCK = 128
"""FlexAttention's block size; packed rows are padded to a multiple of it for ``"flex"``."""

_IMPLS = ("sdpa", "eager", "flex_attention")


def prefix_shared_hidden_states(
    body: nn.Module,
    input_ids: Int[Tensor, "B L"],
    prompt_lens: Int[Tensor, " B"],
    response_mask: Bool[Tensor, "B T"],
    *,
    attention_mask: Bool[Tensor, "B L"] | None = None,
    max_tokens: int | None = None,
    attention: str | None = None,
    share: bool = True,
    model_kwargs: Mapping[str, Any] | None = None,
) -> Float[Tensor, "B T H"]:
    """``h[b, t]``, the decoder body's last hidden state (after its final norm) at sequence position
    ``P_b + t − 1`` of row ``b`` — the state that predicts response token ``t`` — from one prefix-shared forward.

    Equal to ``body(input_ids).last_hidden_state[b, P_b + t − 1]`` of the unshared forward, in value and in the
    gradient of every parameter of ``body`` (up to the order of floating-point sums). ``0`` where
    ``response_mask`` is false (no gradient).

    Args:
        body: an HF decoder body (``LlamaModel``, ``Qwen2Model``, ``Qwen3Model``, ...: ``forward(input_ids,
            attention_mask, position_ids, use_cache)`` returning ``last_hidden_state``), attention
            implementation ``sdpa``, ``eager`` or ``flex_attention``; the body of a causal LM
            (``model.get_decoder()``) or an ``AutoModel`` (a value model's body).
        input_ids: ``[B, L]`` prompt then response of each row, right-padded (``RolloutBatch.input_ids``).
        prompt_lens: ``[B]``, ``>= 1`` on every row that has a response token.
        response_mask: ``[B, T]`` true on the response tokens to score.
        attention_mask: optional ``[B, L]``; it must be true on every position before a row's last scored token
            (right padding: a causal model's earlier positions never see the padding, so that is all it says).
        max_tokens: nodes per packed row (see :func:`rlblocks.sched.build_prefix_tree`; ``None``: the largest
            set of rows sharing a prefix, so no prefix is repeated). Rows beyond it are packed into more rows.
        attention: ``"segments"``, ``"flex"`` or ``"dense"`` (module docstring); ``None``: ``"flex"`` on CUDA,
            ``"segments"`` elsewhere, ``"dense"`` for an ``eager`` model.
        share: ``False`` packs the rows without merging their prefixes (plain sequence packing; for comparison).
        model_kwargs: more keyword arguments for ``body`` (no tensors: those follow the ``[B, L]`` rows, and the
            body sees packed rows); ``input_ids``, ``attention_mask``, ``position_ids`` and ``use_cache`` are set
            here.

    Raises ``ArgumentError`` for mismatched shapes, a budget below the longest row, an ``attention_mask`` false
    before a scored token, a sliding-window model whose window is shorter than a row, an attention
    implementation or backend that cannot run here (``"segments"`` on CUDA, ``"flex"`` on CPU), or a body whose
    output is not ``[R, N, H]``.
    """
    return _select(*prefix_shared_rows(body, input_ids, prompt_lens, response_mask, attention_mask=attention_mask,
                                       max_tokens=max_tokens, attention=attention, share=share,
                                       model_kwargs=model_kwargs))


def prefix_shared_rows(
    body: nn.Module,
    input_ids: Int[Tensor, "B L"],
    prompt_lens: Int[Tensor, " B"],
    response_mask: Bool[Tensor, "B T"],
    *,
    attention_mask: Bool[Tensor, "B L"] | None = None,
    max_tokens: int | None = None,
    attention: str | None = None,
    share: bool = True,
    model_kwargs: Mapping[str, Any] | None = None,
) -> tuple[Float[Tensor, "M H"], Int[Tensor, "B T"]]:
    """:func:`prefix_shared_hidden_states` before its ``[B, T]`` gather: the hidden states of the forward as flat
    rows ``flat [M, H]`` (one per trie node and packing slot) and ``index [B, T]``, the row of ``flat`` that predicts
    response token ``t`` of row ``b`` (``-1`` where ``response_mask`` is false). Positions that the trie shares
    name the same row, so a caller can put the LM head once on each distinct ``(row, label)`` pair. The arguments,
    checks and errors are :func:`prefix_shared_hidden_states`'.
    """
    check_ndim("input_ids", input_ids, 2, "[B, L]")
    seq_len = input_ids.shape[1]
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ArgumentError(f"attention_mask: expected the shape of input_ids {shape_str(input_ids)}, "
                            f"got {shape_str(attention_mask)}")
    max_tokens = check_optional_int("max_tokens", max_tokens, minimum=1)
    extra = dict(model_kwargs or {})
    for k, v in extra.items():
        if isinstance(v, Tensor) or k in ("input_ids", "attention_mask", "position_ids", "use_cache"):
            raise ArgumentError(f"model_kwargs: {k!r} cannot go to a prefix-shared forward (the body sees packed "
                                f"rows, whose input_ids, attention_mask and position_ids are set here; a tensor "
                                f"would follow the [B, L] rows)")
    device = input_ids.device
    config = getattr(body, "config", None)
    impl = getattr(config, "_attn_implementation", None) or "eager"
    kind = _resolve_attention(attention, impl, device)
    tree = response_prefix_tree(input_ids, prompt_lens, response_mask, max_tokens=max_tokens,
                                multiple_of=FLEX_BLOCK if kind == "flex" else 1, share=share)
    if attention_mask is not None:
        am = attention_mask.detach().cpu()
        am = am if am.dtype == torch.bool else am != 0
        hole = (torch.arange(seq_len)[None, :] < tree.lengths[:, None]) & ~am
        if bool(hole.any()):
            row, col = (int(v) for v in hole.nonzero()[0])
            raise ArgumentError(
                f"attention_mask: expected true on every position before a row's last scored token (right "
                f"padding; a prefix-shared forward needs each row's tokens to be its prefix), got false at "
                f"[{row}, {col}]")
    longest = int(tree.lengths.max()) if tree.lengths.numel() else 0
    window = getattr(config, "sliding_window", None)
    if isinstance(window, int) and not isinstance(window, bool) and longest > window:
        raise ArgumentError(
            f"body: config.sliding_window={window} is shorter than the longest row ({longest} tokens); a "
            f"prefix-shared forward gives every token all of its ancestors (full attention), so it would differ")
    return _tree_forward(body, input_ids, attention_mask, tree, kind, impl, extra)


def _tree_forward(body: nn.Module, input_ids: Tensor, attention_mask: Tensor | None, tree: PrefixTree, kind: str,
                  impl: str, extra: dict) -> tuple[Float[Tensor, "M H"], Int[Tensor, "B T"]]:
    """The body's hidden states as flat rows and, for each ``(b, t)``, the row that predicts response token ``t``
    of row ``b`` (``-1`` where it is not scored): one forward over the tree, or one row per sample when the
    packed rows would hold as many slots as the padded batch (nothing shared: no gain)."""
    b, seq_len = input_ids.shape
    device = input_ids.device
    if tree.num_rows * tree.row_len >= b * seq_len:
        return _unshared(body, input_ids, attention_mask, tree, device, extra)
    tree = tree.to(device)
    dtype = _param_dtype(body)
    if impl == "flex_attention":
        mask: Any = _flex_block_mask(tree.subtree_end)
    elif kind == "dense":
        mask = _dense_mask(tree, dtype)
    else:
        mask = TreeAttentionMask(_Plan(tree, kind), dtype)
    out = body(input_ids=tree.input_ids, attention_mask=mask, position_ids=tree.position_ids, use_cache=False,
               **extra)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    if hidden.dim() != 3 or hidden.shape[:2] != tree.input_ids.shape:
        raise ArgumentError(f"body: expected hidden states [{tree.num_rows}, {tree.row_len}, H] for the packed "
                            f"rows, got {shape_str(hidden)}")
    return hidden.reshape(-1, hidden.shape[-1]), tree.logit_index


def prefix_shared_logprobs(
    body: nn.Module,
    weight: Float[Tensor, "V H"],
    input_ids: Int[Tensor, "B L"],
    prompt_lens: Int[Tensor, " B"],
    response_mask: Bool[Tensor, "B T"],
    *,
    attention_mask: Bool[Tensor, "B L"] | None,
    model_kwargs: Mapping[str, Any] | None,
    max_tokens: int | None,
    attention: str | None,
    temperature: float,
    top_k: Any,
    top_p: Any,
    return_entropy: bool,
    return_outside: bool,
    backend: str | None,
) -> Float[Tensor, "B T"] | tuple[Tensor, ...]:
    """``causal_lm_logprobs(..., prefix_share=True)`` once its arguments are checked: the LM head ``weight``
    (``scored_head_logprobs``, the same call as the unshared path) on the hidden states of
    :func:`prefix_shared_hidden_states`, at the scored positions only (the true entries of ``response_mask``;
    the outputs scattered back to ``[B, T]``, 0 / false elsewhere).
    ``temperature`` is the head's effective one. Response positions past ``L`` count as masked, as there."""
    seq_len, t_len = input_ids.shape[1], response_mask.shape[1]
    pos = prompt_lens.to(input_ids.device, torch.long)[:, None] + torch.arange(t_len, device=input_ids.device)
    keep = response_mask & (pos < seq_len)
    flat, index = prefix_shared_rows(body, input_ids, prompt_lens, keep, attention_mask=attention_mask,
                                     max_tokens=max_tokens, attention=attention, share=True, model_kwargs=model_kwargs)
    labels = input_ids.gather(1, pos.clamp(0, seq_len - 1))
    return scored_head_logprobs(flat, index, weight, labels, temperature=temperature, top_k=top_k, top_p=top_p,
                                return_entropy=return_entropy, return_outside=return_outside, backend=backend)


def _select(flat: Float[Tensor, "M H"], index: Int[Tensor, "B T"]) -> Float[Tensor, "B T H"]:
    h = flat[index.clamp(min=0)]
    return torch.where((index >= 0).unsqueeze(-1), h, h.new_zeros(()))


def _unshared(body: nn.Module, input_ids: Tensor, attention_mask: Tensor | None, tree: PrefixTree,
              device: torch.device, extra: dict) -> tuple[Tensor, Tensor]:
    """One row per sample, flat, and the rows of the positions the tree's ``logit_index`` names: a node's position
    id is its depth, i.e. the sequence position ``P_b + t − 1`` it stands for."""
    out = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    b, seq_len = input_ids.shape
    if hidden.dim() != 3 or hidden.shape[:2] != (b, seq_len):
        raise ArgumentError(f"body: expected hidden states [{b}, {seq_len}, H], got {shape_str(hidden)}")
    li = tree.logit_index
    pos = tree.position_ids.reshape(-1)[li.clamp(min=0)]
    src = torch.where(li >= 0, torch.arange(b)[:, None] * seq_len + pos, -1)
    return hidden.reshape(-1, hidden.shape[-1]), src.to(device)


def _resolve_attention(attention: str | None, impl: str, device: torch.device) -> str:
    if impl not in _IMPLS:
        raise ArgumentError(f"body: expected an attention implementation in {_IMPLS} (a 4-D tree mask reaches "
                            f"the attention unchanged only there), got config._attn_implementation={impl!r}")
    if attention is None:
        if impl == "eager":
            return "dense"
        return "flex" if device.type == "cuda" or impl == "flex_attention" else "segments"
    if attention not in ATTENTION_BACKENDS:
        raise ArgumentError(f"attention: expected one of {ATTENTION_BACKENDS} or None, got {attention!r}")
    if attention == "segments" and (device.type != "cpu" or impl != "sdpa"):
        raise ArgumentError(f"attention: 'segments' runs the CPU flash-attention kernel of an sdpa model, got "
                            f"device {device.type} and attention implementation {impl!r} (use 'flex' on CUDA)")
    if attention == "flex" and (device.type != "cuda" or impl == "eager"):
        raise ArgumentError(f"attention: 'flex' needs CUDA (FlexAttention has no backward on CPU) and an sdpa or "
                            f"flex_attention model, got device {device.type} and {impl!r}")
    if impl == "flex_attention" and attention != "flex":
        raise ArgumentError(f"attention: a flex_attention model takes a BlockMask ('flex'), got {attention!r}")
    return attention


def _param_dtype(body: nn.Module) -> torch.dtype:
    for p in body.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()


def _dense_mask(tree: PrefixTree, dtype: torch.dtype) -> Float[Tensor, "R 1 N N"]:
    """Additive: 0 on ancestor pairs, the dtype's most negative value elsewhere (exactly 0 weight after the
    softmax, and no NaN where a whole row were masked)."""
    allowed = tree.ancestor_mask()
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed,
                                                                                     torch.finfo(dtype).min)


# ------------------------------------------------------------------------------------------------ the tree mask
@dataclasses.dataclass
class _Plan:
    """What every attention layer of one forward shares: the tree on the model's device and, built on first use,
    the CPU pieces, the BlockMask or the dense mask."""

    tree: PrefixTree
    kind: str
    _cache: dict = dataclasses.field(default_factory=dict)

    def pieces(self) -> _Pieces:
        if "pieces" not in self._cache:
            self._cache["pieces"] = _segment_pieces(self.tree)
        return self._cache["pieces"]

    def block_mask(self):
        if "block" not in self._cache:
            self._cache["block"] = _flex_block_mask(self.tree.subtree_end)
        return self._cache["block"]

    def dense(self, dtype: torch.dtype) -> Tensor:
        if ("dense", dtype) not in self._cache:
            self._cache[("dense", dtype)] = _dense_mask(self.tree, dtype)
        return self._cache[("dense", dtype)]


_PASSTHROUGH = {
    Tensor.shape.__get__, Tensor.dtype.__get__, Tensor.device.__get__, Tensor.ndim.__get__,
    Tensor.is_cuda.__get__, Tensor.requires_grad.__get__, Tensor.layout.__get__, Tensor.dim, Tensor.size,
    Tensor.is_floating_point, torch.is_floating_point, Tensor.__len__, Tensor.numel, Tensor.is_complex,
}


class TreeAttentionMask(Tensor):
    """A ``[R, 1, N, N]`` additive attention mask (``0`` where node ``j`` sees node ``k``, i.e. ``k`` is ``j`` or
    one of its ancestors; the dtype's most negative value elsewhere) that holds the tree instead of the ``N²``
    entries.

    ``scaled_dot_product_attention(q, k, v, attn_mask=mask)`` with it runs the tree's attention (``"segments"``
    on CPU, FlexAttention on CUDA; see the module docstring). Any other operation on it (an ``eager`` layer's
    ``scores + mask``, a slice) sees the materialised dense mask, so it behaves as that mask everywhere. Shape,
    dtype and device are real; ``.to(dtype)`` keeps the tree.
    """

    plan: _Plan

    @staticmethod
    def __new__(cls, plan: _Plan, dtype: torch.dtype) -> TreeAttentionMask:
        r, n = plan.tree.input_ids.shape
        self = Tensor._make_wrapper_subclass(cls, (r, 1, n, n), dtype=dtype, device=plan.tree.input_ids.device)
        self.plan = plan
        return self

    def __repr__(self) -> str:
        return f"TreeAttentionMask(shape={list(self.shape)}, dtype={self.dtype}, attention={self.plan.kind!r})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _tree_sdpa(*args, **kwargs)
        if func in _PASSTHROUGH:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is Tensor.to and isinstance(args[0], TreeAttentionMask):
            me = args[0]
            with torch._C.DisableTorchFunctionSubclass():  # where .to would put it, without the N² entries
                probe = torch.empty(0, dtype=me.dtype, device=me.device).to(*args[1:], **kwargs)
            if probe.device == me.device:
                return me if probe.dtype == me.dtype else TreeAttentionMask(me.plan, probe.dtype)
        args, kwargs = tree_map_only(TreeAttentionMask, _dense_of, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # an op that reached the dispatcher without passing __torch_function__ (from C++): the dense mask too
        args, kwargs = tree_map_only(TreeAttentionMask, _dense_of, (args, kwargs or {}))
        return func(*args, **kwargs)


def _dense_of(mask: TreeAttentionMask) -> Tensor:
    return mask.plan.dense(mask.dtype)


def _tree_sdpa(query: Tensor, key: Tensor, value: Tensor, attn_mask: TreeAttentionMask | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> Tensor:
    if not isinstance(attn_mask, TreeAttentionMask):
        raise ArgumentError("attn_mask: a TreeAttentionMask goes in as scaled_dot_product_attention's attn_mask")
    if is_causal:
        raise ArgumentError("is_causal: expected False with a TreeAttentionMask (the mask is the causal structure)")
    plan = attn_mask.plan
    if key.shape[1] != query.shape[1]:  # grouped-query attention: each key/value head serves a group of heads
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    if dropout_p > 0 or plan.kind == "dense":
        return F.scaled_dot_product_attention(query, key, value, attn_mask=plan.dense(query.dtype),
                                              dropout_p=dropout_p, scale=scale)
    if plan.kind == "flex":
        return _compiled_flex()(query, key, value, block_mask=plan.block_mask(), scale=scale)
    return _SegmentAttention.apply(query, key, value, plan.pieces(), scale)


# ------------------------------------------------------------------------------------------------ CPU: segments
SOLO_PAIRS = 1 << 12
"""A piece with at least this many (query, key) pairs runs alone, on views of the packed rows (no copies); the
smaller ones are gathered into batches of similar shape."""


@dataclasses.dataclass
class _Solo:
    """One piece on views: queries ``qs..qe-1`` and keys ``ks..ke-1`` of row ``r``, causal for a triangle."""

    r: int
    qs: int
    qe: int
    ks: int
    ke: int
    causal: bool


@dataclasses.dataclass
class _Batch:
    """Small pieces of one padded shape, gathered: row ``i`` attends queries ``q[i]`` to keys ``k[i]`` (flat slots
    ``r·N + j``; padding points at slot 0 and is never written back), causally (triangles: ``q[i] == k[i]``, each
    piece padded at its end) or fully (rectangles; padded keys masked). ``q_pos``/``q_dst`` (and ``k_pos``/
    ``k_dst``): the positions of the real entries in the flattened ``[nb·L]`` batch and their slots.
    ``query_valid``: the real queries (``None``: all); the backward zeroes the output gradient of the padded ones,
    which would otherwise flow into the real keys they see."""

    q: Int[Tensor, "nb Lq"]
    k: Int[Tensor, "nb Lk"]
    causal: bool
    key_valid: Bool[Tensor, "nb Lk"] | None
    query_valid: Bool[Tensor, "nb Lq"] | None
    q_pos: Int[Tensor, " nq"]
    q_dst: Int[Tensor, " nq"]
    k_pos: Int[Tensor, " nk"]
    k_dst: Int[Tensor, " nk"]


@dataclasses.dataclass
class _Pieces:
    """The pieces of a tree: ``triangles`` cover every real node once (their outputs are written), then each
    stage of ``rectangles`` merges into them; within a stage no two pieces share a query."""

    triangles: list[_Solo | _Batch]
    rectangles: list[list[_Solo | _Batch]]
    real: list[int]  # real nodes of each row; the slots after them are padding, covered by no piece

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """An uninitialised ``[R, N, ...]`` buffer with its padding slots zeroed (the triangles write every other
        slot once, so nothing else needs clearing; padding must be finite: a 0 gradient times NaN is NaN)."""
        x = torch.empty(shape, dtype=dtype, device=device)
        for r, n in enumerate(self.real):
            x[r, n:] = 0
        return x


def _bucket(n: int) -> int:
    """The smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... that is >= n (pieces padded to it waste < 1.5x)."""
    p = 1
    while p < n:
        if p >= 2 and p * 3 // 2 >= n:
            return p * 3 // 2
        p *= 2
    return p


def _gathered(items: list[tuple[int, int, int, int]], causal: bool, device: torch.device) -> _Batch:
    """A batch from ``(q_start, q_len, k_start, k_len)`` flat ranges."""
    qs, ql, ks, kl = (torch.tensor(c) for c in zip(*items))
    lq, lk = int(ql.max()), int(kl.max())
    aq, ak = torch.arange(lq)[None, :], torch.arange(lk)[None, :]
    q_ok, k_ok = aq < ql[:, None], ak < kl[:, None]
    q = torch.where(q_ok, qs[:, None] + aq, 0)
    k = torch.where(k_ok, ks[:, None] + ak, 0)
    q_pos, k_pos = q_ok.reshape(-1).nonzero()[:, 0], k_ok.reshape(-1).nonzero()[:, 0]

    def dev(x: Tensor) -> Tensor:
        return x.to(device)

    return _Batch(dev(q), dev(k), causal, None if causal or bool(k_ok.all()) else dev(k_ok),
                  None if bool(q_ok.all()) else dev(q_ok), dev(q_pos), dev(q.reshape(-1)[q_pos]), dev(k_pos),
                  dev(k.reshape(-1)[k_pos]))


def _segment_pieces(tree: PrefixTree) -> _Pieces:
    """Every edge's triangle (its own nodes, causally) and rectangle (the nodes below it against all of its
    nodes): each (query, ancestor) pair lies in exactly one of them. Big pieces run alone; the others are batched
    by padded shape, rectangles also by nesting depth (nested ones share queries)."""
    n = tree.row_len
    end = tree.subtree_end.cpu().tolist()
    device = tree.input_ids.device
    triangles: list[_Solo | _Batch] = []
    small_tri: dict[int, list[tuple[int, int, int, int]]] = defaultdict(list)
    rects = []
    for r, a, b in tree.edges.tolist():
        if (b - a) ** 2 >= SOLO_PAIRS:
            triangles.append(_Solo(r, a, b, a, b, True))
        else:
            small_tri[_bucket(b - a)].append((r * n + a, b - a, r * n + a, b - a))
        e = end[r][b - 1]
        if e > b:
            rects.append((r, b, e, a, b))
    triangles += [_gathered(items, True, device) for items in small_tri.values()]
    # nesting depth of each rectangle's query range (a stack sweep over ranges sorted by start, longest first)
    rects.sort(key=lambda x: (x[0], x[1], -x[2]))
    stages: dict[int, tuple[list[_Solo], dict]] = defaultdict(lambda: ([], defaultdict(list)))
    stack: list[tuple[int, int]] = []
    for r, qs, qe, ks, ke in rects:
        while stack and (stack[-1][0] != r or stack[-1][1] <= qs):
            stack.pop()
        depth = len(stack)
        stack.append((r, qe))
        solo, small = stages[depth]
        if (qe - qs) * (ke - ks) >= SOLO_PAIRS:
            solo.append(_Solo(r, qs, qe, ks, ke, False))
        else:
            small[(_bucket(qe - qs), _bucket(ke - ks))].append((r * n + qs, qe - qs, r * n + ks, ke - ks))
    rectangles = [solo + [_gathered(items, False, device) for items in small.values()]
                  for _, (solo, small) in sorted(stages.items())]
    return _Pieces(triangles, rectangles, tree.row_tokens.tolist())


def _key_mask(valid: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return None if valid is None else torch.where(valid, 0.0, float("-inf")).to(dtype)[:, None, None, :]


def _flash(p: _Solo | _Batch, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``(o [.., L, H, D], lse [.., L, H])`` of one piece, token-major; ``q``/``k``/``v`` token-major ``[R, N, H,
    D]`` (``_Solo``) or flat ``[R·N, H, D]`` (``_Batch``)."""
    if isinstance(p, _Solo):
        args = (q[p.r, p.qs : p.qe, None], k[p.r, p.ks : p.ke, None], v[p.r, p.ks : p.ke, None])  # [L, 1, H, D]
        args = tuple(x.permute(1, 2, 0, 3) for x in args)  # [1, H, L, D], views
        mask = None
    else:
        args = tuple(x.index_select(0, i.reshape(-1)).view(*i.shape, *x.shape[1:]).transpose(1, 2)
                     for x, i in ((q, p.q), (k, p.k), (v, p.k)))
        mask = _key_mask(p.key_valid, q.dtype)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*args, 0.0, p.causal, attn_mask=mask,
                                                                        scale=scale)
    return o.transpose(1, 2), lse.transpose(1, 2)  # [nb, L, H, D], [nb, L, H]


class _SegmentAttention(torch.autograd.Function):
    """Tree attention from pieces with the CPU flash kernel. Forward: the triangles' ``(o, lse)`` written, each
    rectangle merged in, ``lse ← log(e^lse + e^lse_p)``, ``o ← o·e^(lse_old − lse) + o_p·e^(lse_p − lse)``.
    Backward: per piece the kernel's backward given the merged ``o`` and ``lse`` (the gradient of the whole
    attention restricted to the piece's keys), summed. Accumulates in fp32 for 16-bit inputs."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, pieces: _Pieces, scale: float) -> Tensor:
        r, h, n, d = q.shape
        acc = torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [R, N, H, D]; a view of HF's own layout
        # flat token-major copies, for the gathered pieces only (big pieces read views: a tree of long edges,
        # e.g. a group's prompt and responses, needs no copy)
        if any(isinstance(p, _Batch) for p in _all_pieces(pieces)):
            qf, kf, vf = (x.reshape(r * n, h, d) for x in (qt, kt, vt))
        out = pieces.empty((r, n, h, d), acc, q.device)
        lse = pieces.empty((r, n, h), acc, q.device)
        out_f, lse_f = out.view(r * n, h, d), lse.view(r * n, h)
        for p in pieces.triangles:
            o, m = _flash(p, qt, kt, vt, scale) if isinstance(p, _Solo) else _flash(p, qf, kf, vf, scale)
            if isinstance(p, _Solo):
                out[p.r, p.qs : p.qe] = o[0]
                lse[p.r, p.qs : p.qe] = m[0]
            else:
                out_f.index_copy_(0, p.q_dst, o.reshape(-1, h, d).index_select(0, p.q_pos).to(acc))
                lse_f.index_copy_(0, p.q_dst, m.reshape(-1, h).index_select(0, p.q_pos).to(acc))
        for stage in pieces.rectangles:
            for p in stage:
                if isinstance(p, _Solo):
                    o, m = _flash(p, qt, kt, vt, scale)
                    _merge(out[p.r, p.qs : p.qe], lse[p.r, p.qs : p.qe], o[0].to(acc), m[0].to(acc))
                else:
                    o, m = _flash(p, qf, kf, vf, scale)
                    cur_o, cur_l = out_f.index_select(0, p.q_dst), lse_f.index_select(0, p.q_dst)
                    _merge(cur_o, cur_l, o.reshape(-1, h, d).index_select(0, p.q_pos).to(acc),
                           m.reshape(-1, h).index_select(0, p.q_pos).to(acc))
                    out_f.index_copy_(0, p.q_dst, cur_o)
                    lse_f.index_copy_(0, p.q_dst, cur_l)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pieces, ctx.scale = pieces, scale
        return out.to(q.dtype).transpose(1, 2)

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        r, h, n, d = q.shape
        acc = out.dtype
        qt, kt, vt, gt = (x.transpose(1, 2) for x in (q, k, v, grad.to(q.dtype)))
        ot = out.to(q.dtype)
        if any(isinstance(p, _Batch) for p in _all_pieces(ctx.pieces)):  # the gathered pieces read flat copies
            flat = [x.reshape(r * n, *x.shape[2:]) for x in (gt, qt, kt, vt, ot, lse)]  # the kernel's order
        dq, dk, dv = (ctx.pieces.empty((r, n, h, d), acc, q.device) for _ in range(3))
        dq_f, dk_f, dv_f = (x.view(r * n, h, d) for x in (dq, dk, dv))
        n_tri = len(ctx.pieces.triangles)
        # triangles first, written (each slot is in exactly one, as a query and as a key); rectangles added
        for i, p in enumerate(_all_pieces(ctx.pieces)):
            if isinstance(p, _Solo):
                qs, ks = slice(p.qs, p.qe), slice(p.ks, p.ke)
                args = [x[p.r, sl, None].permute(1, 2, 0, 3)
                        for x, sl in ((gt, qs), (qt, qs), (kt, ks), (vt, ks), (ot, qs))]
                args.append(lse[p.r, qs, None].permute(1, 2, 0))
                mask = None
            else:
                args = [x.index_select(0, i.reshape(-1)).view(*i.shape, *x.shape[1:]).transpose(1, 2)
                        for x, i in zip(flat, (p.q, p.q, p.k, p.k, p.q, p.q))]
                if p.query_valid is not None:  # a padded query's gradient would reach the real keys it sees
                    args[0] = args[0] * p.query_valid[:, None, :, None].to(args[0].dtype)
                mask = _key_mask(p.key_valid, q.dtype)
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                *args, 0.0, p.causal, attn_mask=mask, scale=ctx.scale)
            gq, gk, gv = (x.transpose(1, 2) for x in (gq, gk, gv))  # token-major
            if i < n_tri and isinstance(p, _Solo):
                dq[p.r, p.qs : p.qe] = gq[0]
                dk[p.r, p.ks : p.ke] = gk[0]
                dv[p.r, p.ks : p.ke] = gv[0]
            elif i < n_tri:
                dq_f.index_copy_(0, p.q_dst, gq.reshape(-1, h, d).index_select(0, p.q_pos).to(acc))
                dk_f.index_copy_(0, p.k_dst, gk.reshape(-1, h, d).index_select(0, p.k_pos).to(acc))
                dv_f.index_copy_(0, p.k_dst, gv.reshape(-1, h, d).index_select(0, p.k_pos).to(acc))
            elif isinstance(p, _Solo):
                dq[p.r, p.qs : p.qe] += gq[0]
                dk[p.r, p.ks : p.ke] += gk[0]
                dv[p.r, p.ks : p.ke] += gv[0]
            else:
                dq_f.index_add_(0, p.q_dst, gq.reshape(-1, h, d).index_select(0, p.q_pos).to(acc))
                dk_f.index_add_(0, p.k_dst, gk.reshape(-1, h, d).index_select(0, p.k_pos).to(acc))
                dv_f.index_add_(0, p.k_dst, gv.reshape(-1, h, d).index_select(0, p.k_pos).to(acc))
        return (*(x.to(q.dtype).transpose(1, 2) for x in (dq, dk, dv)), None, None)


def _all_pieces(pieces: _Pieces) -> list[_Solo | _Batch]:
    """The triangles, then the rectangles stage by stage."""
    return [*pieces.triangles, *(p for stage in pieces.rectangles for p in stage)]


def _merge(o: Tensor, lse: Tensor, o_p: Tensor, lse_p: Tensor) -> None:
    """In place: ``(o, lse)`` ← the softmax over both key sets, from each one's output and log-sum-exp."""
    new = torch.logaddexp(lse, lse_p)
    o.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(o_p * torch.exp(lse_p - new).unsqueeze(-1))
    lse.copy_(new)


# ------------------------------------------------------------------------------------------------ CUDA: flex
_FLEX: Any = None


def _compiled_flex():
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention)
    return _FLEX


def _ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """``[R, 1, nq, nk]`` bool -> (count per query block, kv block indices with the true ones first), int32."""
    num = blocks.sum(-1, dtype=torch.int32)
    idx = torch.argsort(blocks.to(torch.int32), dim=-1, descending=True, stable=True).to(torch.int32)
    return num.contiguous(), idx.contiguous()


def _flex_block_mask(subtree_end: Int[Tensor, "R N"], block: int = FLEX_BLOCK):
    """FlexAttention ``BlockMask`` of the ancestor mask, built from the tree in ``O(R·(N/block)²)``.

    With ``N`` a multiple of ``block``: query block ``i`` and key block ``j < i`` are *full* when every key's
    subtree reaches past the query block (``min subtree_end >= q1``), *partial* when some key's subtree reaches
    into it (``max subtree_end > q0``), else skipped; a diagonal block is partial; ``j > i`` is skipped (a key
    after its query is never an ancestor). Partial blocks apply ``mask_mod``."""
    from torch.nn.attention.flex_attention import BlockMask

    r, n = subtree_end.shape
    if n % block:
        raise ArgumentError(f"subtree_end: expected N a multiple of {block} for FlexAttention, got N={n}")
    nb = n // block
    ends = subtree_end.view(r, nb, block)
    hi, lo = ends.amax(-1), ends.amin(-1)  # per key block
    ar = torch.arange(nb, device=subtree_end.device)
    q0, q1 = (ar * block)[None, :, None], (ar * block + block)[None, :, None]
    below = ar[:, None] > ar[None, :]  # [nq, nk]: key block before the query block
    full = below & (lo[:, None, :] >= q1)
    partial = (below & (hi[:, None, :] > q0) & ~full) | torch.eye(nb, dtype=torch.bool, device=ar.device)
    kv_num, kv_idx = _ordered(partial[:, None])
    full_num, full_idx = _ordered(full[:, None])

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < subtree_end[b, kv_idx])

    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(n, n))
