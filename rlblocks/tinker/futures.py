"""The server side of Tinker's futures: every long request returns a request id at once; ``retrieve_future``
answers it.

- While the request runs, ``retrieve_future`` holds the poll open for up to ``poll_seconds`` (an event wait, no
  busy loop) and then answers ``{"type": "try_again", ...}``, which the SDK re-polls at once.
- Once done it answers the result (JSON, or protobuf for ``ForwardBackwardOutput`` / ``SampleResponse``), and keeps
  answering the same result to every poll for ``keep_seconds`` (a poll whose answer was lost is simply repeated);
  a failed request answers ``{"error": ..., "category": "user" | "server"}``, which the SDK raises as
  ``RequestFailedError``.
- **Idempotent submission**: each request carries a key (``(model_id, seq_id)`` for training requests,
  ``(sampling_session_id, seq_id)`` for samples, ``(session_id, model_seq_id)`` for model creation). A retried
  submission with a key seen before gets the first submission's request id back and is not run again, so nothing
  runs twice and nothing is lost when the client retries a request whose answer it never received.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
import uuid
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from rlblocks.errors import RequestError


@dataclass(eq=False)
class FutureRecord:
    """One request: pending until :meth:`FutureStore.finish` or :meth:`FutureStore.fail`."""

    request_id: str
    kind: str
    created: float
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: Any = None  # dict (JSON) or bytes (protobuf)
    proto: bool = False
    error: str | None = None
    category: str = "user"
    done_at: float | None = None
    task: asyncio.Task | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pending(self) -> bool:
        return not self.done.is_set()


class FutureStore:
    """Request ids, their results and the submission keys that make retries idempotent (see the module docstring)."""

    def __init__(self, *, poll_seconds: float = 20.0, keep_seconds: float = 3600.0) -> None:
        self.poll_seconds = float(poll_seconds)
        self.keep_seconds = float(keep_seconds)
        self._records: dict[str, FutureRecord] = {}
        self._by_key: dict[Hashable, str] = {}
        self._key_of: dict[str, Hashable] = {}
        self._done: collections.deque[FutureRecord] = collections.deque()  # in completion order, for pruning
        self._prefix = uuid.uuid4().hex[:8]
        self._counter = itertools.count()
        self.stats = {"submitted": 0, "deduplicated": 0, "failed": 0}

    def create(self, kind: str, key: Hashable | None = None) -> tuple[FutureRecord, bool]:
        """``(record, is_new)``: a new pending record, or the one already submitted under ``key``."""
        self._prune()
        if key is not None and key in self._by_key and self._by_key[key] in self._records:
            self.stats["deduplicated"] += 1
            return self._records[self._by_key[key]], False
        rid = f"{self._prefix}-{next(self._counter)}"
        rec = FutureRecord(rid, kind, time.time())
        self._records[rid] = rec
        if key is not None:
            self._by_key[key] = rid
            self._key_of[rid] = key
        self.stats["submitted"] += 1
        return rec, True

    def lookup(self, key: Hashable) -> FutureRecord | None:
        """The record submitted under ``key``, if it is still kept."""
        rid = self._by_key.get(key)
        return None if rid is None else self._records.get(rid)

    def finish(self, rec: FutureRecord, result: Any, *, proto: bool = False) -> None:
        if not rec.pending:
            return
        rec.result, rec.proto, rec.done_at = result, proto, time.time()
        self._done.append(rec)
        rec.done.set()

    def fail(self, rec: FutureRecord, error: str, *, category: str = "user") -> None:
        if not rec.pending:
            return
        rec.error, rec.category, rec.done_at = error, category, time.time()
        self.stats["failed"] += 1
        self._done.append(rec)
        rec.done.set()

    def get(self, request_id: str) -> FutureRecord:
        rec = self._records.get(request_id)
        if rec is None:
            raise RequestError(f"request_id: unknown or expired request {request_id!r} (results are kept "
                               f"{self.keep_seconds:.0f} s after they are ready)", status=404)
        return rec

    async def wait(self, request_id: str, timeout: float | None = None) -> FutureRecord:
        """The record once done, or still pending after ``timeout`` (default ``poll_seconds``)."""
        rec = self.get(request_id)
        if rec.pending:
            wait = self.poll_seconds if timeout is None else timeout
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(rec.done.wait()), wait)
        return rec

    def _prune(self) -> None:
        cutoff = time.time() - self.keep_seconds
        while self._done and self._done[0].done_at < cutoff:  # oldest first: O(1) per request
            rid = self._done.popleft().request_id
            self._records.pop(rid, None)
            key = self._key_of.pop(rid, None)
            if key is not None and self._by_key.get(key) == rid:
                del self._by_key[key]


__all__ = ["FutureRecord", "FutureStore"]
