"""SGLangEngine: the rollout protocol over a running SGLang server's native HTTP API (standard library only).

Written against SGLang 0.5.23; every rule the client follows comes from that server's source. The server is
started by the user::

    python -m sglang.launch_server --model-path /ckpt --port 30000 \\
        --enable-memory-saver --enable-weights-cpu-backup --enable-deterministic-inference

``--enable-memory-saver``: ``sleep()``/``wake()`` release and restore GPU memory (else a logged no-op);
``--enable-weights-cpu-backup`` (optional): ``sleep(level=1)`` then offloads the weights too;
``--enable-deterministic-inference``: seeded requests (``sampling_seed`` is ignored otherwise).

HTTP calls are blocking ``urllib`` requests run in two private thread pools: one for ``/generate`` (up to
``max_concurrency`` requests in flight) and a small one for control calls, so ``pause``, ``abort`` and weight
updates never queue behind generations. What the client does so that the result is the protocol's:

- **Stops**: ``ignore_eos`` only without stop ids; a stop on a model EOS that is not a stop id is continued.
- **Logprobs**: with top-k / top-p, the sampling mask's renormalised logprobs (the processed ones).
- **Versions**: the server's per-token ``weight_versions`` spans.
- **Request ids**: a prefix-free wire id per HTTP request (the scheduler aborts by id prefix); requests made while
  this client keeps the server paused wait in the client, where an abort reaches them.
- **Sleep**: the scheduler is paused and this client's requests aborted before memory is released.

Each rule with the SGLang source it comes from: ``docs/rollout/sglang.md``. Weight updates (CUDA IPC, a checkpoint
on disk, NCCL) are in :mod:`rlblocks.rollout.engines.sglang_weights`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch

from rlblocks.errors import ArgumentError, EngineError, SGLangError

from ..types import Generation, GenerationRequest
from ._weights import WeightLayout
from .lifecycle import EngineBase, RequestState, hold, versions_from_spans, wait_returned
from .sglang_http import _as_int_version, _SGLangHTTP
from .sglang_weights import _SGLangWeights

__all__ = ["SGLangEngine", "SGLangEngineStats"]

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
_ALL_TAGS = ["kv_cache", "weights", "cuda_graph"]  # srt/constants.py GPU_MEMORY_ALL_TYPES


@dataclass
class SGLangEngineStats:
    """Counters since construction. ``prompt_tokens`` / ``cached_prompt_tokens``: as the server reports them per
    HTTP request (``prompt_tokens``, ``cached_tokens``); ``eos_continuations``: generations continued after the
    server stopped on a model EOS that is not a stop id; ``re_aborts``: aborts sent again because the request had
    not reached the server yet; ``sessions_recovered``: weight-update sessions left open and closed by this client."""

    requests: int = 0
    http_requests: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0
    eos_continuations: int = 0
    re_aborts: int = 0
    weight_updates: int = 0
    sessions_recovered: int = 0


@dataclass(eq=False)
class _InFlight(RequestState):
    wire_rid: str = ""
    sent: bool = False  # an HTTP call of it is in progress (else it waits in this client)


# How long pause / sleep / update wait for this client's aborted requests to come back. A request that reaches the
# server's tokenizer manager only after a pause (a race with the pause call) is not on the scheduler: its abort is
# lost there (the tokenizer manager forwards one abort per id) and it runs once the server continues.
_DRAIN_TIMEOUT = 30.0
# How long an abort is repeated for a request that had not reached the server yet.
_REABORT_FOR = 5.0


class SGLangEngine(_SGLangHTTP, _SGLangWeights, EngineBase):
    """Rollout-protocol client of one SGLang server (see the module docstring for every rule).

    Args:
        base_url: e.g. ``"http://127.0.0.1:30000"``.
        timeout: seconds per HTTP call (generation included).
        api_key: sent as ``Authorization: Bearer`` when the server was started with ``--api-key``.
        tp_size: tensor-parallel size of the server (one serialized payload per TP rank).
        tp_devices: for :meth:`update_weights`, the CUDA device whose copy of the tensors TP rank ``i`` opens
            (e.g. the GPU that rank runs on); default: the tensors as given, serialized once per rank.
        version: initial client-side version (call :meth:`refresh_version` to read the server's).
        expected_weights: ``{name: shape}`` of the served model; with it, updates get the full check (names,
            shapes, completeness). Without it only pairs, duplicates and finite values are checked here.
        allow_unprocessed_logprobs: with top-k / top-p, keep SGLang's unrenormalised logprobs instead of asking
            for the sampling mask.
        max_concurrency: threads of the ``/generate`` pool (concurrent requests).
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 3600.0,
        api_key: str | None = None,
        tp_size: int = 1,
        tp_devices: Sequence[torch.device | str | int] | None = None,
        version: int = 0,
        expected_weights: Mapping[str, Sequence[int]] | None = None,
        allow_unprocessed_logprobs: bool = False,
        max_concurrency: int = 256,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ArgumentError(f"base_url: expected 'http://host:port', got {base_url!r}")
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ArgumentError(f"tp_size: expected an int >= 1, got {tp_size!r}")
        if tp_devices is not None and len(tp_devices) != tp_size:
            raise ArgumentError(f"tp_devices: expected one device per TP rank ({tp_size}), got {len(tp_devices)}")
        if not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ArgumentError(f"max_concurrency: expected an int >= 1, got {max_concurrency!r}")
        super().__init__("SGLangEngine", version=version, stats=SGLangEngineStats(),
                         duplicate_note=" on this client (SGLang refuses duplicates)")
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self.api_key = api_key
        self.tp_size = tp_size
        self.tp_devices = None if tp_devices is None else [torch.device(d) for d in tp_devices]
        self.allow_unprocessed_logprobs = bool(allow_unprocessed_logprobs)
        self._initial_version = int(version)
        self._layout = None if expected_weights is None else WeightLayout.from_shapes(expected_weights)
        self._server_paused: str | None = None  # the pause mode this client set on the server, if any
        # Set while this client lets the server run. While it keeps the server paused, new requests wait here
        # rather than in the server: there an abort could not reach them (see _DRAIN_TIMEOUT).
        self._gate = asyncio.Event()
        self._gate.set()
        self._spans_seen = False  # the server reported weight_versions spans
        self._server_info: dict | None = None
        self._released_tags: list[str] | None = None
        self._control = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self._gen_pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="sglang-generate")
        self._ctl_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="sglang-control")

    # ------------------------------------------------------------------ http
    # ------------------------------------------------------------------ generation
    def build_generate_payload(self, request: GenerationRequest, *, rid: str | None = None) -> dict:
        """The JSON body of ``POST /generate`` for ``request`` (see the module docstring); ``rid``: the wire id."""
        sp = request.sampling
        params: dict[str, Any] = {
            "max_new_tokens": sp.max_new_tokens,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": sp.top_k if sp.top_k > 0 else -1,
            "stop_token_ids": list(sp.stop_token_ids),
            # ignore_eos also disables stop_token_ids on SGLang: only a request without stop ids may set it
            "ignore_eos": not sp.stop_token_ids,
            "no_stop_trim": True,
        }
        if sp.seed is not None:
            params["sampling_seed"] = sp.seed
        payload: dict[str, Any] = {
            "input_ids": list(request.prompt_ids),
            "rid": rid if rid is not None else request.request_id,
            "sampling_params": params,
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": False,
        }
        if self._wants_sampling_mask(request):
            payload["return_sampling_mask"] = True
        return payload

    def _wants_sampling_mask(self, request: GenerationRequest) -> bool:
        sp = request.sampling
        return not self.allow_unprocessed_logprobs and sp.temperature > 0 and (sp.top_k > 0 or sp.top_p < 1.0)

    def _span_versions(self, spans: Any, n: int, rid: str) -> list[int]:
        try:
            cuts = [
                (_as_int_version(s["version"], self._initial_version), int(s["start"]), int(s["end"])) for s in spans
            ]
        except (TypeError, KeyError, ValueError) as exc:
            raise SGLangError(f"/generate: malformed weight_versions {str(spans)[:300]} for {rid!r}") from exc
        return versions_from_spans(cuts, n, what=f"/generate: weight_versions of {rid!r}", error=SGLangError)

    def parse_generate_response(self, request: GenerationRequest, body: Any) -> Generation:
        """A :class:`Generation` from the JSON body of ``POST /generate`` (raises :class:`SGLangError` on an
        unexpected shape). A stop on an id that is not in ``stop_token_ids`` is returned as ``"stop"`` here;
        :meth:`generate` continues such a generation (module docstring)."""
        if isinstance(body, list) and len(body) == 1:
            body = body[0]
        if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
            raise SGLangError(f"/generate: expected a JSON object with 'meta_info', got {str(body)[:300]}", body=body)
        rid = request.request_id
        meta = body["meta_info"]
        fr = meta.get("finish_reason")
        kind = fr.get("type") if isinstance(fr, dict) else fr
        if kind not in _FINISH:
            raise SGLangError(f"/generate: unexpected finish_reason {fr!r} for request {rid!r}", body=body)
        entries = meta.get("output_token_logprobs") or []
        try:
            ids = [int(e[1]) for e in entries]
            lps = [float(e[0]) for e in entries]
        except (TypeError, ValueError, IndexError) as exc:
            raise SGLangError(f"/generate: malformed output_token_logprobs {str(entries)[:300]}", body=body) from exc
        out_ids = body.get("output_ids")
        if out_ids is not None and [int(t) for t in out_ids] != ids:
            raise SGLangError(
                f"/generate: output_ids {list(out_ids)[:10]} and output_token_logprobs ids {ids[:10]} disagree "
                f"for request {rid!r}",
                body=body,
            )
        if len(ids) > request.sampling.max_new_tokens:
            raise SGLangError(
                f"/generate: {len(ids)} tokens returned for max_new_tokens={request.sampling.max_new_tokens}", body=body
            )
        if self._wants_sampling_mask(request):
            sampled = meta.get("output_token_sampling_logprobs")
            if not isinstance(sampled, list) or len(sampled) != len(ids):
                raise SGLangError(
                    f"/generate: expected {len(ids)} output_token_sampling_logprobs (return_sampling_mask), got "
                    f"{str(sampled)[:200]} for request {rid!r}",
                    body=body,
                )
            lps = [float(x) for x in sampled]
        spans = meta.get("weight_versions")
        if spans:
            self._spans_seen = True
            versions = self._span_versions(spans, len(ids), rid)
        else:
            versions = [_as_int_version(meta.get("weight_version"), self._version)] * len(ids)
        lps32 = torch.tensor(lps, dtype=torch.float32).tolist()
        return Generation(rid, list(request.prompt_ids), ids, lps32, versions, _FINISH[kind])

    async def generate(self, request: GenerationRequest) -> Generation:
        """``POST /generate``; an aborted request returns its partial output with ``finish_reason="abort"``.
        Requests sent while the server is paused wait there. Raises :class:`~rlblocks.errors.ArgumentError` for a
        request id already in flight or a seeded request to a server without deterministic inference."""
        if not isinstance(request, GenerationRequest):
            raise ArgumentError(f"request: expected a GenerationRequest, got {type(request).__name__}")
        self._state.check_open()
        rid = request.request_id
        self._inflight.check_new(rid)
        if request.sampling.max_new_tokens == 0:
            return Generation(rid, list(request.prompt_ids), finish_reason="length")
        state = _InFlight(request)
        self._inflight[rid] = state
        try:
            if request.sampling.seed is not None and not await self._server_flag("enable_deterministic_inference"):
                raise ArgumentError(
                    "request.sampling.seed: the server ignores sampling_seed unless it runs with "
                    "--enable-deterministic-inference; drop the seed or restart the server with that flag"
                )
            return await self._generate(state)
        finally:
            self._inflight.pop(rid, None)
            state.done.set()

    async def _generate(self, state: _InFlight) -> Generation:
        request = state.request
        sp = request.sampling
        ids: list[int] = []
        lps: list[float] = []
        versions: list[int] = []
        reason = "length"
        while True:
            sub = dataclasses.replace(
                request,
                prompt_ids=list(request.prompt_ids) + ids,
                sampling=dataclasses.replace(sp, max_new_tokens=sp.max_new_tokens - len(ids)),
            )
            if await hold(self._gate, state, self._state):  # aborted while it waited here or between two calls
                reason = "abort"
                break
            state.wire_rid = f"{request.request_id}@{uuid.uuid4().hex}"
            state.sent = True
            try:
                _, body = await self._http(
                    "POST", "/generate", self.build_generate_payload(sub, rid=state.wire_rid), control=False
                )
            except asyncio.CancelledError:  # the caller went away: do not let the server generate for nobody
                if not self._state.closed:
                    self._spawn(self._send_abort(state, rid=state.wire_rid))
                raise
            finally:
                state.sent = False
            gen = self.parse_generate_response(sub, body)
            meta = body["meta_info"] if isinstance(body, dict) else body[0]["meta_info"]
            self._stats.http_requests += 1
            self._stats.prompt_tokens += int(meta.get("prompt_tokens") or 0)
            self._stats.cached_prompt_tokens += int(meta.get("cached_tokens") or 0)
            ids += gen.output_ids
            lps += gen.output_logprobs
            versions += gen.output_versions
            reason = gen.finish_reason
            eos = reason == "stop" and gen.output_ids and gen.output_ids[-1] not in sp.stop_token_ids
            if not eos:
                break
            # the server stopped on a model EOS the protocol does not stop on: continue, as ignore_eos would
            reason = "length"
            if len(ids) >= sp.max_new_tokens:
                break
            self._stats.eos_continuations += 1
        self._stats.requests += 1
        self._stats.output_tokens += len(ids)
        return Generation(request.request_id, list(request.prompt_ids), ids, lps, versions, reason)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def abort(self, request_ids: Iterable[str] | None = None) -> list[str]:
        """Abort this client's named in-flight requests (``None``: all of them) by their wire ids; a request held in
        this client returns at once. Returns the ids that were in flight here; other ids are ignored (documented
        no-op). An abort is repeated for a few seconds while its request has not returned (an abort that arrives
        before its request is dropped by the server)."""
        self._state.check_open()
        names = self._inflight.select(request_ids)
        await self._abort_states([self._inflight[r] for r in names])
        return names

    async def _abort_states(self, states: list[_InFlight]) -> None:
        for s in states:
            s.mark_aborted()
        await asyncio.gather(*[self._send_abort(s) for s in states if s.sent])
        for s in states:
            if s.sent:
                self._spawn(self._repeat_abort(s))

    async def _send_abort(self, state: _InFlight, rid: str | None = None) -> None:
        """Abort ``rid`` (default: the request's current HTTP call, if one is in progress) on the server."""
        if rid is None and state.sent:
            rid = state.wire_rid
        if rid:
            await self._http("POST", "/abort_request", {"rid": rid, "abort_all": False})

    async def _repeat_abort(self, state: _InFlight, interval: float = 0.2) -> None:
        deadline = asyncio.get_running_loop().time() + min(self.timeout, _REABORT_FOR)
        while not state.done.is_set() and asyncio.get_running_loop().time() < deadline and not self._state.closed:
            try:
                await asyncio.wait_for(state.done.wait(), interval)
                return
            except asyncio.TimeoutError:
                pass
            self._stats.re_aborts += 1
            try:
                await self._send_abort(state)
            except EngineError:
                return

    async def _wait_returned(self, states: list[_InFlight]) -> None:
        """Wait (at most ``_DRAIN_TIMEOUT``) for the ``generate`` calls of ``states`` that are on the server."""
        await wait_returned([s for s in states if s.sent], min(self.timeout, _DRAIN_TIMEOUT))

    async def _abort_all_of_client(self, states: list[_InFlight]) -> None:
        """Abort ``states`` and wait until their ``generate`` calls have returned."""
        await self._abort_states(states)
        await self._wait_returned(states)

    # ------------------------------------------------------------------ pause / resume
    async def _pause_server(self, mode: str) -> None:
        self._gate.clear()  # from here on, new requests wait in this client
        await self._http("POST", "/pause_generation", {"mode": mode})
        self._server_paused = mode

    async def _apply_run_state(self) -> None:
        """Continue the server when nothing keeps the engine paused any more (under ``_control``)."""
        if not self._state.paused and self._server_paused is not None:
            await self._http("POST", "/continue_generation", {})
            self._server_paused = None
        if not self._state.paused:
            self._gate.set()

    async def pause(self, mode: Literal["abort", "keep"] = "abort") -> None:
        """``POST /pause_generation``. ``abort`` -> SGLang ``abort`` (every request on the server returns its
        partial output; this call waits until this client's have); ``keep`` -> SGLang ``retract`` (requests wait
        in the server's queue; their KV may be dropped and recomputed on resume). New requests wait in this client
        until :meth:`resume` (in the server an abort could not reach them)."""
        self._state.check_pause(mode)
        async with self._control:
            self._state.user_paused = True
            if self._state.sleep_level:
                return  # asleep: the server is paused and this client has nothing in flight on it
            if mode == "abort":
                states = list(self._inflight.values())
                for st in states:
                    st.mark_aborted()  # those held in this client return at once
                await self._pause_server("abort")
                await self._wait_returned(states)
            else:
                await self._pause_server("retract")

    async def resume(self) -> None:
        """``POST /continue_generation``. Raises :class:`~rlblocks.errors.EngineError` while asleep, and after a
        level-2 sleep until a complete update has loaded weights."""
        self._state.check_resume()
        async with self._control:
            self._state.check_resume()
            self._state.user_paused = False
            await self._apply_run_state()

    # ------------------------------------------------------------------ weights
    # ------------------------------------------------------------------ memory
    async def sleep(self, level: int = 1) -> None:
        """Sleep as the protocol defines it (module docstring): pause the scheduler (``retract``), abort this
        client's requests (they return their partial outputs), then ``POST /release_memory_occupation``."""
        if not self._state.check_sleep(level):
            return
        async with self._control:
            if not self._state.check_sleep(level):
                return
            self._state.on_sleep(level)
            states = list(self._inflight.values())
            await self._pause_server("retract")  # the scheduler must be idle before a release
            await self._abort_all_of_client(states)
            if level == 1:
                tags = ["kv_cache", "cuda_graph"]
                if await self._server_flag("enable_weights_cpu_backup"):
                    tags.insert(1, "weights")  # backed up to CPU by the server and restored on resume
            else:
                tags = list(_ALL_TAGS)
            await self._http("POST", "/release_memory_occupation", {"tags": tags})
            self._released_tags = tags

    async def wake(self) -> None:
        """``POST /resume_memory_occupation`` with the tags the sleep released; generation continues per the
        protocol (after level 2: at the next complete update). A no-op when awake."""
        self._state.check_open()
        async with self._control:
            if not self._state.sleep_level:
                return
            await self._http("POST", "/resume_memory_occupation", {"tags": self._released_tags})
            self._released_tags = None
            self._state.on_wake()
            await self._apply_run_state()

    # ------------------------------------------------------------------ release
    def close(self) -> None:
        """Shut the HTTP pools down; every later call raises :class:`~rlblocks.errors.EngineError`. Idempotent.
        HTTP calls already running finish in their threads (their ``generate`` calls return normally);
        :meth:`aclose` aborts this client's requests first, so they return their partial outputs at once."""
        if self._state.closed:
            return
        self._state.closed = True
        for st in self._inflight.values():  # requests held in this client raise EngineError now
            st.aborted.set()
        self._gate.set()
        self._gen_pool.shutdown(wait=False, cancel_futures=True)
        self._ctl_pool.shutdown(wait=False, cancel_futures=True)

    async def aclose(self) -> None:
        """:meth:`close` from inside the event loop, after aborting this client's requests and waiting for them."""
        if self._state.closed:
            return
        states = list(self._inflight.values())
        if states:
            try:
                await self._abort_all_of_client(states)
            except EngineError:
                pass  # the server is gone: close anyway
        self.close()
