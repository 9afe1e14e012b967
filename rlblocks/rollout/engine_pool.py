"""An engine pool: :class:`Router`, one :class:`~rlblocks.rollout.types.RolloutEngine` over several engines.

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

Engines that die under a live job
---------------------------------
An engine is taken out (``alive[i]`` becomes False, the reason is kept in ``failures``) when a request or a control
call on it fails with an engine failure: an :class:`~rlblocks.errors.EngineError` (an HTTP engine's refused or reset
connection, a timed-out call, a closed engine; an HTTP 4xx answer is the request's fault and is raised instead),
an ``OSError`` or a ``TimeoutError``; or when its heartbeat fails (:meth:`Router.check_health`, every
``health_interval`` seconds when set: ``health_check(engine)``, by default the engine's own ``health()`` where it
has one, e.g. :meth:`~rlblocks.rollout.engines.SGLangEngine.health`, must return within ``health_timeout``). Every
request in flight on it is then sent to a live engine at once (least loaded; its session moves there and stays), so no
request is lost or answered twice: the caller's ``generate`` returns the live engine's answer. Tokens the dead
engine produced in that call are lost with it and generated again; tokens from earlier calls, which
:func:`~rlblocks.rollout.resumable_generate` keeps client-side, keep the versions that produced them. Control
calls skip dead engines (and take out an engine that fails one). With no live engine left a request raises
:class:`~rlblocks.errors.NoLiveEngine`. A restarted engine comes back with :meth:`Router.rejoin` only once it serves
the live engines' weight version (``weights=`` loads them first), so a request never lands on stale weights.
"""

from __future__ import annotations

import asyncio
import inspect
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Literal

from torch import Tensor

from rlblocks._checks import check_int, check_seconds
from rlblocks.errors import ArgumentError, EngineDied, EngineError, NoLiveEngine, WeightUpdateError

from .types import Generation, GenerationRequest, RolloutEngine

__all__ = ["Router"]


def is_engine_failure(exc: BaseException) -> bool:
    """True when ``exc`` means the engine is gone or unusable (see the module docstring), False for a refused
    request or update (the caller's fault: an HTTP 4xx answer, an ``ArgumentError``, a ``WeightUpdateError``)."""
    if isinstance(exc, (ArgumentError, WeightUpdateError)):
        return False
    status = getattr(exc, "status", None)
    if isinstance(exc, EngineError) and isinstance(status, int) and 400 <= status < 500:
        return False
    return isinstance(exc, (EngineError, OSError, TimeoutError, asyncio.TimeoutError))


# what RolloutEngine declares: the methods and properties every engine has
_PROTOCOL = tuple(sorted(n for n in vars(RolloutEngine) if not n.startswith("_")))
_METHODS = frozenset(n for n in _PROTOCOL if inspect.isfunction(vars(RolloutEngine)[n]))


def check_engine(name: str, engine: object) -> RolloutEngine:
    """``engine`` if it implements the :class:`~rlblocks.rollout.types.RolloutEngine` protocol (every method
    callable, every property present), else :class:`~rlblocks.errors.ArgumentError` naming ``name`` and what is
    missing. Properties are looked up without being evaluated (``inspect.getattr_static``: a property of an HTTP
    engine may call its server); an object that forwards attributes through ``__getattr__`` is asked by
    ``hasattr``."""
    forwards = getattr(type(engine), "__getattr__", None) is not None
    missing = []
    for member in _PROTOCOL:
        try:
            value = inspect.getattr_static(engine, member)
        except AttributeError:
            if not (forwards and hasattr(engine, member)):
                missing.append(member)
            continue
        if member in _METHODS and not callable(value):
            missing.append(f"{member} (not callable)")
    if missing:
        raise ArgumentError(f"{name}: expected a rollout engine (the RolloutEngine protocol), got "
                            f"{type(engine).__name__} without {', '.join(missing)}")
    return engine  # type: ignore[return-value]


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


