"""The request lifecycle every engine shares: the state machine of pause / sleep / wake / close that
:class:`~rlblocks.rollout.types.RolloutEngine` documents (:class:`Lifecycle`), the table of requests in flight
(:class:`InFlight`, with :class:`RequestState` for engines whose requests wait on an abort), per-token weight
versions from version spans (:func:`versions_from_spans`), and :class:`EngineBase`, which answers the protocol's
state queries (``version``, ``is_paused``, ``num_in_flight``, ``stats()``) from them. An engine subclasses
:class:`EngineBase` and keeps only what is its own: how it generates, aborts on its backend and loads weights.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rlblocks.errors import ArgumentError, EngineError

from ..types import GenerationRequest

__all__ = [
    "EngineBase",
    "InFlight",
    "Lifecycle",
    "RequestState",
    "hold",
    "versions_from_spans",
    "wait_first",
    "wait_returned",
]

R = TypeVar("R")


async def wait_first(*events: asyncio.Event) -> None:
    """Wait until any of ``events`` is set (e.g. the engine's run gate, or this request's abort); the waits that
    did not finish are cancelled, also when the caller is."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


class Lifecycle:
    """Pause / sleep / wake / close state of one engine, with the rules of the protocol (see
    :class:`~rlblocks.rollout.types.RolloutEngine`). The engine calls the ``check_*`` methods before acting and
    the ``on_*`` methods after; ``paused`` says whether the engine may generate.

    - ``user_paused``: between the caller's ``engine.pause()`` and ``engine.resume()``;
    - ``sleep_level``: 0 awake, 1 or 2 asleep;
    - ``needs_weights``: after waking from level 2, until a complete update loads weights;
    - ``updating``: an update that paused the engine itself is running.
    """

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.user_paused = False
        self.sleep_level = 0
        self.needs_weights = False
        self.updating = 0
        self.closed = False

    @property
    def paused(self) -> bool:
        return bool(self.user_paused or self.sleep_level or self.needs_weights or self.updating)

    def check_open(self) -> None:
        if self.closed:
            raise EngineError(f"{self.engine}: the engine is closed")

    def check_pause(self, mode: object) -> None:
        """The checks of ``pause(mode)``: a known mode, an open engine."""
        if mode not in ("abort", "keep"):
            raise ArgumentError(f"mode: expected 'abort' or 'keep', got {mode!r}")
        self.check_open()

    def check_resume(self) -> None:
        self.check_open()
        if self.sleep_level:
            raise EngineError(f"{self.engine}.resume: the engine is asleep (level {self.sleep_level}); call wake()")
        if self.needs_weights:
            raise EngineError(
                f"{self.engine}.resume: sleep(level=2) discarded the weights; load a complete update_weights(...) "
                "first (it resumes generation itself)"
            )

    def check_update(self, partial: bool) -> None:
        self.check_open()
        if self.sleep_level:
            raise EngineError(
                f"{self.engine}.update_weights: the engine is asleep (level {self.sleep_level}); call wake() first"
            )
        if self.needs_weights and partial:
            from ._weights import refuse

            raise refuse(
                self.engine,
                "sleep(level=2) discarded the weights, so the next update must be complete (partial=False)",
            )

    def check_sleep(self, level: object) -> bool:
        """Validate ``level``; False if the engine is already asleep at that level (a no-op)."""
        self.check_open()
        if isinstance(level, bool) or level not in (1, 2):
            raise ArgumentError(f"level: expected 1 or 2, got {level!r}")
        if self.sleep_level == level:
            return False
        if self.sleep_level:
            raise EngineError(f"{self.engine}.sleep: already asleep at level {self.sleep_level}; call wake() first")
        return True

    def on_sleep(self, level: int) -> None:
        self.sleep_level = int(level)

    def on_wake(self) -> int:
        """Returns the level the engine slept at (0: it was awake, a no-op)."""
        level, self.sleep_level = self.sleep_level, 0
        if level == 2:
            self.needs_weights = True
        return level

    def on_complete_update(self) -> None:
        self.needs_weights = False


