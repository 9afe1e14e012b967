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
``response["rlblocks"]["session_id"]``. Each session accumulates one
:class:`~rlblocks.rollout.trajectory.Trajectory` with the exact ids, processed log-probs and weight versions the
engine produced. A chat request's messages are rendered with the chat template; assistant messages this gateway
returned (recognised by content and tool-call ids) are rendered from the model's raw text, so the re-sent history
gives back the sampled tokens; the rendering must extend the session's trajectory token for token: the suffix is
appended as environment tokens (tool results, the next user message), a mismatch (an edited history, a client that
rebuilt a message) branches the trajectory and is counted (``prefix_mismatches``). Every request of a session carries
its ``session_id`` to the engine, so a Router keeps the session on one engine. Requests of one session are served
one at a time.

Queue. ``queue`` may be a :class:`~rlblocks.sched.StalenessQueue` (``aput(trajectory, oldest_version)``: the
staleness key is the oldest token version), an ``asyncio.Queue``, any callable (called with the trajectory) or None
(finished trajectories are kept in :attr:`Gateway.finished`).

Errors are OpenAI-style ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status (400 malformed,
404 unknown route/session/model, 405 wrong method, 413 body too large, 429 too many open sessions) or 500.

Server library: the standard library's asyncio streams. The gateway must run on the engine's own event loop (the
in-process engines are bound to one loop), it must add little latency per request (one JSON parse, one template
render, one write), and a block file must not pull a web framework into every install; a small HTTP/1.1 server on
asyncio streams does all three (aiohttp or FastAPI + uvicorn would add a dependency and, for uvicorn, its own loop
management). It serves loopback/cluster traffic from trusted agent programs; put a real proxy in front of it for
anything else.

Streaming: the RolloutEngine protocol returns whole generations, so a streamed response sends its headers at once
and the generated text (and tool calls) as one content chunk when the turn is done, then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import time
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

from rlblocks._checks import check_int, check_real, check_seconds, check_str_pair
from rlblocks.errors import ArgumentError, GatewayError, PrefixMismatchError, SessionNotFound

from .agent import TOOL_CALL_TAGS, generate_turn, parse_tool_calls
from .trajectory import OnMismatch, Trajectory, render_chat
from .types import RolloutEngine, SamplingParams

__all__ = ["Gateway"]

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
            409: "Conflict",
            411: "Length Required", 413: "Payload Too Large", 429: "Too Many Requests",
            500: "Internal Server Error", 503: "Service Unavailable"}
_ROLES = ("system", "developer", "user", "assistant", "tool")


def _bad(param: str, message: str, code: str | None = "invalid_value") -> GatewayError:
    return GatewayError(400, f"{param}: {message}", param=param, code=code)


@dataclass
class _Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class _Session:
    session_id: str
    trajectory: Trajectory | None = None
    returned: dict[str, str] = field(default_factory=dict)  # fingerprint of a returned message -> raw model text
    requests: int = 0
    created: float = field(default_factory=time.time)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def _snapshot(traj: Trajectory | None) -> dict | None:
    """The state of ``traj`` (its lists copied), to undo what a request that failed appended."""
    if traj is None:
        return None
    return {k: (list(v) if isinstance(v, list) else v) for k, v in traj.__dict__.items()}


def _restore(sess: _Session, saved: dict | None) -> None:
    if saved is None:
        sess.trajectory = None
    else:
        sess.trajectory.__dict__.clear()
        sess.trajectory.__dict__.update(saved)


def _fingerprint(content: str | None, tool_calls: Sequence[Mapping[str, Any]] | None) -> str:
    calls = []
    for tc in tool_calls or ():
        fn = tc.get("function", {}) if isinstance(tc, Mapping) else {}
        calls.append([tc.get("id") if isinstance(tc, Mapping) else None, fn.get("name"), fn.get("arguments")])
    return json.dumps([content or "", calls], sort_keys=True)


