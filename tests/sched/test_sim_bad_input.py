"""The simulator's configuration refuses bad values with ArgumentError naming them (a truthy string read as a flag,
a float where a count goes, a ZeroDivisionError or KeyError from inside), and its CLI answers bad flags with a
usage error instead of a traceback."""

from __future__ import annotations

import math

import pytest

from rlblocks.errors import ArgumentError, RLBlocksError, SimulationStalled
from rlblocks.sched.sim import (
    Hardware,
    Lengths,
    ModelSpec,
    PrefillCost,
    Schedule,
    SyncCost,
    TrainCost,
    Workload,
    cpu_like,
    gpu_like,
    main,
)

L3 = Lengths.fixed(3)

BAD = [
    ("lengths", lambda: Workload(lengths=100)),  # failed deep inside simulate() with AttributeError
    ("prompt_lengths", lambda: Workload(L3, prompt_lengths=None)),
    ("per_group_length", lambda: Workload(L3, per_group_length="no")),
    ("seed", lambda: Workload(L3, seed=1.5)),
    ("zero_variance_p", lambda: Workload(L3, zero_variance_p=math.nan)),
    ("partial_rollout", lambda: Schedule(partial_rollout="no")),
    ("dynamic_sampling", lambda: Schedule(dynamic_sampling="no")),  # truthy: would have filtered groups
    ("over_sampling", lambda: Schedule(over_sampling=math.nan)),
    ("over_sampling", lambda: Schedule(over_sampling=0.5)),
    ("max_rounds", lambda: Schedule(max_rounds=0)),
    ("max_rounds", lambda: Schedule(max_rounds=2.5)),
    ("kind", lambda: Lengths("bogus")),  # sampled as a lognormal of median 0: math domain error
    ("values", lambda: Lengths.empirical("123")),
    ("padded", lambda: TrainCost(padded="no")),
    ("decode", lambda: Hardware("h", {}, PrefillCost(), TrainCost(), SyncCost(), SyncCost(), 0, 1, 1)),
    ("params", lambda: ModelSpec("x", -1, 1, 1, 1, 1)),
    ("layers", lambda: ModelSpec("x", 1e9, 1.5, 1, 1, 1)),
    ("bandwidth_efficiency", lambda: gpu_like(bandwidth_efficiency=0)),  # ZeroDivisionError
    ("network_bytes_per_s", lambda: gpu_like(network_bytes_per_s=0)),  # ZeroDivisionError
    ("memory_bytes", lambda: gpu_like(memory_bytes=math.nan)),  # int(NaN)
    ("gpu_memory_utilization", lambda: gpu_like(gpu_memory_utilization=2.0)),  # more memory than the device
    ("model", lambda: gpu_like(7)),
    ("decode", lambda: Hardware.from_dict({"name": "x"})),  # KeyError
    ("bogus", lambda: Hardware.from_dict({**cpu_like().to_dict(), "bogus": 1})),  # TypeError
    ("x", lambda: Hardware.from_dict({**cpu_like().to_dict(), "decode": {"x": 1}})),
]


@pytest.mark.parametrize(("arg", "call"), BAD, ids=[f"{i}-{a}" for i, (a, _) in enumerate(BAD)])
def test_refused_and_named(arg, call):
    with pytest.raises(ArgumentError, match=arg):
        call()


def test_valid_configurations_still_build():
    hw = Hardware.from_dict(cpu_like().to_dict())
    assert hw == cpu_like()
    assert Schedule(max_rounds=None, over_sampling=1).max_rounds is None
    assert gpu_like(ModelSpec.preset("1.5b")).devices_per_engine == 1
    assert issubclass(SimulationStalled, RLBlocksError) and issubclass(SimulationStalled, RuntimeError)


@pytest.mark.parametrize("argv", [["--splits", "a,b"], ["--etas", "x"], ["--etas", "-1"]])
def test_cli_bad_flags_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--hardware", "cpu", "--devices", "8", "--steps", "2", "--warmup", "0", *argv])
    assert e.value.code == 2 and "error:" in capsys.readouterr().err