class InFlight(dict[str, R]):
    """The requests of one engine submitted and not yet returned: request id -> the engine's entry for it, in
    submission order. ``note`` ends the message of a refused duplicate id (e.g. why the backend needs unique ids)."""

    def __init__(self, note: str = "") -> None:
        super().__init__()
        self.note = note

    def check_new(self, request_id: str) -> None:
        """Refuse an id already in flight (:class:`~rlblocks.errors.ArgumentError`)."""
        if request_id in self:
            raise ArgumentError(f"request_id: {request_id!r} is already in flight{self.note}")

    def add(self, request_id: str, entry: R) -> R:
        self.check_new(request_id)
        self[request_id] = entry
        return entry

    def select(self, request_ids: Iterable[str] | str | None) -> list[str]:
        """The ids an ``abort(request_ids)`` acts on: every request in flight for ``None``, else those of
        ``request_ids`` (a bare str is one id) that are in flight, in the given order; other ids are dropped (the
        protocol's documented no-op)."""
        if request_ids is None:
            return list(self)
        wanted = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        return [r for r in wanted if r in self]


@dataclass(eq=False)
class RequestState:
    """An in-flight entry for engines whose requests may wait in the client (behind a gate) before they reach the
    backend: ``aborted`` wakes such a waiting request; ``abort_requested`` tells a request that has not been sent
    yet that it must not be; ``done`` is set when its ``generate`` call returns. Engines subclass it with their
    backend's handles."""

    request: GenerationRequest
    abort_requested: bool = False
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def mark_aborted(self) -> None:
        self.abort_requested = True
        self.aborted.set()


async def hold(gate: asyncio.Event, state: RequestState, lifecycle: Lifecycle) -> bool:
    """Hold a request in the client while ``gate`` is clear (the engine keeps new requests from its backend: asleep,
    waiting for weights, paused), until the gate opens or the request is aborted. Returns True when the request was
    aborted (it must not be sent: it returns with nothing generated); raises
    :class:`~rlblocks.errors.EngineError` when the engine was closed meanwhile."""
    if not gate.is_set():
        await wait_first(gate, state.aborted)
        lifecycle.check_open()
    return state.abort_requested


async def wait_returned(states: Iterable[RequestState], timeout: float) -> None:
    """Wait, at most ``timeout`` seconds, until the ``generate`` call of every one of ``states`` has returned (their
    ``done`` events); used after aborting them, so that a pause or close returns once their partial outputs have."""
    waits = [asyncio.ensure_future(s.done.wait()) for s in states if not s.done.is_set()]
    if waits:
        try:
            await asyncio.wait(waits, timeout=timeout)
        finally:
            for w in waits:
                w.cancel()


def versions_from_spans(
    spans: Iterable[tuple[int, int, int]], n: int, *, what: str, error: type[Exception] = EngineError
) -> list[int]:
    """Per-token weight versions from ``(version, start, end)`` spans over a generation's ``n`` output tokens.

    The spans must be contiguous from 0 (``start`` of each is the ``end`` of the one before, ``end >= start``) and
    cover exactly ``n`` tokens; otherwise ``error`` is raised, its message starting with ``what`` (the backend's
    field and the request)."""
    versions: list[int] = []
    cuts = list(spans)
    for v, start, end in cuts:
        if start != len(versions) or end < start:
            raise error(f"{what}: spans {cuts} are not contiguous")
        versions.extend([v] * (end - start))
    if len(versions) != n:
        raise error(f"{what}: spans cover {len(versions)} of the {n} tokens")
    return versions


class EngineBase:
    """What every engine answers the same way: its :class:`Lifecycle` state (``_state``), the requests in flight
    (``_inflight``), the committed weight version (``_version``) and its counters (``_stats``, a dataclass).
    Subclasses call ``super().__init__(name, version=..., stats=...)`` first."""

    def __init__(self, name: str, *, version: int, stats: Any, duplicate_note: str = "") -> None:
        self._state = Lifecycle(name)
        self._inflight: InFlight[Any] = InFlight(duplicate_note)
        self._version = int(version)
        self._stats = stats

    @property
    def version(self) -> int:
        """The weight version that new tokens are tagged with (changes only once a whole update is loaded)."""
        return self._version

    @property
    def is_paused(self) -> bool:
        """True while the engine does not generate: paused by ``pause()``, asleep, waiting for weights after a
        level-2 sleep, or inside an update that paused it."""
        return self._state.paused

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet returned (running, frozen or waiting)."""
        return len(self._inflight)

    def in_flight_ids(self) -> list[str]:
        """The request ids submitted and not yet returned, in submission order."""
        return list(self._inflight)

    def stats(self) -> dict:
        """The engine's counters (its stats dataclass) as a dict."""
        return dataclasses.asdict(self._stats)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()  # every engine defines close()
