"""The bounded-async rollout/trainer protocol of the async loops (``grpo_async.py``, ``agent_async.py``), as one pair.

:class:`RolloutAdmission` is a rollout rank's end: it admits new prompt groups only while they stay within the
staleness bound η of the version its engine runs (AReaL: at most ``(η + v + 1)·B`` groups accepted or running at
version ``v``, ``StalenessController``), optionally filters finished groups (``DynamicSampler``), ships the kept ones
to the trainer (an ``Outbox``), frees the slots of the groups the trainer reports stale (:class:`~.messages.Stale`),
and commits each new weight version (:class:`~.messages.Weights`); a run's first weights (fresh, resumed or
restarted) restart its admission at that version with its groups still queued at the trainer counted as accepted.
A loop subclasses it with what generates a group, receives a payload and loads it (:meth:`RolloutAdmission.run`).

:class:`TrainerLedger` is trainer rank 0's end: the ``StalenessQueue`` of finished groups keyed by their oldest
token version, filled by an :class:`~.messages.Inbox`; it hands out batches of fresh groups (age ≤ η at
consumption), reports the stale ones to their rollout ranks, announces every weight push, restores itself from a
run checkpoint (counting the groups received after it as lost in the crash, from the journal) and keeps the
conservation identity, over every restart::

    samples_generated = samples_trained + samples_without_trajectory + samples_dropped_stale
                        + samples_failed_reward + samples_lost_in_crash + samples_left_in_queue

(``samples_generated``: the samples the trainer received; a group is failed whole at its rollout rank when one of
its reward calls failed; ``samples_without_trajectory``: agent episodes whose environment failed to reset). Groups
filtered by dynamic sampling or cancelled at the end never reach the trainer; their rollout rank counts them
(``groups_filtered``, ``groups_cancelled_at_stop``). ``Stop`` cancels only groups still generating: a group that
reached its rewards (:meth:`RolloutAdmission.settle`) finishes and ships, so every scored sample reaches the trainer.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlblocks.sched import DynamicSampler, StalenessController, StalenessQueue

from .checkpoints import Recovery
from .flags import opt
from .messages import Inbox, RolloutEnd, Stale, Stop, Weights, recv_control, send_control


@dataclass
class DynamicSamplingFlags:
    """Dynamic sampling (DAPO/SLIME) at admission (a loop's ``Config`` inherits them; :class:`RolloutAdmission`)."""

    dynamic_sampling: bool = opt(False, "reject zero-variance groups (DAPO/SLIME) and generate more")
    dynamic_max_rounds: int = opt(4, "--dynamic-sampling bound: once rounds × (per-rank B) groups were filtered "
                                  "while filling one batch, further groups are shipped as they come, filtered or "
                                  "not (counted: groups_filled_unfiltered), so a step never waits forever")


class RolloutAdmission:
    """One rollout rank's end of the bounded-async protocol.

    Args:
        rank: this rollout rank's global rank (the key of ``Stale`` and ``Weights.queued``).
        batch_size, max_staleness, max_concurrent: the GLOBAL ``B``, η and in-flight cap (``--prompts-per-step``,
            ``--max-staleness``, ``--max-concurrent``); divided over the ``dp_size`` rollout ranks once, by the
            ``StalenessController``.
        outbox: where kept and failed group records go (an ``Outbox``; anything with ``put``).
        seed: prompts are drawn from ``self.rng`` = ``Random(seed·1000 + rank)``; a restarted run reseeds it (and
            Python's ``random``) with the run's start number, so that it draws other prompts than the run that
            crashed.
        dynamic_sampling, dynamic_max_rounds: reject zero-variance groups (their slot is freed and another group
            admitted); once ``rounds ×`` this rank's share of ``B`` were rejected in one batch window, further
            groups are shipped as they come, marked ``zero_variance_fill`` and counted ``groups_filled_unfiltered``.
        sync_group: the weight-sync group the control messages arrive on (:meth:`run`).

    Every method runs on the rank's event loop (the control thread schedules them there). ``counters``: what this
    rank did (``groups_dropped_stale``, ``groups_failed_reward``, ``samples_failed_reward``, ``groups_filtered``,
    ``groups_filled_unfiltered``, ``weight_updates``, ``sync_seconds``, ...), sent to the trainer at the end in a
    ``RolloutEnd``.
    """

    def __init__(self, rank: int, *, batch_size: int, max_staleness: int, max_concurrent: int, dp_size: int,
                 outbox, seed: int = 0, dynamic_sampling: bool = False, dynamic_max_rounds: int = 4,
                 sync_group=None) -> None:
        self.rank, self.outbox, self.seed, self.sync_group = rank, outbox, seed, sync_group
        self.ctrl = StalenessController(batch_size=batch_size, max_staleness=max_staleness,
                                        max_concurrent=max_concurrent, dp_size=dp_size)
        self.sampler = (DynamicSampler(target_groups=self.ctrl.batch_size, keep_when_insufficient=True,
                                       max_rounds=dynamic_max_rounds) if dynamic_sampling else None)
        self.rng = random.Random(seed * 1000 + rank)
        self.counters: Counter = Counter()
        self.run_index = 0  # the run's start number (Weights.run): group uids are unique across restarts
        self.started = 0  # groups started by this start of the run
        self.first_weights = asyncio.Event()  # set by the run's first commit (or a failure)
        self.wake = asyncio.Event()  # set whenever admission may have changed: a commit, a stale report, the end
        self.stopping = False
        self.settled: set[asyncio.Task] = set()  # groups past generation: Stop lets them finish and ship
        self.error: BaseException | None = None  # what ended the control thread; run() raises it

    # ---------------------------------------------------------------- admission
    def admit(self, version: int) -> int:
        """Reserve every admission slot the controller allows at ``version``; returns how many groups to start."""
        n = self.ctrl.capacity(version)
        if n == 0 or not self.ctrl.try_submit(version, n):
            return 0
        if self.sampler is not None:
            self.sampler.on_submit(n)
        return n

    def next_group(self) -> tuple[str, int]:
        """The next admitted group's ``uid`` (``r<rank>-<run>-<n>``) and an integer id, both unique over the rollout
        ranks and the restarts of the run."""
        n, self.started = self.started, self.started + 1
        return f"r{self.rank}-{self.run_index}-{n}", (self.rank * 1000 + self.run_index) * 10**9 + n

    def finished(self, uid: str, rec: dict, rewards: list[float] | None = None) -> None:
        """A group finished with every reward: filter it (dynamic sampling, on ``rewards``), then accept it and ship
        ``rec``, or reject it (its slot freed, counted ``groups_filtered``)."""
        if self.sampler is not None:
            if not self.sampler.add_group(uid, rewards):  # zero variance, discarded: another group takes its slot
                self.ctrl.on_reject()
                self.counters["groups_filtered"] += 1
                return
            if uid in self.sampler.filled_groups:  # past the round bound: shipped anyway, marked and counted
                rec["zero_variance_fill"] = True
                self.counters["groups_filled_unfiltered"] += 1
            if self.sampler.done:  # this window's batch is complete; groups in flight carry over to the next
                self.sampler.reset()
        self.ctrl.on_accept()
        self.outbox.put(rec)

    def failed(self, rec: dict, samples: int) -> None:
        """A group one of whose reward calls failed (retries ran out) is failed whole, never trained with a biased
        baseline: its slot is freed at once (the dynamic sampler stops waiting for it), and its record goes to the
        trainer marked ``reward_failed``, whose inbox counts its ``samples`` generated and failed, never queued."""
        self.ctrl.on_reject()
        if self.sampler is not None:
            self.sampler.on_abort()
        self.counters["groups_failed_reward"] += 1
        self.counters["samples_failed_reward"] += samples
        rec["reward_failed"] = True
        self.outbox.put(rec)

    def settle(self) -> None:
        """The calling group has generated its samples and is about to score them: ``Stop`` no longer cancels it
        (its reward calls run and it ships, counted by the trainer), so no sample is scored and then dropped."""
        task = asyncio.current_task()
        self.settled.add(task)
        task.add_done_callback(self.settled.discard)

    def discard(self, n: int) -> None:
        """``n`` of this rank's accepted groups were dropped as stale by the trainer: they leave the accepted count
        (``on_discard``), which frees their slots. Submitting replacements outside the controller's capacity instead
        would only borrow slots from a later version (the replacements are accepted in turn): after (η+1)·B drops
        capacity would stay 0 and the run would stall."""
        self.ctrl.on_discard(n)
        self.counters["groups_dropped_stale"] += n
        self.wake.set()

    def committed(self, msg: Weights, version: int) -> None:
        """The engine runs ``version`` now. On a run's first weights (fresh or resumed) admission restarts there:
        ``accepted = v·B`` (AReaL: the groups trained so far) plus this rank's groups still waiting in the trainer's
        queue (``msg.queued``), which were accepted and will be trained (counting them keeps the rank from admitting
        (η+1)·B more on top of them). Groups lost in a crash hold no slot: they are admitted again."""
        if msg.first:
            self.ctrl.on_version_recovered(version)
            if queued := msg.queued.get(self.rank, 0):
                self.ctrl.on_submit(queued)
                self.ctrl.on_accept(queued)
            if msg.run:  # a restarted run: other prompts and sampling seeds than the run that crashed drew
                self.run_index = msg.run
                self.rng = random.Random((self.seed * 1000 + self.rank) * 1009 + msg.run)
                random.seed((self.seed * 1000 + self.rank) * 1009 + msg.run)
        self.first_weights.set()
        self.wake.set()

    def stop(self) -> None:
        """``Stop`` arrived: admit nothing more; :meth:`run` cancels what is in flight and ends."""
        self.stopping = True
        self.wake.set()

    def fail(self, error: BaseException) -> None:
        """The control thread failed (e.g. weights the engine refused): stop generating; :meth:`run` raises it."""
        self.error = error
        self.first_weights.set()
        self.stop()

    # ---------------------------------------------------------------- what a loop provides
    def version(self) -> int:
        """The weight version the engine runs (admission is checked against it)."""
        raise NotImplementedError

    async def group(self, uid: str, gid: int) -> None:
        """Generate, score and ship one admitted group (ending in :meth:`finished` or :meth:`failed`)."""
        raise NotImplementedError

    def receive(self, msg: Weights) -> tuple[list, int]:
        """On the control thread: receive the payload announced by ``msg``; returns ``(tensors, version)``."""
        raise NotImplementedError

    async def load(self, tensors: list, version: int) -> None:
        """On the event loop: load ``tensors`` into the engine as ``version``."""
        raise NotImplementedError

    def end(self) -> RolloutEnd:
        """The rank's last message to the trainer."""
        return RolloutEnd(self.rank, dict(self.counters))

    # ---------------------------------------------------------------- the rank's two loops
    async def run(self) -> None:
        """The generation loop: after the first weights, start every group admission allows at the engine's
        version, wait for a group to finish or admission to change, repeat until ``Stop``; then cancel the groups
        still generating (counted ``groups_cancelled_at_stop``), let the settled ones (:meth:`settle`) score and
        ship, and send the :meth:`end` message. A group that raises, or the control thread's failure, ends the rank
        with that error (nothing is left waiting or lost silently)."""
        loop = asyncio.get_running_loop()
        control = threading.Thread(target=self._control, args=(self.sync_group, loop), daemon=True)
        control.start()
        self.outbox.start()
        await self.first_weights.wait()
        tasks: set[asyncio.Task] = set()
        while not self.stopping:
            for _ in range(self.admit(self.version())):
                tasks.add(loop.create_task(self.group(*self.next_group())))
            self.wake.clear()
            waiter = loop.create_task(self.wake.wait())
            await asyncio.wait([*tasks, waiter], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            for t in [t for t in tasks if t.done()]:
                tasks.discard(t)
                if t.exception() is not None:
                    raise t.exception()  # a failed group is a bug: stop loudly rather than lose it
        for t in tasks - self.settled:
            t.cancel()  # a no-op for a group that finished (and shipped) since the last wait
        await asyncio.gather(*tasks, return_exceptions=True)  # settled groups score and ship first
        for t in tasks:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()
        self.counters["groups_cancelled_at_stop"] = sum(t.cancelled() for t in tasks)
        # CPU seconds of this process (all its threads): on a shared machine, a load-independent measure of the work
        self.counters["cpu_seconds"] = time.process_time()
        self.outbox.close(self.end())
        control.join()
        if self.error is not None:
            raise self.error

    def _control(self, sync_group, loop: asyncio.AbstractEventLoop) -> None:
        """The control thread: ``Stop`` ends the rank, ``Stale`` frees slots (:meth:`discard`), ``Weights``:
        :meth:`receive` the payload here, :meth:`load` it on the event loop, :meth:`committed`. Its failure reaches
        :meth:`run` (:meth:`fail`)."""
        try:
            while True:
                msg = recv_control(sync_group)
                if isinstance(msg, Stop):
                    loop.call_soon_threadsafe(self.stop)
                    return
                if isinstance(msg, Stale):
                    if n := msg.groups.get(self.rank, 0):
                        loop.call_soon_threadsafe(self.discard, n)
                    continue
                t0 = time.perf_counter()
                tensors, version = self.receive(msg)
                asyncio.run_coroutine_threadsafe(self._commit(tensors, version, msg), loop).result()
                self.counters["sync_seconds"] += time.perf_counter() - t0
                self.counters["weight_updates"] += 1
        except BaseException as e:
            loop.call_soon_threadsafe(self.fail, e)

    async def _commit(self, tensors: list, version: int, msg: Weights) -> None:
        await self.load(tensors, version)
        self.committed(msg, version)


class TrainerLedger:
    """Trainer rank 0's end of the bounded-async protocol: the queue of finished groups and the run's accounting.

    Args:
        max_staleness: η; a group is trained only if ``version − its oldest token's version ≤ η`` when its batch is
            taken.
        group_size: ``K``, samples per group (a stale group counts ``K`` samples dropped).
        sources: the rollout ranks; an :class:`~.messages.Inbox` thread per rank receives their records on
            ``sample_group`` (none: records are given to ``self.inbox.receive`` directly).
        sync_group: the weight-sync group the control messages go out on (``send_control``).
        recovery: what ``resume_run`` found: a fresh run, or the checkpoint (its ``queue``, ``counters``,
            ``stale_uids``, as :meth:`state_dict` wrote them) and the journal of the run's received groups.
        samples: how many samples a record holds.

    ``counters`` (over every start of the run): ``samples_generated`` and ``samples_failed_reward`` (as of the
    last checkpoint; live in ``inbox``), ``samples_trained``, ``samples_without_trajectory``,
    ``samples_dropped_stale``, ``samples_lost_in_crash``, ``max_staleness_seen``.
    """

    def __init__(self, *, max_staleness: int, group_size: int, sources, sample_group, sync_group,
                 recovery: Recovery, samples: Callable[[dict], int] = lambda rec: len(rec["samples"])) -> None:
        ck = recovery.state
        self.group_size, self.sync_group = group_size, sync_group
        self.counters: Counter = Counter(ck["counters"]) if ck is not None else Counter()
        self.stale_uids: list[str] = list(ck.get("stale_uids", [])) if ck is not None else []
        self.stale_by_rank: Counter = Counter()  # dropped as stale, not yet reported to their rank
        if recovery.received > self.counters["samples_generated"]:
            # groups the crashed run received after its checkpoint: trained (by weights the crash threw away),
            # dropped or still queued then; none of them is in the restored queue, so each is counted lost
            self.counters["samples_lost_in_crash"] += recovery.received - self.counters["samples_generated"]
            self.counters["samples_generated"] = recovery.received
        self.run = max(len(recovery.starts) - 1, 0)  # the run's start number (0: the first)
        self.queue = StalenessQueue(max_staleness=max_staleness, on_stale=self._on_stale)
        if ck is not None:
            self.queue.load_state_dict(ck["queue"])
        self.sources = list(sources)
        self.inbox = Inbox(self.sources, sample_group, self.queue, samples=samples,
                           generated=self.counters["samples_generated"], failed=self.counters["samples_failed_reward"],
                           journal=recovery.journal)

    def _on_stale(self, rec: dict, version: int) -> None:  # counted and reported to its rollout rank, never silent
        self.stale_by_rank[int(rec["rank"])] += 1
        self.stale_uids.append(rec["uid"])

    # ---------------------------------------------------------------- batches
    def poll(self, n: int, version: int, timeout: float = 0.0) -> list[dict]:
        """Up to ``n`` fresh groups (age ≤ η at ``version``), oldest first, waiting at most ``timeout`` seconds; the
        stale groups met on the way are reported to their ranks at once (:meth:`report_stale`)."""
        out = self.queue.get_batch(n, current_version=version, timeout=timeout)
        self.report_stale()
        return out

    def take(self, n: int, version: int) -> list[dict]:
        """``n`` fresh groups for the step that trains ``version`` (blocks until they have arrived). Raises
        ``RuntimeError`` when every rollout rank has ended first."""
        batch: list[dict] = []
        while len(batch) < n:
            batch += self.poll(n - len(batch), version, timeout=0.5)
            if len(batch) < n and len(self.inbox.ended) == len(self.sources):
                raise RuntimeError("every rollout rank ended while the trainer still needs groups")
        return batch

    def report_stale(self) -> None:
        """``Stale`` to the rollout ranks for the groups dropped since the last report: they free those slots."""
        if self.stale_by_rank:
            stale, _ = dict(self.stale_by_rank), self.stale_by_rank.clear()
            self.counters["samples_dropped_stale"] += sum(stale.values()) * self.group_size
            send_control(self.sync_group, Stale(stale))

    def trained(self, samples: int, max_age: int, without_trajectory: int = 0) -> None:
        """A batch was trained: ``samples`` samples (and ``without_trajectory`` of its samples that had nothing to
        train), the oldest of its tokens ``max_age`` versions old."""
        self.counters["samples_trained"] += samples
        self.counters["samples_without_trajectory"] += without_trajectory
        self.counters["max_staleness_seen"] = max(self.counters["max_staleness_seen"], max_age)

    # ---------------------------------------------------------------- the weight commit
    def announce(self, version: int, kind: str = "full", first: bool = False) -> None:
        """The control message before a weight push: its payload ``kind`` and ``version``. The run's first push
        (``first``: fresh or resumed) also carries each rollout rank's groups still queued here and the run's start
        number (:meth:`RolloutAdmission.committed`)."""
        queued = Counter(int(rec["rank"]) for rec, _, _ in self.queue.state_dict()["items"]) if first else {}
        send_control(self.sync_group, Weights(version=version, kind=kind, first=first, queued=dict(queued),
                                              run=self.run if first else 0))

    # ---------------------------------------------------------------- checkpoint, end, figures
    def state_dict(self) -> dict[str, Any]:
        """``queue``, ``counters`` and ``stale_uids`` for the run checkpoint; the queue and the received counts are
        read under the inbox's lock, so that they agree (nothing received before the checkpoint is lost)."""
        with self.inbox.lock:
            queue = self.queue.state_dict()
            self.counters["samples_generated"] = self.inbox.generated
            self.counters["samples_failed_reward"] = self.inbox.failed
        return {"queue": queue, "counters": dict(self.counters), "stale_uids": list(self.stale_uids)}

    def stop(self) -> Counter:
        """``Stop`` to the rollout ranks; waits for their ``RolloutEnd`` s and returns their counters summed."""
        send_control(self.sync_group, Stop())
        self.inbox.join()
        rollout: Counter = Counter()
        for end in self.inbox.ended.values():
            rollout.update(end.counters)
        return rollout

    def figures(self) -> dict[str, int]:
        """The conservation identity's terms (summary.json): ``samples_generated`` and where each sample went."""
        c, k = self.counters, self.group_size
        return {"samples_generated": self.inbox.generated, "samples_trained": c["samples_trained"],
                "samples_without_trajectory": c["samples_without_trajectory"],
                "samples_dropped_stale": c["samples_dropped_stale"], "samples_failed_reward": self.inbox.failed,
                "samples_lost_in_crash": c["samples_lost_in_crash"], "samples_left_in_queue": len(self.queue) * k,
                "max_staleness_seen": c["max_staleness_seen"]}

    def unaccounted(self) -> int:
        """``samples_generated`` less every place a sample can go (0 between steps: the conservation identity)."""
        f = self.figures()
        return f["samples_generated"] - sum(f[k] for k in (
            "samples_trained", "samples_without_trajectory", "samples_dropped_stale", "samples_failed_reward",
            "samples_lost_in_crash", "samples_left_in_queue"))
