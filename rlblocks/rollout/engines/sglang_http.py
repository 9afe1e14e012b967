"""HTTP transport of :class:`~rlblocks.rollout.engines.SGLangEngine` (standard library only): blocking ``urllib``
calls run in the engine's two thread pools, one for ``/generate`` and a small one for control calls, so
``pause``, ``abort`` and weight updates never queue behind generations."""

from __future__ import annotations

import asyncio
import functools
import http.client
import json
import urllib.error
import urllib.request
from typing import Any

from rlblocks.errors import EngineError, SGLangError


def _as_int_version(value: Any, default: int) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return default


class _SGLangHTTP:
    """The HTTP calls of :class:`~rlblocks.rollout.engines.SGLangEngine` (a base class of it): reads its
    ``base_url``, ``timeout``, ``api_key``, ``_gen_pool``, ``_ctl_pool``, ``_state`` and ``_server_info``."""

    _server_info: dict | None

    def _call(self, method: str, path: str, payload: dict | None, timeout: float | None = None) -> tuple[int, Any]:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout if timeout is None else timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:  # refused, reset, cut, timed out
            raise SGLangError(f"{method} {path}: no answer from {self.base_url}: {exc}") from exc
        if not raw:
            return status, None
        try:
            return status, json.loads(raw)
        except json.JSONDecodeError:
            return status, raw.decode(errors="replace")

    async def _http(
        self, method: str, path: str, payload: dict | None = None, *, control: bool = True, check: bool = True
    ) -> tuple[int, Any]:
        """One HTTP call in its pool; with ``check`` an HTTP error raises :class:`SGLangError`."""
        pool = self._ctl_pool if control else self._gen_pool
        try:
            status, body = await asyncio.get_running_loop().run_in_executor(pool, self._call, method, path, payload)
        except SGLangError:
            raise
        except RuntimeError as exc:  # the pool was shut down by close()
            raise EngineError(f"SGLangEngine: the engine is closed ({method} {path} not sent)") from exc
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._state.closed and (task is None or not task.cancelling()):  # close() cancelled the queued call
                raise EngineError(f"SGLangEngine: the engine was closed before {method} {path} was sent") from None
            raise
        if check and status >= 400:
            raise SGLangError(f"{method} {path}: HTTP {status}: {str(body)[:2000]}", status=status, body=body)
        return status, body

    async def health(self, timeout: float = 5.0) -> None:
        """The heartbeat a :class:`~rlblocks.rollout.Router` calls: ``GET /health`` must answer HTTP 200 within
        ``timeout`` seconds, else :class:`SGLangError` (a dead, hung or unreachable server)."""
        self._state.check_open()
        call = functools.partial(self._call, "GET", "/health", None, timeout=timeout)
        status, body = await asyncio.get_running_loop().run_in_executor(self._ctl_pool, call)
        if status != 200:
            raise SGLangError(f"GET /health: HTTP {status}: {str(body)[:300]}", status=status, body=body)

    async def _server_flag(self, name: str) -> bool:
        """A launch flag of the server, from ``GET /server_info`` (read once)."""
        if self._server_info is None:
            _, body = await self._http("GET", "/server_info")
            if not isinstance(body, dict):
                raise SGLangError(f"/server_info: expected a JSON object, got {str(body)[:300]}", body=body)
            self._server_info = body
        return bool(self._server_info.get(name, False))
