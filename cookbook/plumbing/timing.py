"""Where a disaggregated loop's time goes, per step: the rollout rank's and the trainer's parts of it.

Rollout rank (:class:`RolloutClock`). Between two weight commits (one *interval*, ending when the engine runs the
new version) every second is in exactly one phase, from timestamps taken on the event loop:

- ``weight_load``: inside the update, from ``pause`` to ``resume`` (the engine generates nothing);
- ``idle``: no request in flight (admission is waiting for the trainer);
- busy otherwise (requests in flight, engine stepping), split by forward hooks on the engine's model (TorchEngine;
  other engines run their model out of process: their busy time stays whole, in ``engine_other``) into
  ``decode`` (one-token forwards over the KV cache), ``prefill`` and ``reprefill`` (forwards of whole prompts; the
  re-prefill share is the share of their tokens that resumed requests re-sent after an interrupt) and
  ``engine_other`` = busy − forwards (sampling, batching and scheduling of the engine, and the event loop's own
  work: rewards, records). Forwards on CUDA are synchronised in the hook, so that their time is the device's.

``reprefill_tokens`` are the tokens (prompt + output so far) that interrupted requests re-submitted in the interval;
``decode_batch_mean`` / ``decode_batch_max`` the rows of its decode forwards (their mean is decode tokens / decode
forwards). The rank ships one :class:`RolloutTimes` per interval with its groups; the trainer adds up what arrived
during a step (:func:`rollout_columns`).

Trainer rank 0 (:class:`StepLaps`, consecutive laps, so every second of a step is in exactly one part):
``queue_wait_seconds`` (waiting for B fresh groups), ``train_seconds`` (batch tensors, the update, its statistics),
``sync_seconds`` (the weight push, then the step's accounting and the run-end decision), ``eval_seconds`` (held-out
evaluation, when it runs); they add up to ``step_seconds``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

PARTS = ("decode", "prefill", "reprefill", "engine_other", "weight_load", "idle")


class StepLaps:
    """One trainer step as consecutive laps: :meth:`lap` gives the seconds since the previous lap (or the start) to
    ``name``, so no instant between two laps goes unattributed (a garbage collection or a wait for the GIL counts in
    the part it interrupts) and the parts add up to :attr:`step_seconds`."""

    def __init__(self) -> None:
        self.start = self._last = time.perf_counter()
        self.seconds: Counter = Counter()

    def lap(self, name: str) -> float:
        """Ends part ``name`` now (adding to it if it already ran); returns the seconds of this lap."""
        now = time.perf_counter()
        lap, self._last = now - self._last, now
        self.seconds[name] += lap
        return lap

    @property
    def step_seconds(self) -> float:
        """Seconds from the start to the last lap."""
        return self._last - self.start


@dataclass(frozen=True)
class RolloutTimes:
    """One rollout rank's interval ending at the commit of ``version``: ``seconds`` by part (:data:`PARTS`),
    ``interval_s`` its length, and its counters (``reprefill_tokens``, ``prefill_tokens``, ``decode_tokens``,
    ``decode_forwards``, ``decode_batch_max``)."""

    rank: int
    version: int
    interval_s: float
    seconds: dict[str, float]
    counts: dict[str, int] = field(default_factory=dict)


class RolloutClock:
    """The phase clock of one rollout rank (see the module docstring). Call :meth:`submitted` / :meth:`returned`
    around every engine call, :meth:`load_started` / :meth:`load_ended` around a weight update, and :meth:`report`
    at each commit. The forward hooks run in the engine's worker thread; everything else on the event loop."""

    def __init__(self, engine: Any) -> None:
        self._lock = threading.Lock()
        self._fwd: Counter = Counter()  # forward seconds and counters, written by the hooks
        self._phase_s: Counter = Counter()  # busy / idle / weight_load seconds
        self._counts: Counter = Counter()
        self._next: Counter = Counter()  # counted during an update: re-prefilled after it, in the next interval
        self._in_flight = 0
        self._loading = False
        self._start = self._since = time.perf_counter()
        self._phase = "idle"
        self._t_fwd: dict[int, float] = {}  # thread id -> start of its forward in progress
        model = getattr(engine, "model", None)
        if isinstance(model, torch.nn.Module):
            self._cuda = next(model.parameters()).is_cuda
            model.register_forward_pre_hook(self._pre, with_kwargs=True)
            model.register_forward_hook(self._post, with_kwargs=True)

    # ---------------------------------------------------------------- forward hooks (engine worker thread)
    def _pre(self, module, args, kwargs) -> None:
        if self._cuda:
            torch.cuda.synchronize()
        self._t_fwd[threading.get_ident()] = time.perf_counter()

    def _post(self, module, args, kwargs, output) -> None:
        if self._cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - self._t_fwd.pop(threading.get_ident())
        ids = kwargs.get("input_ids", args[0] if args else None)
        rows, width = (ids.shape[0], ids.shape[1]) if ids is not None and ids.dim() == 2 else (0, 0)
        with self._lock:
            if width == 1:  # one token per row over the KV cache: a decode step
                self._fwd["decode_s"] += dt
                self._fwd["decode_forwards"] += 1
                self._fwd["decode_tokens"] += rows
                self._fwd["decode_batch_max"] = max(self._fwd["decode_batch_max"], rows)
            else:
                self._fwd["prefill_s"] += dt
                self._fwd["prefill_tokens"] += rows * width

    # ---------------------------------------------------------------- phases (event loop)
    def _switch(self) -> None:
        now = time.perf_counter()
        self._phase_s[self._phase] += now - self._since
        self._since = now
        self._phase = "weight_load" if self._loading else "busy" if self._in_flight else "idle"

    def submitted(self, tokens: int, *, resume: bool) -> None:
        """An engine call starts with ``tokens`` prompt tokens (``resume``: a re-submission after an interrupt)."""
        if resume:
            (self._next if self._loading else self._counts)["reprefill_tokens"] += tokens
        self._in_flight += 1
        self._switch()

    def returned(self) -> None:
        self._in_flight -= 1
        self._switch()

    def load_started(self) -> None:
        self._loading = True
        self._switch()

    def load_ended(self, reprefill_tokens: int = 0) -> None:
        """The update committed; ``reprefill_tokens``: what the engine now re-prefills itself (requests it kept in
        flight across the update, whose KV was computed under the old weights), counted in the next interval,
        where the re-prefill runs, like the re-submissions made while the update ran."""
        self._next["reprefill_tokens"] += reprefill_tokens
        self._loading = False
        self._switch()

    def report(self, rank: int, version: int) -> RolloutTimes:
        """Close the interval at ``now`` (the commit of ``version``) and start the next one."""
        self._switch()
        now = self._since  # the phases end exactly here
        with self._lock:
            fwd, self._fwd = self._fwd, Counter()
        phases, self._phase_s = self._phase_s, Counter()
        counts, self._counts, self._next = self._counts, self._next, Counter()
        interval, self._start = now - self._start, now
        pre = fwd["prefill_s"]
        share = min(1.0, counts["reprefill_tokens"] / fwd["prefill_tokens"]) if fwd["prefill_tokens"] else 0.0
        seconds = {"decode": fwd["decode_s"], "prefill": pre * (1 - share), "reprefill": pre * share,
                   "engine_other": phases["busy"] - fwd["decode_s"] - pre, "weight_load": phases["weight_load"],
                   "idle": phases["idle"]}
        keys = ("reprefill_tokens", "prefill_tokens", "decode_tokens", "decode_forwards", "decode_batch_max")
        return RolloutTimes(rank, version, interval, seconds, {k: int(counts[k] + fwd[k]) for k in keys})


