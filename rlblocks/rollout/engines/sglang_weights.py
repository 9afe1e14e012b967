"""Weight updates of :class:`~rlblocks.rollout.engines.SGLangEngine` (written against SGLang 0.5.23; the paths
named are inside the ``sglang`` package).

The update is checked with the rule every engine shares (:mod:`rlblocks.rollout.engines._weights`; names, shapes and
completeness only when ``expected_weights`` is given, since the client cannot see the model otherwise), then:

1. the scheduler is paused in ``retract`` mode: running requests go back to the queue, and the cache flush that
   follows every load succeeds only when nothing runs (``srt/managers/scheduler_components/weight_updater.py``,
   ``flush_cache_after_weight_update``; ``Scheduler.flush_cache`` ignores queued requests only while paused);
2. a weight-update session is opened: ``update_weights_from_tensor`` and ``update_weights_from_distributed`` answer
   HTTP 400 outside ``/begin_weight_update`` ... ``/end_weight_update`` (``weight_updater.py``), and a session left
   open (a client that died mid-update) makes the next begin fail: it is then closed and opened again;
3. the load call; 4. ``/end_weight_update``, always; 5. ``continue_generation`` if the update paused.

A refusal comes back as HTTP 400 with ``{"success": false, "message"}`` (``srt/entrypoints/http_server.py``): it
raises :class:`~rlblocks.errors.WeightUpdateError` and the client keeps its version. If the server's weight
version moved although the call failed (the weights were loaded, a later step such as the cache flush failed) the
client takes the new version and raises :class:`SGLangError`, so client and server never disagree silently.

``update_weights`` sends tensors through CUDA IPC: one ``MultiprocessingSerializer`` payload (base64 of a
``ForkingPickler`` dump) *per TP rank*, each a separate dump, since every rank opens only its own
(``srt/managers/tp_worker.py``, ``deserialize_own_rank``: opening another rank's copy breaks the producer's IPC
reference counting). The device of each tensor is written as its GPU UUID, which the server maps to its own device
index (``srt/utils/patch_torch.py``): a local index means nothing in a process with other visible devices. CPU
tensors cannot be shared with the server's processes and are refused; use
:meth:`SGLangEngine.update_weights_from_disk` or the NCCL path (:meth:`SGLangEngine.init_weights_update_group` +
:meth:`SGLangEngine.update_weights_from_distributed`).

"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from rlblocks._checks import check_bool
from rlblocks.errors import ArgumentError, EngineError, SGLangError

from ._weights import check_tensors, check_update_version, refuse
from .sglang_http import _as_int_version

__all__ = ["serialize_named_tensors"]


def _gpu_uuid_reducer(t: Tensor) -> tuple[Any, tuple]:
    """``torch.multiprocessing.reductions.reduce_tensor`` with the CUDA device index replaced by the GPU's UUID,
    the form SGLang's patched ``rebuild_cuda_tensor`` maps back to its own index (``srt/utils/patch_torch.py``;
    the device is argument 6 of ``rebuild_cuda_tensor``)."""
    from torch.multiprocessing import reductions

    fn, args = reductions.reduce_tensor(t)
    if t.is_cuda:
        args = list(args)
        args[6] = str(torch.cuda.get_device_properties(args[6]).uuid)
        args = tuple(args)
    return fn, args


def serialize_named_tensors(named_tensors: list[tuple[str, Tensor]], *, device_uuid: bool = True) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)`` format: base64 of a ``ForkingPickler``
    dump (CUDA tensors become CUDA-IPC handles, CPU tensors shared-memory handles; valid on this host only, while
    this process keeps the tensors alive). With ``device_uuid`` CUDA devices are written as GPU UUIDs."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # registers the tensor reductions on ForkingPickler

    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    if device_uuid:  # a private dispatch table: the process-wide reductions stay as they are
        pickler.dispatch_table[torch.Tensor] = _gpu_uuid_reducer
        pickler.dispatch_table[torch.nn.Parameter] = _gpu_uuid_reducer
    pickler.dump(named_tensors)
    return base64.b64encode(buf.getvalue()).decode("ascii")



class _SGLangWeights:
    """The weight-update calls of :class:`~rlblocks.rollout.engines.SGLangEngine` (a base class of it); they run
    under its ``_control`` lock and keep its ``_version`` and :class:`~rlblocks.rollout.engines.lifecycle.Lifecycle`
    state in step with the server."""

    def _check_update(
        self, named_tensors: Iterable[tuple[str, Tensor]], *, version: int, partial: bool, allow_rollback: bool
    ) -> list[tuple[str, Tensor]]:
        self._state.check_open()
        version = check_update_version("SGLangEngine", version, self._version, allow_rollback=allow_rollback)
        self._state.check_update(check_bool("partial", partial))
        if self._layout is not None:
            return self._layout.validate(named_tensors, engine="SGLangEngine", partial=partial)
        return check_tensors(named_tensors, engine="SGLangEngine")

    async def _server_version(self) -> str | None:
        try:
            return await self.get_weight_version()
        except EngineError:
            return None

    async def _session(self, begin: bool) -> None:
        path = "/begin_weight_update" if begin else "/end_weight_update"
        status, body = await self._http("POST", path, {}, check=False)
        if status < 400 and isinstance(body, dict) and body.get("success") is True:
            return
        message = body.get("message", body) if isinstance(body, dict) else body
        if begin and "already open" in str(message):
            # a session left open (a client that died mid-update): close it and open ours
            await self._session(begin=False)
            self._stats.sessions_recovered += 1
            status, body = await self._http("POST", path, {}, check=False)
            if status < 400 and isinstance(body, dict) and body.get("success") is True:
                return
            message = body.get("message", body) if isinstance(body, dict) else body
        raise SGLangError(f"POST {path}: HTTP {status}: {message}", status=status, body=body)

    async def _update(
        self, path: str, payload: dict, *, version: int, partial: bool, allow_rollback: bool, session: bool
    ) -> None:
        """The update sequence of the module docstring, for the load call ``path``."""
        async with self._control:
            version = check_update_version("SGLangEngine", version, self._version, allow_rollback=allow_rollback)
            self._state.check_update(partial)
            self._state.updating += 1
            try:
                if not self._spans_seen:  # without spans, a response has one version: let no request span two
                    await self._abort_all_of_client(list(self._inflight.values()))
                before = await self._server_version()
                if self._server_paused != "retract":
                    await self._pause_server("retract")
                if session:
                    await self._session(begin=True)
                end_error: BaseException | None = None
                try:
                    status, body = await self._http("POST", path, payload, check=False)
                finally:
                    if session:
                        try:
                            await self._session(begin=False)
                        except EngineError as exc:
                            end_error = exc
                ok = status < 400 and isinstance(body, dict) and body.get("success") is True
                if not ok:
                    message = body.get("message", body) if isinstance(body, dict) else body
                    after = await self._server_version()
                    if after is not None and after != before:
                        self._version = _as_int_version(after, self._version)
                        raise SGLangError(
                            f"POST {path}: the server loaded the weights (its version is now {after!r}) but answered "
                            f"HTTP {status}: {message}",
                            status=status,
                            body=body,
                        )
                    raise refuse("SGLangEngine", f"the server answered HTTP {status}: {message}")
                self._version = version
                self._stats.weight_updates += 1
                if not partial:
                    self._state.on_complete_update()
                if end_error is not None:
                    raise end_error
            finally:
                self._state.updating -= 1
                await self._apply_run_state()

    def _tensor_payloads(self, items: list[tuple[str, Tensor]]) -> tuple[list[str], list[Tensor]]:
        """One separate serialization per TP rank (module docstring), on ``tp_devices[rank]`` if given. Returns the
        payloads and the tensors they point to: the caller keeps those alive until the server has loaded them."""
        for name, t in items:
            if not t.is_cuda:
                raise refuse(
                    "SGLangEngine",
                    f"{name!r} is on {t.device}: the server opens tensors through CUDA IPC, and CPU tensors cannot be "
                    "shared with its processes (use update_weights_from_disk or update_weights_from_distributed)",
                )
        payloads, keep = [], []
        for rank in range(self.tp_size):
            dev = None if self.tp_devices is None else self.tp_devices[rank]
            on_rank = [(n, t if dev is None else t.to(dev)) for n, t in items]
            keep += [t for _, t in on_rank]
            payloads.append(serialize_named_tensors(on_rank))
        return payloads, keep

    async def update_weights(
        self,
        named_tensors: Iterable[tuple[str, Tensor]],
        *,
        version: int,
        partial: bool = False,
        allow_rollback: bool = False,
    ) -> None:
        """``POST /update_weights_from_tensor`` (CUDA tensors on this host; see the module docstring) inside a
        weight-update session. Refusals raise :class:`~rlblocks.errors.WeightUpdateError` (client version
        unchanged); the tensors must stay alive until the call returns."""
        items = self._check_update(list(named_tensors), version=version, partial=partial, allow_rollback=allow_rollback)
        payloads, keep_alive = self._tensor_payloads(items)  # the server opens these tensors during the call
        payload = {
            "serialized_named_tensors": payloads,
            "load_format": None,
            "flush_cache": True,
            "weight_version": str(version),
        }
        await self._update("/update_weights_from_tensor", payload, version=version, partial=partial,
                           allow_rollback=allow_rollback, session=True)
        del keep_alive

    async def update_weights_from_disk(
        self, model_path: str, *, version: int, load_format: str | None = None, allow_rollback: bool = False
    ) -> None:
        """``POST /update_weights_from_disk``: the server loads a whole checkpoint directory it can read (no
        session needed for this one)."""
        self._state.check_open()
        version = check_update_version("SGLangEngine", version, self._version, allow_rollback=allow_rollback)
        self._state.check_update(False)
        if not isinstance(model_path, str) or not model_path:
            raise ArgumentError(f"model_path: expected a non-empty path string, got {model_path!r}")
        payload = {"model_path": model_path, "load_format": load_format, "weight_version": str(version)}
        await self._update("/update_weights_from_disk", payload, version=version, partial=False,
                           allow_rollback=allow_rollback, session=False)

    async def init_weights_update_group(
        self,
        master_addr: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        """``POST /init_weights_update_group``: the server's ranks join a process group with the trainer at
        ``master_addr:master_port`` (the trainer is rank 0 and calls ``init_process_group`` concurrently; server
        rank ``i`` is ``rank_offset + i``). ``master_address=`` still works, with a warning."""
        self._state.check_open()
        payload = {  # SGLang's own field names (InitWeightsUpdateGroupReqInput)
            "master_address": master_addr,
            "master_port": int(master_port),
            "rank_offset": int(rank_offset),
            "world_size": int(world_size),
            "group_name": group_name,
            "backend": backend,
        }
        status, body = await self._http("POST", "/init_weights_update_group", payload, check=False)
        if status >= 400 or not (isinstance(body, dict) and body.get("success") is True):
            message = body.get("message", body) if isinstance(body, dict) else body
            raise SGLangError(f"/init_weights_update_group: HTTP {status}: {message}", status=status, body=body)

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[torch.dtype | str],
        shapes: Sequence[Sequence[int]],
        *,
        version: int,
        partial: bool = False,
        allow_rollback: bool = False,
        group_name: str = "weight_update_group",
    ) -> None:
        """``POST /update_weights_from_distributed`` inside a weight-update session: the server receives each named
        tensor by broadcast from the trainer's rank 0 (run the trainer's broadcasts concurrently with this call)."""
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ArgumentError(
                f"names, dtypes, shapes: expected equal lengths, got {len(names)}, {len(dtypes)}, {len(shapes)}"
            )
        torch_dtypes = [d if isinstance(d, torch.dtype) else getattr(torch, str(d), None) for d in dtypes]
        bad = [d for d, t in zip(dtypes, torch_dtypes) if not isinstance(t, torch.dtype)]
        if bad:
            raise ArgumentError(f"dtypes: expected torch dtypes or their names, got {bad[:3]}")
        metas = [(n, torch.empty(tuple(s), dtype=d, device="meta")) for n, d, s in zip(names, torch_dtypes, shapes)]
        self._check_update(metas, version=version, partial=partial, allow_rollback=allow_rollback)
        payload = {
            "names": list(names),
            "dtypes": [str(d).removeprefix("torch.") for d in torch_dtypes],
            "shapes": [[int(s) for s in shape] for shape in shapes],
            "group_name": group_name,
            "flush_cache": True,
            "weight_version": str(version),
        }
        await self._update("/update_weights_from_distributed", payload, version=version, partial=partial,
                           allow_rollback=allow_rollback, session=True)

    async def flush_cache(self) -> None:
        """``POST /flush_cache`` (drop the radix cache; refused with HTTP 400 while requests run)."""
        self._state.check_open()
        await self._http("POST", "/flush_cache")

    async def get_weight_version(self) -> str:
        """The server's weight version string (``GET /model_info``, ``weight_version``)."""
        _, body = await self._http("GET", "/model_info")
        if not isinstance(body, dict) or "weight_version" not in body:
            raise SGLangError(f"/model_info: expected {{'weight_version': ...}}, got {str(body)[:300]}", body=body)
        return str(body["weight_version"])

    async def refresh_version(self) -> int:
        """Set ``version`` from the server's weight version (kept if it is not an integer string)."""
        self._version = _as_int_version(await self.get_weight_version(), self._version)
        return self._version

