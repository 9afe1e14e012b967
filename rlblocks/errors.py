"""The exceptions rlblocks raises on purpose, under one base class.

Every error a block raises deliberately derives from :class:`RLBlocksError`, so ``except RLBlocksError`` catches
all of them. Each one also derives from the built-in exception a caller would naturally catch, so code written
against the built-ins keeps working:

| class | also a | raised when |
|---|---|---|
| ``ArgumentError`` | ``ValueError`` | an argument is refused (the message names it, what was expected, what came) |
| ``WeightUpdateError`` | ``ValueError`` | a weight update is refused before anything changed |
| ``EngineError`` | ``RuntimeError`` | a rollout engine failed or answered unexpectedly |
| ``SyncError`` | ``RuntimeError`` | a collective of a sync group failed (dead or silent peer, timeout) |
| ``SyncMismatchError`` | ``SyncError``, ``WeightUpdateError`` | sender and receivers disagree on what to move |
| ``DeltaError`` | ``WeightUpdateError`` | a delta packet was refused |
| ``QueueFull`` | ``queue.Full`` | a bounded queue is at capacity |
| ``QueueClosed`` | ``RuntimeError`` | ``put`` on a closed queue |
| ``InsufficientGroupsError`` | ``RuntimeError`` | dynamic sampling could not fill its target |
| ``SandboxUnavailable`` | ``RuntimeError`` | the sandbox cannot put its isolation layers in force here (the message names the missing ones) |
| ``CheckpointError`` | ``ValueError`` | a checkpoint is missing, foreign, torn, damaged or lacks a key (none loaded) |
| ``NoLiveEngine`` | ``EngineError`` | a ``Router`` has no live engine left to serve a request |

The same failure raises the same class from every engine and transport: a refused weight update is a
``WeightUpdateError`` whether TorchEngine, VLLMEngine, SGLangEngine or a sync receiver refused it.
"""

from __future__ import annotations

import queue as _stdlib_queue

__all__ = [
    "ArgumentError",
    "CheckpointError",
    "DeltaError",
    "EngineError",
    "InsufficientGroupsError",
    "NoLiveEngine",
    "QueueClosed",
    "QueueFull",
    "RLBlocksError",
    "SandboxUnavailable",
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


class SandboxUnavailable(RLBlocksError, RuntimeError):
    """The sandbox refused to run untrusted code: a required isolation layer (bubblewrap, a namespace, seccomp, a
    per-sandbox process limit) cannot be put in force on this machine. The message names the missing layers and
    how to opt into the weaker isolation explicitly."""


class CheckpointError(RLBlocksError, ValueError):
    """A checkpoint was refused: no file, a foreign file, a torn or damaged one (length or checksum), another format
    version or kind, or a missing key. The message names the file and the fault; nothing was loaded."""


class NoLiveEngine(EngineError):
    """A ``Router`` was asked to generate while every one of its engines is out (dead, not yet rejoined)."""
