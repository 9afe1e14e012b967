"""Router: one :class:`~rlblocks.rollout.types.RolloutEngine` over several engines.

- **Dispatch.** A request with a ``session_id`` seen before goes to the engine that served that session (prefix-cache
  locality; the map is an LRU of ``max_sessions`` entries). A request whose ``request_id`` was just aborted goes
  back to the engine that aborted it (the AReaL contract re-submits "to the same server", where its KV may be
  cached). Anything else goes to the least-loaded engine: fewest requests in flight through this router, then
  fewest requests ever assigned, then lowest index (so sequential traffic is spread round-robin).
- **Broadcast.** ``pause``, ``resume``, ``update_weights``, ``sleep``, ``wake`` and ``close`` go to every engine
  concurrently; ``update_weights`` materialises the iterable once and hands the same list to each engine.
  ``abort(ids)`` goes to the engine that holds each id (ids not in flight here are ignored, as in the protocol);
  ``abort(None)`` to all.
- ``version`` is the smallest engine version (all equal after a completed broadcast update); ``is_paused`` is True if
  any engine is paused; ``num_in_flight`` counts the requests in flight through this router.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Literal

from torch import Tensor

from rlblocks.errors import ArgumentError

from .types import Generation, GenerationRequest, RolloutEngine

__all__ = ["Router"]


class Router:
    """Least-loaded dispatch with session affinity over ``engines``; control calls are broadcast.

    Args:
        engines: at least one engine implementing the rollout protocol (any mix of kinds).
        max_sessions: sessions remembered for affinity (least recently used ones are forgotten first).
    """

    def __init__(self, engines: Sequence[RolloutEngine], *, max_sessions: int = 1_000_000) -> None:
        engines = list(engines)
        if not engines:
            raise ArgumentError("engines: expected at least one engine, got an empty sequence")
        if max_sessions < 1:
            raise ArgumentError(f"max_sessions: expected >= 1, got {max_sessions}")
        self.engines = engines
        self.max_sessions = int(max_sessions)
        self.in_flight = [0] * len(engines)  # requests in flight through this router, per engine
        self.assigned = [0] * len(engines)  # requests ever dispatched, per engine
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._aborted: OrderedDict[str, int] = OrderedDict()  # request id -> engine, for re-submissions
        self._where: dict[str, int] = {}  # request id in flight -> engine

    @property
    def version(self) -> int:
        return min(int(e.version) for e in self.engines)

    @property
    def is_paused(self) -> bool:
        """True if any engine is paused (asleep, or waiting for weights after a level-2 sleep, included)."""
        return any(bool(e.is_paused) for e in self.engines)

    @property
    def num_in_flight(self) -> int:
        """Requests in flight through this router (all engines)."""
        return len(self._where)

    def stats(self) -> dict:
        """``{"num_in_flight", "in_flight": [per engine], "assigned": [per engine], "engines": [engine.stats()]}``."""
        return {
            "num_in_flight": len(self._where),
            "in_flight": list(self.in_flight),
            "assigned": list(self.assigned),
            "engines": [e.stats() for e in self.engines],
        }

    def engine_for(self, request: GenerationRequest) -> int:
        """Index of the engine that :meth:`generate` would use now (records nothing)."""
        if request.session_id is not None and request.session_id in self._sessions:
            return self._sessions[request.session_id]
        if request.request_id in self._aborted:
            return self._aborted[request.request_id]
        return min(range(len(self.engines)), key=lambda i: (self.in_flight[i], self.assigned[i], i))

    async def generate(self, request: GenerationRequest) -> Generation:
        """Dispatch ``request`` (see the module docstring) and return the engine's generation."""
        if request.request_id in self._where:
            raise ArgumentError(f"request_id: {request.request_id!r} is already in flight")
        i = self.engine_for(request)
        self._aborted.pop(request.request_id, None)
        if request.session_id is not None:
            self._sessions[request.session_id] = i
            self._sessions.move_to_end(request.session_id)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        self.in_flight[i] += 1
        self.assigned[i] += 1
        self._where[request.request_id] = i
        try:
            gen = await self.engines[i].generate(request)
        finally:
            self.in_flight[i] -= 1
            self._where.pop(request.request_id, None)
        if gen.finish_reason == "abort":
            self._aborted[request.request_id] = i
            while len(self._aborted) > self.max_sessions:
                self._aborted.popitem(last=False)
        return gen

    async def abort(self, request_ids: Iterable[str] | None = None) -> list[str]:
        """Abort on the engines holding ``request_ids`` (``None``: every engine, every request). Returns the ids
        the engines report as aborted."""
        if request_ids is None:
            parts = await asyncio.gather(*[e.abort(None) for e in self.engines])
            return [rid for part in parts for rid in part]
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        by_engine: dict[int, list[str]] = {}
        for rid in ids:
            if rid in self._where:
                by_engine.setdefault(self._where[rid], []).append(rid)
        parts = await asyncio.gather(*[self.engines[i].abort(rs) for i, rs in by_engine.items()])
        return [rid for part in parts for rid in part]

    async def pause(self, mode: Literal["abort", "keep"] = "abort") -> None:
        """Pause every engine (``mode`` as in the protocol)."""
        if mode not in ("abort", "keep"):
            raise ArgumentError(f"mode: expected 'abort' or 'keep', got {mode!r}")
        await asyncio.gather(*[e.pause(mode) for e in self.engines])

    async def resume(self) -> None:
        """Resume every engine."""
        await asyncio.gather(*[e.resume() for e in self.engines])

    async def update_weights(
        self,
        named_tensors: Iterable[tuple[str, Tensor]],
        *,
        version: int,
        partial: bool = False,
        allow_rollback: bool = False,
    ) -> None:
        """Broadcast one weight update. Each engine checks it with the same rule before loading, so engines of
        the same model refuse the same update (:class:`~rlblocks.errors.WeightUpdateError`); the first error is
        re-raised after every call has returned."""
        items = list(named_tensors)
        results = await asyncio.gather(
            *[
                e.update_weights(items, version=version, partial=partial, allow_rollback=allow_rollback)
                for e in self.engines
            ],
            return_exceptions=True,
        )
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def sleep(self, level: int = 1) -> None:
        """Put every engine to sleep at ``level`` (the protocol's meaning: in-flight requests are aborted)."""
        await asyncio.gather(*[e.sleep(level) for e in self.engines])

    async def wake(self) -> None:
        """Wake every engine."""
        await asyncio.gather(*[e.wake() for e in self.engines])

    def close(self) -> None:
        """Close every engine (each close is idempotent, so this is too)."""
        for e in self.engines:
            e.close()

    async def aclose(self) -> None:
        """Close every engine from inside the event loop (``aclose`` where the engine has it)."""
        for e in self.engines:
            closer = getattr(e, "aclose", None)
            if closer is not None:
                await closer()
            else:
                e.close()
