"""What the ranks of a disaggregated loop tell each other.

Trainer rank 0 → every rollout rank, on the weight-sync group: one control message (:class:`Weights`,
:class:`Stale`, :class:`Stop`), JSON-encoded, then its payload (if any). Rollout rank → trainer rank 0, on the
sample group: finished group records (plain dicts, pickled losslessly by ``send_object_list``), then one
:class:`RolloutEnd`. :class:`Outbox` ships them (a thread on the rollout rank), :class:`Inbox` receives them into the
trainer's ``StalenessQueue`` (a thread per rollout rank).
"""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class Weights:
    """New weights follow: ``kind`` full buckets, a delta packet or LoRA adapters, committed as ``version``.
    ``first`` marks a run's first push (fresh or resumed): the admission counters restart at ``version`` and each
    rollout rank's groups already waiting in the trainer's queue (``queued``, by rank) count as admitted; ``run``
    numbers the starts of the run (0 for the first, then one more per resume or restart), so that the rollout ranks
    name their groups uniquely across restarts and draw new prompts."""

    version: int
    kind: str
    first: bool = False
    queued: dict[int, int] = field(default_factory=dict)
    run: int = 0


@dataclass(frozen=True)
class Stale:
    """Groups the trainer dropped as stale (older than η when their batch was taken), by rollout rank. Each rank
    discards them from its controller's accepted count (``on_discard``), which frees their admission slots."""

    groups: dict[int, int]


@dataclass(frozen=True)
class Stop:
    """Training is over: stop admitting, cancel what is in flight, report counters."""


CONTROL = {cls.__name__: cls for cls in (Weights, Stale, Stop)}


def send_control(sync_group, msg: Weights | Stale | Stop) -> None:
    """Trainer rank 0: broadcast ``msg`` to every rollout rank of ``sync_group``."""
    sync_group.broadcast_bytes(json.dumps({"type": type(msg).__name__, **dataclasses.asdict(msg)}).encode(), 0)


def recv_control(sync_group) -> Weights | Stale | Stop:
    """Rollout rank: the next control message from trainer rank 0 (blocks)."""
    d = json.loads(sync_group.broadcast_bytes(None, 0))
    cls = CONTROL[d.pop("type")]
    for k in ("queued", "groups"):  # JSON object keys are strings; ranks are ints
        if k in d:
            d[k] = {int(r): int(n) for r, n in d[k].items()}
    return cls(**d)


@dataclass(frozen=True)
class RolloutEnd:
    """The last message of a rollout rank: its counters (samples/tokens generated, filtered, discarded, ...) and,
    from the agent loops, its ``EpisodeStats.stats()`` (``episodes``)."""

    rank: int
    counters: dict[str, float]
    episodes: dict[str, Any] = field(default_factory=dict)


class Outbox(queue.Queue):
    """Rollout rank: records put here are sent to trainer rank 0 in order by one thread (``send_object_list`` on
    ``group``), so the event loop never blocks on the network. :meth:`close` sends the :class:`RolloutEnd` last."""

    def __init__(self, group=None) -> None:
        super().__init__()
        self.group = group
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self, end: RolloutEnd) -> None:
        """Send ``end`` after every record put so far, and wait until it is sent."""
        self.put(end)
        self.thread.join()

    def _loop(self) -> None:
        while True:
            rec = self.get()
            dist.send_object_list([rec], dst=0, group=self.group)
            if isinstance(rec, RolloutEnd):
                return


class Inbox:
    """Trainer rank 0: one thread per rollout rank in ``sources`` receives group records into ``q`` (a
    ``StalenessQueue``, keyed by each record's ``version``) until that rank's :class:`RolloutEnd`. Nothing is
    dropped: ``generated`` counts the samples received (``samples(record)`` each, starting at ``generated``),
    ``failed`` those of the records marked ``"reward_failed"`` (a group failed whole for its reward: counted, never
    queued, starting at ``failed``), ``failed_calls`` their failed reward calls (``rec["reward_failures"]``, this
    process's), and ``ended`` holds each finished rank's :class:`RolloutEnd`. The put, the count and the
    ``journal`` line of a record (``{"event": "recv", "uid", "samples"}``, when a journal is given) happen together
    under ``lock``: a checkpoint that reads the queue and ``generated`` under it sees them agree. Other messages (a
    rank's :class:`~plumbing.timing.RolloutTimes`) are kept in arrival order until :meth:`take_reports`. :meth:`receive`
    files one message as the threads do (no ``sources``: no threads, the records are given to it directly)."""

    def __init__(self, sources: Iterable[int], group, q, *, generated: int = 0, failed: int = 0,
                 samples: Callable[[dict], int] = lambda rec: len(rec["samples"]), journal=None) -> None:
        self.q, self.generated, self.samples, self.journal = q, generated, samples, journal
        self.failed, self.failed_calls = failed, 0
        self.ended: dict[int, RolloutEnd] = {}
        self.reports: list[Any] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, args=(r, group), daemon=True) for r in sources]
        for t in self.threads:
            t.start()

    def _loop(self, src: int, group) -> None:
        while True:
            box = [None]
            dist.recv_object_list(box, src=src, group=group)
            self.receive(src, box[0])
            if isinstance(box[0], RolloutEnd):
                return

    def receive(self, src: int, rec: Any) -> None:
        """File one message from rollout rank ``src`` (what each receiving thread does with what arrives)."""
        if isinstance(rec, RolloutEnd):
            with self.lock:
                self.ended[src] = rec
            return
        if not isinstance(rec, dict):  # a report, not a group record
            with self.lock:
                self.reports.append(rec)
            return
        with self.lock:
            n = self.samples(rec)
            if rec.get("reward_failed"):
                self.failed += n
                self.failed_calls += int(rec.get("reward_failures", 0))
            else:
                self.q.put(rec, rec["version"])  # an unbounded queue: never blocks under the lock
            self.generated += n
            if self.journal is not None:
                self.journal.append({"event": "recv", "uid": rec["uid"], "samples": n})

    def take_reports(self) -> list[Any]:
        """The reports received since the last call, oldest first."""
        with self.lock:
            out, self.reports = self.reports, []
        return out

    def join(self) -> None:
        for t in self.threads:
            t.join()