def rollout_columns(reports: list[RolloutTimes], ranks: int) -> dict[str, Any]:
    """The metrics.jsonl columns of the rollout intervals that reached the trainer during one step: seconds per
    part and ``rollout_seconds`` (the intervals' length) as the mean over the ``ranks`` rollout ranks of each rank's
    sum, ``reprefill_tokens`` summed, the decode batch mean (tokens / forwards) and max, the newest version
    committed. ``None`` everywhere when no report arrived (it then arrives with the next step's)."""
    cols: dict[str, Any] = {f"rollout_{p}_seconds": None for p in PARTS}
    cols.update(rollout_seconds=None, rollout_version=None, reprefill_tokens=None, decode_batch_mean=None,
                decode_batch_max=None)
    if not reports:
        return cols
    for p in PARTS:
        cols[f"rollout_{p}_seconds"] = sum(r.seconds[p] for r in reports) / ranks
    forwards = sum(r.counts.get("decode_forwards", 0) for r in reports)
    cols.update(rollout_seconds=sum(r.interval_s for r in reports) / ranks,
                rollout_version=max(r.version for r in reports),
                reprefill_tokens=sum(r.counts.get("reprefill_tokens", 0) for r in reports),
                decode_batch_mean=sum(r.counts.get("decode_tokens", 0) for r in reports) / forwards if forwards
                else None,
                decode_batch_max=max(r.counts.get("decode_batch_max", 0) for r in reports))
    return cols


class TimedEngine:
    """``engine`` with every ``generate`` call reported to ``clock``: a call for a request id whose previous call
    came back aborted is a re-submission after an interrupt (``resumable_generate`` and restarts reuse the id), so
    its prompt (prompt + output so far, or the prompt alone for a restart) counts as re-prefilled;
    :meth:`in_flight_tokens` is what an update that keeps the requests in flight makes the engine re-prefill.
    Every other attribute is the engine's."""

    def __init__(self, engine: Any, clock: RolloutClock) -> None:
        self._engine, self._clock = engine, clock
        self._interrupted: set[str] = set()
        self._flight: dict[str, int] = {}  # request id -> prompt tokens of its call in flight

    def in_flight_tokens(self) -> int:
        """Prompt + output so far of every call in flight (``num_output_tokens`` of engines that count them)."""
        count = getattr(self._engine, "num_output_tokens", None)
        return sum(n + ((count(rid) or 0) if count else 0) for rid, n in self._flight.items())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, request):
        rid = request.request_id
        self._clock.submitted(len(request.prompt_ids), resume=rid in self._interrupted)
        self._interrupted.discard(rid)
        self._flight[rid] = len(request.prompt_ids)
        try:
            gen = await self._engine.generate(request)
        finally:
            self._flight.pop(rid, None)
            self._clock.returned()
        if gen.finish_reason == "abort":
            self._interrupted.add(rid)
        return gen
