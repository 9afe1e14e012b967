"""The HTTP layer of the Tinker service: FastAPI routes over :class:`~rlblocks.tinker.service.TinkerService`, run by
uvicorn on one event loop (the one that also drives the rollout engines).

Routes: every ``/api/v1`` route the SDK's ``ServiceClient``, ``TrainingClient``, ``SamplingClient`` and
``RestClient`` call in normal use (:data:`SERVED`). Routes of the hosted service that have no meaning here answer
404 with the reason (:data:`REFUSED`); any other path answers 404 naming it. 404 is final for the SDK (it does not
retry it), so a refused route fails fast instead of hanging.

Errors: bad input answers 4xx with ``{"detail": "<field>: <what was expected>, got <what came>"}`` (a refused
request changes nothing); a body over ``max_body_bytes`` answers 413 before it is read in full; an unexpected
failure answers 500 and is logged with its traceback. Either way the server keeps serving. Requests are checked
with the SDK's own pydantic request types (``tinker.types``), so the field names are the SDK's.

Auth: with ``api_key`` set, every request must carry it in ``X-API-Key`` (401 otherwise); without it any key is
accepted (the SDK itself insists on a ``tml-`` prefix).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from rlblocks.errors import RequestError
from rlblocks.tinker.service import TinkerService
from rlblocks.tinker.wire import decode_forward_backward

log = logging.getLogger("rlblocks.tinker")

PROTO = "application/x-protobuf"

SERVED = [
    "GET /api/v1/healthz", "GET /api/v1/get_server_capabilities", "POST /api/v1/client/config",
    "POST /api/v1/client/dynamic_config", "POST /api/v1/create_session", "POST /api/v1/session_heartbeat",
    "POST /api/v1/sessions/{session_id}/finish", "GET /api/v1/sessions", "GET /api/v1/sessions/{session_id}",
    "POST /api/v1/create_model", "POST /api/v1/get_info", "POST /api/v1/forward_backward", "POST /api/v1/optim_step",
    "POST /api/v1/save_weights", "POST /api/v1/save_weights_for_sampler", "POST /api/v1/load_weights",
    "POST /api/v1/create_sampling_session", "POST /api/v1/join_sampling_session", "GET /api/v1/samplers/{sampler_id}",
    "POST /api/v1/asample", "POST /api/v1/retrieve_future", "POST /api/v1/cancel_future", "POST /api/v1/telemetry",
    "GET /api/v1/training_runs", "GET /api/v1/training_runs/{training_run_id}",
    "GET /api/v1/training_runs/{training_run_id}/checkpoints",
    "DELETE /api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id}", "GET /api/v1/checkpoints",
    "POST /api/v1/weights_info",
]
"""Every route served (``method path``)."""

REFUSED = {
    "/api/v1/auth/token": "JWT exchange is off (client/config: pjwt_auth_enabled=false); the API key is used as is",
    "/api/v1/create_custom_loss": "server-side custom losses are not served; forward_backward_custom runs "
    "client-side (client/config: custom_loss_server_side=false)",
    "/api/v1/retrieve_futures": "session-wide future polling is off (client/config: "
    "sample_use_retrieve_futures=false); each future is long-polled through retrieve_future",
    "/api/v1/copy_weights": "there are no projects or other accounts to copy checkpoints between",
    "/api/v1/save_weights_external": "external (merged HF) exports are not served; a saved checkpoint directory "
    "is a PEFT adapter (adapter_model.safetensors + adapter_config.json) under --state-dir",
    "/api/v1/sessions/search": "session search is not served; GET /api/v1/sessions lists the sessions",
    "/api/v1/billing/usage/events": "local runs are not billed",
    "/api/v1/billing/usage/checkpoints/current": "checkpoint storage is the local --state-dir, not billed",
    "/api/v1/audit": "no audit log is kept",
}
"""Routes of the hosted service answered with 404 and the reason."""

_REFUSED_PATTERNS = [("/publish", "checkpoints are not published (they are local files)"),
                     ("/ttl", "checkpoint TTLs are set at save time (ttl_seconds)"),
                     ("/external_weights_urls", "there is no blob storage to sign URLs for; checkpoints are files "
                      "under --state-dir"),
                     ("/trace_export", "session traces are not recorded"), ("/project", "there are no projects")]


try:  # orjson (a dependency of the tinker SDK) is several times faster than json for these small bodies
    import orjson

    _loads = orjson.loads

    def _json(obj: Any, status: int = 200) -> Response:
        return Response(orjson.dumps(obj), status_code=status, media_type="application/json")
except ImportError:  # pragma: no cover
    _loads = json.loads

    def _json(obj: Any, status: int = 200) -> Response:
        return JSONResponse(obj, status_code=status)


_EXPECTED = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
             "string_type": "a string"}


def _validate(model: type, body: Any) -> Any:
    """``body`` as the SDK's request type ``model``, in pydantic's strict mode: a value of another JSON type is
    refused rather than coerced (``lora_config.rank: true`` would otherwise become rank 1, ``4.0`` rank 4)."""
    try:
        return model.model_validate(body, strict=True)
    except pydantic.ValidationError as strict:
        try:
            model.model_validate(body)
        except pydantic.ValidationError as e:
            raise RequestError(_words(e)) from None
        raise RequestError(_words(strict)) from None


def _words(e: pydantic.ValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        if err["type"] in _EXPECTED:
            got = err.get("input")
            shown = json.dumps(got) if isinstance(got, (bool, int, float, str)) else type(got).__name__
            parts.append(f"{loc}: expected {_EXPECTED[err['type']]}, got {shown} ({type(got).__name__})")
        else:
            parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def create_app(service: TinkerService, *, api_key: str | None = None, max_body_bytes: int = 256 << 20,
               on_ready: Callable[[], None] | None = None):
    """The FastAPI application serving ``service`` (see the module docstring); ``on_ready()`` is called once every
    model is loaded and the engines run."""
    from tinker import types

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await service.start()
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            await service.close()

    app = FastAPI(title="rlblocks.tinker", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service

    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, exc: RequestError):
        return JSONResponse({"detail": str(exc)}, status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            path = request.url.path
            reason = REFUSED.get(path) or next((r for suffix, r in _REFUSED_PATTERNS if path.endswith(suffix)), None)
            msg = (f"{request.method} {path}: not served by rlblocks.tinker: {reason}" if reason else
                   f"{request.method} {path}: unknown route (rlblocks.tinker serves the Tinker API under /api/v1)")
            return JSONResponse({"detail": msg}, status_code=404)
        if exc.status_code == 405:
            return JSONResponse({"detail": f"{request.method} {request.url.path}: method not allowed"}, 405)
        return JSONResponse({"detail": str(exc.detail)}, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse({"detail": f"internal error: {type(exc).__name__}: {exc}"}, status_code=500)

    async def body_json(request: Request) -> Any:
        raw = await _read_body(request, max_body_bytes)
        if not raw:
            return {}
        try:
            return _loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(f"body: not valid JSON ({e})") from None

    # Routes are plain Starlette routes on the FastAPI app (no dependency injection per request), the busiest
    # first: route matching is a linear scan.
    routes: list[tuple[str, str, Callable[[Request], Awaitable[Response]]]] = []

    def route(method: str, path: str):
        def deco(fn):
            routes.append((method, path, fn))
            return fn
        return deco

    def post(path: str, model: type | None, fn: Callable[[Any], Any]) -> None:
        async def handler(request: Request) -> Response:
            body = await body_json(request)
            return _json(fn(_validate(model, body) if model is not None else body))

        routes.append(("POST", path, handler))

    # ------------------------------------------------------------------ futures and sampling (per sample)
    @route("POST", "/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        body = _validate(types.FutureRetrieveRequest, await body_json(request))
        rec = await service.futures.wait(body.request_id)
        if rec.pending:
            return _json({"type": "try_again", "request_id": rec.request_id, "queue_state": "active"})
        if rec.error is not None:
            return _json({"error": rec.error, "category": rec.category})
        if rec.proto:
            return Response(rec.result, media_type=PROTO)
        return _json(rec.result)

    post("/api/v1/asample", types.SampleRequest, service.asample)

    # ------------------------------------------------------------------ training
    @route("POST", "/api/v1/forward_backward")
    async def forward_backward(request: Request) -> Response:
        ctype = request.headers.get("content-type", "")
        if not ctype.startswith(PROTO):
            raise RequestError(f"Content-Type: expected {PROTO} (the SDK's ForwardBackwardRequest), got {ctype!r}",
                               status=415)
        raw = await _read_body(request, max_body_bytes)
        return _json(service.forward_backward(decode_forward_backward(raw, request.headers.get("content-encoding"))))

    post("/api/v1/optim_step", types.OptimStepRequest, service.optim_step)
    post("/api/v1/save_weights_for_sampler", types.SaveWeightsForSamplerRequest, service.save_weights_for_sampler)
    post("/api/v1/save_weights", types.SaveWeightsRequest, service.save_weights)
    post("/api/v1/load_weights", types.LoadWeightsRequest, service.load_weights)
    post("/api/v1/create_model", types.CreateModelRequest, service.create_model)
    post("/api/v1/get_info", types.GetInfoRequest, service.get_info)

    # ------------------------------------------------------------------ sessions and sampling sessions
    post("/api/v1/session_heartbeat", types.SessionHeartbeatRequest, lambda b: service.heartbeat(b.session_id))
    post("/api/v1/create_sampling_session", types.CreateSamplingSessionRequest, service.create_sampling_session)
    post("/api/v1/join_sampling_session", types.JoinSamplingSessionRequest, service.join_sampling_session)
    post("/api/v1/create_session", types.CreateSessionRequest, service.create_session)
    post("/api/v1/client/config", None, lambda body: service.client_config())
    post("/api/v1/client/dynamic_config", None, lambda body: {"refresh_interval_sec": 3600,
                                                              "sample_cancel_enabled": True})

    @route("POST", "/api/v1/cancel_future")
    async def cancel_future(request: Request) -> Response:
        body = await body_json(request)
        rid = body.get("request_id") if isinstance(body, dict) else None
        if not isinstance(rid, str):
            raise RequestError("request_id: expected a string")
        service.cancel(rid)
        return _json(None)

    @route("POST", "/api/v1/telemetry")
    async def telemetry(request: Request) -> Response:
        body = await body_json(request)  # accepted and dropped: nothing is stored or forwarded
        service.telemetry["batches"] += 1
        service.telemetry["events"] += len(body.get("events", [])) if isinstance(body, dict) else 0
        return _json({"status": "accepted"})

    @route("GET", "/api/v1/healthz")
    async def healthz(request: Request) -> Response:
        return _json({"status": "ok"})

    @route("GET", "/api/v1/get_server_capabilities")
    async def capabilities(request: Request) -> Response:
        return _json(service.capabilities())

    @route("POST", "/api/v1/sessions/{session_id}/finish")
    async def finish(request: Request) -> Response:
        service.finish_session(request.path_params["session_id"], await body_json(request))
        return _json(None)

    @route("GET", "/api/v1/sessions")
    async def sessions(request: Request) -> Response:
        return _json({"sessions": sorted(service.sessions)})

    @route("GET", "/api/v1/sessions/{session_id}")
    async def session(request: Request) -> Response:
        return _json(service.get_session(request.path_params["session_id"]))

    @route("GET", "/api/v1/samplers/{sampler_id}")
    async def sampler(request: Request) -> Response:
        return _json(service.get_sampler(request.path_params["sampler_id"]))

    # ------------------------------------------------------------------ REST: runs and checkpoints
    def _page(request: Request) -> tuple[int, int]:
        out = []
        for name, default in (("limit", 20), ("offset", 0)):
            raw = request.query_params.get(name, str(default))
            if not raw.isdigit():
                raise RequestError(f"{name}: expected a non-negative integer, got {raw!r}")
            out.append(int(raw))
        return out[0], out[1]

    @route("GET", "/api/v1/training_runs")
    async def training_runs(request: Request) -> Response:
        return _json(service.training_runs(*_page(request)))

    @route("GET", "/api/v1/training_runs/{run_id}")
    async def training_run(request: Request) -> Response:
        return _json(service.training_run(request.path_params["run_id"]))

    @route("GET", "/api/v1/training_runs/{run_id}/checkpoints")
    async def checkpoints(request: Request) -> Response:
        return _json(service.checkpoints(request.path_params["run_id"]))

    @route("DELETE", "/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(request: Request) -> Response:
        service.delete_checkpoint(request.path_params["run_id"], request.path_params["checkpoint_id"])
        return _json(None)

    @route("GET", "/api/v1/checkpoints")
    async def all_checkpoints(request: Request) -> Response:
        return _json(service.all_checkpoints(*_page(request)))

    post("/api/v1/weights_info", None, service.weights_info)

    @route("GET", "/api/v1/stats")
    async def stats(request: Request) -> Response:
        return _json(service.stats())

    for method, path, fn in routes:
        app.add_route(path, fn, methods=[method])
    return app


class _Guard:
    """Pure ASGI middleware (no per-request task, unlike ``BaseHTTPMiddleware``): the API key and the declared body
    size, checked before the route runs."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or ())
            problem = None
            if self.api_key is not None and headers.get(b"x-api-key", b"").decode("latin-1") != self.api_key:
                problem = (401, "X-API-Key: missing or not this server's key")
            length = headers.get(b"content-length", b"")
            if problem is None and length.isdigit() and int(length) > self.max_body_bytes:
                problem = (413, f"body: {int(length)} bytes exceeds the limit of {self.max_body_bytes}")
            if problem is not None:
                await JSONResponse({"detail": problem[1]}, status_code=problem[0])(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _read_body(request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it passes ``limit`` (a chunked body carries no Content-Length)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(f"body: exceeds the limit of {limit} bytes", status=413)
        chunks.append(chunk)
    return b"".join(chunks)


def bind(host: str = "127.0.0.1", port: int = 8000) -> socket.socket:
    """A listening socket (``port=0``: a free port; read it from ``sock.getsockname()[1]``)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def make_server(app, sock: socket.socket, *, log_level: str = "warning"):
    """A ``uvicorn.Server`` for ``app`` on ``sock``; ``await server.serve(sockets=[sock])`` runs it on the current
    event loop."""
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, access_log=False, timeout_keep_alive=75, lifespan="on",
                            h11_max_incomplete_event_size=1 << 20)
    return uvicorn.Server(config)


class ServerThread:
    """A Tinker server in a background thread (its own event loop): for tests, benchmarks and notebooks.

    ``with ServerThread(models, state_dir=...) as srv: os.environ["TINKER_BASE_URL"] = srv.base_url``. Startup
    waits for the models to load (an event, not a sleep); leaving the block stops the server and its engines.
    """

    def __init__(self, models: dict[str, str], *, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 max_body_bytes: int = 256 << 20, startup_timeout: float = 300.0, **service_options: Any) -> None:
        self.service = TinkerService(models, **service_options)
        self._ready = threading.Event()
        self.app = create_app(self.service, api_key=api_key, max_body_bytes=max_body_bytes, on_ready=self._ready.set)
        self._sock = bind(host, port)
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://{host}:{self.port}"
        self._server = make_server(self.app, self._sock)
        self._error: BaseException | None = None
        self._startup_timeout = startup_timeout
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="rlblocks-tinker-server", daemon=True)

    def _run(self) -> None:
        try:
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._server.serve(sockets=[self._sock]))
        except BaseException as e:  # surfaced by start()
            self._error = e
        finally:
            self._ready.set()
            self.loop.close()

    def start(self) -> ServerThread:
        self._thread.start()
        if not self._ready.wait(self._startup_timeout) or self._error is not None or not self.service.started:
            self.stop()
            raise RuntimeError(f"rlblocks.tinker server failed to start: {self._error!r}")
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=60)
        with contextlib.suppress(OSError):
            self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["REFUSED", "SERVED", "ServerThread", "bind", "create_app", "make_server"]
