"""An OpenAI-compatible HTTP server in front of any RolloutEngine that captures trainable trajectories
(AReaL's online-proxy contract: an agent written for the ``openai`` client produces RL data without change).

Endpoints (JSON over HTTP/1.1 with keep-alive; server-sent events for ``stream=true``):

- ``POST /v1/chat/completions``: ``messages``, ``temperature``, ``top_p``, ``top_k`` (extension),
  ``max_tokens``/``max_completion_tokens``, ``stop``, ``seed``, ``logprobs`` (the sampled tokens' processed
  log-probs; ``top_logprobs`` > 0 is refused: the engines report the sampled token only), ``tools`` and
  ``tool_choice`` (``"auto"``/``"none"``) with Hermes tool calls parsed into ``message.tool_calls``, ``stream``
  with ``stream_options.include_usage``.
- ``POST /v1/completions``: ``prompt`` as text or token ids (token-in), the same sampling fields, ``logprobs=0``.
- ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``.
- ``POST /v1/sessions/{id}/reward`` with ``{"reward": r}`` closes a session and hands its trajectory to the queue
  (:meth:`Gateway.finish_session` is the same from Python); ``GET /v1/sessions/{id}`` summarises an open session.

Sessions. A request belongs to the session named by the ``X-Session-Id`` header, else by the body's ``user``
field, else to a new session whose id comes back in the ``X-Session-Id`` response header and in
``response["rlblocks"]["session_id"]``. A session id holding a control character (CR/LF would forge response
headers) or longer than 512 characters is refused with a 400 naming the header or ``user``. Each session
accumulates one :class:`~rlblocks.rollout.agents.Trajectory` with the exact ids, processed log-probs and weight
versions the engine produced. A chat request's messages are rendered with the chat template; assistant messages this
gateway returned (recognised by content and tool-call ids) are rendered from the model's raw text, so the re-sent
history gives back the sampled text. The re-sent history is matched by content, never by re-tokenising what the
model sampled: when the rendering starts with the text of the session's trajectory, only the rest (tool results,
the next user message, the template's glue) is tokenised and appended as environment tokens, after the engine's
ids; otherwise the rendering's ids must extend the trajectory token for token, and a mismatch (an edited history,
a client that rebuilt a message, a template that rewrites history) branches the trajectory and is counted
(``prefix_mismatches``; with ``on_mismatch="raise"`` a 409 names the first message that differs from the session's
stored one). A text prompt of ``/v1/completions`` is matched the same way. Every request of a
session carries its ``session_id`` to the engine, so a Router keeps the session on one engine. Requests of one
session are served one at a time.

Delivery. A turn is captured only once its whole response was written to a connection that was still open. A
client that disconnects while its turn is generated (its generation is cancelled) or before the answer is written,
streaming or not, leaves the trajectory as it was before the request (counted in ``turns_undelivered`` and
``tokens_undelivered``): a retry of that turn extends the trajectory again, and the undelivered turn is never
trained with the episode's reward.

Queue. ``queue`` may be a :class:`~rlblocks.sched.StalenessQueue` (``aput(trajectory, oldest_version)``: the
staleness key is the oldest token version), an ``asyncio.Queue``, any callable (called with the trajectory) or None
(finished trajectories are kept in :attr:`Gateway.finished`). A trajectory is handed to the queue before its session
is deleted; one the queue refuses (closed, still full after ``handover_timeout``, a callable that raised, the
gateway shutting down) is kept in :attr:`Gateway.finished` and the reward is answered 503 with the reason
(:class:`~rlblocks.errors.QueueRefused` from Python), never dropped. :meth:`Gateway.flush` offers the kept ones to
the queue again, :meth:`Gateway.take_finished` hands them over, :meth:`Gateway.aclose` returns them. The counters
conserve every session and trajectory::

    sessions_opened   == sessions_open + sessions_finished + sessions_discarded
    sessions_finished == handed_over + finished_kept + finished_taken

Errors are OpenAI-style ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status (400 malformed,
404 unknown route/session/model, 405 wrong method, 408 too slow, 409 closed session or refused history, 413 body
larger than ``max_body_bytes``, 429 too many open sessions), 500, or 503 (queue refused, shutting down). Requests to
unknown routes are counted under one key, ``requests unknown``.

Server library: FastAPI + uvicorn (the optional extra ``rlblocks[gateway]``), run as a coroutine on the caller's
event loop, which must be the engine's (the in-process engines are bound to one loop); see ``server.py`` for what is
added on top of them. It serves loopback/cluster traffic from trusted agent programs; put a real proxy in front of
it for anything else.

Streaming: the RolloutEngine protocol returns whole generations, so a streamed response sends its headers at once
and the generated text (and tool calls) as one content chunk when the turn is done, then ``[DONE]``.

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
