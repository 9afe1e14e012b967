"""The gateway's HTTP server: a FastAPI app served by uvicorn on the caller's event loop (the in-process engines are
bound to one loop, so the gateway runs on the engine's: ``uvicorn.Server(config).serve()`` is a coroutine).

What is ours on top of FastAPI + uvicorn, and why:

- uvicorn's httptools protocol is subclassed (:class:`_Protocol`) for what the ASGI interface cannot see:
  a malformed request (bad request line, header or chunk framing) gets an OpenAI-style JSON 400 instead of
  uvicorn's plain text; a client that takes longer than ``request_timeout`` to send its headers gets a JSON 408;
  and every request's scope carries a check of whether its response was completely written before the connection
  was lost (uvicorn drops what is sent to a closed connection without a word), which is what "delivered" means for
  a captured turn, and a future per connection that is done when it is lost. Its writes of one event-loop turn
  leave in one send (:class:`_CorkedTransport`).
- Bodies are read by the gateway, not by FastAPI: with a size limit (413 naming ``max_body_bytes``; the rest of the
  body is read and discarded up to 64 MiB more, so the client reads the 413 instead of a reset connection) and a
  deadline (408).
- A completion is answered by an ASGI response that runs the turn while it sends (:class:`_TurnResponse`): it
  watches the connection while the engine generates (a client that goes away cancels its generation), and only a
  response that reached the connection whole is committed to the trajectory (see ``sessions.py``).
- The server does not install signal handlers (the embedding program keeps Ctrl-C) and does not configure logging.

One file: it is the only module that imports FastAPI and uvicorn (the optional extra), so everything that touches
them stays here; the request models are in ``schema.py`` and the sessions in ``sessions.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
import socket
import sys
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

try:
    import uvicorn
    from fastapi import FastAPI, Request
    from starlette.exceptions import HTTPException
    from starlette.responses import Response
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError as e:  # pragma: no cover - the optional extra is not installed
    raise ImportError(f"rlblocks.rollout.gateway needs FastAPI, uvicorn and httptools ({e}); install the extra: "
                      "pip install 'rlblocks[gateway]'") from e

from rlblocks._checks import check_int, check_seconds, check_str_pair
from rlblocks.errors import ArgumentError, ClientDisconnected, GatewayError, SessionNotFound

from ..agents.episode import generate_turn
from ..agents.tool_calls import TOOL_CALL_TAGS
from ..agents.trajectory import OnMismatch, Trajectory, render_chat_text
from ..resume import ResumableResult
from ..types import RolloutEngine, SamplingParams
from . import schema
from .sessions import Session, SessionStore, Turn, fingerprint

__all__ = ["Gateway"]

_DELIVERED = "rlblocks.delivered"  # scope["extensions"] key: () -> whether the response was written whole
_GONE = "rlblocks.gone"  # scope["extensions"] key: a future done when the connection is lost
_FLUSH = "rlblocks.flush"  # scope["extensions"] key: () -> send what was written (else sent a loop turn later)
_DRAIN_BYTES = 64 << 20  # what is read (and discarded) past max_body_bytes so that the client reads its 413
_KEEP_ALIVE_S = 600  # longer than any client pool's idle expiry (httpx: 5 s), so that the client closes first
_MAX_SESSION_ID = 512
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_CLOSE_STATUSES = (408, 413, 500)  # answered with "connection: close": the connection's state is not trusted
_ROUTES = ("POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /v1/models/{id}, GET /health, "
           "POST /v1/sessions/{id}/reward, GET /v1/sessions/{id}")


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _sse(obj: Any) -> bytes:
    return b"data: " + _json_bytes(obj) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


def _json_response(status: int, obj: Any, *, close: bool = False) -> Response:
    return Response(_json_bytes(obj), status_code=status, media_type="application/json",
                    headers={"connection": "close"} if close else None)


async def _within(coro: Any, seconds: float) -> Any:
    """``await coro`` or raise ``asyncio.TimeoutError`` after ``seconds``."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):  # no task per call, which wait_for makes
            return await coro
    return await asyncio.wait_for(coro, seconds)  # pragma: no cover


