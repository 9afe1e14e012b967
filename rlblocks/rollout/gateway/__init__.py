"""An OpenAI-compatible HTTP server in front of any RolloutEngine that captures trainable trajectories
(AReaL's online-proxy contract: an agent written for the ``openai`` client produces RL data without change).

:class:`Gateway` serves ``/v1/chat/completions`` and ``/v1/completions`` (and the models, health and session
routes). Each request belongs to a session (the ``X-Session-Id`` header, else the body's ``user``, else a new one);
a session accumulates one :class:`~rlblocks.rollout.agents.Trajectory` with the exact ids, processed log-probs and
weight versions the engine produced. The re-sent history is matched by content, never by re-tokenising what the
model sampled, so a session stays one trajectory; a history that does not extend it branches it (counted). A turn
is captured only once its whole response reached an open connection. ``POST /v1/sessions/{id}/reward`` closes the
session and hands its trajectory to the queue (a :class:`~rlblocks.sched.StalenessQueue`, an ``asyncio.Queue``, a
callable, or None); a trajectory the queue refuses is kept, never dropped, and the counters conserve every session
and trajectory. Errors are OpenAI-style JSON with a 4xx/5xx status. The full contract: ``docs/rollout/gateway.md``.

Why a server of its own: the capture must sit where the tokens are (the engine's ids, not the client's text), and
an agent program must not change to produce training data.

Server library: FastAPI + uvicorn (the optional extra ``rlblocks[gateway]``), run as a coroutine on the caller's
event loop, which must be the engine's (the in-process engines are bound to one loop). It serves loopback/cluster
traffic from trusted agent programs; put a real proxy in front of it for anything else.

Layout: ``schema.py`` (request models and response shapes), ``sessions.py`` (sessions, turn capture, hand-over),
``server.py`` (:class:`Gateway`: the app and its server). Only ``server.py`` imports FastAPI and uvicorn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlblocks._lazy import lazy_exports

if TYPE_CHECKING:
    from .server import Gateway

__all__ = ["Gateway"]

_LAZY = {"Gateway": ".server"}  # the server imports FastAPI and uvicorn (optional extra)


__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
