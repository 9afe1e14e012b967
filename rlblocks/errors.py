"""The exceptions rlblocks raises on purpose, under one base class: every exception class of the library is here.

Every error a block raises deliberately derives from :class:`RLBlocksError`, so ``except RLBlocksError`` catches
all of them. Each one also derives from the built-in exception a caller would naturally catch (``ArgumentError`` is
a ``ValueError``, ``QueueFull`` a ``queue.Full``, ``RewardTimeout`` a ``TimeoutError``, ...), so code written
against the built-ins keeps working. The same failure raises the same class from every engine and transport: a
refused weight update is a ``WeightUpdateError`` whether TorchEngine, VLLMEngine, SGLangEngine or a sync receiver
refused it. Exceptions are imported from this module only.

The table of every class, its built-in base and when it is raised: ``docs/concepts.md`` (Errors).
"""

from __future__ import annotations

import queue as _stdlib_queue
from typing import Any

__all__ = [
    "ArgumentError",
    "CheckpointError",
    "ClientDisconnected",
    "DeltaError",
    "EngineDied",
    "EngineError",
    "GatewayError",
    "InsufficientGroupsError",
    "NoLiveEngine",
    "PrefixMismatchError",
    "QueueClosed",
    "QueueFull",
    "QueueRefused",
    "RLBlocksError",
    "RequestError",
    "RewardTimeout",
    "SGLangError",
    "SandboxUnavailable",
    "SessionNotFound",
    "SimulationStalled",
    "SyncError",
    "SyncMismatchError",
    "ToolUnavailable",
    "WeightUpdateError",
    "WorkerCrashed",
    "WorkerError",
]


class RLBlocksError(Exception):
    """Base class of every exception rlblocks raises on purpose."""


class ArgumentError(RLBlocksError, ValueError):
    """An argument was refused. The message names the argument, what was expected and what was given."""


class WeightUpdateError(RLBlocksError, ValueError):
    """A weight update was refused before any weight, cache or version changed."""


class EngineError(RLBlocksError, RuntimeError):
    """A rollout engine failed, was closed, or answered with something unexpected."""


class SGLangError(EngineError):
    """An SGLang server answered with an HTTP error or an unexpected body, or could not be reached. ``status`` is
    the HTTP status (``None`` when there was no answer) and ``body`` the decoded answer."""

    def __init__(self, message: str, *, status: int | None = None, body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class SyncError(RLBlocksError, RuntimeError):
    """A collective of the sync group failed: a peer died, refused, or did not answer within the timeout."""


class SyncMismatchError(SyncError, WeightUpdateError):
    """Sender and receiver disagree on the tensors to move (names, shapes or dtypes); nothing was moved."""


class DeltaError(WeightUpdateError):
    """A delta packet was refused (wrong chain position, corrupted bytes, checksum or layout mismatch): a refused
    weight update, so also a :class:`WeightUpdateError`."""


class QueueFull(RLBlocksError, _stdlib_queue.Full):
    """``put`` could not insert because the queue is at capacity (non-blocking put, or the timeout expired)."""


class QueueClosed(RLBlocksError, RuntimeError):
    """``put`` on a closed queue."""


class InsufficientGroupsError(RLBlocksError, RuntimeError):
    """Dynamic sampling finished with fewer accepted groups than its target and was told not to proceed."""


class SimulationStalled(RLBlocksError, RuntimeError):
    """The simulated loop ran out of events before ``schedule.steps`` steps (a configuration that cannot finish);
    raised instead of returning partial figures."""


class SandboxUnavailable(RLBlocksError, RuntimeError):
    """The sandbox refused to run untrusted code: a required isolation layer (bubblewrap, a namespace, seccomp, a
    per-sandbox process limit) cannot be put in force on this machine. The message names the missing layers and
    how to opt into the weaker isolation explicitly."""


class PrefixMismatchError(ArgumentError):
    """A rendering (or a re-sent prompt) does not extend the trajectory's tokens exactly.

    Attributes: ``position`` (first differing index), ``expected`` (the trajectory's id there, or ``None`` when
    the rendering is longer only because the trajectory ended), ``got`` (the rendering's id there, or ``None``
    when the rendering is shorter), ``role`` and ``turn`` of the trajectory token at ``position``.
    """

    def __init__(self, message: str, *, position: int, expected: int | None, got: int | None,
                 role: str | None, turn: int | None) -> None:
        super().__init__(message)
        self.position = position
        self.expected = expected
        self.got = got
        self.role = role
        self.turn = turn


class GatewayError(RLBlocksError, RuntimeError):
    """What the capture gateway answers a request with: an HTTP ``status`` and an OpenAI-style error object
    (``type``, ``param`` naming the offending field, ``code``); :meth:`body` is the JSON the client receives."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ClientDisconnected(RLBlocksError, ConnectionError):
    """The client of a gateway request closed its connection before its response: nothing can be answered (a turn
    generated for it is rolled back as undelivered)."""


class QueueRefused(GatewayError):
    """A session was closed with its reward but the queue refused its trajectory (closed, still full after the
    hand-over timeout, or the callable raised). Nothing is lost: ``trajectory`` is kept in ``Gateway.finished``
    (answered over HTTP as 503 with code ``queue_refused``)."""

    def __init__(self, message: str, *, session_id: str, trajectory: Any) -> None:
        super().__init__(503, message, type="server_error", code="queue_refused")
        self.session_id, self.trajectory = session_id, trajectory


class SessionNotFound(ArgumentError):
    """No open gateway session has this id (unknown, already closed by a reward, or nothing was captured in it)."""


class ToolUnavailable(RLBlocksError, RuntimeError):
    """A tool refused a call because ``max_hung`` of its earlier calls timed out and are still running."""


class RequestError(ArgumentError):
    """A service request was refused. ``status`` is the HTTP status the server answers with (400 bad input, 404
    unknown id or route, 409 conflict, 413 too large, 415 wrong content type); the message names the field."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = int(status)


class RewardTimeout(RLBlocksError, TimeoutError):
    """A reward call did not finish within its timeout (its worker process was killed)."""


class WorkerCrashed(RLBlocksError, RuntimeError):
    """The worker process died during a call, or could not be started."""


class WorkerError(RLBlocksError, RuntimeError):
    """The called function raised in the worker process. ``remote_type`` and ``remote_traceback`` describe it."""

    def __init__(self, message: str, *, remote_type: str = "", remote_traceback: str = "") -> None:
        super().__init__(message)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback


class CheckpointError(RLBlocksError, ValueError):
    """A checkpoint was refused: no file, a foreign file, a torn or damaged one (length or checksum), another format
    version or kind, or a missing key. The message names the file and the fault; nothing was loaded."""


class EngineDied(EngineError):
    """A ``Router`` took one of its engines out (a failed call, a missed heartbeat) while that engine served a
    request; the router answers it by moving the request to a live engine, so callers see it only from the router's
    own machinery."""


class NoLiveEngine(EngineError):
    """A ``Router`` was asked to generate while every one of its engines is out (dead, not yet rejoined)."""
