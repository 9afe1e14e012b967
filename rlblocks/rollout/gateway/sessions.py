"""The gateway's sessions: one :class:`~rlblocks.rollout.agents.Trajectory` per session, built turn by turn, and
its hand-over to the queue when the session is closed with a reward.

A turn is captured in two steps. :meth:`SessionStore.begin_turn` extends the trajectory to the request's rendering
and :meth:`SessionStore.record` appends the engine's generation; nothing is final until :meth:`SessionStore.commit`,
called once the whole response was written to a connection that was still open. Any other end (an error answer, an
engine failure, a client that went away before the answer reached it, a cancelled request) calls
:meth:`SessionStore.rollback`: the trajectory is exactly what it was before the request, so a retry of that turn
extends it again instead of branching, and an undelivered turn is never trained with the episode's reward (it is
counted in ``turns_undelivered`` / ``tokens_undelivered``).

Closing a session (:meth:`SessionStore.finish`) hands its trajectory to the queue *before* the session is deleted. If
the queue refuses it (closed, still full after ``handover_timeout``, a callable that raised, the gateway shutting
down) the trajectory goes to :attr:`SessionStore.finished` instead and :class:`~rlblocks.errors.QueueRefused` is
raised (503 over HTTP): it is never dropped. :meth:`SessionStore.flush` offers the kept trajectories to the queue
again; :meth:`SessionStore.take_finished` hands them to the caller.

Conservation (checked by the tests), from :meth:`SessionStore.stats`::

    sessions_opened   == sessions_open + sessions_finished + sessions_discarded
    sessions_finished == handed_over + finished_kept + finished_taken

where ``finished_kept == len(finished)``, a discarded session is one in which nothing was captured (its first
request failed), and ``finished_taken`` counts what :meth:`SessionStore.take_finished` returned. A session whose
hand-over is waiting for room in a full queue is still open (``handovers_waiting`` counts them).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlblocks._checks import check_real
from rlblocks.errors import ArgumentError, GatewayError, PrefixMismatchError, QueueRefused, SessionNotFound

from ..agents.trajectory import OnMismatch, Trajectory
from ..resume import ResumableResult

__all__ = ["Session", "SessionStore", "Turn", "fingerprint"]

_MISSING = object()


@dataclass
class Session:
    """An open session: its trajectory (None until a turn was captured), the assistant messages it returned
    (fingerprint -> the model's raw text, so a re-sent history renders back the sampled text), how many requests
    it served, and the lock that serves them one at a time."""

    session_id: str
    trajectory: Trajectory | None = None
    returned: dict[str, str] = field(default_factory=dict)
    requests: int = 0
    created: float = field(default_factory=time.time)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass
class Turn:
    """One request's change to its session, undone by :meth:`SessionStore.rollback` unless committed."""

    session: Session
    saved: dict[str, Any] | None  # the trajectory's state before the request (None: there was no trajectory)
    mismatches_before: int
    generated: int = 0
    fingerprint: str | None = None
    replaced: Any = _MISSING  # what ``returned[fingerprint]`` held before this turn


def fingerprint(content: str | None, tool_calls: Sequence[Mapping[str, Any]] | None) -> str:
    """What identifies an assistant message the gateway returned, when the client sends it back."""
    calls = []
    for tc in tool_calls or ():
        fn = tc.get("function", {}) if isinstance(tc, Mapping) else {}
        calls.append([tc.get("id") if isinstance(tc, Mapping) else None, fn.get("name"), fn.get("arguments")])
    return json.dumps([content or "", calls], sort_keys=True)


def _first_edit(stored: list[dict[str, Any]], messages: list[dict[str, Any]], stored_tools: Any, tools: Any
                ) -> str | None:
    """Why a request's history is not the session's (compared by content, after :meth:`SessionStore.canonical`):
    the first stored message it does not re-send unchanged, or a changed tool list; None when it re-sends all."""
    if (stored_tools or None) != (tools or None):
        return "; the request's tools differ from the session's"
    for i, m in enumerate(stored):
        if i >= len(messages):
            return f"; the request re-sends {len(messages)} of the session's {len(stored)} messages"
        if messages[i] != m:
            return (f"; messages[{i}] (role {messages[i].get('role')!r}) is not the message the session has there "
                    f"(role {m.get('role')!r})")
    return None


def _snapshot(traj: Trajectory | None) -> dict[str, Any] | None:
    """The state of ``traj`` (its lists copied), to undo what a request appended."""
    if traj is None:
        return None
    return {k: (list(v) if isinstance(v, list) else v) for k, v in traj.__dict__.items()}


class SessionStore:
    """Open sessions, the trajectories kept in :attr:`finished`, and the counters of both (module docstring).

    Args:
        queue: a :class:`~rlblocks.sched.StalenessQueue` (``aput(trajectory, oldest_version)``), an
            ``asyncio.Queue``, a callable (sync or async) or None (everything is kept in :attr:`finished`).
        current_version: the engine's version, the queue key of a trajectory without model tokens.
        max_open_sessions: more open sessions are refused with 429.
        handover_timeout: seconds a hand-over waits for room in a full queue (None: as long as it takes, which
            holds the reward request: backpressure from the trainer to the agents).
        counts: the gateway's counters (shared with the server's request counters).
    """

    def __init__(self, *, queue: Any, current_version: Callable[[], int], max_open_sessions: int,
                 handover_timeout: float | None, counts: Counter[str]) -> None:
        self.queue = queue
        self._version = current_version
        self.max_open_sessions = max_open_sessions
        self.handover_timeout = handover_timeout
        self.counts = counts
        self.sessions: dict[str, Session] = {}
        self.finished: list[Trajectory] = []
        self._waiting = 0
        self._flush_lock = asyncio.Lock()
        self._flushing = 0  # a kept trajectory that flush() is offering to the queue (still counted as kept)

    # ------------------------------------------------------------------ sessions
    def open(self, session_id: str | None) -> Session:
        """The open session ``session_id``, or a new one (a fresh id when None); 429 when too many are open."""
        if session_id is None:
            session_id = f"sess-{uuid.uuid4().hex}"
        sess = self.sessions.get(session_id)
        if sess is None:
            if len(self.sessions) >= self.max_open_sessions:
                raise GatewayError(429, f"too many open sessions ({self.max_open_sessions}); post rewards to close "
                                   "finished ones", type="rate_limit_error", code="too_many_sessions")
            sess = self.sessions[session_id] = Session(session_id)
            self.counts["sessions_opened"] += 1
        return sess

    def release(self, sess: Session) -> None:
        """End of a request: a session in which nothing was captured is not left open (it would count against
        ``max_open_sessions`` for good)."""
        if sess.trajectory is None and self.sessions.get(sess.session_id) is sess:
            del self.sessions[sess.session_id]
            self.counts["sessions_discarded"] += 1

    def canonical(self, sess: Session, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Assistant messages the gateway returned on ``sess`` become the model's raw text (what was sampled)."""
        out = []
        for m in messages:
            if m["role"] == "assistant":
                raw = sess.returned.get(fingerprint(m.get("content"), m.get("tool_calls")))
                if raw is not None:
                    m = {"role": "assistant", "content": raw}
            out.append(m)
        return out

    # ------------------------------------------------------------------ turns (the session's lock is held)
    def begin_turn(self, sess: Session, prompt: str | list[int], *, messages: list[dict[str, Any]] | None,
                   tools: list[dict[str, Any]] | None, on_mismatch: OnMismatch, tokenizer: Any,
                   template_kwargs: Mapping[str, Any] | None = None) -> Turn:
        """Extend ``sess``'s trajectory to ``prompt`` for a new turn: the request's rendering (the chat template's
        text of ``messages``, or a completion's text), or a completion's token ids.

        A text is matched against the trajectory by content, never by re-tokenising what the model sampled: when it
        starts with the trajectory's text, only the rest is tokenised and appended
        (:meth:`~rlblocks.rollout.agents.Trajectory.extend_to_text`); a history the client edited, or that the
        template rewrote, falls back to the token-level prefix check (a branch, counted). Token ids must extend the
        trajectory's ids exactly.

        409 when the session was closed by a reward while the request waited, or when the prompt does not extend
        the trajectory and ``on_mismatch="raise"`` (naming the first message that differs from the session's
        stored one); 400 when the trajectory refuses the ids."""
        sid = sess.session_id
        current = self.sessions.get(sid)
        if current is None and sess.trajectory is None:
            # dropped while empty by a concurrent first request that failed (never closed by a reward, which
            # needs a trajectory): open it again for this request
            current = self.sessions[sid] = sess
            self.counts["sessions_opened"] += 1
        if current is not sess:
            raise GatewayError(409, f"session {sid!r} was closed by a reward", code="session_closed")
        turn = Turn(sess, _snapshot(sess.trajectory),
                    0 if sess.trajectory is None else sess.trajectory.prefix_mismatches)
        traj = sess.trajectory
        try:
            if traj is None:
                ids = list(tokenizer.encode(prompt, add_special_tokens=False)) if isinstance(prompt, str) else prompt
                sess.trajectory = Trajectory(ids, messages=messages, tools=tools, session_id=sid,
                                             template_kwargs=template_kwargs)
            elif isinstance(prompt, str):
                traj.extend_to_text(tokenizer, prompt, on_mismatch=on_mismatch, messages=messages)
            else:
                traj.extend_to(prompt, on_mismatch=on_mismatch, tokenizer=tokenizer)
        except PrefixMismatchError as e:
            edited = None if messages is None else _first_edit(traj.messages, messages, traj.tools, tools)
            self.rollback(turn)
            raise GatewayError(409, f"{e}{edited or ''}", code="prefix_mismatch") from e
        except ArgumentError as e:  # the request's own tokens were refused: the client's error, not ours
            self.rollback(turn)
            raise GatewayError(400, f"{'messages' if messages is not None else 'prompt'}: {e}",
                               param="messages" if messages is not None else "prompt", code="invalid_value") from e
        sess.requests += 1
        return turn

    def record(self, turn: Turn, result: ResumableResult, raw: str, returned: str | None) -> None:
        """Append the engine's generation (``raw``: its decoded text, the assistant message of the trajectory);
        ``returned``: the fingerprint of the message the client receives (chat), mapped back to ``raw``."""
        turn.session.trajectory.append_generation(result, message={"role": "assistant", "content": raw})
        turn.generated = len(result.output_ids)
        if returned is not None:
            turn.fingerprint, turn.replaced = returned, turn.session.returned.get(returned, _MISSING)
            turn.session.returned[returned] = raw

    def commit(self, turn: Turn) -> None:
        """The response reached the client: the turn is part of the trajectory for good."""
        self.counts["prefix_mismatches"] += turn.session.trajectory.prefix_mismatches - turn.mismatches_before

    def rollback(self, turn: Turn, *, undelivered: bool = False) -> None:
        """Undo everything the request changed (``undelivered``: a generated turn whose answer never reached the
        client; counted, its tokens are not trained)."""
        sess = turn.session
        if turn.saved is None:
            sess.trajectory = None
        else:
            sess.trajectory.__dict__.clear()
            sess.trajectory.__dict__.update(turn.saved)
        if turn.fingerprint is not None:
            if turn.replaced is _MISSING:
                sess.returned.pop(turn.fingerprint, None)
            else:
                sess.returned[turn.fingerprint] = turn.replaced
        if undelivered:
            self.counts["turns_undelivered"] += 1
            self.counts["tokens_undelivered"] += turn.generated

    # ------------------------------------------------------------------ closing
    async def finish(self, session_id: str, reward: float, *, info: Mapping[str, Any] | None = None) -> Trajectory:
        """Close ``session_id`` with ``reward`` and hand its trajectory to the queue (module docstring); returns
        it. Waits for a request of that session that is still being served.

        Raises :class:`~rlblocks.errors.SessionNotFound` (an ``ArgumentError``) for a session that is not open,
        ``ArgumentError`` for a reward that is not a finite number (a NaN reward would poison its whole group's
        advantages) or an ``info`` that is not a mapping, and :class:`~rlblocks.errors.QueueRefused` when the
        queue refused the trajectory (closed with its reward and kept in :attr:`finished`)."""
        reward = check_real("reward", reward, finite=True)
        if info is not None and not isinstance(info, Mapping):
            raise ArgumentError(f"info: expected None or a mapping, got {type(info).__name__}")
        sess = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if sess is None:
            raise SessionNotFound(f"session_id: no open session {session_id!r} (unknown, or already closed by a "
                                  "reward)")
        async with sess.lock:
            if self.sessions.get(session_id) is not sess or sess.trajectory is None:
                raise SessionNotFound(f"session_id: no open session {session_id!r} (closed by a reward meanwhile, "
                                      "or nothing was captured)")
            traj = sess.trajectory
            traj.reward = reward
            traj.info.update(dict(info or {}), requests=sess.requests)
            try:
                queued = await self._hand_over(traj)
            except BaseException as e:  # refused, or cancelled while waiting for room: kept, never dropped
                self._close(sess)
                self.finished.append(traj)
                self.counts["handover_refused"] += 1
                if not isinstance(e, Exception):
                    raise
                raise QueueRefused(
                    f"session {session_id!r} was closed with reward {reward:g}, but the queue refused its trajectory "
                    f"({type(e).__name__}: {e}); it is kept in Gateway.finished", session_id=session_id,
                    trajectory=traj) from e
            self._close(sess)
            if queued:
                self.counts["handed_over"] += 1
            else:
                self.finished.append(traj)
        return traj

    def _close(self, sess: Session) -> None:
        del self.sessions[sess.session_id]
        self.counts["sessions_finished"] += 1

    async def _hand_over(self, traj: Trajectory) -> bool:
        """Put ``traj`` into the queue; False when there is no queue (kept). Raises what the queue raised."""
        q = self.queue
        if q is None:
            return False
        self._waiting += 1
        try:
            if hasattr(q, "aput"):
                version = traj.oldest_version
                await q.aput(traj, int(self._version()) if version is None else version,
                             timeout=self.handover_timeout)
            elif isinstance(q, asyncio.Queue):
                await asyncio.wait_for(q.put(traj), self.handover_timeout)
            else:
                r = q(traj)
                if inspect.isawaitable(r):
                    await asyncio.wait_for(r, self.handover_timeout)
        finally:
            self._waiting -= 1
        return True

    async def flush(self) -> list[Trajectory]:
        """Offer the kept trajectories to the queue again, oldest first; stops at the first refusal. Returns what
        is still kept (also in :attr:`finished`)."""
        if self.queue is None:
            return list(self.finished)
        async with self._flush_lock:  # one flush at a time, and each trajectory leaves `finished` while offered:
            while self.finished:      # neither a second flush nor take_finished() can hand it over twice
                traj = self.finished.pop(0)
                self._flushing = 1
                try:
                    await self._hand_over(traj)
                except BaseException as e:
                    self.finished.insert(0, traj)
                    if not isinstance(e, Exception):
                        raise
                    self.counts["handover_refused"] += 1
                    break
                finally:
                    self._flushing = 0
                self.counts["handed_over"] += 1
        return list(self.finished)

    def take_finished(self) -> list[Trajectory]:
        """Hand the kept trajectories to the caller (and forget them: counted in ``finished_taken``)."""
        out, self.finished = self.finished, []
        self.counts["finished_taken"] += len(out)
        return out

    def stats(self) -> dict[str, int]:
        """The session and hand-over counters (module docstring for the identities they satisfy)."""
        c = self.counts
        out = {k: int(c[k]) for k in ("sessions_opened", "sessions_finished", "sessions_discarded", "handed_over",
                                      "handover_refused", "finished_taken", "turns_undelivered",
                                      "tokens_undelivered", "prefix_mismatches")}
        out["sessions_open"] = len(self.sessions)
        out["finished_kept"] = len(self.finished) + self._flushing
        out["handovers_waiting"] = self._waiting
        return out
