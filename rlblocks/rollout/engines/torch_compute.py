"""The forward passes of one :class:`~rlblocks.rollout.engines.TorchEngine` step (run in a worker thread): one
left-padded prefill forward for the newcomers (chunked by a token budget, not one forward per prompt length), one
decode forward over the preallocated decode batch (:class:`~rlblocks.rollout.engines.torch_memory._Batch`, written
in place), or, in batch-invariant mode, one one-token forward per sequence; then one token sampled per stepped
sequence."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .torch_memory import KV, _Batch, _make_cache
from .torch_sampling import sample_tokens

if TYPE_CHECKING:
    from .torch_memory import _Seq

# Most padded tokens (rows x longest prompt) one prefill forward takes: bounds its activations; newcomers beyond it
# (sorted by length, so that rows of similar length share a forward and padding stays small) go in further forwards.
PREFILL_TOKEN_BUDGET = 16384


class _Compute:
    """The step computation of :class:`~rlblocks.rollout.engines.TorchEngine` (a base class of it). It reads the
    engine's ``model``, ``batch_invariant``, ``max_model_len``, ``_device``, ``_cache_arg``,
    ``_supports_logits_to_keep``, ``_routing``, ``_stats`` and ``_state``, and owns the decode batch ``_batch``."""

    _batch: _Batch | None

    def _in_batch(self, seq: _Seq) -> bool:
        return self._batch is not None and seq in self._batch.row_of

    def _take_kv(self, seq: _Seq) -> tuple[KV | None, int]:
        """The KV of ``seq`` (its own, or views of its row of the decode batch) and how many tokens it covers."""
        if self._batch is not None:
            b = self._batch.row_of.get(seq)
            if b is not None:
                return self._batch.row_kv(b), self._batch.width - self._batch.pads[b]
        return seq.kv, seq.n_cached

    def _leave_batch(self, seqs: list[_Seq]) -> None:
        """Remove ``seqs``' rows from the decode batch: O(rows leaving), independent of the batch size."""
        if self._batch is not None and seqs:
            self._batch.remove(seqs)
            if self._batch.n == 0:
                self._batch = None

    def _forward(
        self, input_ids: Tensor, cache: Any, attention_mask: Tensor, position_ids: Tensor, seqs: list[_Seq],
        restart: bool = False, pads: list[int] | None = None,
    ) -> tuple[Tensor, Any]:
        """One model forward; the fp32 logits of each row's last position, and ``cache`` (updated in place).
        ``pads``: left padding per row, whose positions are not recorded by the routing recorder."""
        kwargs: dict[str, Any] = {self._cache_arg: cache, "use_cache": True}
        if self._supports_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        with self._routing if self._routing is not None else contextlib.nullcontext():
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        if self._routing is not None:  # row b of this forward: the routing of seqs[b]'s fed positions
            rows = self._routing.take().view(*input_ids.shape, self._routing.spec.num_layers, -1)
            for b, seq in enumerate(seqs):
                if restart:  # a prefill from position 0 (e.g. after a weight update) replaces the old rows
                    seq.routed = []
                seq.routed.append(rows[b, pads[b] :] if pads else rows[b])
        self._stats.forwards += 1
        return out.logits[:, -1, :].float(), cache

    @staticmethod
    def _cache_kv(cache: Any) -> KV:
        # A Cache is updated in place by the forward: read the keys and values from the object we passed rather
        # than from the output, whose field is also being renamed (``past_key_values`` -> ``cache``).
        return [(layer.keys, layer.values) for layer in cache.layers]

    def _compute(self, live: list[_Seq]) -> list[tuple[_Seq, int, float] | None]:
        try:
            with torch.inference_mode():
                return self._compute_invariant(live) if self.batch_invariant else self._compute_batched(live)
        finally:
            if self._state.closed:  # closed while this step ran: do not keep its decode batch alive
                self._batch = None

    def _prefill_group(self, group: list[_Seq], n_cached: int, m: int) -> tuple[Tensor, KV]:
        """Feed ``tokens[n_cached : n_cached + m]`` of every sequence of ``group`` over their own KV (no padding)."""
        dev = self._device
        ids = torch.tensor([s.tokens[n_cached : n_cached + m] for s in group], device=dev)
        pos = torch.arange(n_cached, n_cached + m, device=dev).unsqueeze(0).expand(len(group), m)
        mask = torch.ones((len(group), n_cached + m), dtype=torch.long, device=dev)
        kv = None
        if n_cached > 0:
            kv = [
                (torch.cat([s.kv[layer][0] for s in group]), torch.cat([s.kv[layer][1] for s in group]))
                for layer in range(len(group[0].kv))
            ]
        self._stats.prefill_tokens += len(group) * m
        logits, cache = self._forward(ids, _make_cache(kv), mask, pos, group, restart=n_cached == 0)
        return logits, self._cache_kv(cache)

    def _prefill_padded(self, group: list[_Seq]) -> tuple[Tensor, KV, list[int]]:
        """Prefill every token of every sequence of ``group`` in one forward, left-padded to the longest: the
        padding is masked out of attention and gets position 0; returns the logits, the KV ``[B, H, longest, D]``
        and the padding per row. Sequences with identical tokens (a GRPO group: K samples of one prompt) are
        forwarded once and their rows copied (``prefill_tokens_shared`` counts the tokens not recomputed); with a
        routing recorder every row is forwarded, since each request records its own routing."""
        keys = [tuple(s.tokens) for s in group]
        slot: dict[tuple[int, ...], int] = {}
        inverse = [slot.setdefault(k, len(slot)) for k in keys]
        if self._routing is not None or len(slot) == len(group):
            return self._prefill_rows(group)
        unique: list[_Seq] = []
        for s, i in zip(group, inverse):
            if i == len(unique):  # the first sequence with these tokens
                unique.append(s)
        logits, kv, pads = self._prefill_rows(unique)
        idx = torch.tensor(inverse, device=self._device)
        self._stats.prefill_tokens_shared += sum(map(len, keys)) - sum(len(s.tokens) for s in unique)
        kv = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in kv]
        return logits.index_select(0, idx), kv, [pads[i] for i in inverse]

    def _prefill_rows(self, group: list[_Seq]) -> tuple[Tensor, KV, list[int]]:
        """:meth:`_prefill_padded` of distinct sequences: one left-padded forward."""
        dev = self._device
        lens = [len(s.tokens) for s in group]
        m = max(lens)
        pads = [m - t for t in lens]
        ids = torch.tensor([[0] * p + s.tokens for s, p in zip(group, pads)], device=dev)
        pad_t = torch.tensor(pads, device=dev).unsqueeze(1)
        cols = torch.arange(m, device=dev).unsqueeze(0)
        mask = (cols >= pad_t).long()
        pos = (cols - pad_t).clamp_min(0)
        self._stats.prefill_tokens += sum(lens)
        logits, cache = self._forward(ids, _make_cache(None), mask, pos, group, restart=True, pads=pads)
        return logits, self._cache_kv(cache), pads

    def _compute_invariant(self, live: list[_Seq]) -> list[tuple[_Seq, int, float] | None]:
        """One forward per sequence, one token each: tokens[n_cached] is fed; sample if it was the last one."""
        self._batch = None
        sampled: list[tuple[_Seq, Tensor]] = []
        for seq in live:
            logits, kv = self._prefill_group([seq], seq.n_cached, 1)
            seq.kv, seq.n_cached = kv, seq.n_cached + 1
            if seq.n_cached == len(seq.tokens):
                sampled.append((seq, logits))
        out: list[tuple[_Seq, int, float] | None] = []
        if sampled:
            out.extend(sample_tokens([s for s, _ in sampled], torch.cat([lg for _, lg in sampled])))
        return out

    def _join(self, kv: KV, pads: list[int], seqs: list[_Seq]) -> None:
        if self._batch is None:
            self._batch = _Batch(kv, pads, seqs, self.max_model_len)
        else:
            self._batch.add(kv, pads, seqs)
        for s in seqs:
            s.kv = None

    def _compute_batched(self, live: list[_Seq]) -> list[tuple[_Seq, int, float] | None]:
        if self._batch is not None:  # rows of cancelled requests leave
            self._leave_batch([s for s in self._batch.seqs if s.done])
        newcomers = [s for s in live if not self._in_batch(s)]
        # 1) a resumed request whose KV covers all but its last token (the prefix cache) joins the decode batch
        #    now: its one token is fed by the decode step, the same computation as had it never been interrupted
        resumed = [s for s in newcomers if s.kv is not None and len(s.tokens) - s.n_cached == 1]
        for s in resumed:
            self._join(s.kv, [0], [s])
        seqs: list[_Seq] = []
        logits_parts: list[Tensor] = []
        # 2) decode the batch: every row feeds its last token; keys and values are written in place
        if self._batch is not None:
            logits = self._decode(self._batch, resumed=len(resumed))
            seqs.extend(self._batch.seqs)
            logits_parts.append(logits)
        # 3) prefill the other newcomers: prefix-cache hits with several tokens to feed over their own KV (grouped
        #    by cached length and tokens to feed), everything else from position 0, left-padded, in one forward per
        #    token budget
        joining: list[tuple[KV, list[int], list[_Seq]]] = []
        extend: dict[tuple[int, int], list[_Seq]] = {}
        fresh: list[_Seq] = []
        for s in newcomers:
            if self._in_batch(s):
                continue
            if s.kv is not None:
                extend.setdefault((s.n_cached, len(s.tokens) - s.n_cached), []).append(s)
            else:
                s.n_cached = 0
                fresh.append(s)
        for (n_cached, m), group in extend.items():
            logits, kv = self._prefill_group(group, n_cached, m)
            for s in group:
                s.n_cached = n_cached + m
            joining.append((kv, [0] * len(group), group))
            seqs.extend(group)
            logits_parts.append(logits)
        for group in self._prefill_chunks(fresh):
            logits, kv, pads = self._prefill_padded(group)
            for s in group:
                s.n_cached = len(s.tokens)
            joining.append((kv, pads, group))
            seqs.extend(group)
            logits_parts.append(logits)
        # 4) the prefilled newcomers join the decode batch for the next step
        for kv, pads, group in joining:
            self._join(kv, pads, group)
        if not seqs:
            return []
        return sample_tokens(seqs, logits_parts[0] if len(logits_parts) == 1 else torch.cat(logits_parts))

    @staticmethod
    def _prefill_chunks(fresh: list[_Seq]) -> list[list[_Seq]]:
        """``fresh`` sorted by length and cut so that each chunk's padded size stays within the token budget."""
        chunks: list[list[_Seq]] = []
        chunk: list[_Seq] = []
        for s in sorted(fresh, key=lambda s: len(s.tokens)):
            if chunk and (len(chunk) + 1) * len(s.tokens) > PREFILL_TOKEN_BUDGET:
                chunks.append(chunk)
                chunk = []
            chunk.append(s)
        if chunk:
            chunks.append(chunk)
        return chunks

    def _decode(self, batch: _Batch, resumed: int = 0) -> Tensor:
        """One token per row over the batch's cache (left padding masked, positions counted from each row's first
        real token); the cache grows by one column in place. ``resumed`` rows feed a resumed request's last prompt
        token: counted as prefill tokens, the others as decode tokens."""
        dev = self._device
        batch.trim()
        batch.reserve(1)
        width = batch.width
        ids = torch.tensor([[s.tokens[-1]] for s in batch.seqs], device=dev)
        pads = torch.tensor(batch.pads, device=dev).unsqueeze(1)
        mask = (torch.arange(width + 1, device=dev).unsqueeze(0) >= pads).long()
        pos = width - pads
        self._stats.decode_tokens += batch.n - resumed
        self._stats.prefill_tokens += resumed
        logits, _ = self._forward(ids, batch.cache(), mask, pos, batch.seqs)
        batch.end += 1
        return logits
