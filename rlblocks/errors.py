"""The exceptions rlblocks raises on purpose, under one base class.

Every error a block raises deliberately derives from :class:`RLBlocksError`, so ``except RLBlocksError`` catches
all of them. Each one also derives from the built-in exception a caller would naturally catch, so code written
against the built-ins keeps working:

=========================  ==================================  ==========================================
class                      also a                              raised when
=========================  ==================================  ==========================================
``ArgumentError``          ``ValueError``                      an argument is refused (its message names the
                                                               argument, what was expected, and what was given)
``WeightUpdateError``      ``ValueError``                      a weight update is refused before anything was
                                                               touched (names, shapes, dtypes, non-finite
                                                               values, a version that does not move forward)
``EngineError``            ``RuntimeError``                    a rollout engine failed or answered unexpectedly
``SyncError``              ``RuntimeError``                    a collective of a sync group failed (dead or
                                                               silent peer, timeout)
``SyncMismatchError``      ``SyncError``, ``WeightUpdateError`` sender and receivers disagree on what to move
``DeltaError``             ``WeightUpdateError``               a delta packet was refused
``QueueFull``              ``queue.Full``                      a bounded queue is at capacity
``QueueClosed``            ``RuntimeError``                    ``put`` on a closed queue
``InsufficientGroupsError``  ``RuntimeError``                  dynamic sampling could not fill its target
``RequestError``           ``ArgumentError``                   a service request was refused (the Tinker
                                                               server answers it with ``status``, a 4xx, and
                                                               a message naming the field)
=========================  ==================================  ==========================================

The same failure raises the same class from every engine and transport: a refused weight update is a
``WeightUpdateError`` whether TorchEngine, VLLMEngine, SGLangEngine or a sync receiver refused it.
"""

from __future__ import annotations

import queue as _stdlib_queue

__all__ = [
    "ArgumentError",
    "DeltaError",
    "EngineError",
    "InsufficientGroupsError",
    "QueueClosed",
    "QueueFull",
    "RLBlocksError",
    "RequestError",
    "SyncError",
    "SyncMismatchError",
    "WeightUpdateError",
]


class RLBlocksError(Exception):
    """Base class of every exception rlblocks raises on purpose."""


class ArgumentError(RLBlocksError, ValueError):
    """An argument was refused. The message names the argument, what was expected and what was given."""


class WeightUpdateError(RLBlocksError, ValueError):
    """A weight update was refused before any weight, cache or version changed."""


class EngineError(RLBlocksError, RuntimeError):
    """A rollout engine failed, was closed, or answered with something unexpected."""


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


class RequestError(ArgumentError):
    """A service request was refused. ``status`` is the HTTP status the server answers with (400 bad input, 404
    unknown id or route, 409 conflict, 413 too large, 415 wrong content type); the message names the field."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = int(status)
