"""Small pieces every engine shares: waiting on the first of several events, and the state
machine of pause / sleep / wake / close that :class:`~rlblocks.rollout.types.RolloutEngine` documents."""

from __future__ import annotations

import asyncio

from rlblocks.errors import ArgumentError, EngineError

__all__ = ["Lifecycle", "wait_first"]


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