# ================================================================================================ validation
def _number(
    body: Mapping[str, Any], name: str, default: float, lo: float, hi: float, *, lo_open: bool = False
) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(name, f"expected a number, got {type(v).__name__}", "invalid_type")
    ok = (v > lo if lo_open else v >= lo) and v <= hi
    if not ok:
        raise _bad(name, f"expected a value in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
    return float(v)


def _int(body: Mapping[str, Any], name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, f"expected an integer, got {type(v).__name__}", "invalid_type")
    if v < lo or (hi is not None and v > hi):
        raise _bad(name, f"expected an integer in [{lo}, {hi if hi is not None else 'inf'}], got {v}")
    return int(v)


def _content_text(param: str, content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"{param}[{j}]", "expected a text part {\"type\": \"text\", \"text\": ...} (only text is "
                           f"supported), got {json.dumps(part)[:80]}")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(param, f"expected a string, null or a list of text parts, got {type(content).__name__}", "invalid_type")


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "expected a non-empty array of messages", "missing_required_parameter"
                   if msgs is None else "invalid_value")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, Mapping):
            raise _bad(f"messages[{i}]", f"expected an object, got {type(m).__name__}", "invalid_type")
        role = m.get("role")
        if role not in _ROLES:
            raise _bad(f"messages[{i}].role", f"expected one of {list(_ROLES)}, got {role!r}")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _content_text(f"messages[{i}].content", m.get("content"))}
        if role == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise _bad(f"messages[{i}].tool_calls", "expected an array", "invalid_type")
            for j, tc in enumerate(calls):
                fn = tc.get("function") if isinstance(tc, Mapping) else None
                if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not isinstance(
                        fn.get("arguments"), str):
                    raise _bad(f"messages[{i}].tool_calls[{j}]",
                               "expected {\"id\", \"type\": \"function\", \"function\": {\"name\": str, "
                               "\"arguments\": str}}")
            msg["tool_calls"] = [dict(tc) for tc in calls]
        elif role != "assistant" and msg["content"] is None:
            raise _bad(f"messages[{i}].content", "expected a string", "missing_required_parameter")
        for key in ("name", "tool_call_id"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        out.append(msg)
    return out


def _tools(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]] | None, bool]:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("tools", "expected an array of tools", "invalid_type")
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, Mapping) else None
            if not isinstance(t, Mapping) or t.get("type") != "function" or not isinstance(fn, Mapping) or \
                    not isinstance(fn.get("name"), str):
                raise _bad(f"tools[{i}]", "expected {\"type\": \"function\", \"function\": {\"name\": ...}}")
        tools = [dict(t) for t in tools] or None
    choice = body.get("tool_choice", "auto" if tools else "none")
    if choice not in ("auto", "none"):
        raise _bad("tool_choice", "only \"auto\" and \"none\" are supported (forcing a call would need constrained "
                   f"decoding), got {json.dumps(choice)[:80]}", "unsupported_value")
    return tools, bool(tools) and choice == "auto"


def _stops(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise _bad("stop", "expected a non-empty string or an array of at most 4 of them")
    return list(stops)


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    """Fields whose requested behaviour the engines cannot give are refused rather than silently ignored."""
    n = body.get("n", 1)
    if n != 1:
        raise _bad("n", f"only n=1 is supported (send one request per sample), got {n!r}", "unsupported_value")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise _bad(name, "penalties are not supported by the rollout engines (use 0)", "unsupported_value")
    if body.get("logit_bias"):
        raise _bad("logit_bias", "not supported by the rollout engines", "unsupported_value")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, Mapping) and rf.get("type") == "text"):
        raise _bad("response_format", "only {\"type\": \"text\"} is supported", "unsupported_value")
    if body.get("stream") not in (None, True, False):
        raise _bad("stream", "expected a boolean", "invalid_type")


