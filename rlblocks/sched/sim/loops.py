"""The simulated loops (synchronous colocated, synchronous disaggregated, bounded-async) on the virtual clock, making
their decisions with the real sched blocks, and :func:`simulate`, which runs one and returns a :class:`SimResult`."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

from rlblocks._checks import check_int
from rlblocks.errors import ArgumentError, SimulationStalled

from ..admission import StalenessController
from ..dynamic_sampling import DynamicSampler
from ..partial import PartialRollout, PartialRolloutBuffer
from ..queue import StalenessQueue
from .clock import Clock
from .costs import Hardware
from .engine import _DONE, _NEW, _Engine, _Group, _Sample
from .workload import Schedule, Workload

__all__ = ["SimResult", "simulate"]


@dataclass
class SimResult:
    """What a simulation measured (all times virtual seconds). ``samples``: ``generated == trained + dropped +
    left``, ``dropped`` broken down in ``dropped_by_reason``."""

    mode: str
    max_staleness: int
    partial_rollout: bool
    dynamic_sampling: bool
    rollout_devices: int
    train_devices: int
    steps: int
    wall_s: float
    step_end_s: list[float]
    trained_tokens: int
    tokens_per_s: float
    steady_tokens_per_s: float
    utilisation: dict[str, float]
    staleness_histogram: dict[int, int]
    samples: dict[str, int]
    dropped_by_reason: dict[str, int]
    tokens: dict[str, int]
    preemptions: int
    queue: dict[str, Any]
    controller: dict[str, int] | None
    buffer: dict[str, int] | None
    sampler_filled: int

    def summary(self) -> str:
        u = self.utilisation
        hist = " ".join(f"{k}:{v / max(1, sum(self.staleness_histogram.values())):.2f}"
                        for k, v in sorted(self.staleness_histogram.items()))
        return (f"{self.mode:<19} η={self.max_staleness} partial={int(self.partial_rollout)} "
                f"ds={int(self.dynamic_sampling)}: {self.steady_tokens_per_s:,.0f} trained tok/s, "
                f"rollout busy {u['rollout_busy']:.2f} (compute-bound {u['rollout_compute']:.2f}), "
                f"train busy {u['train_busy']:.2f}, staleness {{{hist}}}, dropped {self.samples['dropped']}")


class _Sim:
    def __init__(self, hw: Hardware, work: Workload, sched: Schedule, rollout_devices: int, train_devices: int,
                 ) -> None:
        self.hw, self.work, self.sched = hw, work, sched
        self.clock = Clock(hw.host_contention)  # work time and real time (see clock.py)
        colocated = sched.mode == "sync-colocated"
        pool = rollout_devices + train_devices if colocated else rollout_devices
        if pool % hw.devices_per_engine:
            raise ArgumentError(f"rollout_devices: expected a multiple of devices_per_engine="
                                f"{hw.devices_per_engine}, got {pool}")
        self.engines = [_Engine(self.clock, hw, i, self.on_sample_done) for i in range(pool // hw.devices_per_engine)]
        self.rollout_devices, self.train_devices = rollout_devices, train_devices
        self.train_pool = rollout_devices + train_devices if colocated else train_devices
        self.B, self.K = work.batch_groups, work.group_size
        self.groups: list[_Group] = []
        self.step = 0
        self.step_end: list[float] = []
        self.trained_tokens_per_step: list[int] = []
        self.age_hist: Counter[int] = Counter()
        self._train_since: float | None = None
        self._train_phase = "train"
        self._train_real = {"train": 0.0, "sync": 0.0}
        self.tokens_discarded = 0  # of aborted groups (the engines count those of restarted samples)
        self.dropped: Counter[str] = Counter()
        self.generated = 0
        self.done = False
        eta = sched.max_staleness if sched.mode == "async" else 0
        self.eta = eta
        # Synchronous loops with dynamic sampling and partial rollout resume aborted groups one version later, so
        # their queue (like their buffer) accepts one version of age; everything else is exactly η.
        resumes = sched.mode != "async" and sched.dynamic_sampling and sched.partial_rollout
        self.queue = StalenessQueue(max_staleness=max(eta, 1) if resumes else eta, on_stale=self._on_stale)
        self._aborting = False
        self.sampler = None
        if sched.dynamic_sampling:
            self.sampler = DynamicSampler(target_groups=self.B, over_sampling=sched.over_sampling,
                                          max_rounds=sched.max_rounds, keep_when_insufficient=True)
        self.ctrl = None
        self.buffer = None
        self.filled_total = 0
        # the rewards of a filled group are not informative; they are trained anyway (counted)
        if sched.mode == "async":
            conc = sched.max_concurrent if sched.max_concurrent is not None else (eta + 1) * self.B
            self.ctrl = StalenessController(batch_size=self.B, max_staleness=eta, max_concurrent=conc)
            self._freed = False
            self.batch: list[_Group] = []
            self.trainer_phase = "wait"  # wait | train | sync
        elif sched.dynamic_sampling and sched.partial_rollout:
            # Aborted groups resume next step: their tokens are then one version old, so the buffer keeps them for
            # one version (a group aborted twice is dropped rather than trained two versions off-policy).
            self.buffer = PartialRolloutBuffer(group_size=self.K, max_staleness=max(1, eta),
                                               on_drop=self._on_buffer_drop)

    # ------------------------------------------------------------------ the training pool's busy time
    def _trainer(self, busy: bool, phase: str = "") -> None:
        """The training pool starts (``phase`` "train" or "sync") or stops working."""
        rn = self.clock.real_now()
        if self._train_since is not None:
            self._train_real[self._train_phase] += rn - self._train_since
            self._train_since = None
            self.clock.busy_change(-self.train_pool)
        if busy:
            self.clock.busy_change(self.train_pool)
            self._train_since, self._train_phase = self.clock.real_now(), phase

    # ------------------------------------------------------------------ event loop
    def run(self) -> None:
        if self.sched.mode == "async":
            self._admit()
        else:
            self._sync_start_step()
        self.clock.run(lambda: self.done)

    # ------------------------------------------------------------------ groups
    def _new_group(self) -> _Group:
        gid = len(self.groups)
        g = _Group(gid)
        rng = random.Random(self.work.seed * 1_000_003 + gid)
        glen = self.work.lengths.sample(rng, gid)
        gprompt = self.work.prompt_lengths.sample(rng, gid)
        for k in range(self.K):
            target = glen if self.work.per_group_length else self.work.lengths.sample(rng, gid * self.K + k)
            prompt = gprompt
            if prompt + target > self.hw.kv_capacity_tokens:
                raise ArgumentError(f"lengths: a sequence of {prompt + target} tokens exceeds the engine's KV capacity "
                                    f"({self.hw.kv_capacity_tokens} tokens); lower the maximum length or use more "
                                    "devices per engine")
            g.samples.append(_Sample(g, k, prompt, target))
        zero_var = rng.random() < self.work.zero_variance_p
        g.rewards = [1.0] * self.K if zero_var else [float((k + gid) % 2) for k in range(self.K)]
        if self.K == 1:
            g.rewards = [1.0]
        self.groups.append(g)
        return g

    def _dispatch(self, g: _Group, *, front: bool = False) -> None:
        """Send a group's unfinished samples to the least-loaded engine (ties: lowest index)."""
        g.state = "running"
        todo = [s for s in g.samples if s.state != _DONE]
        eng = min(self.engines, key=lambda e: (e.load, e.idx))
        eng.submit(todo, front=front)

    def on_sample_done(self, s: _Sample) -> None:
        if not s.finished_once:
            s.finished_once = True
            self.generated += 1
        g = s.group
        g.n_done += 1
        if g.n_done == self.K and not self._aborting:
            g.state = "done"
            if self.sched.mode == "async":
                self._async_group_done(g)
            else:
                self._sync_group_done(g)

    def _drop(self, g: _Group, reason: str) -> None:
        g.state, g.reason = "dropped", reason
        self.dropped[reason] += sum(1 for s in g.samples if s.finished_once)

    # ------------------------------------------------------------------ training
    def _train_seconds(self, batch: list[_Group]) -> float:
        lengths = [s.prompt + s.target for g in batch for s in g.samples]
        return self.hw.train.seconds(lengths, self.train_pool)

    def _record_training(self, batch: list[_Group]) -> None:
        tokens = 0
        for g in batch:
            g.state = "trained"
            for s in g.samples:
                for v, n in s.spans:
                    self.age_hist[self.step - v] += n
                tokens += s.gen
        self.trained_tokens_per_step.append(tokens)

    def _sync_seconds(self) -> float:
        cost = self.hw.sync_colocated if self.sched.mode == "sync-colocated" else self.hw.sync
        return cost.seconds(self.hw.weight_bytes)

    # ------------------------------------------------------------------ synchronous loops
    def _sync_start_step(self) -> None:
        self.batch = []
        if self.sampler is None:
            for _ in range(self.B):
                self._dispatch(self._new_group())
            return
        self.sampler.reset()
        self.in_flight: list[_Group] = []
        if self.buffer is not None:
            resumed = self.buffer.pop_groups(n=max(1, len(self.buffer)), current_version=self.step)
            for samples in resumed:
                g = self.groups[samples[0].group_id]
                self._check_resumed(g, samples)
                self.sampler.on_submit()
                self.in_flight.append(g)
                self._dispatch(g, front=True)
        self._sync_top_up()

    def _check_resumed(self, g: _Group, samples: list[PartialRollout]) -> None:
        # The buffer hands back what was put in: each sample's tokens so far and finished flag.
        for p, s in zip(samples, g.samples):
            if len(p.output_ids) != s.gen or p.finished != (s.state == _DONE):
                raise RuntimeError(f"partial rollout of group {g.gid} changed in the buffer")

    def _sync_top_up(self) -> None:
        for _ in range(self.sampler.num_to_submit()):
            g = self._new_group()
            self.sampler.on_submit()
            self.in_flight.append(g)
            self._dispatch(g)

    def _sync_group_done(self, g: _Group) -> None:
        if self.sampler is None:
            self.batch.append(g)
            if len(self.batch) == self.B:
                self._sync_train()
            return
        self.in_flight.remove(g)
        kept = self.sampler.add_group(g.gid, g.rewards)
        if kept:
            self.batch.append(g)
            if g.gid in self.sampler.filled_groups:
                self.filled_total += 1
        else:
            self._drop(g, "surplus" if g.gid in self.sampler.surplus_groups else "filtered")
        if self.sampler.done:
            self._sync_abort_in_flight()
            self._sync_train()
        else:
            self._sync_top_up()

    def _sync_abort_in_flight(self) -> None:
        """The sampler is done: abort every group still in flight (into the partial-rollout buffer, or discarded).
        A group whose last samples finish at the very step boundary of the abort completed: it is offered to the
        sampler like any other (surplus or filtered, since the batch is full)."""
        aborted, self.in_flight = self.in_flight, []
        self._aborting = True  # completions seen while cutting the engines are handled below, not re-entrantly
        try:
            for a in aborted:
                by_engine: dict[int, tuple[_Engine, list[_Sample]]] = {}
                for smp in a.samples:
                    if smp.state != _DONE and smp.engine is not None:
                        by_engine.setdefault(smp.engine.idx, (smp.engine, []))[1].append(smp)
                for eng, samples in by_engine.values():
                    eng.abort(samples)
        finally:
            self._aborting = False
        still = []
        for a in aborted:
            if all(smp.state == _DONE for smp in a.samples):
                a.state = "done"
                self.sampler.add_group(a.gid, a.rewards)
                self._drop(a, "surplus" if a.gid in self.sampler.surplus_groups else "filtered")
            else:
                still.append(a)
        if still:
            self.sampler.on_abort(len(still))
        for a in still:
            if self.buffer is not None:
                a.state = "buffered"
                a.n_done = sum(1 for smp in a.samples if smp.state == _DONE)
                self.buffer.put_group([self._to_partial(a, smp) for smp in a.samples])
            else:
                for smp in a.samples:
                    if smp.state != _DONE:
                        self.tokens_discarded += smp.gen
                self._drop(a, "aborted")

    def _to_partial(self, g: _Group, s: _Sample) -> PartialRollout:
        done = s.state == _DONE
        if not done:
            s.state = _NEW
        versions = [v for v, n in s.spans for _ in range(n)]
        return PartialRollout(group_id=g.gid, prompt_ids=[0] * s.prompt, output_ids=[0] * s.gen,
                              output_logprobs=[0.0] * s.gen, output_versions=versions,
                              remaining_tokens=0 if done else s.target - s.gen, finished=done,
                              request_id=f"{g.gid}/{s.k}")

    def _on_buffer_drop(self, gid: Any, samples: list[PartialRollout]) -> None:
        self._drop(self.groups[gid], "stale-partial")

    def _sync_train(self) -> None:
        for g in self.batch:
            g.state = "queued"
            self.queue.put(g.gid, g.version())
        got = self.queue.get_batch(len(self.batch), current_version=self.step, timeout=0)
        batch = [self.groups[i] for i in got]
        dt = self._train_seconds(batch)
        self._trainer(True, "train")
        self.clock.at(self.clock.now + dt, self._sync_after_train, batch)

    def _sync_after_train(self, batch: list[_Group]) -> None:
        self._record_training(batch)
        dt = self._sync_seconds()
        self._trainer(True, "sync")
        self.clock.at(self.clock.now + dt, self._sync_after_push)

    def _sync_after_push(self) -> None:
        self._trainer(False)
        self.step += 1
        self.step_end.append(self.clock.real_now())
        for e in self.engines:
            e.version = self.step
        if self.step >= self.sched.steps:
            self.done = True
            return
        self._sync_start_step()

    # ------------------------------------------------------------------ bounded-async loop
    def _admit(self) -> None:
        v = self.engines[0].version
        while self.ctrl.try_submit(v):
            if self.sampler is not None:
                self.sampler.on_submit()
            self._dispatch(self._new_group())

    def _async_group_done(self, g: _Group) -> None:
        if self.sampler is not None:
            kept = self.sampler.add_group(g.gid, g.rewards)
            if kept and g.gid in self.sampler.filled_groups:
                self.filled_total += 1
            if self.sampler.done:
                self.sampler.reset()
            if not kept:
                self.ctrl.on_reject()
                self._drop(g, "filtered")
                self._admit()
                return
        self.ctrl.on_accept()
        g.state = "queued"
        self.queue.put(g.gid, g.version())
        self._admit()
        self._trainer_try()

    def _on_stale(self, gid: int, version: int) -> None:
        self._drop(self.groups[gid], "stale")
        if self.ctrl is not None:
            self.ctrl.on_discard()  # accepted, then dropped: its slot is free again
            self._freed = True

    def _trainer_try(self) -> None:
        if self.trainer_phase != "wait" or self.done:
            return
        got = self.queue.get_batch(self.B - len(self.batch), current_version=self.step, timeout=0)
        for gid in got:
            self.groups[gid].state = "batch"
        self.batch += [self.groups[i] for i in got]
        if self._freed:  # stale groups were dropped: their admission slots are free
            self._freed = False
            self._admit()
        if len(self.batch) < self.B:
            return
        batch, self.batch = self.batch, []
        dt = self._train_seconds(batch)
        self._trainer(True, "train")
        self.trainer_phase = "train"
        self.clock.at(self.clock.now + dt, self._async_after_train, batch)

    def _async_after_train(self, batch: list[_Group]) -> None:
        self._record_training(batch)
        dt = self._sync_seconds()
        self._trainer(True, "sync")
        self.trainer_phase = "sync"
        for e in self.engines:
            e.pause()
        self.clock.at(self.clock.now + dt, self._async_after_push)

    def _async_after_push(self) -> None:
        self._trainer(False)
        self.step += 1
        self.step_end.append(self.clock.real_now())
        for e in self.engines:
            e.swap_weights(self.step, partial=self.sched.partial_rollout)
        if self.step >= self.sched.steps:
            self.done = True
            return
        for e in self.engines:
            e.resume()
        self.trainer_phase = "wait"
        self._admit()
        self._trainer_try()

    # ------------------------------------------------------------------ result
    def result(self) -> SimResult:
        sched = self.sched
        wall = self.step_end[-1] if self.step_end else self.clock.real_now()
        trained = sum(self.trained_tokens_per_step)
        w = sched.warmup_steps
        t0 = self.step_end[w - 1] if w > 0 else 0.0
        steady = sum(self.trained_tokens_per_step[w:]) / (wall - t0) if wall > t0 else 0.0
        n_eng = len(self.engines)
        busy = comp = busy_work = batch_time = 0.0
        for e in self.engines:
            b, bw = e.busy, e.busy_work
            if e._busy_since is not None:  # still working when the last step ended
                b += self.clock.real_now() - e._busy_real_since
                bw += self.clock.now - e._busy_since
            busy += b
            busy_work += bw
            comp += e.compute * (b / bw) if bw > 0 else 0.0
            batch_time += e.batch_time
        train_real = dict(self._train_real)
        if self._train_since is not None:
            train_real[self._train_phase] += self.clock.real_now() - self._train_since
        util = {"rollout_busy": busy / (n_eng * wall) if wall else 0.0,
                "rollout_compute": comp / (n_eng * wall) if wall else 0.0,
                "rollout_mean_batch": batch_time / busy_work if busy_work else 0.0,
                "train_busy": train_real["train"] / wall if wall else 0.0,
                "sync": train_real["sync"] / wall if wall else 0.0}
        if sched.mode == "sync-colocated":  # one pool: it generates, then it trains
            util["pool_busy"] = util["rollout_busy"] + util["train_busy"]
        trained_samples = sum(1 for g in self.groups if g.state == "trained" for s in g.samples if s.finished_once)
        dropped = sum(self.dropped.values())
        left = sum(1 for g in self.groups if g.state not in ("trained", "dropped") for s in g.samples
                   if s.finished_once)
        discarded = self.tokens_discarded + sum(e.tokens_discarded for e in self.engines)
        return SimResult(
            mode=sched.mode, max_staleness=self.eta, partial_rollout=sched.partial_rollout,
            dynamic_sampling=sched.dynamic_sampling, rollout_devices=self.rollout_devices,
            train_devices=self.train_devices, steps=self.step, wall_s=wall, step_end_s=list(self.step_end),
            trained_tokens=trained, tokens_per_s=trained / wall if wall else 0.0, steady_tokens_per_s=steady,
            utilisation=util, staleness_histogram=dict(sorted(self.age_hist.items())),
            samples={"generated": self.generated, "trained": trained_samples, "dropped": dropped, "left": left},
            dropped_by_reason=dict(self.dropped),
            tokens={"decoded": sum(e.decode_tokens for e in self.engines),
                    "prefilled": sum(e.prefill_tokens for e in self.engines), "discarded": discarded},
            preemptions=sum(e.preemptions for e in self.engines),
            queue=self.queue.stats(), controller=self.ctrl.stats() if self.ctrl else None,
            buffer=self.buffer.stats() if self.buffer else None, sampler_filled=self.filled_total,
        )


