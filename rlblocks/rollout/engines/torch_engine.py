"""TorchEngine: an in-process reference rollout engine over any Hugging Face causal LM (CPU or GPU).

It implements the whole :class:`~rlblocks.rollout.types.RolloutEngine` protocol with plain PyTorch:

- **Continuous batching.** A background asyncio task runs the engine loop; every *step* gives each running sequence
  one new token: new requests are prefilled together in one left-padded forward, the others decoded together over a
  left-padded KV cache preallocated per batch row, grown by doubling and written in place
  (:mod:`~rlblocks.rollout.engines.torch_memory`); a finished or aborted request leaves it in O(1). The forward runs
  in a worker thread so the event loop stays responsive (or on the loop's thread, ``inline_steps=True``); abort,
  pause and weight updates happen under one lock, i.e. *between* steps.
- **Processed logprobs and seeds** (:mod:`~rlblocks.rollout.engines.torch_sampling`): logprobs of the distribution
  sampled from (temperature, top-k, top-p), in fp32; a counter-based draw per (seed, position), so a seeded request
  interrupted and re-submitted draws the same numbers.
- **Versions.** Each token is tagged with the weight version of the step that produced it.
- **Exact interrupt + resume.** The KV of an aborted request is kept (a prefix cache keyed by its tokens and the
  weight version), so a resume continues from the exact KV state; ``batch_invariant=True`` makes greedy interrupt +
  resume bit-identical under any concurrency (one forward per sequence and token).
- **Updates, sleep, close.** An update is checked whole with the rule every engine shares before anything is
  copied (block-FP8 updates are dequantised first); a level-2 sleep re-allocates each parameter with the layout it
  had (alignment included, so BLAS takes the same code path); ``close()`` returns every partial output.

Why each mechanism is exact, with the measurements behind it: ``docs/rollout/engines.md`` (``TorchEngine``).
An engine is bound to one event loop at a time; using it from a new loop abandons the requests of the previous one.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import random
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from rlblocks.errors import ArgumentError, EngineError

from ..moe_replay import RoutingRecorder
from ..types import Generation, GenerationRequest
from ._weights import WeightLayout, check_update_version, dequantize_fp8
from .lifecycle import EngineBase
from .torch_compute import _Compute
from .torch_memory import KV, PrefixCache, _Placement, _Seq

__all__ = ["EngineStats", "TorchEngine"]


@dataclass
class EngineStats:
    """Counters since construction: prompt tokens computed by prefill forwards, prompt tokens served by an
    identical prompt prefilled in the same forward (``prefill_tokens_shared``: the K samples of one prompt), tokens
    decoded, forwards, prefix-cache hits."""

    prefill_tokens: int = 0
    prefill_tokens_shared: int = 0
    decode_tokens: int = 0
    forwards: int = 0
    steps: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_reused_tokens: int = 0


def tune_owned_model(model: torch.nn.Module) -> None:
    """What an engine changes on a model it owns (loaded for it, not shared with a trainer): grouped-query SDPA
    (``torch_attention.py``) and, on a CPU, the LM head in vocabulary slices (``torch_head.py``). The same logits;
    parameters and state dict untouched."""
    from .torch_attention import use_gqa_sdpa
    from .torch_head import use_sliced_head

    use_gqa_sdpa(model)
    use_sliced_head(model)


class TorchEngine(_Compute, EngineBase):
    """In-process rollout engine over a Hugging Face causal LM (see the module docstring for the semantics).

    Args:
        model: an HF ``*ForCausalLM`` module with a standard (``DynamicCache``) KV cache. Put it on its device and
            dtype first; the engine calls ``eval()`` and never tracks gradients.
        batch_invariant: one forward per sequence and per token (exact under any concurrency, slow).
        prefix_cache_size: number of aborted requests whose KV is kept for resumption (LRU); 0 disables it.
        max_batch_size: most sequences stepped together; more requests wait for a free slot.
        max_model_len: longest prompt + output (default ``config.max_position_embeddings``); a generation reaching
            it ends with ``"length"``.
        version: initial weight version.
        record_routing: MoE models: record the experts each fed position was routed to
            (``Generation.routed_experts``, see :mod:`rlblocks.rollout.moe_replay`); kept with the prefix cache;
            a re-prefill from position 0 (after a weight update) records every position again.
        inline_steps: run each step's forward on the event loop's own thread, blocking the loop for the step,
            instead of on the engine's worker thread. For a CPU process whose other torch work (a trainer) runs on
            the loop's thread: each thread that runs torch ops gets its own OpenMP team, and with more OpenMP
            threads than cores libgomp shortens its spin-waits, so every parallel region of both waits on a
            futex wake-up (SmolLM2-135M, batch 64, 2 cores: a decode step 182 -> 240 ms once another thread of
            the process had run a forward). Abort, pause and updates wait for the step either way.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        batch_invariant: bool = False,
        prefix_cache_size: int = 64,
        max_batch_size: int = 256,
        max_model_len: int | None = None,
        version: int = 0,
        record_routing: bool = False,
        inline_steps: bool = False,
    ) -> None:
        if max_batch_size < 1:
            raise ArgumentError(f"max_batch_size: expected >= 1, got {max_batch_size}")
        if prefix_cache_size < 0:
            raise ArgumentError(f"prefix_cache_size: expected >= 0, got {prefix_cache_size}")
        super().__init__("TorchEngine", version=version, stats=EngineStats())
        self.model = model.eval()
        cfg = getattr(model, "config", None)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        if max_model_len is None:
            max_model_len = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
        self.max_model_len = int(max_model_len)
        self.batch_invariant = bool(batch_invariant)
        self.prefix_cache_size = int(prefix_cache_size)
        self.max_batch_size = int(max_batch_size)
        self.inline_steps = bool(inline_steps)
        params = inspect.signature(model.forward).parameters
        self._supports_logits_to_keep = "logits_to_keep" in params
        # transformers >= 5.24 names the KV-cache argument ``cache`` (``past_key_values=`` warns there and is
        # removed in 5.40); earlier releases only know ``past_key_values``. Pass whichever the model's forward takes.
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._device = next(model.parameters()).device
        self._layout = WeightLayout.from_module(model)
        self._discarded: list[tuple[torch.nn.Parameter, _Placement]] = []  # level-2 sleep
        self._routing = RoutingRecorder(model) if record_routing else None
        self._batch: _Batch | None = None  # the decode batch (batched mode)
        self._prefix = PrefixCache(self.prefix_cache_size)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        # every step's forward runs on this one thread: one allocator heap (glibc arena) holds its activations and
        # KV growth, reused from step to step; steps hopping between the event loop's shared pool threads would
        # each fault fresh pages in (the pool grows when other code uses it, e.g. inside a server)
        self._executor: ThreadPoolExecutor | None = None
        self._lock: asyncio.Lock | None = None
        self._wake: asyncio.Event | None = None

    @classmethod
    def from_pretrained(
        cls, path: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device | None = None, **options: Any
    ) -> TorchEngine:
        """Load ``AutoModelForCausalLM`` from a checkpoint directory (``dtype``, ``device``: default CUDA if
        available, else CPU) and wrap it; ``options`` go to :class:`TorchEngine`. A model on HF's ``sdpa``
        attention is switched to its grouped-query form (``torch_attention.py``: the KV heads are not repeated per
        step), which the engine owns here; on a CPU its LM head is computed in vocabulary slices (``torch_head.py``:
        the same logits, faster at a real vocabulary)."""
        from transformers import AutoModelForCausalLM

        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        tune_owned_model(model)
        return cls(model, **options)

    # ------------------------------------------------------------------ protocol
    def num_output_tokens(self, request_id: str) -> int | None:
        """Tokens generated so far by an in-flight request, or ``None`` if it is not in flight."""
        seq = self._inflight.get(request_id)
        return None if seq is None else len(seq.output_ids)

    async def generate(self, request: GenerationRequest) -> Generation:
        """Complete ``request``; returns its partial output with ``finish_reason="abort"`` if aborted. Requests
        submitted while paused (or asleep) wait for generation to resume. Raises
        :class:`~rlblocks.errors.ArgumentError` for a request id already in flight, token ids outside the vocabulary
        or a prompt of ``max_model_len`` tokens or more, and :class:`~rlblocks.errors.EngineError` once closed."""
        self._state.check_open()
        self._bind_loop()
        if not isinstance(request, GenerationRequest):
            raise ArgumentError(f"request: expected a GenerationRequest, got {type(request).__name__}")
        rid = request.request_id
        self._inflight.check_new(rid)
        bad = [t for t in request.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ArgumentError(f"prompt_ids: expected token ids in [0, {self.vocab_size}), got {bad[:5]}")
        if request.sampling.max_new_tokens == 0:
            return Generation(rid, list(request.prompt_ids), finish_reason="length")
        if len(request.prompt_ids) >= self.max_model_len:
            raise ArgumentError(
                f"prompt_ids: expected fewer than max_model_len={self.max_model_len} tokens, "
                f"got {len(request.prompt_ids)}"
            )
        seed = request.sampling.seed if request.sampling.seed is not None else random.getrandbits(62)
        seq = _Seq(request, self._loop.create_future(), int(seed), list(request.prompt_ids))
        self._inflight[rid] = seq
        self._wake.set()
        try:
            return await asyncio.shield(seq.future)
        except asyncio.CancelledError:
            if not seq.done:  # the caller went away: drop the request (its rows leave the batch next step)
                seq.done = True
                self._inflight.pop(rid, None)
            raise

    async def abort(self, request_ids: Iterable[str] | None = None) -> list[str]:
        """Abort in-flight requests (``None``: all) between steps; each returns its partial output with
        ``finish_reason="abort"``. Ids not in flight are ignored (documented no-op) and absent from the result."""
        self._state.check_open()
        self._bind_loop()
        async with self._lock:
            return self._abort_locked(request_ids)

    async def pause(self, mode: Literal["abort", "keep"] = "abort") -> None:
        """Stop stepping at the end of the current step. ``abort``: every request submitted before this call
        returns its partial output (``"abort"``); ``keep``: they are frozen (KV kept) and continue after
        :meth:`resume`. Requests submitted after this call wait for :meth:`resume`."""
        self._state.check_pause(mode)
        self._bind_loop()
        self._state.user_paused = True
        before = list(self._inflight)
        async with self._lock:
            if mode == "abort":
                self._abort_locked(before)

    async def resume(self) -> None:
        """Continue stepping (frozen and waiting requests proceed). Raises
        :class:`~rlblocks.errors.EngineError` while asleep or while a level-2 sleep's weights are missing."""
        self._state.check_resume()
        self._bind_loop()
        self._state.user_paused = False
        self._wake.set()

    async def update_weights(
        self,
        named_tensors: Iterable[tuple[str, Tensor]],
        *,
        version: int,
        partial: bool = False,
        allow_rollback: bool = False,
    ) -> None:
        """Load ``named_tensors`` (``state_dict()`` names) between steps and set ``version`` afterwards.

        The whole update is checked first (:mod:`rlblocks.rollout.engines._weights`; a refusal raises
        :class:`~rlblocks.errors.WeightUpdateError` with weights, caches and version unchanged). Pauses itself
        (keep) if not paused and resumes afterwards. After a level-2 sleep, a complete update is what lets the
        engine generate again. Weights may come in the block-FP8 wire format (``rlblocks.sync.quantize_named``):
        they are dequantised into the engine's dtypes first (``_weights.dequantize_fp8``)."""
        self._state.check_open()
        self._bind_loop()
        version = check_update_version("TorchEngine", version, self._version, allow_rollback=allow_rollback)
        self._state.check_update(partial)
        items = self._layout.validate(dequantize_fp8(list(named_tensors), self._layout, engine="TorchEngine"),
                                     engine="TorchEngine", partial=partial)
        # every tensor an update may write, by state_dict() name (buffers included)
        targets = {**self.model.state_dict(keep_vars=True), **dict(self.model.named_buffers())}
        self._state.updating += 1
        try:
            async with self._lock:
                # another update may have committed while this one waited for the step to end
                version = check_update_version("TorchEngine", version, self._version, allow_rollback=allow_rollback)
                self._state.check_update(partial)
                with torch.no_grad():
                    for name, t in items:
                        targets[name].copy_(t.to(targets[name].device))
                self._invalidate_kv()
                self._version = version
                if not partial:
                    self._state.on_complete_update()
        finally:
            self._state.updating -= 1
            self._wake.set()

    async def sleep(self, level: int = 1) -> None:
        """Sleep as the protocol defines it: every request in flight returns its partial output
        (``finish_reason="abort"``), every KV cache is dropped, new requests wait. Level 1 keeps the weights (moved
        to CPU on CUDA; :meth:`wake` moves them back). Level 2 frees the parameters' storage: after :meth:`wake`,
        a complete :meth:`update_weights` must load weights before the engine generates again. Sleeping again at
        the same level is a no-op."""
        if not self._state.check_sleep(level):
            return
        self._bind_loop()
        self._state.on_sleep(level)  # paused from here on: no new step starts
        async with self._lock:
            self._abort_locked(None, keep_kv=False)
            self._invalidate_kv()
            on_device = self._device.type != "cpu"
            if level == 1 and on_device:
                self.model.to("cpu")
            if level == 2:
                self._discarded = [(p, _Placement.of(p)) for p in self.model.parameters()]
                for p, placement in self._discarded:
                    p.data = torch.empty(0, dtype=placement.dtype, device=p.device)
            if on_device and torch.cuda.is_available():
                torch.cuda.empty_cache()

    async def wake(self) -> None:
        """Undo :meth:`sleep`: level 1 brings the weights back and generation resumes (unless :meth:`pause` was
        called before the sleep); level 2 re-allocates the parameters (NaN-filled, each with the shape, strides,
        dtype and 64-byte address alignment it had before the sleep, so that kernels take the same code path) and
        generation resumes after the next complete :meth:`update_weights`. A no-op when awake."""
        self._state.check_open()
        self._bind_loop()
        async with self._lock:
            if not self._state.sleep_level:
                return
            if self._state.sleep_level == 1 and self._device.type != "cpu":
                self.model.to(self._device)
            if self._state.sleep_level == 2:
                for p, placement in self._discarded:  # the layout of before the sleep: the same kernel paths
                    p.data = placement.nan_tensor(self._device)
                self._discarded = []
                self.model.to(self._device)  # buffers too, had they moved
            self._state.on_wake()
        self._wake.set()

    def close(self) -> None:
        """Release the engine: every request in flight returns its partial output (``finish_reason="abort"``),
        the KV caches are freed, the engine loop stops, and every later call raises
        :class:`~rlblocks.errors.EngineError`. Idempotent; callable from any thread or after the event loop ended."""
        if self._state.closed:
            return
        self._state.closed = True
        loop = self._loop
        if loop is None or loop.is_closed():
            self._close_now(resolve=False)  # no one can await these futures any more
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not loop and loop.is_running():
            loop.call_soon_threadsafe(self._close_now)
        else:
            self._close_now()

    async def aclose(self) -> None:
        """:meth:`close` from inside the engine's event loop, waiting for the current step to end first."""
        if self._state.closed:
            return
        if self._lock is not None and self._loop is asyncio.get_running_loop():
            async with self._lock:
                self.close()
        else:
            self.close()
        task = self._task
        if task is not None and not task.done() and task.get_loop() is asyncio.get_running_loop():
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _close_now(self, resolve: bool = True) -> None:
        for seq in list(self._inflight.values()):
            if resolve:
                self._finish(seq, "abort")
            else:
                seq.done = True
        self._inflight.clear()
        self._batch = None
        self._prefix.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._executor is not None:  # a step still running finishes on it; its result is dropped
            self._executor.shutdown(wait=False)
            self._executor = None

    # ------------------------------------------------------------------ loop
    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop = loop
            self._lock = asyncio.Lock()
            self._wake = asyncio.Event()
            self._inflight.clear()
            self._batch = None
            self._task = None
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run())

    def _has_work(self) -> bool:
        return not self._state.paused and bool(self._inflight)

    async def _run(self) -> None:
        while True:
            if not self._has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self._lock:
                if not self._has_work():
                    continue
                try:
                    plan = self._plan()
                    if self.inline_steps:
                        result = self._compute(plan)
                    else:
                        if self._executor is None:
                            self._executor = ThreadPoolExecutor(1, thread_name_prefix="torch-engine")
                        result = await asyncio.get_running_loop().run_in_executor(self._executor, self._compute,
                                                                                  plan)
                    self._apply(result)
                except Exception as exc:  # fail every waiting caller rather than hang; the loop lives on
                    err = EngineError(
                        f"TorchEngine: a forward step failed ({type(exc).__name__}: {exc}); the "
                        f"{len(self._inflight)} request(s) in flight failed with it and the engine goes on"
                    )
                    err.__cause__ = exc
                    for seq in list(self._inflight.values()):
                        seq.done = True
                        if not seq.future.done():
                            seq.future.set_exception(err)
                    self._inflight.clear()
                    self._batch = None
            await asyncio.sleep(0)  # let pause/abort/update take the lock between steps

    # ------------------------------------------------------------------ scheduling (event loop, under lock)
    def _plan(self) -> list[_Seq]:
        """The sequences stepped this step (at most ``max_batch_size``, oldest first); prefix-cache lookup for
        newcomers."""
        live = [s for s in self._inflight.values() if not s.done][: self.max_batch_size]
        for seq in live:
            if seq.kv is None and seq.n_cached == 0 and not self._in_batch(seq):
                self._lookup_prefix(seq)
        return live


    def _lookup_prefix(self, seq: _Seq) -> None:
        hit = self._prefix.take(seq.tokens, self._version)
        if hit is not None:
            seq.n_cached, seq.kv, routed = hit
            seq.routed = [] if routed is None else [routed]
            self._stats.prefix_cache_hits += 1
            self._stats.prefix_cache_reused_tokens += seq.n_cached

    def _store_prefix(self, seq: _Seq, kv: KV | None, n_cached: int) -> None:
        if self.prefix_cache_size == 0 or kv is None or n_cached == 0:
            return
        routed = torch.cat(seq.routed)[:n_cached] if self._routing is not None and seq.routed else None
        self._prefix.put(seq.tokens[:n_cached], kv, self._version, routed)

    def _abort_locked(self, wanted: Iterable[str] | str | None, *, keep_kv: bool = True) -> list[str]:
        """Abort ``wanted`` (``None``: all); with ``keep_kv`` their KV goes to the prefix cache for the resume."""
        ids = self._inflight.select(wanted)
        seqs = [self._inflight.pop(rid) for rid in ids]
        if keep_kv:
            for seq in seqs:
                kv, n = self._take_kv(seq)
                self._store_prefix(seq, kv, n)
        self._leave_batch(seqs)  # their rows only: no scan of the batch; the last rows move into the holes
        for seq in seqs:
            self._finish(seq, "abort")
        return ids

    def _invalidate_kv(self) -> None:
        """Forget every KV computed under the current weights: prefix cache, decode batch, frozen requests."""
        self._prefix.clear()
        self._batch = None
        for seq in self._inflight.values():
            seq.kv, seq.n_cached = None, 0

    def _finish(self, seq: _Seq, reason: str) -> None:
        seq.done = True
        seq.kv = None
        if not seq.future.done():
            seq.future.set_result(
                Generation(
                    seq.rid,
                    list(seq.request.prompt_ids),
                    seq.output_ids,
                    seq.output_logprobs,
                    seq.output_versions,
                    finish_reason=reason,
                    routed_experts=None if self._routing is None else self._routing_record(seq),
                )
            )

    def _routing_record(self, seq: _Seq) -> Tensor:
        spec = self._routing.spec
        return torch.cat(seq.routed) if seq.routed else torch.empty((0, spec.num_layers, spec.top_k), dtype=spec.dtype)


    # ------------------------------------------------------------------ results (event loop, under lock)
    def _apply(self, result: list[tuple[_Seq, int, float] | None]) -> None:
        self._stats.steps += 1
        finished: list[_Seq] = []
        for item in result:
            if item is None:
                continue
            seq, token, lp = item
            if seq.done:
                finished.append(seq)
                continue
            seq.tokens.append(token)
            seq.output_ids.append(token)
            seq.output_logprobs.append(lp)
            seq.output_versions.append(self._version)
            sp = seq.request.sampling
            reason = None
            if token in sp.stop_token_ids:
                reason = "stop"
            elif len(seq.output_ids) >= sp.max_new_tokens or len(seq.tokens) >= self.max_model_len:
                reason = "length"
            if reason is not None:
                self._inflight.pop(seq.rid, None)
                self._finish(seq, reason)
                finished.append(seq)
        self._leave_batch(finished)