# ================================================================================================ HTTP layer
class _CorkedTransport:
    """A transport whose writes made in one turn of the event loop leave in one send. uvicorn writes a response's
    head and its body separately; on loopback each send wakes the client, so two per response cost a second
    wake-up and context switch, which is most of the per-request time on a busy 2-core machine."""

    __slots__ = ("_buffer", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop, self._buffer = transport, loop, []

    def write(self, data: bytes) -> None:
        if not self._buffer:
            self._loop.call_soon(self._flush)
        self._buffer.append(data)

    def _flush(self) -> None:
        if self._buffer:
            data = b"".join(self._buffer)
            self._buffer.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _Protocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the gateway's answers at the HTTP layer (module docstring)."""

    def __init__(self, *args: Any, gateway: Gateway, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._gateway = gateway
        self._header_timer: asyncio.TimerHandle | None = None
        self._gone: asyncio.Future = self.loop.create_future()  # one per connection (cheaper than a task per request)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_CorkedTransport(transport, self.loop))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._stop_timer()
        self._header_timer = self.loop.call_later(self._gateway.request_timeout, self._headers_too_slow)

    def on_headers_complete(self) -> None:
        self._stop_timer()
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # None or another request's cycle: an upgrade
            ext = self.scope.setdefault("extensions", {})
            ext[_DELIVERED] = lambda: cycle.response_complete and not cycle.disconnected
            ext[_GONE] = self._gone
            ext[_FLUSH] = self.transport._flush

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        if not self._gone.done():
            self._gone.set_result(None)
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self._answer_and_close(GatewayError(
            400, "malformed HTTP request: the request line, a header or the chunked body framing could not be parsed",
            code="invalid_http"))

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self._answer_and_close(GatewayError(
                408, f"the request headers were not received within {self._gateway.request_timeout:g} s "
                "(request_timeout)", code="request_timeout"))

    def _stop_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _answer_and_close(self, err: GatewayError) -> None:
        self._gateway._count_error(err.status)
        cycle = self.cycle
        if not (cycle is not None and cycle.response_started and not cycle.response_complete):
            data = _json_bytes(err.body())
            head = (f"HTTP/1.1 {err.status} {HTTPStatus(err.status).phrase}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(data)}\r\nconnection: close\r\n\r\n")
            self.transport.write(head.encode() + data)
        self.transport.close()


class _Server(uvicorn.Server):
    """``uvicorn.Server`` that says when it listens, and leaves signal handling to the embedding program."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = asyncio.Event()
        self.closing = False

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # The requests in flight are cancelled (Gateway.aclose), then uvicorn closes the listener and connections
        # and waits for the cancelled requests to finish undoing what they held (no await in between, so no new
        # request starts meanwhile).
        self.closing = True
        for task in list(self.server_state.tasks):
            task.cancel()
        await super().shutdown(sockets=sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self.ready.set()


def _listen(host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    # proto must be IPPROTO_TCP: asyncio sets TCP_NODELAY only on such sockets, and without it a response written
    # as headers then body waits for the client's delayed ACK (~40 ms)
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except BaseException:
        sock.close()
        raise
    return sock


class _TurnResponse(Response):
    """The answer to a completion request: the turn is generated and captured while the response is sent."""

    def __init__(self, gateway: Gateway, req: Any, session_id: str | None, chat: bool) -> None:
        self.background = None
        self._args = (req, session_id, chat)
        self._gateway = gateway

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self._gateway._serve_turn(*self._args, scope=scope, receive=receive, send=send)


# ================================================================================================ gateway
class Gateway:
    """OpenAI-compatible capture server in front of ``engine`` (see the package docstring).

    Args:
        engine: any RolloutEngine (TorchEngine, VLLMEngine, SGLangEngine, Router). The gateway must be started on
            the event loop that drives the engine.
        tokenizer: the policy's Hugging Face tokenizer with its chat template; its EOS must be the template's
            end-of-turn token (the stop token of every request).
        model: the model id served by ``/v1/models`` (requests may name any model; the name is echoed back).
        queue: where finished sessions go (see the package docstring).
        session_header: request header naming the session.
        default_max_tokens: generation budget when a request gives none.
        max_open_sessions: more open sessions are refused with 429 (a session stays open until its reward).
        on_mismatch: ``"branch"`` (count, keep the old segment, continue on the new rendering) or ``"raise"``
            (answer 409 with the first differing position).
        template_kwargs: extra variables for the chat template.
        max_body_bytes: larger request bodies are refused with 413.
        tool_call_tags: the opening and closing tags of a Hermes tool call.
        request_timeout: seconds a client may take to send a request's headers once its first byte arrived, and
            again for its body; a slower one gets 408 and the connection is closed, so a client that announces a
            body it never sends cannot hold a request forever. Idle keep-alive connections between requests are
            closed after 10 minutes.
        handover_timeout: seconds a reward waits for room in a full queue before the trajectory is kept in
            :attr:`finished` and the reward answered 503 (None: wait as long as it takes).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        *,
        model: str = "rlblocks",
        queue: Any = None,
        session_header: str = "X-Session-Id",
        default_max_tokens: int = 256,
        max_open_sessions: int = 100_000,
        on_mismatch: OnMismatch = "branch",
        template_kwargs: Mapping[str, Any] | None = None,
        max_body_bytes: int = 16 << 20,
        tool_call_tags: tuple[str, str] = TOOL_CALL_TAGS,
        request_timeout: float = 60.0,
        handover_timeout: float | None = None,
    ) -> None:
        if on_mismatch not in ("raise", "branch"):
            raise ArgumentError(f"on_mismatch: expected 'raise' or 'branch', got {on_mismatch!r}")
        for name in ("apply_chat_template", "encode", "decode"):
            if not callable(getattr(tokenizer, name, None)):
                raise ArgumentError(f"tokenizer: expected a Hugging Face tokenizer with a chat template (it has no "
                                    f"{name}()), got {type(tokenizer).__name__}")
        if tokenizer.eos_token_id is None:
            raise ArgumentError("tokenizer: expected a tokenizer with an EOS (end-of-turn) token, got none")
        if not isinstance(model, str) or not model:
            raise ArgumentError(f"model: expected a non-empty str (the served model id), got {model!r}")
        if not isinstance(session_header, str) or not re.fullmatch(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+", session_header):
            raise ArgumentError(f"session_header: expected a header name, got {session_header!r}")
        self.engine, self.tokenizer, self.model = engine, tokenizer, model
        self.session_header = session_header
        self._header_key = session_header.lower().encode()
        self.default_max_tokens = check_int("default_max_tokens", default_max_tokens, minimum=1)
        self.on_mismatch = on_mismatch
        self.template_kwargs = dict(template_kwargs or {})
        self.max_body_bytes = check_int("max_body_bytes", max_body_bytes, minimum=1024)
        self.request_timeout = check_seconds("request_timeout", request_timeout)
        self.tool_call_tags = check_str_pair("tool_call_tags", tool_call_tags)
        self.eos_id = int(tokenizer.eos_token_id)
        self._counts: Counter[str] = Counter()
        self._store = SessionStore(
            queue=queue, current_version=lambda: int(self.engine.version),
            max_open_sessions=check_int("max_open_sessions", max_open_sessions, minimum=1),
            handover_timeout=check_seconds("handover_timeout", handover_timeout, allow_none=True),
            counts=self._counts)
        self._app = self._build_app()
        self._server: _Server | None = None
        self._serve_task: asyncio.Task | None = None
        self.host: str | None = None
        self.port: int | None = None
        self._created = int(time.time())

    # ------------------------------------------------------------------ lifecycle
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on ``host:port`` (0: a free port); returns the base URL for the client, ``http://host:port/v1``."""
        if self._server is not None:
            raise ArgumentError("start: the gateway is already listening")
        sock = _listen(host, port)
        config = uvicorn.Config(
            self._asgi, interface="asgi3", lifespan="off", ws="none", http=functools.partial(_Protocol, gateway=self),
            log_config=None, access_log=False, proxy_headers=False, server_header=False,
            timeout_keep_alive=_KEEP_ALIVE_S)
        server = _Server(config)
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        ready = asyncio.ensure_future(server.ready.wait())
        await asyncio.wait((ready, task), return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            sock.close()
            task.result()  # raises why the server stopped
            raise GatewayError(500, "the gateway's server stopped while starting", type="server_error")
        self._server, self._serve_task = server, task
        self.host, self.port = sock.getsockname()[:2]
        return self.url

    @property
    def url(self) -> str:
        """``http://host:port/v1`` (what ``openai.OpenAI(base_url=...)`` takes)."""
        if self.port is None:
            raise ArgumentError("url: the gateway is not listening (call start() first)")
        host = f"[{self.host}]" if ":" in (self.host or "") else self.host
        return f"http://{host}:{self.port}/v1"

    async def aclose(self) -> list[Trajectory]:
        """Stop listening, close the connections and cancel the requests in flight (their turns are rolled back;
        a reward waiting for room in the queue keeps its trajectory in :attr:`finished`). Open sessions and
        :attr:`finished` are kept; returns the trajectories in :attr:`finished` (closed but not queued). Idempotent."""
        server, task = self._server, self._serve_task
        if server is not None:
            server.should_exit = True
            try:
                await task
                # the requests still in flight were cancelled; wait until each has undone or kept what it held
                await asyncio.gather(*list(server.server_state.tasks), return_exceptions=True)
            finally:
                self._server = self._serve_task = None
        return list(self.finished)

    async def __aenter__(self) -> Gateway:
        if self._server is None:
            await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ state (Python API)
    @property
    def queue(self) -> Any:
        return self._store.queue

    @queue.setter
    def queue(self, value: Any) -> None:
        self._store.queue = value

    @property
    def sessions(self) -> dict[str, Session]:
        """The open sessions by id (each with its ``trajectory``, None until a turn was captured)."""
        return self._store.sessions

    @property
    def finished(self) -> list[Trajectory]:
        """Closed sessions' trajectories that are not in a queue: all of them when ``queue`` is None, else those
        the queue refused. Take them with :meth:`take_finished` or offer them again with :meth:`flush`."""
        return self._store.finished

    def stats(self) -> dict[str, Any]:
        """Counters: requests per route (``requests unknown`` for every unmatched method or path), streamed
        requests, 4xx/5xx errors, prompt/completion tokens and tool calls of delivered turns, and the session and
        hand-over counters, which add up (package docstring)::

            sessions_opened   == sessions_open + sessions_finished + sessions_discarded
            sessions_finished == handed_over + finished_kept + finished_taken
        """
        out = dict(self._counts)
        out.update(self._store.stats())
        return out

    async def finish_session(self, session_id: str, reward: float, *, info: Mapping[str, Any] | None = None
                             ) -> Trajectory:
        """Close ``session_id`` with ``reward``: the trajectory (``reward`` and ``info`` set) goes to the queue and
        is returned. Waits for a request of that session that is still being served.

        Raises :class:`~rlblocks.errors.SessionNotFound` (an ``ArgumentError``) for a session that is not open
        (unknown, already closed, or one whose first request failed before anything was captured),
        ``ArgumentError`` for a ``reward`` that is not a finite number or an ``info`` that is not a mapping, and
        :class:`~rlblocks.errors.QueueRefused` when the queue refused the trajectory (it is kept in
        :attr:`finished`)."""
        return await self._store.finish(session_id, reward, info=info)

    async def flush(self) -> list[Trajectory]:
        """Offer the trajectories in :attr:`finished` to the queue again (oldest first, until one is refused);
        returns those still kept."""
        return await self._store.flush()

    def take_finished(self) -> list[Trajectory]:
        """Return the trajectories in :attr:`finished` and empty it (counted in ``finished_taken``)."""
        return self._store.take_finished()

    # ------------------------------------------------------------------ app
    def _build_app(self) -> FastAPI:
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
        app.router.redirect_slashes = False  # "/v1/models/" is served as "/v1/models" (see _asgi), not redirected
        # the hot routes take the raw request (the body is read and validated here), so they are plain Starlette
        # routes: FastAPI's dependency solving would add ~0.1 ms per request for nothing
        app.add_route("/v1/chat/completions", self._chat, methods=["POST"])
        app.add_route("/v1/completions", self._text, methods=["POST"])
        app.add_api_route("/v1/models", self._models, methods=["GET"])
        app.add_api_route("/v1/models/{model_id:path}", self._model, methods=["GET"])
        app.add_api_route("/health", self._health, methods=["GET"])
        app.add_api_route("/v1/sessions/{session_id:path}/reward", self._reward, methods=["POST"])
        app.add_api_route("/v1/sessions/{session_id:path}", self._session_summary, methods=["GET"])
        app.add_exception_handler(GatewayError, self._on_gateway_error)
        app.add_exception_handler(HTTPException, self._on_unrouted)
        app.add_exception_handler(ClientDisconnected, self._on_client_gone)
        app.add_exception_handler(Exception, self._on_bug)
        return app

    async def _asgi(self, scope: Any, receive: Any, send: Any) -> None:
        """The server's entry: a trailing "/" is ignored, and a request cancelled by :meth:`aclose` before it
        answered gets a 503 rather than uvicorn's plain-text 500."""
        path = scope.get("path", "")
        if len(path) > 1 and path.endswith("/"):
            scope = {**scope, "path": path.rstrip("/") or "/"}
        started = False

        async def tracked(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._app(scope, receive, tracked)
        except asyncio.CancelledError:
            if self._server is not None and not self._server.closing:
                raise
            # cancelled by aclose(): what the request held was undone or kept on the way out; answer and end here
            # (re-raised, uvicorn would log the shutdown as a crash of every request in flight)
            if not started:
                self._count_error(503)
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.wait_for(_json_response(503, GatewayError(
                        503, "the gateway is shutting down; the request was not served", type="server_error",
                        code="shutting_down").body(), close=True)(scope, receive, send), 1.0)

    def _count_error(self, status: int) -> None:
        self._counts["errors_4xx" if status < 500 else "errors_5xx"] += 1

    async def _on_gateway_error(self, request: Request, e: GatewayError) -> Response:
        self._count_error(e.status)
        return _json_response(e.status, e.body(), close=e.status in _CLOSE_STATUSES)

    async def _on_unrouted(self, request: Request, e: HTTPException) -> Response:
        self._counts["requests unknown"] += 1  # one key for every unmatched method or path
        method, path = request.method, request.url.path
        if e.status_code == 405:
            allowed = (e.headers or {}).get("Allow", "")
            err = GatewayError(405, f"{path} accepts {allowed}, got {method}", code="method_not_allowed")
        else:
            err = GatewayError(e.status_code, f"unknown route {method} {path}; this gateway serves {_ROUTES}",
                               code="not_found")
        return await self._on_gateway_error(request, err)

    async def _on_client_gone(self, request: Request, e: ClientDisconnected) -> Response:
        return Response(status_code=400)  # nobody reads it: the connection is closed

    async def _on_bug(self, request: Request, e: Exception) -> Response:
        # a bug here must still answer the client, with the reason (uvicorn logs the traceback)
        return await self._on_gateway_error(request, GatewayError(
            500, f"internal error: {type(e).__name__}: {e}", type="server_error", code="internal_error"))

    # ------------------------------------------------------------------ request bodies and sessions
    async def _read_body(self, scope: Any, receive: Any) -> bytes:
        """The whole body, within ``request_timeout`` (408) and ``max_body_bytes`` (413)."""
        limit = self.max_body_bytes
        declared = next((int(v) for k, v in scope["headers"] if k == b"content-length"), None)
        chunks: list[bytes] = []
        size = 0

        async def read() -> None:
            nonlocal size
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    raise ClientDisconnected
                data = msg.get("body", b"")
                size += len(data)
                if size <= limit:
                    chunks.append(data)
                elif size > limit + _DRAIN_BYTES:
                    return  # the client gets its 413, then a closed connection
                if not msg.get("more_body", False):
                    return

        if declared is None or declared <= limit + _DRAIN_BYTES:
            try:
                await _within(read(), self.request_timeout)
            except asyncio.TimeoutError:
                raise GatewayError(408, f"the request body was not received within {self.request_timeout:g} s "
                                   "(request_timeout)", code="request_timeout") from None
        if max(size, declared or 0) > limit:
            what = f"of {declared} bytes" if declared is not None else f"of more than {limit} bytes"
            raise GatewayError(413, f"request body {what} is larger than the limit of {limit} bytes (max_body_bytes)",
                               code="body_too_large")
        return b"".join(chunks)

    async def _read_json(self, request: Request) -> Any:
        data = await self._read_body(request.scope, request.receive)
        try:
            return json.loads(data.decode("utf-8")) if data else None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise GatewayError(400, f"could not parse the JSON body: {e}", code="invalid_json") from e
        except RecursionError:  # deeply nested arrays: the client's body, not a server fault
            raise GatewayError(400, "could not parse the JSON body: nested too deeply", code="invalid_json") from None

    def _session_id(self, scope: Any, user: str | None) -> str | None:
        """The session named by the header, else by ``user``, else None (a new one). Either is refused (400 naming
        it) when empty, longer than 512 characters or holding a control character (CR/LF would forge response
        headers): the id is echoed in the ``X-Session-Id`` response header."""
        if user is not None:
            _check_session_id("user", user)
        raw = next((v for k, v in scope["headers"] if k == self._header_key), None)
        if raw is None:
            return user
        try:
            sid = raw.strip(b" \t").decode("utf-8")
        except UnicodeDecodeError:
            raise schema.bad_request(self.session_header, "expected a UTF-8 session id") from None
        if not sid:
            raise schema.bad_request(self.session_header, "expected a non-empty session id")
        _check_session_id(self.session_header, sid)
        return sid

    # ------------------------------------------------------------------ routes
    async def _chat(self, request: Request) -> Response:
        self._counts["requests POST /v1/chat/completions"] += 1
        req = schema.parse(schema.ChatCompletionRequest, await self._read_json(request))
        return _TurnResponse(self, req, self._session_id(request.scope, req.user), chat=True)

    async def _text(self, request: Request) -> Response:
        self._counts["requests POST /v1/completions"] += 1
        req = schema.parse(schema.CompletionRequest, await self._read_json(request))
        return _TurnResponse(self, req, self._session_id(request.scope, req.user), chat=False)

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model, "object": "model", "created": self._created, "owned_by": "rlblocks"}

    async def _models(self) -> Response:
        self._counts["requests GET /v1/models"] += 1
        return _json_response(200, {"object": "list", "data": [self._model_card()]})

    async def _model(self, model_id: str) -> Response:
        self._counts["requests GET /v1/models"] += 1
        if model_id != self.model:
            raise GatewayError(404, f"model {model_id!r} not found; this gateway serves {self.model!r}",
                               code="model_not_found")
        return _json_response(200, self._model_card())

    async def _health(self) -> Response:
        self._counts["requests GET /health"] += 1
        return _json_response(200, {"status": "ok", "version": int(self.engine.version)})

    async def _reward(self, request: Request, session_id: str) -> Response:
        self._counts["requests POST /v1/sessions"] += 1
        req = schema.parse(schema.RewardRequest, await self._read_json(request))
        try:
            traj = await self._store.finish(session_id, req.reward, info=req.info)
        except SessionNotFound:
            raise GatewayError(404, f"no open session {session_id!r} (unknown, or already closed by a reward)",
                               code="session_not_found") from None
        segments = traj.segments()
        return _json_response(200, {"session_id": session_id, "reward": req.reward, "segments": len(segments),
                                    "model_tokens": sum(s.num_model_tokens for s in segments),
                                    "prefix_mismatches": traj.prefix_mismatches})

    async def _session_summary(self, session_id: str) -> Response:
        self._counts["requests GET /v1/sessions"] += 1
        if session_id.endswith("/reward"):
            raise GatewayError(405, f"/v1/sessions/{session_id} accepts POST, got GET", code="method_not_allowed")
        sess = self.sessions.get(session_id)
        if sess is None or sess.trajectory is None:
            raise GatewayError(404, f"no open session {session_id!r}", code="session_not_found")
        t = sess.trajectory
        segments = t.segments()
        return _json_response(200, {
            "session_id": session_id, "requests": sess.requests, "tokens": len(t), "turns": t.num_turns,
            "segments": len(segments), "prefix_mismatches": t.prefix_mismatches,
            "model_tokens": sum(s.num_model_tokens for s in segments), "oldest_version": t.oldest_version})

    # ------------------------------------------------------------------ one turn, in named steps
    async def _serve_turn(self, req: Any, session_id: str | None, chat: bool, *, scope: Any, receive: Any,
                          send: Any) -> None:
        """Serve one completion: open the session, (stream: send the headers), render the prompt and extend the
        trajectory, generate while watching the connection, shape the reply, send it, then commit the turn if
        the response was delivered whole and roll it back otherwise."""
        sess = self._store.open(session_id)
        out = _Outgoing(self, req, sess.session_id, chat, scope, send)
        # done when the client closes its connection: our protocol's future, else (another ASGI server) a task on
        # receive(), which answers "http.disconnect" then (the body was read)
        gone = scope.get("extensions", {}).get(_GONE)
        own_watch = gone is None
        if own_watch:
            gone = asyncio.ensure_future(receive())
        try:
            if req.stream:
                await out.open_stream()
            async with sess.lock:
                turn = self._begin_turn(sess, req, chat)
                try:
                    result, stopped_by = await self._generate(turn, req, chat, gone)
                    reply = self._capture(turn, req, chat, result, stopped_by)
                    delivered = await out.send_reply(turn, result, reply, gone)
                except BaseException as e:
                    self._store.rollback(turn, undelivered=isinstance(e, (ClientDisconnected, asyncio.CancelledError)))
                    raise
                if delivered:
                    self._store.commit(turn)
                    self._counts["prompt_tokens"] += len(result.prompt_ids)
                    self._counts["completion_tokens"] += len(result.output_ids)
                    self._counts["tool_calls"] += len(reply.tool_calls)
                else:
                    self._store.rollback(turn, undelivered=True)
        except ClientDisconnected:
            pass  # nobody to answer
        except GatewayError as e:
            if not out.streaming:
                raise  # answered by the exception handler, as JSON
            self._count_error(e.status)
            await out.end_stream_with_error(e)
        except asyncio.CancelledError:
            if out.streaming:
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.wait_for(out.end_stream_with_error(GatewayError(
                        503, "the gateway is shutting down; the turn was not captured", type="server_error",
                        code="shutting_down")), 1.0)
            raise
        finally:
            if own_watch:
                gone.cancel()
            self._store.release(sess)

    def _begin_turn(self, sess: Session, req: Any, chat: bool) -> Turn:
        """Step 1: the prompt (the chat template's rendering of the canonical messages, or the completion's text
        or tokens), which must extend the session's trajectory."""
        if chat:
            messages = self._store.canonical(sess, [m.for_template() for m in req.messages])
            try:
                text = render_chat_text(self.tokenizer, messages, tools=req.tools, add_generation_prompt=True,
                                        **self.template_kwargs)
            except Exception as e:
                raise schema.bad_request("messages", f"the chat template could not render them: {type(e).__name__}: "
                                         f"{e}") from e
            return self._store.begin_turn(sess, text, messages=messages, tools=req.tools, on_mismatch=self.on_mismatch,
                                          tokenizer=self.tokenizer, template_kwargs=self.template_kwargs)
        return self._store.begin_turn(sess, req.prompt, messages=None, tools=None, on_mismatch=self.on_mismatch,
                                      tokenizer=self.tokenizer)

    def _sampling(self, req: Any) -> SamplingParams:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
            max_new_tokens=req.budget or self.default_max_tokens, stop_token_ids=(self.eos_id,),
            seed=None if req.seed is None else req.seed & ((1 << 62) - 1))

    async def _generate(self, turn: Turn, req: Any, chat: bool, gone: asyncio.Future
                        ) -> tuple[ResumableResult, str | None]:
        """Step 2: the engine generates the turn, in this request's task (a task per turn would cost a loop turn
        and its scheduling); a client that goes away meanwhile cancels it through a callback on ``gone``, disarmed
        as soon as the turn returns, and the request ends with ``ClientDisconnected``."""
        if gone.done():
            raise ClientDisconnected
        sess = turn.session
        parse_calls = chat and req.parse_tool_calls
        task = asyncio.current_task()
        state = {"armed": True, "left": False}

        def on_gone(_: Any) -> None:
            if state["armed"]:
                state["left"] = True
                task.cancel()

        gone.add_done_callback(on_gone)
        try:
            return await generate_turn(
                self.engine, sess.trajectory.token_ids, self._sampling(req),
                request_id=f"{sess.session_id}/{sess.requests}", session_id=sess.session_id,
                stop_texts=[*req.stop, *([self.tool_call_tags[1]] if parse_calls else [])], tokenizer=self.tokenizer)
        except asyncio.CancelledError:
            if not state["left"]:
                raise  # aclose() cancelled the request
            if sys.version_info >= (3, 11):
                task.uncancel()
            raise ClientDisconnected from None
        except ArgumentError as e:
            raise GatewayError(400, f"the engine refused the request: {e}", code="engine_refused") from e
        except Exception as e:
            raise GatewayError(500, f"the engine failed: {type(e).__name__}: {e}", type="server_error",
                               code="engine_error") from e
        finally:
            state["armed"] = False
            gone.remove_done_callback(on_gone)

    def _capture(self, turn: Turn, req: Any, chat: bool, result: ResumableResult, stopped_by: str | None
                 ) -> schema.Reply:
        """Step 3: the reply the client gets, and the generation appended to the trajectory (not yet committed)."""
        out = result.output_ids
        body = out[:-1] if out and out[-1] == self.eos_id else out
        raw = self.tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        reply = schema.assistant_reply(raw, stopped_by=stopped_by, stops=req.stop,
                                       parse_calls=chat and req.parse_tool_calls, tags=self.tool_call_tags,
                                       engine_finish=result.finish_reason)
        self._store.record(turn, result, raw, fingerprint(reply.text, reply.tool_calls) if chat else None)
        return reply


def _check_session_id(field: str, sid: str) -> None:
    if len(sid) > _MAX_SESSION_ID:
        raise schema.bad_request(field, f"expected a session id of at most {_MAX_SESSION_ID} characters, got "
                                 f"{len(sid)}")
    bad = _CONTROL.search(sid)
    if bad:
        raise schema.bad_request(field, f"expected a session id without control characters (CR, LF, ...), got "
                                 f"{bad.group()!r} at position {bad.start()}")


class _Outgoing:
    """Step 4: what one completion request sends (JSON, or server-sent events when ``stream``), and whether it was
    delivered: written whole to a connection that was still open."""

    def __init__(self, gateway: Gateway, req: Any, session_id: str, chat: bool, scope: Any, send: Any) -> None:
        self.gw, self.req, self.chat, self.scope, self.send = gateway, req, chat, scope, send
        self.sid_header = (gateway._header_key, session_id.encode("utf-8"))
        self.session_id = session_id
        self.created = int(time.time())
        self.cid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.streaming = False

    def _delivered(self, gone: asyncio.Future) -> bool:
        ext = self.scope.get("extensions", {})
        if _FLUSH in ext:
            ext[_FLUSH]()  # the response leaves now, in one send
        check = ext.get(_DELIVERED)
        return check() if check is not None else not gone.done()

    async def open_stream(self) -> None:
        """Headers first: the client sees the response start while the engine generates."""
        await self.send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), self.sid_header]})
        self.streaming = True
        self.gw._counts["stream_requests"] += 1
        if self.chat:
            chunk = schema.chat_chunk(self.cid, self.created, self.req.model, {"role": "assistant", "content": ""},
                                      None, None)
            await self.send({"type": "http.response.body", "body": _sse(chunk), "more_body": True})

    async def end_stream_with_error(self, e: GatewayError) -> None:
        await self.send({"type": "http.response.body", "body": _sse(e.body()) + _DONE, "more_body": False})

    async def send_reply(self, turn: Turn, result: ResumableResult, reply: schema.Reply, gone: asyncio.Future
                         ) -> bool:
        if gone.done():
            return False
        req, model = self.req, self.req.model
        out = result.output_ids
        traj = turn.session.trajectory
        usage = {"prompt_tokens": len(result.prompt_ids), "completion_tokens": len(out),
                 "total_tokens": len(result.prompt_ids) + len(out)}
        ext = {"session_id": self.session_id, "output_ids": list(out), "versions": list(result.output_versions),
               "turn": traj.turn, "prefix_mismatches": traj.prefix_mismatches}
        want_lp = req.logprobs is True if self.chat else req.logprobs is not None
        tokens = [self.gw.tokenizer.decode([t], skip_special_tokens=False) for t in out] if want_lp else []
        if self.chat:
            lp = schema.chat_logprobs(tokens, result.output_logprobs) if want_lp else None
            if not self.streaming:
                return await self._send_json(schema.chat_completion(self.cid, self.created, model, reply, lp, usage,
                                                                    ext), gone)
            delta: dict[str, Any] = {}
            if reply.text:
                delta["content"] = reply.text
            if reply.tool_calls:
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(reply.tool_calls)]
            events = [schema.chat_chunk(self.cid, self.created, model, delta, None, lp)] if delta else []
            last = schema.chat_chunk(self.cid, self.created, model, {}, reply.finish, None)
        else:
            lp = schema.text_logprobs(tokens, result.output_logprobs) if want_lp else None
            text = reply.text or ""
            if not self.streaming:
                body = schema.text_completion(self.cid, self.created, model, text, lp, reply.finish)
                return await self._send_json({**body, "usage": usage, "rlblocks": ext}, gone)
            events = [schema.text_completion(self.cid, self.created, model, text, lp, None)]
            last = schema.text_completion(self.cid, self.created, model, "", None, reply.finish)
        last["rlblocks"] = ext
        events.append(last)
        if req.include_usage:
            events.append({"id": self.cid, "object": last["object"], "created": self.created, "model": model,
                           "choices": [], "usage": usage})
        await self.send({"type": "http.response.body", "body": b"".join(map(_sse, events)) + _DONE,
                         "more_body": False})
        return self._delivered(gone)

    async def _send_json(self, obj: Any, gone: asyncio.Future) -> bool:
        data = _json_bytes(obj)
        await self.send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), self.sid_header]})
        await self.send({"type": "http.response.body", "body": data, "more_body": False})
        return self._delivered(gone)
