"""The forward passes of one :class:`~rlblocks.rollout.engines.TorchEngine` step (run in a worker thread):
prefill of newcomers grouped by length, one decode forward over the left-padded batch, or, in batch-invariant
mode, one one-token forward per sequence; then one token sampled per stepped sequence."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .torch_memory import KV, _Batch, _left_pad_stack, _make_cache
from .torch_sampling import sample_tokens

if TYPE_CHECKING:
    from .torch_engine import _Seq


class _Compute:
    """The step computation of :class:`~rlblocks.rollout.engines.TorchEngine` (a base class of it). It reads the
    engine's ``model``, ``batch_invariant``, ``_device``, ``_cache_arg``, ``_supports_logits_to_keep``,
    ``_routing``, ``_stats`` and ``_state``, and owns the decode batch ``_batch``."""

    _batch: _Batch | None

    def _in_batch(self, seq: _Seq) -> bool:
        return self._batch is not None and any(s is seq for s in self._batch.seqs)

    def _take_kv(self, seq: _Seq) -> tuple[KV | None, int]:
        """The KV of ``seq`` (its own, or its row of the decode batch) and how many tokens it covers."""
        if self._batch is not None:
            for b, s in enumerate(self._batch.seqs):
                if s is seq:
                    return self._batch.row_kv(b), self._batch.width - self._batch.pads[b]
        return seq.kv, seq.n_cached

    def _drop_rows(self, batch: _Batch) -> _Batch | None:
        return self._select_rows(batch, [s for s in batch.seqs if not s.done])

    def _forward(
        self, input_ids: Tensor, kv: KV | None, attention_mask: Tensor, position_ids: Tensor, seqs: list[_Seq],
        restart: bool = False,
    ):
        cache = _make_cache(kv)
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
                seq.routed.append(rows[b])
        self._stats.forwards += 1
        # A Cache is updated in place by the forward: read the keys and values from the object we passed rather
        # than from the output, whose field is also being renamed (``past_key_values`` -> ``cache``).
        new_kv = [(layer.keys, layer.values) for layer in cache.layers]
        return out.logits[:, -1, :].float(), new_kv

    def _compute(self, live: list[_Seq]) -> list[tuple[_Seq, int, float] | None]:
        try:
            with torch.inference_mode():
                return self._compute_invariant(live) if self.batch_invariant else self._compute_batched(live)
        finally:
            if self._state.closed:  # closed while this step ran: do not keep its decode batch alive
                self._batch = None

    def _prefill_group(self, group: list[_Seq], n_cached: int, m: int) -> tuple[Tensor, KV]:
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
        return self._forward(ids, kv, mask, pos, group, restart=n_cached == 0)

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

    def _compute_batched(self, live: list[_Seq]) -> list[tuple[_Seq, int, float] | None]:
        in_batch = set()
        if self._batch is not None:
            in_batch = {id(s) for s in self._batch.seqs}
        decode = [s for s in live if id(s) in in_batch]
        newcomers = [s for s in live if id(s) not in in_batch]
        seqs: list[_Seq] = []
        logits_parts: list[Tensor] = []
        # 1) decode the batch (rows that left are dropped; the remaining ones each feed their last token)
        if self._batch is not None:
            batch = self._batch
            if len(decode) != len(batch.seqs):  # rows of cancelled requests leave
                batch = self._select_rows(batch, decode)
            self._batch = batch
            if batch is not None:
                logits, kv = self._decode(batch)
                batch.keys = [k for k, _ in kv]
                batch.values = [v for _, v in kv]
                seqs.extend(batch.seqs)
                logits_parts.append(logits)
        # 2) prefill newcomers, grouped by (cached length, tokens to feed) so that no padding is needed
        groups: dict[tuple[int, int], list[_Seq]] = {}
        for s in newcomers:
            groups.setdefault((s.n_cached, len(s.tokens) - s.n_cached), []).append(s)
        joined: list[_Seq] = []
        for (n_cached, m), group in groups.items():
            logits, kv = self._prefill_group(group, n_cached, m)
            for b, s in enumerate(group):
                s.kv = [(k[b : b + 1], v[b : b + 1]) for k, v in kv]
                s.n_cached = n_cached + m
            seqs.extend(group)
            joined.extend(group)
            logits_parts.append(logits)
        # 3) the newcomers join the decode batch for the next step
        if joined:
            members = ([] if self._batch is None else list(self._batch.seqs)) + joined
            kvs = [self._batch.row_kv(b) for b in range(len(self._batch.seqs))] if self._batch is not None else []
            kvs += [s.kv for s in joined]
            keys, values, pads = _left_pad_stack(kvs)
            self._batch = _Batch(members, keys, values, pads)
            for s in joined:
                s.kv = None
        if not seqs:
            return []
        return sample_tokens(seqs, torch.cat(logits_parts))

    def _select_rows(self, batch: _Batch, keep_seqs: list[_Seq]) -> _Batch | None:
        pos = {id(s): b for b, s in enumerate(batch.seqs)}
        keep = [pos[id(s)] for s in keep_seqs]
        if not keep:
            return None
        idx = torch.tensor(keep, device=batch.keys[0].device)
        trim = min(batch.pads[b] for b in keep)
        return _Batch(
            [batch.seqs[b] for b in keep],
            [k.index_select(0, idx)[:, :, trim:] for k in batch.keys],
            [v.index_select(0, idx)[:, :, trim:] for v in batch.values],
            [batch.pads[b] - trim for b in keep],
        )

    def _decode(self, batch: _Batch) -> tuple[Tensor, KV]:
        dev = self._device
        width, n = batch.width, len(batch.seqs)
        ids = torch.tensor([[s.tokens[-1]] for s in batch.seqs], device=dev)
        mask = torch.ones((n, width + 1), dtype=torch.long, device=dev)
        for b, p in enumerate(batch.pads):
            if p:
                mask[b, :p] = 0
        pos = torch.tensor([[width - p] for p in batch.pads], device=dev)
        self._stats.decode_tokens += n
        return self._forward(ids, list(zip(batch.keys, batch.values)), mask, pos, batch.seqs)
