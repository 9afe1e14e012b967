"""What the simulated loop generates and how it runs: response/prompt length distributions (:class:`Lengths`), the
groups per step (:class:`Workload`) and the schedule (:class:`Schedule`: mode, η, partial rollout, dynamic sampling)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from rlblocks._checks import check_bool, check_int, check_optional_int, check_real
from rlblocks.errors import ArgumentError

__all__ = ["Lengths", "Schedule", "Workload"]

Mode = Literal["sync-colocated", "sync-disaggregated", "async"]
MODES = ("sync-colocated", "sync-disaggregated", "async")
_LENGTH_KINDS = ("fixed", "empirical", "cycle", "lognormal")
Z99 = 2.3263478740408408  # standard normal 99th percentile: p99 / median = exp(Z99 * sigma) for a lognormal


@dataclass(frozen=True)
class Lengths:
    """A distribution of token counts (response or prompt lengths).

    Build with :meth:`lognormal`, :meth:`empirical`, :meth:`cycle` or :meth:`fixed`; :meth:`sample` draws one
    integer in ``[minimum, maximum]``. A lognormal is truncated by clamping (like a ``max_new_tokens`` budget: a
    sample that would run longer stops at the budget with ``finish_reason="length"``).
    """

    kind: str
    median: float = 0.0
    sigma: float = 0.0
    minimum: int = 1
    maximum: int = 1
    values: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in _LENGTH_KINDS:
            raise ArgumentError(f"kind: expected one of {_LENGTH_KINDS} (build with Lengths.lognormal(), .empirical(), "
                                f".cycle() or .fixed()), got {self.kind!r}")
        lo = check_int("minimum", self.minimum, minimum=1)
        check_int("maximum", self.maximum, minimum=lo)
        if self.kind in ("empirical", "cycle") and not self.values:
            raise ArgumentError("values: expected at least one length, got none")

    @classmethod
    def lognormal(cls, median: float, p99: float, *, maximum: int, minimum: int = 1) -> Lengths:
        """Lognormal with the given median and 99th percentile (``sigma = ln(p99 / median) / z_0.99``), clamped to
        ``[minimum, maximum]``. E.g. median 2048, p99 32768: ``sigma = 1.19``, mean ≈ 4.1k before the clamp."""
        median = check_real("median", median, finite=True, gt=0)
        p99 = check_real("p99", p99, finite=True, gt=0)
        if p99 < median:
            raise ArgumentError(f"p99: expected >= median ({median}), got {p99}")
        minimum = check_int("minimum", minimum, minimum=1)
        maximum = check_int("maximum", maximum, minimum=minimum)
        return cls("lognormal", median=median, sigma=math.log(p99 / median) / Z99, minimum=minimum, maximum=maximum)

    @classmethod
    def empirical(cls, values: Sequence[int]) -> Lengths:
        """Draw uniformly from observed lengths (e.g. the response lengths of a previous run)."""
        if isinstance(values, (str, bytes)):
            raise ArgumentError(f"values: expected a sequence of int lengths, got {type(values).__name__}")
        vals = tuple(check_int(f"values[{i}]", v, minimum=1) for i, v in enumerate(values))
        if not vals:
            raise ArgumentError("values: expected at least one length, got none")
        return cls("empirical", minimum=min(vals), maximum=max(vals), values=vals)

    @classmethod
    def cycle(cls, values: Sequence[int]) -> Lengths:
        """Replay ``values`` in order: the ``i``-th draw is ``values[i % len(values)]`` (a trace, or a case small
        enough to check by hand). Draws are numbered per sample (group by group), or per group when lengths are
        drawn per group."""
        e = cls.empirical(values)
        return replace(e, kind="cycle")

    @classmethod
    def fixed(cls, n: int) -> Lengths:
        n = check_int("n", n, minimum=1)
        return cls("fixed", minimum=n, maximum=n)

    def sample(self, rng: random.Random, index: int = 0) -> int:
        """One draw; ``index`` numbers the draw (only :meth:`cycle` uses it)."""
        if self.kind == "fixed":
            return self.minimum
        if self.kind == "cycle":
            return self.values[index % len(self.values)]
        if self.kind == "empirical":
            return self.values[rng.randrange(len(self.values))]
        x = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return min(self.maximum, max(self.minimum, x))

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed {self.minimum}"
        if self.kind in ("empirical", "cycle"):
            s = sorted(self.values)
            return f"empirical n={len(s)} median {s[len(s) // 2]} p99 {s[min(len(s) - 1, int(0.99 * len(s)))]}"
        return (f"lognormal median {self.median:g} p99 {self.median * math.exp(Z99 * self.sigma):.0f} "
                f"in [{self.minimum}, {self.maximum}]")


@dataclass(frozen=True)
class Workload:
    """What is generated: ``batch_groups`` prompt groups of ``group_size`` samples per optimizer step.

    ``lengths`` are response lengths (per sample, or one per group with ``per_group_length=True`` as when a group
    shares a budget); ``prompt_lengths`` likewise. A group's rewards are all equal with probability
    ``zero_variance_p`` (what dynamic sampling filters). Every draw comes from a generator seeded by ``(seed, group
    index)``, so two schedules simulated with the same workload see exactly the same groups in the same order.
    """

    lengths: Lengths
    prompt_lengths: Lengths = field(default_factory=lambda: Lengths.fixed(256))
    batch_groups: int = 64
    group_size: int = 8
    per_group_length: bool = False
    zero_variance_p: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("lengths", "prompt_lengths"):
            if not isinstance(getattr(self, name), Lengths):
                raise ArgumentError(f"{name}: expected a Lengths (Lengths.lognormal(), .fixed(), ...), got "
                                    f"{type(getattr(self, name)).__name__}")
        check_bool("per_group_length", self.per_group_length)
        check_int("seed", self.seed)
        check_int("batch_groups", self.batch_groups, minimum=1)
        check_int("group_size", self.group_size, minimum=1)
        p = check_real("zero_variance_p", self.zero_variance_p, finite=True, ge=0)
        if p > 1:
            raise ArgumentError(f"zero_variance_p: expected a probability in [0, 1], got {p}")


@dataclass(frozen=True)
class Schedule:
    """How the loop runs.

    Args:
        mode: ``"sync-colocated"``, ``"sync-disaggregated"`` or ``"async"``.
        max_staleness: η for ``"async"`` (0 = synchronous on the disaggregated layout); ignored by the sync modes.
        partial_rollout: resume interrupted samples from their tokens so far (True) or restart them from the prompt
            (False, their tokens discarded). Interruptions: weight updates (async) and dynamic-sampling aborts (sync).
        dynamic_sampling: filter zero-variance groups with a :class:`DynamicSampler` (``over_sampling``,
            ``max_rounds``).
        max_concurrent: groups in flight (AReaL's ``max_concurrent_rollouts``); default ``(η + 1) · B``, which the
            staleness bound reaches first.
        steps: optimizer steps to simulate; ``warmup_steps`` are left out of the steady-state throughput.
    """

    mode: Mode = "async"
    max_staleness: int = 1
    partial_rollout: bool = True
    dynamic_sampling: bool = False
    over_sampling: float = 1.0
    max_rounds: int | None = 4
    max_concurrent: int | None = None
    steps: int = 10
    warmup_steps: int = 2

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ArgumentError(f"mode: expected one of {MODES}, got {self.mode!r}")
        check_int("max_staleness", self.max_staleness, minimum=0)
        check_bool("partial_rollout", self.partial_rollout)
        check_bool("dynamic_sampling", self.dynamic_sampling)  # "no" is truthy: it would have filtered groups
        over = check_real("over_sampling", self.over_sampling, finite=True, gt=0)
        if over < 1:
            raise ArgumentError(f"over_sampling: expected a factor >= 1, got {self.over_sampling!r}")
        check_optional_int("max_rounds", self.max_rounds, minimum=1)
        check_optional_int("max_concurrent", self.max_concurrent, minimum=1)
        check_int("steps", self.steps, minimum=1)
        w = check_int("warmup_steps", self.warmup_steps, minimum=0)
        if w >= self.steps:
            raise ArgumentError(f"warmup_steps: expected < steps ({self.steps}), got {w}")
