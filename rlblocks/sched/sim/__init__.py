"""A discrete-event simulation of synchronous and bounded-async RL on a virtual clock, driven by the real sched blocks.

What it answers: for a model, a device split, a response-length distribution and a staleness bound η, how many
trained tokens per second to expect, how busy each device pool is, how stale the trained tokens are and how many
samples are dropped — before renting the cluster. ``python -m rlblocks.sched.sim --help`` sizes a deployment.

It lives in the package (not under ``benchmarks/``) because it is something users import and run: the sizing CLI and
:func:`simulate` are public, it imports only the standard library and :mod:`rlblocks.sched`, and its tests run in CI.

The decisions are real (:class:`~rlblocks.sched.StalenessController`, :class:`~rlblocks.sched.StalenessQueue`,
:class:`~rlblocks.sched.DynamicSampler`, :class:`~rlblocks.sched.PartialRolloutBuffer`, nothing re-implemented);
the engines, the trainer and the weight sync are cost models (:class:`Hardware`). Modes (:class:`Schedule`):
``"sync-colocated"``, ``"sync-disaggregated"`` and ``"async"`` (η = 0 gives exactly the disaggregated result).
What is modelled, the conventions and the outputs (:class:`SimResult`): ``docs/simulator.md``.

Layout: :mod:`.clock` (the virtual clock: events, work time and real time), :mod:`.costs` (the cost models and the
device presets), :mod:`.workload` (lengths, workload, schedule), :mod:`.engine` (the engine model, on the clock),
:mod:`.loops` (the simulated loops, their policy, and :func:`simulate`), ``__main__`` (the sizing CLI, :func:`main`).
:class:`~rlblocks.errors.SimulationStalled` is in :mod:`rlblocks.errors`.
"""

from __future__ import annotations

from rlblocks._lazy import lazy_exports
from rlblocks.errors import SimulationStalled  # noqa: F401  (what simulate() raises; its home is rlblocks.errors)

from .costs import DecodeCost, Hardware, ModelSpec, PrefillCost, SyncCost, TrainCost, cpu_like, gpu_like
from .loops import SimResult, _Sim, simulate  # noqa: F401  (_Sim: the loop itself, for white-box tests)
from .workload import Lengths, Schedule, Workload

__all__ = [
    "DecodeCost",
    "Hardware",
    "Lengths",
    "ModelSpec",
    "PrefillCost",
    "Schedule",
    "SimResult",
    "SyncCost",
    "TrainCost",
    "Workload",
    "cpu_like",
    "gpu_like",
    "simulate",
]


# The CLI is imported on first use: importing ``__main__`` here would make ``python -m rlblocks.sched.sim`` find it
# already in sys.modules and run it twice over (runpy's RuntimeWarning).
__getattr__, __dir__ = lazy_exports(__name__, globals(), {"main": ".__main__"})