# ================================================================================================ gateway
class Gateway:
    """OpenAI-compatible capture server in front of ``engine`` (see the module docstring).

    Args:
        engine: any RolloutEngine (TorchEngine, VLLMEngine, SGLangEngine, Router). The gateway must be started on
            the event loop that drives the engine.
        tokenizer: the policy's Hugging Face tokenizer with its chat template; its EOS must be the template's
            end-of-turn token (the stop token of every request).
        model: the model id served by ``/v1/models`` (requests may name any model; the name is echoed back).
        queue: where finished sessions go (see the module docstring).
        session_header: request header naming the session.
        default_max_tokens: generation budget when a request gives none.
        max_open_sessions: more open sessions are refused with 429 (a session stays open until its reward).
        on_mismatch: ``"branch"`` (count, keep the old segment, continue on the new rendering) or ``"raise"``
            (answer 409 with the first differing position).
        template_kwargs: extra variables for the chat template.
        max_body_bytes: larger request bodies are refused with 413.
        tool_call_tags: the opening and closing tags of a Hermes tool call.
        request_timeout: seconds a client may take to send the rest of a request once its first line arrived
            (headers and body); a slower one gets 408 and the connection is closed, so a client that announces
            a body it never sends cannot hold a connection task forever. Idle keep-alive connections between
            requests are not limited.
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
        if not isinstance(session_header, str) or not session_header:
            raise ArgumentError(f"session_header: expected a header name, got {session_header!r}")
        self.engine, self.tokenizer, self.model = engine, tokenizer, model
        self.queue = queue
        self.session_header = session_header.lower()
        self.default_max_tokens = check_int("default_max_tokens", default_max_tokens, minimum=1)
        self.max_open_sessions = check_int("max_open_sessions", max_open_sessions, minimum=1)
        self.on_mismatch = on_mismatch
        self.template_kwargs = dict(template_kwargs or {})
        self.max_body_bytes = check_int("max_body_bytes", max_body_bytes, minimum=1024)
        self.request_timeout = check_seconds("request_timeout", request_timeout)
        self.tool_call_tags = check_str_pair("tool_call_tags", tool_call_tags)
        self.eos_id = int(tokenizer.eos_token_id)
        self.sessions: dict[str, _Session] = {}
        self.finished: list[Trajectory] = []
        self._counts: Counter[str] = Counter()
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task] = set()
        self.host: str | None = None
        self.port: int | None = None
        self._created = int(time.time())

    # ------------------------------------------------------------------ lifecycle
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on ``host:port`` (0: a free port); returns the base URL for the client, ``http://host:port/v1``."""
        if self._server is not None:
            raise ArgumentError("start: the gateway is already listening")
        self._server = await asyncio.start_server(self._connection, host, port, limit=1 << 16)
        sock = self._server.sockets[0].getsockname()
        self.host, self.port = sock[0], int(sock[1])
        return self.url

    @property
    def url(self) -> str:
        """``http://host:port/v1`` (what ``openai.OpenAI(base_url=...)`` takes)."""
        if self.port is None:
            raise ArgumentError("url: the gateway is not listening (call start() first)")
        return f"http://{self.host}:{self.port}/v1"

    async def aclose(self) -> None:
        """Stop listening and close open connections (sessions and finished trajectories are kept). Idempotent."""
        if self._server is not None:
            self._server.close()
            for t in list(self._conns):
                t.cancel()
            await asyncio.gather(*self._conns, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> Gateway:
        if self._server is None:
            await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def stats(self) -> dict[str, Any]:
        """Counters: requests per route, streamed requests, 4xx/5xx errors, sessions, prefix mismatches (branches),
        prompt/completion tokens, tool calls returned.

        Sessions add up: ``sessions_opened == sessions_finished + sessions_open + sessions_discarded``, where a
        discarded session is one whose first request failed before anything was captured."""
        out = dict(self._counts)
        for key in ("sessions_opened", "sessions_finished", "sessions_discarded"):
            out.setdefault(key, 0)
        out["sessions_open"] = len(self.sessions)
        return out

    # ------------------------------------------------------------------ sessions (Python API)
    async def finish_session(self, session_id: str, reward: float, *, info: Mapping[str, Any] | None = None
                             ) -> Trajectory:
        """Close ``session_id`` with ``reward``: the trajectory (``reward`` and ``info`` set) goes to the queue and
        is returned. Waits for a request of that session that is still being served.

        Raises :class:`~rlblocks.errors.ArgumentError` for a session that is not open (unknown, already closed, or
        one whose first request failed before anything was captured), a ``reward`` that is not a finite number (a
        NaN reward would poison its whole group's advantages, and is not valid JSON), or an ``info`` that is not
        a mapping."""
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
            del self.sessions[session_id]
        traj = sess.trajectory
        traj.reward = reward
        traj.info.update(dict(info or {}), requests=sess.requests)
        self._counts["sessions_finished"] += 1
        await self._hand_over(traj)
        return traj

    async def _hand_over(self, traj: Trajectory) -> None:
        q = self.queue
        if q is None:
            self.finished.append(traj)
            return
        if hasattr(q, "aput"):
            version = traj.oldest_version
            await q.aput(traj, int(self.engine.version) if version is None else version)
        elif isinstance(q, asyncio.Queue):
            await q.put(traj)
        else:
            r = q(traj)
            if inspect.isawaitable(r):
                await r

    def _session(self, sid: str | None) -> _Session:
        if sid is None:
            sid = f"sess-{uuid.uuid4().hex}"
        sess = self.sessions.get(sid)
        if sess is None:
            if len(self.sessions) >= self.max_open_sessions:
                raise GatewayError(429, f"too many open sessions ({self.max_open_sessions}); post rewards to close "
                                   "finished ones", type="rate_limit_error", code="too_many_sessions")
            sess = self.sessions[sid] = _Session(sid)
            self._counts["sessions_opened"] += 1
        return sess

    def _session_id(self, req: _Request, body: Mapping[str, Any]) -> str | None:
        user = body.get("user")
        if user is not None and (not isinstance(user, str) or not user):
            raise _bad("user", f"expected a non-empty string, got {json.dumps(user)[:40]}", "invalid_type")
        sid = req.headers.get(self.session_header)
        if sid is not None and not sid:
            raise GatewayError(400, f"{self.session_header}: expected a non-empty session id", code="invalid_value")
        return user if sid is None else sid

    # ------------------------------------------------------------------ HTTP
    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._conns.add(task)
        try:
            while True:
                try:
                    req = await self._read_request(reader)
                except GatewayError as e:
                    await self._send_json(writer, e.status, e.body(), keep_alive=False)
                    self._counts["errors_4xx"] += 1
                    return
                if req is None:
                    return
                keep = req.headers.get("connection", "").lower() != "close"
                await self._handle(req, writer, keep)
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            self._conns.discard(task)
            writer.close()

    async def _read_request(self, reader: asyncio.StreamReader) -> _Request | None:
        try:
            line = await reader.readline()
        except (asyncio.LimitOverrunError, ValueError) as e:
            raise GatewayError(400, "request line too long") from e
        if not line:
            return None
        try:
            return await asyncio.wait_for(self._read_rest(reader, line), self.request_timeout)
        except asyncio.TimeoutError:
            raise GatewayError(408, f"the request was not received within {self.request_timeout:g} s",
                               code="request_timeout") from None

    async def _read_rest(self, reader: asyncio.StreamReader, line: bytes) -> _Request:
        parts = line.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise GatewayError(400, f"malformed request line {line[:80]!r}")
        method, target, _ = parts
        headers: dict[str, str] = {}
        while True:
            try:
                h = await reader.readline()
            except (asyncio.LimitOverrunError, ValueError) as e:
                raise GatewayError(400, "header line too long") from e
            if h in (b"\r\n", b"\n", b""):
                break
            k, sep, v = h.decode("latin-1").partition(":")
            if not sep:
                raise GatewayError(400, f"malformed header line {h[:80]!r}")
            headers[k.strip().lower()] = v.strip()
            if len(headers) > 100:
                raise GatewayError(400, "too many headers")
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = bytearray()
            while True:
                size_line = (await reader.readline()).split(b";")[0].strip()
                try:
                    size = int(size_line or b"0", 16)
                except ValueError:
                    size = -1
                if size < 0 or not size_line[:1].isalnum():  # int() also takes "-5", "+5" and "0x5"
                    raise GatewayError(400, f"malformed chunk size {size_line[:40]!r}")
                if size == 0:
                    await reader.readline()
                    break
                if len(body) + size > self.max_body_bytes:
                    raise GatewayError(413, f"request body larger than {self.max_body_bytes} bytes")
                body += await reader.readexactly(size)
                await reader.readexactly(2)
            data = bytes(body)
        else:
            try:
                length = int(headers.get("content-length", "0"))
            except ValueError as e:
                raise GatewayError(400, "content-length: expected an integer") from e
            if length < 0:
                raise GatewayError(400, f"content-length: expected a non-negative integer, got {length}")
            if length > self.max_body_bytes:
                raise GatewayError(413, f"request body of {length} bytes is larger than {self.max_body_bytes}")
            data = await reader.readexactly(length) if length > 0 else b""
        return _Request(method.upper(), unquote(urlsplit(target).path), headers, data)

    async def _send_json(self, writer: asyncio.StreamWriter, status: int, obj: Any, *, keep_alive: bool = True,
                         headers: Mapping[str, str] | None = None) -> None:
        data = json.dumps(obj, separators=(",", ":")).encode()
        head = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}", "Content-Type: application/json",
                f"Content-Length: {len(data)}", f"Connection: {'keep-alive' if keep_alive else 'close'}"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        await writer.drain()

    async def _handle(self, req: _Request, writer: asyncio.StreamWriter, keep: bool) -> None:
        route = req.path.rstrip("/") or "/"
        self._counts[f"requests {req.method} {route if not route.startswith('/v1/sessions/') else '/v1/sessions'}"] += 1
        try:
            if route in ("/v1/chat/completions", "/v1/completions"):
                if req.method != "POST":
                    raise GatewayError(405, f"{route} accepts POST, got {req.method}", code="method_not_allowed")
                body = self._json(req)
                await self._completion(req, body, writer, keep, chat=route.endswith("chat/completions"))
                return
            if route == "/v1/models" and req.method == "GET":
                await self._send_json(writer, 200, {"object": "list", "data": [self._model_card()]}, keep_alive=keep)
                return
            if route.startswith("/v1/models/") and req.method == "GET":
                if route[len("/v1/models/"):] != self.model:
                    raise GatewayError(404, f"model {route[len('/v1/models/'):]!r} not found; this gateway serves "
                                       f"{self.model!r}", code="model_not_found")
                await self._send_json(writer, 200, self._model_card(), keep_alive=keep)
                return
            if route == "/health" and req.method == "GET":
                await self._send_json(writer, 200, {"status": "ok", "version": int(self.engine.version)},
                                      keep_alive=keep)
                return
            if route.startswith("/v1/sessions/"):
                await self._session_route(req, route, writer, keep)
                return
            if route in ("/v1/models", "/health"):
                raise GatewayError(405, f"{route} accepts GET, got {req.method}", code="method_not_allowed")
            raise GatewayError(404, f"unknown route {req.method} {req.path}", code="not_found")
        except GatewayError as e:
            self._counts["errors_4xx" if e.status < 500 else "errors_5xx"] += 1
            await self._send_json(writer, e.status, e.body(), keep_alive=keep)
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as e:  # a bug here must still answer the client, with the reason
            self._counts["errors_5xx"] += 1
            err = GatewayError(500, f"internal error: {type(e).__name__}: {e}", type="server_error",
                               code="internal_error")
            await self._send_json(writer, 500, err.body(), keep_alive=False)
            raise ConnectionAbortedError from e

    def _json(self, req: _Request) -> dict[str, Any]:
        try:
            body = json.loads(req.body.decode("utf-8")) if req.body else None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise GatewayError(400, f"could not parse the JSON body: {e}", code="invalid_json") from e
        except RecursionError:  # deeply nested arrays: the client's body, not a server fault
            raise GatewayError(400, "could not parse the JSON body: nested too deeply", code="invalid_json") from None
        if not isinstance(body, dict):
            raise GatewayError(400, "expected a JSON object as the request body", code="invalid_json")
        return body

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model, "object": "model", "created": self._created, "owned_by": "rlblocks"}

    async def _session_route(self, req: _Request, route: str, writer: asyncio.StreamWriter, keep: bool) -> None:
        rest = route[len("/v1/sessions/"):]
        # a session id may itself contain "/" (a ``user`` such as "team/42"), so the action is read from the end
        sid, action = (rest[: -len("/reward")], "reward") if rest.endswith("/reward") else (rest, "")
        if action == "reward":
            if req.method != "POST":
                raise GatewayError(405, f"{route} accepts POST, got {req.method}", code="method_not_allowed")
            body = self._json(req)
            reward = body.get("reward")
            if isinstance(reward, bool) or not isinstance(reward, (int, float)):
                raise _bad("reward", f"expected a number, got {json.dumps(reward)[:40]}",
                           "missing_required_parameter" if reward is None else "invalid_type")
            if not math.isfinite(reward):  # json.loads reads NaN and Infinity
                raise _bad("reward", f"expected a finite number, got {reward}")
            info = body.get("info")
            if info is not None and not isinstance(info, dict):
                raise _bad("info", "expected an object", "invalid_type")
            try:
                traj = await self.finish_session(sid, float(reward), info=info)
            except SessionNotFound:
                raise GatewayError(404, f"no open session {sid!r} (unknown, or already closed by a reward)",
                                   code="session_not_found") from None
            await self._send_json(writer, 200, {"session_id": sid, "reward": float(reward),
                                                "segments": len(traj.segments()),
                                                "model_tokens": sum(s.num_model_tokens for s in traj.segments()),
                                                "prefix_mismatches": traj.prefix_mismatches}, keep_alive=keep)
            return
        if action == "" and req.method == "GET":
            sess = self.sessions.get(sid)
            if sess is None or sess.trajectory is None:
                raise GatewayError(404, f"no open session {sid!r}", code="session_not_found")
            t = sess.trajectory
            await self._send_json(writer, 200, {
                "session_id": sid, "requests": sess.requests, "tokens": len(t), "turns": t.num_turns,
                "segments": len(t.segments()), "prefix_mismatches": t.prefix_mismatches,
                "model_tokens": sum(s.num_model_tokens for s in t.segments()),
                "oldest_version": t.oldest_version}, keep_alive=keep)
            return
        raise GatewayError(404 if action not in ("reward", "") else 405, f"unknown route {req.method} {route}",
                           code="not_found")

    # ------------------------------------------------------------------ completions
    def _sampling(self, body: Mapping[str, Any], chat: bool) -> SamplingParams:
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
        top_k = _int(body, "top_k", -1, -1)
        names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
        max_tokens = None
        for name in names:
            max_tokens = _int(body, name, None, 1)
            if max_tokens is not None:
                break
        seed = _int(body, "seed", None, -(1 << 63), (1 << 63) - 1)
        return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                              max_new_tokens=max_tokens or self.default_max_tokens, stop_token_ids=(self.eos_id,),
                              seed=None if seed is None else seed & ((1 << 62) - 1))

    def _canonical(self, sess: _Session, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Assistant messages this session returned are replaced by the model's raw text (what was sampled)."""
        out = []
        for m in messages:
            if m["role"] == "assistant":
                raw = sess.returned.get(_fingerprint(m.get("content"), m.get("tool_calls")))
                if raw is not None:
                    m = {"role": "assistant", "content": raw}
            out.append(m)
        return out

    async def _completion(self, req: _Request, body: dict[str, Any], writer: asyncio.StreamWriter, keep: bool,
                          *, chat: bool) -> None:
        _refuse_unsupported(body)
        if not isinstance(body.get("model"), str) or not body["model"]:
            raise _bad("model", "expected the model id (a non-empty string)", "missing_required_parameter")
        sampling = self._sampling(body, chat)
        stops = _stops(body)
        stream = bool(body.get("stream", False))
        opts = body.get("stream_options") or {}
        if not isinstance(opts, Mapping):
            raise _bad("stream_options", "expected an object", "invalid_type")
        if chat:
            messages = _messages(body)
            tools, parse_calls = _tools(body)
            want_lp = body.get("logprobs") in (True,)
            if body.get("logprobs") not in (None, True, False):
                raise _bad("logprobs", "expected a boolean", "invalid_type")
            if _int(body, "top_logprobs", 0, 0, 20):
                raise _bad("top_logprobs", "only 0 is supported: the engines report the sampled token's log-prob, "
                           "not the alternatives", "unsupported_value")
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                if not prompt:
                    raise _bad("prompt", "expected a non-empty prompt")
                prompt_ids = list(self.tokenizer.encode(prompt, add_special_tokens=False))
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                             for t in prompt):
                prompt_ids = [int(t) for t in prompt]
            else:
                raise _bad("prompt", "expected a string or an array of token ids >= 0 (one prompt)",
                           "missing_required_parameter" if prompt is None else "invalid_value")
            lp = _int(body, "logprobs", None, 0, 5)
            if lp:
                raise _bad("logprobs", "only 0 is supported (the sampled tokens' log-probs), not alternatives",
                           "unsupported_value")
            want_lp = lp is not None
            if body.get("echo"):
                raise _bad("echo", "not supported", "unsupported_value")
            if body.get("suffix") is not None:
                raise _bad("suffix", "not supported", "unsupported_value")
            if _int(body, "best_of", 1, 1) != 1:
                raise _bad("best_of", "only 1 is supported", "unsupported_value")
            tools, parse_calls = None, False
        sess = self._session(self._session_id(req, body))
        sid = sess.session_id
        created = int(time.time())
        cid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        obj = "chat.completion" if chat else "text_completion"

        started = False
        try:
            if stream:  # headers first: the client sees the response start while the engine generates
                head = ["HTTP/1.1 200 OK", "Content-Type: text/event-stream", "Cache-Control: no-cache",
                        "Transfer-Encoding: chunked", f"Connection: {'keep-alive' if keep else 'close'}",
                        f"X-Session-Id: {sid}"]
                writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
                started = True
                self._counts["stream_requests"] += 1
                if chat:
                    await self._sse(writer, self._chunk(cid, obj, created, body["model"],
                                                        {"role": "assistant", "content": ""}, None, None))
            async with sess.lock:
                current = self.sessions.get(sid)
                if current is None and sess.trajectory is None:
                    # dropped while empty by a concurrent first request that failed (never closed by a reward,
                    # which needs a trajectory): open it again for this request
                    current = self.sessions[sid] = sess
                    self._counts["sessions_opened"] += 1
                if current is not sess:  # closed by a reward while this request waited
                    raise GatewayError(409, f"session {sid!r} was closed by a reward", code="session_closed")
                if chat:
                    canon = self._canonical(sess, messages)
                    try:
                        ids = render_chat(self.tokenizer, canon, tools=tools, add_generation_prompt=True,
                                          **self.template_kwargs)
                    except Exception as e:
                        raise _bad("messages", f"the chat template could not render them: {type(e).__name__}: "
                                   f"{e}") from e
                else:
                    canon, ids = None, prompt_ids
                saved = _snapshot(sess.trajectory)
                before = 0 if sess.trajectory is None else sess.trajectory.prefix_mismatches
                try:
                    if sess.trajectory is None:
                        sess.trajectory = Trajectory(ids, messages=canon, tools=tools, session_id=sid)
                    else:
                        sess.trajectory.extend_to(ids, on_mismatch=self.on_mismatch, messages=canon,
                                                  tokenizer=self.tokenizer)
                except PrefixMismatchError as e:
                    raise GatewayError(409, str(e), code="prefix_mismatch") from e
                except ArgumentError as e:  # the request's own tokens were refused: the client's error, not ours
                    raise _bad("messages" if chat else "prompt", str(e)) from e
                traj = sess.trajectory
                sess.requests += 1
                stop_texts = [*stops, *([self.tool_call_tags[1]] if parse_calls else [])]
                try:
                    res, stopped_by = await generate_turn(
                        self.engine, traj.token_ids, sampling, request_id=f"{sid}/{sess.requests}", session_id=sid,
                        stop_texts=stop_texts, tokenizer=self.tokenizer)
                except BaseException as e:
                    # The request produced nothing: the session's trajectory goes back to what it was (a refused or
                    # failed request adds no tokens and counts no mismatch, and a first one leaves no session).
                    _restore(sess, saved)
                    if isinstance(e, ArgumentError):
                        raise GatewayError(400, f"the engine refused the request: {e}", code="engine_refused") from e
                    if isinstance(e, Exception):
                        raise GatewayError(500, f"the engine failed: {type(e).__name__}: {e}", type="server_error",
                                           code="engine_error") from e
                    raise
                self._counts["prefix_mismatches"] += traj.prefix_mismatches - before
                out = res.output_ids
                body_ids = out[:-1] if out and out[-1] == self.eos_id else out
                raw = self.tokenizer.decode(body_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
                traj.append_generation(res, message={"role": "assistant", "content": raw})
                text, calls = raw, []
                if stopped_by in stops:  # OpenAI leaves the stop sequence out of the returned text
                    text = text[: len(text) - len(stopped_by)]
                if parse_calls:
                    parsed, _errors, rest = parse_tool_calls(text, tags=self.tool_call_tags)
                    if parsed:
                        text = rest
                        calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                  "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                 for c in parsed]
                if calls:
                    finish = "tool_calls"
                elif res.finish_reason == "stop":
                    finish = "stop"
                else:
                    finish = "length"
                if chat:
                    sess.returned[_fingerprint(text, calls)] = raw
        except GatewayError as e:
            if not started:
                raise
            self._counts["errors_4xx" if e.status < 500 else "errors_5xx"] += 1
            await self._sse(writer, e.body())
            await self._end_stream(writer)
            return
        finally:
            # Whatever ended the request (an error answer, a cancelled connection, a bug), a session in which
            # nothing was captured is not left open: it would count against max_open_sessions for good.
            if sess.trajectory is None and self.sessions.get(sid) is sess:
                del self.sessions[sid]
                self._counts["sessions_discarded"] += 1
        self._counts["prompt_tokens"] += len(res.prompt_ids)
        self._counts["completion_tokens"] += len(out)
        self._counts["tool_calls"] += len(calls)
        usage = {"prompt_tokens": len(res.prompt_ids), "completion_tokens": len(out),
                 "total_tokens": len(res.prompt_ids) + len(out)}
        ext = {"session_id": sid, "output_ids": list(out), "versions": list(res.output_versions),
               "turn": traj.turn, "prefix_mismatches": traj.prefix_mismatches}
        tokens = [self.tokenizer.decode([t], skip_special_tokens=False) for t in out] if want_lp else []
        if chat:
            lp_obj = None
            if want_lp:
                lp_obj = {"content": [{"token": s, "logprob": float(x), "bytes": list(s.encode()), "top_logprobs": []}
                                      for s, x in zip(tokens, res.output_logprobs)]}
            message: dict[str, Any] = {"role": "assistant", "content": text if (text or not calls) else None}
            if calls:
                message["tool_calls"] = calls
            if not stream:
                await self._send_json(writer, 200, {
                    "id": cid, "object": obj, "created": created, "model": body["model"],
                    "choices": [{"index": 0, "message": message, "logprobs": lp_obj, "finish_reason": finish}],
                    "usage": usage, "rlblocks": ext}, keep_alive=keep, headers={"X-Session-Id": sid})
                return
            delta: dict[str, Any] = {}
            if message["content"]:
                delta["content"] = message["content"]
            if calls:
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
            if delta:
                await self._sse(writer, self._chunk(cid, obj, created, body["model"], delta, None, lp_obj))
            last = self._chunk(cid, obj, created, body["model"], {}, finish, None)
        else:
            lp_obj = None
            if want_lp:
                offsets, acc = [], 0
                for s in tokens:
                    offsets.append(acc)
                    acc += len(s)
                lp_obj = {"tokens": tokens, "token_logprobs": [float(x) for x in res.output_logprobs],
                          "top_logprobs": None, "text_offset": offsets}
            choice = {"index": 0, "text": text, "logprobs": lp_obj, "finish_reason": finish}
            if not stream:
                await self._send_json(writer, 200, {"id": cid, "object": obj, "created": created,
                                                    "model": body["model"], "choices": [choice], "usage": usage,
                                                    "rlblocks": ext}, keep_alive=keep, headers={"X-Session-Id": sid})
                return
            await self._sse(writer, {"id": cid, "object": obj, "created": created, "model": body["model"],
                                     "choices": [{**choice, "finish_reason": None}]})
            last = {"id": cid, "object": obj, "created": created, "model": body["model"],
                    "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": finish}]}
        last["rlblocks"] = ext
        await self._sse(writer, last)
        if opts.get("include_usage"):
            await self._sse(writer, {"id": cid, "object": last["object"], "created": created,
                                     "model": body["model"], "choices": [], "usage": usage})
        await self._end_stream(writer)

    @staticmethod
    def _chunk(cid: str, obj: str, created: int, model: str, delta: dict[str, Any], finish: str | None,
               logprobs: Any) -> dict[str, Any]:
        return {"id": cid, "object": f"{obj}.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    @staticmethod
    async def _sse(writer: asyncio.StreamWriter, obj: Any) -> None:
        data = b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()

    @staticmethod
    async def _end_stream(writer: asyncio.StreamWriter) -> None:
        data = b"data: [DONE]\n\n"
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n0\r\n\r\n")
        await writer.drain()