def simulate(
    hardware: Hardware,
    workload: Workload,
    schedule: Schedule,
    *,
    rollout_devices: int,
    train_devices: int,
) -> SimResult:
    """Run one simulation to ``schedule.steps`` optimizer steps and report what it measured.

    ``rollout_devices`` generate and ``train_devices`` train (``"sync-colocated"`` uses all of them for both, in
    turn, and accepts ``train_devices=0``). Deterministic: the same arguments give the same result.
    """
    if not isinstance(hardware, Hardware):
        raise ArgumentError(f"hardware: expected a Hardware (gpu_like(), cpu_like()), got {type(hardware).__name__}")
    if not isinstance(workload, Workload):
        raise ArgumentError(f"workload: expected a Workload, got {type(workload).__name__}")
    if not isinstance(schedule, Schedule):
        raise ArgumentError(f"schedule: expected a Schedule, got {type(schedule).__name__}")
    check_int("rollout_devices", rollout_devices, minimum=1)
    # A colocated pool is rollout_devices + train_devices devices doing both, so 0 + n is a valid split there.
    check_int("train_devices", train_devices, minimum=0 if schedule.mode == "sync-colocated" else 1)
    sim = _Sim(hardware, workload, schedule, rollout_devices, train_devices)
    sim.run()
    if not sim.done:
        states = Counter(g.state for g in sim.groups)
        raise SimulationStalled(
            f"the simulated loop stalled after {sim.step} of {schedule.steps} steps: nothing left to run "
            f"(groups by state {dict(states)}; controller {sim.ctrl.stats() if sim.ctrl else None})"
        )
    return sim.result()
