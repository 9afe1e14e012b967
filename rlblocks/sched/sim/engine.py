"""The engine model: one continuous-batching rollout engine on the simulator's virtual clock (decode runs summed in
closed form, blocking (re-)prefills, KV-capacity preemption, pause / weight swap / resume, aborts), and the samples
and groups it works on. It stands on the clock alone: a finished sample is handed to the loop through a callback."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence

from .clock import Clock
from .costs import Hardware

_NEW, _WAITING, _PREFILL, _ACTIVE, _DONE, _ABORTED = range(6)


class _Sample:
    __slots__ = (
        "engine",
        "finished_once",
        "gen",
        "group",
        "join_gen",
        "join_id",
        "join_steps",
        "k",
        "prompt",
        "spans",
        "state",
        "target",
    )

    def __init__(self, group: _Group, k: int, prompt: int, target: int) -> None:
        self.group, self.k, self.prompt, self.target = group, k, prompt, target
        self.gen = 0  # output tokens materialised
        self.spans: list[list[int]] = []  # [version, count] runs of output tokens
        self.state = _NEW
        self.join_steps = self.join_gen = self.join_id = 0
        self.finished_once = False
        self.engine: _Engine | None = None

    def add_tokens(self, version: int, n: int) -> None:
        if n <= 0:
            return
        if self.spans and self.spans[-1][0] == version:
            self.spans[-1][1] += n
        else:
            self.spans.append([version, n])
        self.gen += n

    def oldest(self) -> int | None:
        return min(v for v, _ in self.spans) if self.spans else None


class _Group:
    __slots__ = ("gid", "n_done", "reason", "rewards", "samples", "state")

    def __init__(self, gid: int) -> None:
        self.gid = gid
        self.samples: list[_Sample] = []
        self.n_done = 0
        self.rewards: list[float] = []
        self.state = "new"  # new | running | done | queued | batch | trained | dropped | buffered
        self.reason = ""

    def version(self) -> int:
        vs = [s.oldest() for s in self.samples if s.spans]
        return min(v for v in vs if v is not None) if vs else 0


class _Engine:
    """One continuous-batching engine on the virtual clock (see the package docstring, rlblocks.sched.sim)."""

    def __init__(self, clock: Clock, hw: Hardware, idx: int, on_sample_done: Callable[[_Sample], None]) -> None:
        self.clock, self.idx = clock, idx
        self.on_sample_done = on_sample_done  # the loop's: a sample reached its target length
        self.dc, self.pc = hw.decode, hw.prefill
        self.kv_cap, self.max_batch = hw.kv_capacity_tokens, hw.max_batch
        self.version = 0
        self.t = 0.0  # the engine's clock: time of its last step boundary
        self.steps = 0  # decode steps done (a global counter; active samples' tokens are implicit in it)
        self.active: dict[int, _Sample] = {}  # join_id -> sample
        self.finish_heap: list[tuple[int, int]] = []  # (end_step, join_id)
        self.S = 0  # sum over active of (prompt + join_gen - join_steps): context = S + b·steps
        self.waiting: deque[_Sample] = deque()
        self._phase = "idle"  # idle | decode | prefill | paused
        self._busy_since: float | None = None  # (work clock) start of the current busy interval
        self.weight = hw.devices_per_engine  # devices of the host this engine keeps busy
        self.seg: tuple[float, int, int, int] | None = None  # decode segment: (t0, b, c0, k)
        self.prefilling: list[_Sample] = []
        self.token = 0  # invalidates scheduled events
        self.join_counter = itertools.count()
        self.busy = self.compute = self.batch_time = 0.0  # busy: real seconds; compute, batch_time: work clock
        self.busy_work = 0.0
        self.prefill_tokens = self.decode_tokens = self.preemptions = 0
        self.tokens_discarded = 0  # tokens of in-flight samples restarted from the prompt at a weight swap
        self.wasted_s = 0.0  # work seconds of decode steps abandoned by a pause or an abort

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        busy = value in ("decode", "prefill")
        if busy != (self._busy_since is not None):
            if busy:
                self._busy_since = self.clock.now
                self._busy_real_since = self.clock.real_now()
            else:
                self.busy_work += self.clock.now - self._busy_since
                self.busy += self.clock.real_now() - self._busy_real_since
                self._busy_since = None
            self.clock.busy_change(self.weight if busy else -self.weight)
        self._phase = value

    # ------------------------------------------------------------------ helpers
    @property
    def load(self) -> int:
        return len(self.active) + len(self.waiting) + len(self.prefilling)

    def context(self) -> int:
        return self.S + len(self.active) * self.steps

    def _materialise(self, s: _Sample) -> None:
        s.add_tokens(self.version, s.join_gen + (self.steps - s.join_steps) - s.gen)

    def _remove_active(self, s: _Sample) -> None:
        del self.active[s.join_id]
        self.S -= s.prompt + s.join_gen - s.join_steps

    def _schedule(self, when: float) -> None:
        self.token += 1
        self.clock.at(when, self._on_event, self.token)

    # ------------------------------------------------------------------ entry points
    def submit(self, samples: Sequence[_Sample], *, front: bool = False) -> None:
        for s in samples:
            s.state, s.engine = _WAITING, self
        if front:
            self.waiting.extendleft(reversed(samples))
        else:
            self.waiting.extend(samples)
        self._touch()

    def _touch(self) -> None:
        """New work arrived: start now if idle, or stop the current decode run at its next step boundary."""
        now = self.clock.now
        if self.phase == "idle":
            # Plan in a zero-delay event, so that everything submitted at this instant is prefilled together.
            self.t = max(self.t, now)
            self._schedule(now)
        elif self.phase == "decode":
            t0, b, c0, k = self.seg
            done = self._steps_by(now - t0, b, c0, k, finish_partial=True)
            if done < k:
                self.seg = (t0, b, c0, done)
                dt, _ = self.dc.run_s(b, c0, done)
                self._schedule(t0 + dt)

    def _steps_by(self, budget: float, b: int, c0: int, k: int, *, finish_partial: bool) -> int:
        """Steps of the run completed within ``budget`` seconds (``finish_partial``: plus the one in progress)."""
        lo, hi = 0, k
        while lo < hi:  # largest j with run_s(j) <= budget
            mid = (lo + hi + 1) // 2
            if self.dc.run_s(b, c0, mid)[0] <= budget:
                lo = mid
            else:
                hi = mid - 1
        if finish_partial and lo < k and self.dc.run_s(b, c0, lo)[0] < budget:
            lo += 1
        return max(lo, 1) if finish_partial and k > 0 else lo

    def _on_event(self, token: int) -> None:
        if token != self.token:
            return
        now = self.clock.now
        if self.phase == "decode":
            self._end_decode(now, self.seg[3])
        elif self.phase == "prefill":
            self._end_prefill(now)
        self._plan()

    def _end_decode(self, now: float, k: int) -> None:
        t0, b, c0, _ = self.seg
        dt, comp = self.dc.run_s(b, c0, k)
        self.compute += comp
        self.batch_time += dt * b
        self.decode_tokens += b * k
        self.steps += k
        self.t = t0 + dt
        self.seg = None
        self.phase = "idle"
        while self.finish_heap and self.finish_heap[0][0] <= self.steps:
            _, jid = heapq.heappop(self.finish_heap)
            s = self.active.get(jid)
            if s is None:
                continue  # removed earlier (aborted or preempted): stale heap entry
            self._materialise(s)
            self._remove_active(s)
            s.state = _DONE
            self.on_sample_done(s)
        # KV overflow before the next step: preempt the most recently admitted sequences (vLLM recompute).
        while self.active and self.context() + len(self.active) > self.kv_cap:
            jid = max(self.active)
            s = self.active[jid]
            self._materialise(s)
            self._remove_active(s)
            s.state = _WAITING
            self.waiting.appendleft(s)
            self.preemptions += 1

    def _end_prefill(self, now: float) -> None:
        self.t = now
        self.phase = "idle"
        batch, self.prefilling = self.prefilling, []
        for s in batch:
            s.add_tokens(self.version, 1)  # a prefill yields the next token
            if s.gen >= s.target:
                s.state = _DONE
                self.on_sample_done(s)
                continue
            s.state = _ACTIVE
            s.join_id = next(self.join_counter)
            s.join_steps, s.join_gen = self.steps, s.gen
            self.active[s.join_id] = s
            self.S += s.prompt + s.join_gen - s.join_steps
            heapq.heappush(self.finish_heap, (self.steps + s.target - s.gen, s.join_id))

    def _plan(self) -> None:
        """At a step boundary (``self.t``): admit waiting samples (a prefill), else run decode to the next event."""
        if self.phase != "idle":
            return
        admit: list[_Sample] = []
        ctx = self.context()
        b = len(self.active)
        while self.waiting and b + len(admit) < self.max_batch:
            s = self.waiting[0]
            need = s.prompt + s.gen
            if ctx + need + b + len(admit) + 1 > self.kv_cap and (b or admit):
                break
            admit.append(self.waiting.popleft())
            ctx += need
        if admit:
            contexts = [s.prompt + s.gen for s in admit]
            for s in admit:
                s.state = _PREFILL
            self.prefilling = admit
            # a group's samples that have no token yet hold identical tokens (its prompt): one key, which a padded
            # prefill (TorchEngine) computes once; an unpadded cost reads no keys
            keys = [("group", id(s.group)) if s.gen == 0 else ("sample", id(s)) for s in admit] \
                if self.pc.padded else None
            dt = self.pc.seconds(contexts, keys)
            self.compute += dt
            self.prefill_tokens += sum(contexts)
            self.phase = "prefill"
            self._prefill_end = self.t + dt
            self._schedule(self.t + dt)
            return
        if not self.active:
            return
        b = len(self.active)
        c0 = self.context()
        k = self.finish_heap[0][0] - self.steps
        k_cap = (self.kv_cap - c0) // b  # KV after step j+1 holds c0 + (j+1)·b tokens
        k = max(1, min(k, k_cap))
        dt, _ = self.dc.run_s(b, c0, k)
        self.phase = "decode"
        self.seg = (self.t, b, c0, k)
        self._schedule(self.t + dt)

    def pause(self) -> None:
        """Stop at ``now``: the step in progress is abandoned (its tokens never produced), a prefill is undone."""
        now = self.clock.now
        if self.phase == "decode":
            t0, b, c0, k = self.seg
            done = self._steps_by(now - t0, b, c0, k, finish_partial=False)
            ran, _ = self.dc.run_s(b, c0, done)
            self.seg = (t0, b, c0, done)
            self._end_decode(now, done)  # the device stays busy until now: the abandoned step was computed
            self.wasted_s += now - (t0 + ran)
        elif self.phase == "prefill":
            self.compute -= self._prefill_end - now
            for s in reversed(self.prefilling):
                s.state = _WAITING
                self.waiting.appendleft(s)
            self.prefilling = []
        self.token += 1
        self.t = max(self.t, now)
        self.phase = "paused"

    def swap_weights(self, version: int, *, partial: bool) -> None:
        """While paused: the KV cache is invalid under new weights. Every in-flight sample goes back to the head of
        the waiting queue (in admission order) for a re-prefill of its prompt + tokens so far (``partial``), or
        restarts from the prompt with its tokens discarded."""
        back = [self.active[j] for j in sorted(self.active)]
        for s in back:
            self._materialise(s)
            self._remove_active(s)
            s.state = _WAITING
        self.finish_heap.clear()
        self.waiting.extendleft(reversed(back))
        if not partial:
            for s in self.waiting:
                self.tokens_discarded += s.gen
                s.gen, s.spans = 0, []
        self.version = version

    def resume(self) -> None:
        self.phase = "idle"
        self.t = max(self.t, self.clock.now)
        self._schedule(self.clock.now)

    def abort(self, samples: Sequence[_Sample]) -> None:
        """Take these samples out (dynamic sampling reached its target); their tokens so far are materialised."""
        if self.phase == "decode":  # cut the run at the last completed step boundary so tokens are exact
            now = self.clock.now
            t0, b, c0, k = self.seg
            done = self._steps_by(now - t0, b, c0, k, finish_partial=False)
            self.seg = (t0, b, c0, done)
            self._end_decode(now, done)
            self.wasted_s += now - self.t
            self.t = now
        for s in samples:
            if s.state == _ACTIVE:
                self._materialise(s)
                self._remove_active(s)
            elif s.state == _WAITING:
                self.waiting.remove(s)
            elif s.state == _PREFILL:
                self.prefilling.remove(s)
            s.state = _ABORTED
        if self.phase in ("idle", "decode"):
            self.phase = "idle"
            self.t = max(self.t, self.clock.now)
            self._schedule(self.clock.now)
