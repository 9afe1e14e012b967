"""SGLangEngine: the rollout protocol over a running SGLang server's native HTTP API (standard library only).

The server is started by the user (``python -m sglang.launch_server --model-path ... --port 30000``); this client
speaks its RL endpoints. HTTP calls are blocking ``urllib`` requests run in a private thread pool, so many
``generate`` calls can be in flight from one event loop.

Endpoints and fields used
-------------------------
- ``POST /generate`` ``{"input_ids", "rid", "sampling_params": {"max_new_tokens", "temperature", "top_p",
  "top_k", "stop_token_ids", "sampling_seed", "ignore_eos": true, "no_stop_trim": true}, "return_logprob": true,
  "logprob_start_len": -1, "stream": false}`` -> ``{"output_ids", "meta_info": {"finish_reason": {"type":
  "stop"|"length"|"abort", ...}, "output_token_logprobs": [[logprob, token_id, text], ...], "weight_version"}}``.
  Tokens are taken from ``output_token_logprobs`` (and checked against ``output_ids`` when present). Only
  ``stop_token_ids`` stop a generation (``ignore_eos``), as in TorchEngine; pass the EOS id there.
- ``POST /pause_generation {"mode": "abort"|"retract"}``, ``POST /continue_generation``,
  ``POST /abort_request {"rid", "abort_all"}``, ``POST /flush_cache``.
- ``POST /update_weights_from_tensor {"serialized_named_tensors": [payload] * tp_size, "load_format": null,
  "flush_cache": true, "weight_version"}`` where ``payload`` is the base64 of a ``ForkingPickler`` dump of the
  ``[(name, tensor), ...]`` list (SGLang's ``MultiprocessingSerializer`` format). Tensors travel as CUDA-IPC or
  shared-memory handles: **same host only**, and this process must stay alive until the call returns.
- ``POST /init_weights_update_group`` + ``POST /update_weights_from_distributed {"names", "dtypes", "shapes",
  "group_name", "flush_cache", "weight_version"}`` (NCCL broadcast from a trainer in another job: run the
  trainer's broadcast concurrently with :meth:`SGLangEngine.update_weights_from_distributed`).
- ``POST /update_weights_from_disk {"model_path", "load_format", "weight_version"}``.
- ``GET /get_weight_version`` (falls back to ``GET /model_info`` on servers where it is gone), returning
  ``{"weight_version": ...}``. ``POST /release_memory_occupation`` / ``/resume_memory_occupation`` for sleep/wake.

Semantics and caveats
---------------------
- **Logprobs.** SGLang reports ``log_softmax(logits / T)`` of the sampled token: temperature is applied, top-k and
  top-p renormalisation is not (and with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` not even temperature). Those are
  the processed logprobs of the protocol only when top-k and top-p are off, so by default a request with top-k or
  top-p raises ``ValueError``; ``allow_unprocessed_logprobs=True`` accepts it knowingly.
- **Versions.** SGLang returns one ``weight_version`` per response, so every token of a response carries it (an
  int when the server's version string is one, else the client's version). To keep that exact, updates go
  through ``pause("abort")`` semantics: ``update_weights*`` first aborts every in-flight request of this client
  (they return partial outputs, which :func:`~rlblocks.rollout.resume.resumable_generate` re-submits), also
  when the engine was paused with ``"keep"`` (SGLang's ``retract`` mode).
- ``abort(ids)`` only knows the requests sent by this client; other ids are a documented no-op (absent from the
  returned list). ``abort(None)`` aborts everything on the server (``abort_all``).
- ``version`` is the client-side view: set by ``update_weights*`` after the server confirmed the load, or by
  :meth:`SGLangEngine.refresh_version`.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import urllib.error
import urllib.request
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import torch
from torch import Tensor

from rlblocks.errors import ArgumentError, EngineError

from .types import Generation, GenerationRequest

__all__ = ["SGLangEngine", "SGLangError", "serialize_named_tensors"]

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class SGLangError(EngineError):
    """The server answered with an HTTP error or an unexpected body."""


def serialize_named_tensors(named_tensors: list[tuple[str, Tensor]]) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)`` format: base64 of a
    ``ForkingPickler`` dump (tensors become CUDA-IPC / shared-memory handles, valid on this host only)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers the tensor reductions on ForkingPickler)

    buf = io.BytesIO()
    ForkingPickler(buf).dump(named_tensors)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _as_int_version(value: Any, default: int) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return default


class SGLangEngine:
    """Rollout-protocol client of one SGLang server.

    Args:
        base_url: e.g. ``"http://127.0.0.1:30000"``.
        timeout: seconds per HTTP call (generation included).
        api_key: sent as ``Authorization: Bearer`` when the server was started with ``--api-key``.
        tp_size: tensor-parallel size of the server (one serialized payload per TP rank).
        version: initial client-side version (call :meth:`refresh_version` to read the server's).
        allow_unprocessed_logprobs: accept top-k / top-p requests although SGLang's logprobs ignore them.
        max_concurrency: threads of the private HTTP pool (concurrent requests).
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 3600.0,
        api_key: str | None = None,
        tp_size: int = 1,
        version: int = 0,
        allow_unprocessed_logprobs: bool = False,
        max_concurrency: int = 256,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ArgumentError(f"base_url: expected 'http://host:port', got {base_url!r}")
        if tp_size < 1:
            raise ArgumentError(f"tp_size: expected >= 1, got {tp_size}")
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self.api_key = api_key
        self.tp_size = int(tp_size)
        self.allow_unprocessed_logprobs = bool(allow_unprocessed_logprobs)
        self._version = int(version)
        self._paused = False
        self._inflight: dict[str, int] = {}  # request id -> number of calls in flight with it
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="sglang-http")

    # ------------------------------------------------------------------ http
    def _call(self, method: str, path: str, payload: dict | None = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                body = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            raise SGLangError(f"{method} {path}: HTTP {exc.code}: {detail}") from exc
        if not body:
            return None
        try:
            return json.loads(body)
        except json.JSONDecodeError:
            return body.decode(errors="replace")

    async def _request(self, method: str, path: str, payload: dict | None = None) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._call, method, path, payload)

    @staticmethod
    def _check_success(path: str, body: Any) -> Any:
        if isinstance(body, dict) and body.get("success") is False:
            raise ArgumentError(f"{path}: the server rejected the update: {body.get('message', body)}")
        return body

    # ------------------------------------------------------------------ protocol
    @property
    def version(self) -> int:
        return self._version

    @property
    def is_paused(self) -> bool:
        """Client-side view: True between :meth:`pause` and :meth:`resume` called on this client."""
        return self._paused

    def build_generate_payload(self, request: GenerationRequest) -> dict:
        """The JSON body of ``POST /generate`` for ``request`` (see the module docstring)."""
        sp = request.sampling
        if not self.allow_unprocessed_logprobs and sp.temperature > 0 and (sp.top_k > 0 or sp.top_p < 1.0):
            raise ArgumentError(
                f"request.sampling: SGLang's logprobs ignore top_k/top_p (got top_k={sp.top_k}, top_p={sp.top_p}); "
                "they would not be the processed logprobs. Disable them or pass allow_unprocessed_logprobs=True"
            )
        params: dict[str, Any] = {
            "max_new_tokens": sp.max_new_tokens,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": sp.top_k if sp.top_k > 0 else -1,
            "stop_token_ids": list(sp.stop_token_ids),
            "ignore_eos": True,
            "no_stop_trim": True,
        }
        if sp.seed is not None:
            params["sampling_seed"] = sp.seed
        return {
            "input_ids": list(request.prompt_ids),
            "rid": request.request_id,
            "sampling_params": params,
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": False,
        }

    def parse_generate_response(self, request: GenerationRequest, body: Any) -> Generation:
        """A :class:`Generation` from the JSON body of ``POST /generate`` (raises :class:`SGLangError` on an
        unexpected shape)."""
        if isinstance(body, list) and len(body) == 1:
            body = body[0]
        if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
            raise SGLangError(f"/generate: expected a JSON object with 'meta_info', got {str(body)[:300]}")
        meta = body["meta_info"]
        fr = meta.get("finish_reason")
        kind = fr.get("type") if isinstance(fr, dict) else fr
        if kind not in _FINISH:
            raise SGLangError(f"/generate: unexpected finish_reason {fr!r} for request {request.request_id!r}")
        entries = meta.get("output_token_logprobs") or []
        try:
            ids = [int(e[1]) for e in entries]
            lps = [float(e[0]) for e in entries]
        except (TypeError, ValueError, IndexError) as exc:
            raise SGLangError(f"/generate: malformed output_token_logprobs {str(entries)[:300]}") from exc
        out_ids = body.get("output_ids", meta.get("output_ids"))
        if out_ids is not None and [int(t) for t in out_ids] != ids:
            raise SGLangError(
                f"/generate: output_ids {list(out_ids)[:10]} and output_token_logprobs ids {ids[:10]} disagree "
                f"for request {request.request_id!r}"
            )
        if len(ids) > request.sampling.max_new_tokens:
            raise SGLangError(
                f"/generate: {len(ids)} tokens returned for max_new_tokens={request.sampling.max_new_tokens}"
            )
        version = _as_int_version(meta.get("weight_version"), self._version)
        lps32 = torch.tensor(lps, dtype=torch.float32).tolist()
        return Generation(request.request_id, list(request.prompt_ids), ids, lps32, [version] * len(ids), _FINISH[kind])

    async def generate(self, request: GenerationRequest) -> Generation:
        """``POST /generate``; an aborted request returns its partial output with ``finish_reason="abort"``."""
        if not isinstance(request, GenerationRequest):
            raise ArgumentError(f"request: expected a GenerationRequest, got {type(request).__name__}")
        if request.sampling.max_new_tokens == 0:
            return Generation(request.request_id, list(request.prompt_ids), finish_reason="length")
        payload = self.build_generate_payload(request)
        rid = request.request_id
        self._inflight[rid] = self._inflight.get(rid, 0) + 1
        try:
            body = await self._request("POST", "/generate", payload)
        finally:
            self._inflight[rid] -= 1
            if self._inflight[rid] == 0:
                del self._inflight[rid]
        return self.parse_generate_response(request, body)

    async def abort(self, request_ids: Iterable[str] | None = None) -> list[str]:
        """``POST /abort_request`` per id sent by this client (``None``: ``abort_all``). Returns the ids that
        were in flight here; other ids are ignored (documented no-op)."""
        if request_ids is None:
            ids = list(self._inflight)
            await self._request("POST", "/abort_request", {"rid": "", "abort_all": True})
            return ids
        wanted = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        ids = [r for r in wanted if r in self._inflight]
        await asyncio.gather(*[self._request("POST", "/abort_request", {"rid": r, "abort_all": False}) for r in ids])
        return ids

    async def pause(self, mode: Literal["abort", "keep"] = "abort") -> None:
        """``POST /pause_generation``: ``abort`` -> SGLang ``abort``; ``keep`` -> SGLang ``retract`` (requests
        wait in the server's queue; their KV may be flushed and recomputed on resume)."""
        if mode not in ("abort", "keep"):
            raise ArgumentError(f"mode: expected 'abort' or 'keep', got {mode!r}")
        self._paused = True
        await self._request("POST", "/pause_generation", {"mode": "abort" if mode == "abort" else "retract"})

    async def resume(self) -> None:
        """``POST /continue_generation``."""
        await self._request("POST", "/continue_generation", {})
        self._paused = False

    async def _quiesce(self) -> bool:
        """Pause with abort (every in-flight request of this client returns); True if this call paused."""
        self_paused = not self._paused
        if self_paused:
            await self.pause("abort")
        elif self._inflight:
            await self.abort(list(self._inflight))
        return self_paused

    async def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], *, version: int) -> None:
        """``POST /update_weights_from_tensor`` (same host; see the module docstring). Names and tensor types are
        checked here, names and shapes by the server (its ``success: false`` becomes ``ValueError`` and the
        client's version is unchanged). Version set after the server confirmed the load."""
        if isinstance(version, bool) or not isinstance(version, int):
            raise ArgumentError(f"version: expected an int, got {version!r}")
        items = list(named_tensors)
        seen: set[str] = set()
        for i, item in enumerate(items):
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise ArgumentError(f"named_tensors[{i}]: expected a (name, tensor) pair, got {type(item).__name__}")
            if not isinstance(item[1], Tensor):
                raise ArgumentError(
                    f"named_tensors: {item[0]!r}: expected a "
                    f"torch.Tensor, got {type(item[1]).__name__}"
                )
            if item[0] in seen:
                raise ArgumentError(f"named_tensors: {item[0]!r} appears more than once")
            seen.add(item[0])
        payload = {
            "serialized_named_tensors": [serialize_named_tensors(items)] * self.tp_size,
            "load_format": None,
            "flush_cache": True,
            "weight_version": str(version),
        }
        await self._update("/update_weights_from_tensor", payload, version)

    async def _update(self, path: str, payload: dict, version: int) -> None:
        self_paused = await self._quiesce()
        try:
            self._check_success(path, await self._request("POST", path, payload))
            self._version = version
        finally:
            if self_paused:
                await self.resume()

    async def update_weights_from_disk(self, model_path: str, *, version: int, load_format: str | None = None) -> None:
        """``POST /update_weights_from_disk``: the server loads a checkpoint directory it can read."""
        payload = {"model_path": model_path, "load_format": load_format, "weight_version": str(version)}
        await self._update("/update_weights_from_disk", payload, version)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        """``POST /init_weights_update_group``: the server's ranks join a process group with the trainer
        (the trainer is rank 0 and must call ``init_process_group`` concurrently)."""
        payload = {
            "master_address": master_address,
            "master_port": int(master_port),
            "rank_offset": int(rank_offset),
            "world_size": int(world_size),
            "group_name": group_name,
            "backend": backend,
        }
        self._check_success(
            "/init_weights_update_group", await self._request("POST", "/init_weights_update_group", payload)
        )

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[torch.dtype | str],
        shapes: list[list[int]],
        *,
        version: int,
        group_name: str = "weight_update_group",
    ) -> None:
        """``POST /update_weights_from_distributed``: the server receives each named tensor by broadcast from
        the trainer's rank 0 (run the trainer's broadcasts concurrently with this call)."""
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ArgumentError(
                f"names, dtypes, shapes: expected equal lengths, got {len(names)}, {len(dtypes)}, {len(shapes)}"
            )
        payload = {
            "names": list(names),
            "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [[int(s) for s in shape] for shape in shapes],
            "group_name": group_name,
            "flush_cache": True,
            "weight_version": str(version),
        }
        await self._update("/update_weights_from_distributed", payload, version)

    async def flush_cache(self) -> None:
        """``POST /flush_cache`` (drop the radix cache)."""
        await self._request("POST", "/flush_cache", {})

    async def get_weight_version(self) -> str:
        """The server's weight version string (``/get_weight_version``, else ``/model_info``)."""
        try:
            body = await self._request("GET", "/get_weight_version")
        except SGLangError as exc:
            if "HTTP 404" not in str(exc):
                raise
            body = await self._request("GET", "/model_info")
        if not isinstance(body, dict) or "weight_version" not in body:
            raise SGLangError(f"weight version: expected {{'weight_version': ...}}, got {str(body)[:300]}")
        return str(body["weight_version"])

    async def refresh_version(self) -> int:
        """Set ``version`` from the server's weight version (kept if it is not an integer string)."""
        self._version = _as_int_version(await self.get_weight_version(), self._version)
        return self._version

    async def sleep(self) -> None:
        """``POST /release_memory_occupation`` (weights and KV cache leave the GPU)."""
        await self._request("POST", "/release_memory_occupation", {})

    async def wake(self) -> None:
        """``POST /resume_memory_occupation``."""
        await self._request("POST", "/resume_memory_occupation", {})

    def close(self) -> None:
        """Shut the private HTTP thread pool down."""
        self._pool.shutdown(wait=False, cancel_futures=True)