class Router:
    """Least-loaded dispatch with session affinity over ``engines``; control calls are broadcast; dead engines are
    taken out and their requests moved to live ones (module docstring).

    Args:
        engines: at least one engine implementing the rollout protocol (any mix of kinds); anything else (``None``,
            an object missing a method or property of ``RolloutEngine``) is refused here, naming its index.
        max_sessions: sessions remembered for affinity (least recently used ones are forgotten first).
        health_check: ``await health_check(engine)`` raises (or times out) when the engine is dead; default: the
            engine's own ``health()`` method where it has one (engines without either are checked by their
            requests only).
        health_timeout: seconds a heartbeat may take before the engine counts as dead.
        health_interval: seconds between heartbeats of a background monitor (started by the first
            :meth:`generate`, stopped by :meth:`aclose`); ``None``: only explicit :meth:`check_health` calls.
    """

    def __init__(self, engines: Sequence[RolloutEngine], *, max_sessions: int = 1_000_000,
                 health_check: Callable[[RolloutEngine], Awaitable[Any]] | None = None,
                 health_timeout: float = 10.0, health_interval: float | None = None) -> None:
        if isinstance(engines, (str, bytes)) or not isinstance(engines, Iterable):
            raise ArgumentError(f"engines: expected a sequence of rollout engines, got {type(engines).__name__}")
        engines = list(engines)
        if not engines:
            raise ArgumentError("engines: expected at least one engine, got an empty sequence")
        for i, e in enumerate(engines):
            check_engine(f"engines[{i}]", e)
        max_sessions = check_int("max_sessions", max_sessions, minimum=1)
        if health_check is not None and not callable(health_check):
            raise ArgumentError(f"health_check: expected None or an async callable, got {type(health_check).__name__}")
        self.engines = engines
        self.max_sessions = max_sessions
        self.health_check = health_check
        self.health_timeout = check_seconds("health_timeout", health_timeout)
        self.health_interval = check_seconds("health_interval", health_interval, allow_none=True)
        self.in_flight = [0] * len(engines)  # requests in flight through this router, per engine
        self.assigned = [0] * len(engines)  # requests ever dispatched, per engine
        self.alive = [True] * len(engines)
        self.failures: list[tuple[int, str]] = []  # (engine index, why it was taken out), in order
        self._counts = {"failovers": 0, "rejoins": 0, "health_checks": 0}
        self._dead: list[asyncio.Event] = [asyncio.Event() for _ in engines]  # set when engine i is taken out
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._aborted: OrderedDict[str, int] = OrderedDict()  # request id -> engine, for re-submissions
        self._where: dict[str, int] = {}  # request id in flight -> engine
        self._weights = asyncio.Lock()  # a rejoin and a weight update never interleave
        self._paused: str | None = None  # the pause mode of the live engines, for an engine that rejoins
        self._monitor: asyncio.Task | None = None

    def _live(self) -> list[int]:
        return [i for i, ok in enumerate(self.alive) if ok]

    @property
    def version(self) -> int:
        """The smallest version of the live engines (of all engines when none is live)."""
        live = self._live() or range(len(self.engines))
        return min(int(self.engines[i].version) for i in live)

    @property
    def is_paused(self) -> bool:
        """True if any live engine is paused (asleep, or waiting for weights after a level-2 sleep, included)."""
        return any(bool(self.engines[i].is_paused) for i in self._live())

    @property
    def num_in_flight(self) -> int:
        """Requests in flight through this router (all engines)."""
        return len(self._where)

    def stats(self) -> dict:
        """``{"num_in_flight", "in_flight": [per engine], "assigned": [per engine], "alive": [per engine],
        "failovers" (requests moved off a dead engine), "rejoins", "health_checks", "failures": [(engine, why)],
        "engines": [engine.stats() of the live engines, None for the dead ones]}``."""
        return {
            "num_in_flight": len(self._where),
            "in_flight": list(self.in_flight),
            "assigned": list(self.assigned),
            "alive": list(self.alive),
            **self._counts,
            "failures": list(self.failures),
            "engines": [e.stats() if ok else None for e, ok in zip(self.engines, self.alive)],
        }

    def engine_for(self, request: GenerationRequest) -> int:
        """Index of the engine that :meth:`generate` would use now (records nothing); raises
        :class:`~rlblocks.errors.NoLiveEngine` when every engine is out."""
        live = self._live()
        if not live:
            raise NoLiveEngine(f"Router: every engine is out ({self.failures[-len(self.engines):]}); rejoin one "
                               "with Router.rejoin")
        sticky = self._sessions.get(request.session_id) if request.session_id is not None else None
        if sticky is None:
            sticky = self._aborted.get(request.request_id)
        if sticky is not None and self.alive[sticky]:  # an engine that was taken out loses its sessions
            return sticky
        return min(live, key=lambda i: (self.in_flight[i], self.assigned[i], i))

    async def generate(self, request: GenerationRequest) -> Generation:
        """Dispatch ``request`` (see the module docstring) and return the engine's generation; a request whose
        engine dies is sent to a live one (counted in ``stats()["failovers"]``)."""
        if request.request_id in self._where:
            raise ArgumentError(f"request_id: {request.request_id!r} is already in flight")
        self._start_monitor()
        self._aborted.pop(request.request_id, None)
        while True:
            i = self.engine_for(request)
            if request.session_id is not None:
                self._sessions[request.session_id] = i
                self._sessions.move_to_end(request.session_id)
                while len(self._sessions) > self.max_sessions:
                    self._sessions.popitem(last=False)
            self.in_flight[i] += 1
            self.assigned[i] += 1
            self._where[request.request_id] = i
            try:
                gen = await self._on(i, request)
            except EngineDied:
                self._counts["failovers"] += 1
                continue
            finally:
                self.in_flight[i] -= 1
                self._where.pop(request.request_id, None)
            if gen.finish_reason == "abort":
                self._aborted[request.request_id] = i
                while len(self._aborted) > self.max_sessions:
                    self._aborted.popitem(last=False)
            return gen

    async def _on(self, i: int, request: GenerationRequest) -> Generation:
        """``engines[i].generate(request)``, or :class:`EngineDied` as soon as engine ``i`` is taken out (by this
        call's failure, another call's, or a heartbeat)."""
        if self._dead[i].is_set():
            raise EngineDied
        call = asyncio.ensure_future(self.engines[i].generate(request))
        dead = asyncio.ensure_future(self._dead[i].wait())
        try:
            await asyncio.wait({call, dead}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled by the caller: the engine call goes with it
            call.cancel()
            raise
        finally:
            dead.cancel()
        if not call.done():  # taken out while this request ran there (a hung engine never answers)
            call.cancel()
            call.add_done_callback(_retrieve)
            raise EngineDied
        exc = call.exception()
        if exc is None:
            return call.result()
        if is_engine_failure(exc):
            self._take_out(i, f"generate {request.request_id!r}: {type(exc).__name__}: {exc}")
            raise EngineDied from exc
        raise exc

    def _take_out(self, i: int, why: str) -> None:
        if self.alive[i]:
            self.alive[i] = False
            self.failures.append((i, why[:500]))
            self._dead[i].set()

    # ------------------------------------------------------------------ health
    def _start_monitor(self) -> None:
        if self.health_interval is not None and (self._monitor is None or self._monitor.done()):
            self._monitor = asyncio.get_running_loop().create_task(self._heartbeat())

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await self.check_health()

    async def check_health(self) -> list[int]:
        """One heartbeat of every live engine that has a check (``health_check`` or its own ``health()``); an
        engine whose check raises or takes longer than ``health_timeout`` is taken out. Returns the indices taken
        out by this call."""
        async def one(i: int) -> bool:
            e = self.engines[i]
            check = self.health_check(e) if self.health_check is not None else (
                e.health() if callable(getattr(e, "health", None)) else None)
            if check is None:
                return True
            self._counts["health_checks"] += 1
            try:
                await asyncio.wait_for(check, self.health_timeout)
                return True
            except Exception as exc:  # any failure of the heartbeat means the engine is out
                self._take_out(i, f"heartbeat: {type(exc).__name__}: {exc}")
                return False

        live = self._live()
        ok = await asyncio.gather(*[one(i) for i in live])
        return [i for i, good in zip(live, ok) if not good]

    async def rejoin(self, index: int, engine: RolloutEngine | None = None, *,
                     weights: Iterable[tuple[str, Tensor]] | None = None) -> None:
        """Bring engine ``index`` back (``engine``: a new client for the restarted server; default the one it
        had). With ``weights`` it is first loaded with them as the live engines' version; either way it rejoins
        only when its version equals theirs (else :class:`~rlblocks.errors.EngineError`, and it stays out). It is
        paused the way the live engines are, if they are."""
        index = check_int("index", index, minimum=0, maximum=len(self.engines) - 1)
        if self.alive[index]:
            raise ArgumentError(f"index: engine {index} is live; only an engine that was taken out can rejoin")
        e = self.engines[index] if engine is None else check_engine("engine", engine)
        async with self._weights:
            live = self._live()
            target = self.version if live else int(e.version)
            if weights is not None:
                await e.update_weights(list(weights), version=target, allow_rollback=True)
            if int(e.version) != target:
                raise EngineError(f"rejoin: engine {index} serves version {e.version}, the live engines {target}; "
                                  "load the current weights into it first (weights=...)")
            if self._paused is not None:
                await e.pause(self._paused)
            self.engines[index] = e
            self._dead[index] = asyncio.Event()
            self.alive[index] = True
            self._counts["rejoins"] += 1

    async def _broadcast(self, what: str, call: Callable[[RolloutEngine], Awaitable[Any]],
                         targets: Iterable[int] | None = None) -> list[Any]:
        """``call`` on every live engine (of ``targets``) at once; an engine failure takes that engine out, any
        other error is raised after every call has returned (the first one)."""
        live = [i for i in (self._live() if targets is None else targets) if self.alive[i]]
        results = await asyncio.gather(*[call(self.engines[i]) for i in live], return_exceptions=True)
        first: BaseException | None = None
        out = []
        for i, r in zip(live, results):
            if isinstance(r, BaseException):
                if is_engine_failure(r):
                    self._take_out(i, f"{what}: {type(r).__name__}: {r}")
                elif first is None:
                    first = r
            else:
                out.append(r)
        if first is not None:
            raise first
        return out

    async def abort(self, request_ids: Iterable[str] | None = None) -> list[str]:
        """Abort on the engines holding ``request_ids`` (``None``: every engine, every request). Returns the ids
        the engines report as aborted."""
        if request_ids is None:
            parts = await self._broadcast("abort", lambda e: e.abort(None))
            return [rid for part in parts for rid in part]
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        by_engine: dict[int, list[str]] = {}
        for rid in ids:
            if rid in self._where:
                by_engine.setdefault(self._where[rid], []).append(rid)
        parts = []
        for i, rs in by_engine.items():  # each engine gets its own ids (a dead one is skipped: nothing runs there)
            parts += await self._broadcast("abort", lambda e, rs=rs: e.abort(rs), [i])
        return [rid for part in parts for rid in part]

    async def pause(self, mode: Literal["abort", "keep"] = "abort") -> None:
        """Pause every engine (``mode`` as in the protocol)."""
        if mode not in ("abort", "keep"):
            raise ArgumentError(f"mode: expected 'abort' or 'keep', got {mode!r}")
        self._paused = mode
        await self._broadcast("pause", lambda e: e.pause(mode))

    async def resume(self) -> None:
        """Resume every live engine."""
        self._paused = None
        await self._broadcast("resume", lambda e: e.resume())

    async def update_weights(
        self,
        named_tensors: Iterable[tuple[str, Tensor]],
        *,
        version: int,
        partial: bool = False,
        allow_rollback: bool = False,
    ) -> None:
        """Broadcast one weight update to the live engines. Each engine checks it with the same rule before
        loading, so engines of the same model refuse the same update (:class:`~rlblocks.errors.WeightUpdateError`);
        the first refusal is re-raised after every call has returned. An engine that fails it otherwise is taken
        out (it rejoins with the weights, :meth:`rejoin`)."""
        items = list(named_tensors)
        async with self._weights:
            await self._broadcast("update_weights", lambda e: e.update_weights(
                items, version=version, partial=partial, allow_rollback=allow_rollback))

    async def sleep(self, level: int = 1) -> None:
        """Put every live engine to sleep at ``level`` (the protocol's meaning: in-flight requests are aborted)."""
        await self._broadcast("sleep", lambda e: e.sleep(level))

    async def wake(self) -> None:
        """Wake every live engine."""
        await self._broadcast("wake", lambda e: e.wake())

    def close(self) -> None:
        """Close every engine (each close is idempotent, so this is too)."""
        for e in self.engines:
            e.close()

    async def aclose(self) -> None:
        """Stop the heartbeat and close every engine from inside the event loop (``aclose`` where the engine has
        it)."""
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
        for e in self.engines:
            closer = getattr(e, "aclose", None)
            if closer is not None:
                await closer()
            else:
                e.close()
