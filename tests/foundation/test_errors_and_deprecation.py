"""The shared exception hierarchy and the deprecation helpers."""

import queue
import warnings

import pytest

import rlblocks
from rlblocks import errors
from rlblocks._deprecate import renamed_kwargs, take_renamed


def test_every_error_derives_from_the_base_and_its_builtin():
    expected = {
        errors.ArgumentError: ValueError,
        errors.WeightUpdateError: ValueError,
        errors.EngineError: RuntimeError,
        errors.SyncError: RuntimeError,
        errors.SyncMismatchError: ValueError,  # a refused update: also a WeightUpdateError
        errors.DeltaError: errors.WeightUpdateError,
        errors.QueueFull: queue.Full,
        errors.QueueClosed: RuntimeError,
        errors.InsufficientGroupsError: RuntimeError,
        errors.SimulationStalled: RuntimeError,
        errors.GatewayError: RuntimeError,
        errors.QueueRefused: errors.GatewayError,
        errors.SessionNotFound: errors.ArgumentError,
        errors.ToolUnavailable: RuntimeError,
        errors.SandboxUnavailable: RuntimeError,
        errors.RequestError: errors.ArgumentError,
        errors.CheckpointError: ValueError,
        errors.NoLiveEngine: errors.EngineError,
    }
    for cls, builtin in expected.items():
        assert issubclass(cls, rlblocks.RLBlocksError), cls
        assert issubclass(cls, builtin), cls
    assert issubclass(errors.SyncMismatchError, errors.SyncError)
    assert issubclass(errors.SyncMismatchError, errors.WeightUpdateError)
    assert set(errors.__all__) == {c.__name__ for c in expected} | {"RLBlocksError"}


def test_modules_re_export_the_same_classes():
    from rlblocks.rollout.sglang_engine import SGLangError
    from rlblocks.sched.dynamic_sampling import InsufficientGroupsError
    from rlblocks.sched.queue import QueueClosed, QueueFull
    from rlblocks.sync.broadcast import SyncError, SyncMismatchError
    from rlblocks.sync.delta import DeltaError

    assert QueueFull is errors.QueueFull and QueueClosed is errors.QueueClosed
    assert SyncError is errors.SyncError and SyncMismatchError is errors.SyncMismatchError
    assert DeltaError is errors.DeltaError and InsufficientGroupsError is errors.InsufficientGroupsError
    assert issubclass(SGLangError, errors.EngineError)


def test_bad_input_raises_argument_error_naming_the_argument():
    import torch

    from rlblocks.losses import aggregate

    with pytest.raises(errors.ArgumentError, match="mode"):
        aggregate(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), mode="no-such-mode")


def test_renamed_kwargs_maps_the_old_name_and_warns():
    @renamed_kwargs(max_age="max_staleness")
    def f(*, max_staleness=None):
        return max_staleness

    with pytest.warns(DeprecationWarning, match=r"max_age=.*deprecated.*max_staleness="):
        assert f(max_age=3) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert f(max_staleness=4) == 4
    with pytest.raises(errors.ArgumentError, match="both"):
        f(max_age=1, max_staleness=2)


def test_take_renamed_resolves_inside_kwargs():
    kw = {"behav_logp": 7}
    with pytest.warns(DeprecationWarning, match="behav_logp"):
        assert take_renamed(kw, "behav_logp", "rollout_logp", None, where="loss") == 7
    assert kw == {}
    assert take_renamed({}, "behav_logp", "rollout_logp", 5, where="loss") == 5
    with pytest.raises(errors.ArgumentError, match="both"):
        take_renamed({"behav_logp": 1}, "behav_logp", "rollout_logp", 2, where="loss")
