"""A buffer of aborted partial generations, kept by prompt group, resumed before new prompts.

When rollouts are interrupted (a weight update, or :class:`rlblocks.sched.DynamicSampler` reaching its target) the
tokens generated so far are not thrown away: each sample's prompt, output tokens, logprobs and per-token versions
go here with the token budget left, and the next generation round resumes them (prompt + output so far as the new
prompt, ``remaining_tokens`` as the new ``max_new_tokens``) before it draws new prompts.

Groups stay whole: a GRPO group's advantages need all its samples, so the buffer returns a group only with all of
its samples, including samples that had already finished (``finished=True``) when the others were aborted.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from rlblocks.errors import ArgumentError


class GenerationLike(Protocol):
    """Structural type of :class:`rlblocks.rollout.Generation` (only the attributes read here)."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: str


@dataclass
class PartialRollout:
    """One sample of a group, possibly unfinished.

    ``output_logprobs[i]`` / ``output_versions[i]`` belong to ``output_ids[i]``. ``remaining_tokens`` is the budget
    still allowed (``max_new_tokens - len(output_ids)`` for the sample's original budget). ``finished`` marks a
    sample that completed (stop or length) before its group was aborted; it is carried so the group stays whole
    and is not regenerated.
    """

    group_id: Hashable
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    remaining_tokens: int = 0
    finished: bool = False
    request_id: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.output_ids)
        if len(self.output_logprobs) != n or len(self.output_versions) != n:
            raise ArgumentError(
                "PartialRollout: output_ids, output_logprobs and output_versions need one entry per token, got "
                f"{n}, {len(self.output_logprobs)} and {len(self.output_versions)}"
            )
        if isinstance(self.remaining_tokens, bool) or not isinstance(self.remaining_tokens, int) or (
            self.remaining_tokens < 0
        ):
            raise ArgumentError(f"remaining_tokens: expected an int >= 0, got {self.remaining_tokens!r}")
        if len(self.prompt_ids) == 0:
            raise ArgumentError("prompt_ids: expected at least one token, got an empty list")

    @property
    def oldest_version(self) -> int | None:
        """The oldest policy version among the output tokens (``None`` if no token was generated)."""
        return min(self.output_versions) if self.output_versions else None

    @property
    def resume_prompt_ids(self) -> list[int]:
        """What to feed the engine to continue: ``prompt_ids + output_ids``."""
        return list(self.prompt_ids) + list(self.output_ids)

    @classmethod
    def from_generation(cls, gen: GenerationLike, *, group_id: Hashable, max_new_tokens: int) -> PartialRollout:
        """Wrap a :class:`rlblocks.rollout.Generation` (or anything with its attributes).

        ``max_new_tokens`` is the sample's ORIGINAL budget; ``remaining_tokens = max_new_tokens - len(output_ids)``
        (0 if ``finish_reason != "abort"``, and then ``finished=True``).
        """
        n = len(gen.output_ids)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < n:
            raise ArgumentError(f"max_new_tokens: expected an int >= len(output_ids) = {n}, got {max_new_tokens!r}")
        finished = gen.finish_reason != "abort"
        return cls(
            group_id=group_id,
            prompt_ids=list(gen.prompt_ids),
            output_ids=list(gen.output_ids),
            output_logprobs=list(gen.output_logprobs),
            output_versions=list(gen.output_versions),
            remaining_tokens=0 if finished else max_new_tokens - n,
            finished=finished,
            request_id=gen.request_id,
        )


def _group_oldest(samples: Sequence[PartialRollout]) -> int | None:
    versions = [s.oldest_version for s in samples if s.oldest_version is not None]
    return min(versions) if versions else None


class PartialRolloutBuffer:
    """FIFO of whole prompt groups of :class:`PartialRollout` samples.

    Args:
        group_size: samples per group. When set, :meth:`put_group` requires exactly that many, and :meth:`add`
            collects samples one by one: a group with fewer samples is *incomplete*, never returned by
            :meth:`pop_groups` (it is counted in :meth:`stats`, saved by :meth:`state_dict`, and can be taken with
            :meth:`pop_incomplete`). Without ``group_size`` only :meth:`put_group` is allowed, and any group it is
            given is whole by definition.
        max_age: if set, a group whose oldest token is more than ``max_age`` versions older than ``current_version``
            (passed to :meth:`pop_groups` / :meth:`drop_stale`) is dropped whole (its samples would be too stale
            to finish and train on), counted in ``groups_dropped`` / ``samples_dropped``.
        on_drop: ``on_drop(group_id, samples)`` receives each dropped group; without it dropped groups are kept
            for :meth:`drain_dropped`. Nothing is discarded silently.

    Thread-safe (one lock). Groups come out oldest-inserted first. Serve :meth:`pop_groups` before drawing new
    prompts, so resumed work is not starved.
    """

    def __init__(
        self,
        *,
        group_size: int | None = None,
        max_age: int | None = None,
        on_drop: Callable[[Hashable, list[PartialRollout]], None] | None = None,
    ) -> None:
        if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)
                                       or group_size < 1):
            raise ArgumentError(f"group_size: expected None or an int >= 1, got {group_size!r}")
        if max_age is not None and (isinstance(max_age, bool) or not isinstance(max_age, int) or max_age < 0):
            raise ArgumentError(f"max_age: expected None or an int >= 0, got {max_age!r}")
        self.group_size = group_size
        self.max_age = max_age
        self.on_drop = on_drop
        self._lock = threading.Lock()
        self._complete: dict[Hashable, list[PartialRollout]] = {}
        self._incomplete: dict[Hashable, list[PartialRollout]] = {}
        self._dropped: list[tuple[Hashable, list[PartialRollout]]] = []
        self._counts = dict.fromkeys(
            ("groups_added", "samples_added", "groups_popped", "samples_popped", "groups_dropped", "samples_dropped"),
            0,
        )

    # ------------------------------------------------------------------ adding
    def _check_sample(self, s: object, name: str) -> PartialRollout:
        if not isinstance(s, PartialRollout):
            raise ArgumentError(
                f"{name}: expected a PartialRollout (use PartialRollout.from_generation), got {type(s).__name__}"
            )
        return s

    def put_group(self, samples: Sequence[PartialRollout]) -> None:
        """Add a whole group at once (all samples share one ``group_id`` not already in the buffer)."""
        samples = [self._check_sample(s, f"samples[{i}]") for i, s in enumerate(samples)]
        if not samples:
            raise ArgumentError("samples: expected at least one sample, got an empty group")
        gid = samples[0].group_id
        for i, s in enumerate(samples):
            if s.group_id != gid:
                raise ArgumentError(f"samples[{i}].group_id: expected {gid!r} (one group per call), got {s.group_id!r}")
        if self.group_size is not None and len(samples) != self.group_size:
            raise ArgumentError(f"samples: expected a whole group of group_size={self.group_size}, got {len(samples)}")
        with self._lock:
            if gid in self._complete or gid in self._incomplete:
                raise ArgumentError(f"samples: group_id {gid!r} is already in the buffer")
            self._complete[gid] = samples
            self._counts["groups_added"] += 1
            self._counts["samples_added"] += len(samples)

    def put_generations(
        self, generations: Sequence[GenerationLike], *, group_id: Hashable, max_new_tokens: int
    ) -> None:
        """:meth:`put_group` for :class:`rlblocks.rollout.Generation` objects of one prompt group (aborted ones and
        ones that already finished), converted with :meth:`PartialRollout.from_generation`."""
        self.put_group(
            [PartialRollout.from_generation(g, group_id=group_id, max_new_tokens=max_new_tokens) for g in generations]
        )

    def add(self, sample: PartialRollout) -> bool:
        """Add one sample (needs ``group_size``). Returns True when this sample completed its group."""
        sample = self._check_sample(sample, "sample")
        if self.group_size is None:
            raise ArgumentError("sample: add() needs group_size to know when a group is whole; use put_group()")
        gid = sample.group_id
        with self._lock:
            if gid in self._complete:
                raise ArgumentError(f"sample: group {gid!r} is already whole ({self.group_size} samples)")
            group = self._incomplete.setdefault(gid, [])
            group.append(sample)
            self._counts["samples_added"] += 1
            if len(group) < self.group_size:
                return False
            del self._incomplete[gid]
            self._complete[gid] = group
            self._counts["groups_added"] += 1
            return True

    # ------------------------------------------------------------------ taking
    def _drop_locked(self, current_version: int) -> list[tuple[Hashable, list[PartialRollout]]]:
        if self.max_age is None:
            return []
        limit = current_version - self.max_age
        dropped = []
        for store in (self._complete, self._incomplete):
            for gid in [g for g, samples in store.items() if (o := _group_oldest(samples)) is not None and o < limit]:
                dropped.append((gid, store.pop(gid)))
        for _, samples in dropped:
            self._counts["groups_dropped"] += 1
            self._counts["samples_dropped"] += len(samples)
        if self.on_drop is None:
            self._dropped.extend(dropped)
        return dropped

    def _deliver(self, dropped: list[tuple[Hashable, list[PartialRollout]]]) -> None:
        if self.on_drop is None:
            return
        for i, (gid, samples) in enumerate(dropped):
            try:
                self.on_drop(gid, samples)
            except BaseException:
                with self._lock:
                    self._dropped.extend(dropped[i:])
                raise

    def drop_stale(self, current_version: int) -> int:
        """Drop (whole) every group older than ``max_age`` versions at ``current_version``. Returns how many."""
        if isinstance(current_version, bool) or not isinstance(current_version, int) or current_version < 0:
            raise ArgumentError(f"current_version: expected an int >= 0, got {current_version!r}")
        with self._lock:
            dropped = self._drop_locked(current_version)
        self._deliver(dropped)
        return len(dropped)

    def pop_groups(self, k: int, *, current_version: int | None = None) -> list[list[PartialRollout]]:
        """Up to ``k`` whole groups, oldest inserted first (each a list of its samples in insertion order).

        With ``current_version`` and ``max_age`` set, stale groups are dropped first (see :meth:`drop_stale`).
        """
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ArgumentError(f"k: expected an int > 0, got {k!r}")
        if current_version is not None and (
            isinstance(current_version, bool) or not isinstance(current_version, int) or current_version < 0
        ):
            raise ArgumentError(f"current_version: expected None or an int >= 0, got {current_version!r}")
        with self._lock:
            dropped = self._drop_locked(current_version) if current_version is not None else []
            out = []
            for gid in list(self._complete)[:k]:
                out.append(self._complete.pop(gid))
            self._counts["groups_popped"] += len(out)
            self._counts["samples_popped"] += sum(len(g) for g in out)
        self._deliver(dropped)
        return out

    def pop_incomplete(self) -> list[list[PartialRollout]]:
        """Take every incomplete group (e.g. at shutdown, or when a sample was lost upstream). Counted as popped."""
        with self._lock:
            out = list(self._incomplete.values())
            self._incomplete.clear()
            self._counts["groups_popped"] += len(out)
            self._counts["samples_popped"] += sum(len(g) for g in out)
            return out

    def drain_dropped(self) -> list[tuple[Hashable, list[PartialRollout]]]:
        """Dropped ``(group_id, samples)`` kept because no ``on_drop`` callback was given."""
        with self._lock:
            out, self._dropped = self._dropped, []
            return out

    # ------------------------------------------------------------------ introspection and checkpointing
    def __len__(self) -> int:
        """Number of whole groups ready for :meth:`pop_groups`."""
        with self._lock:
            return len(self._complete)

    def stats(self) -> dict[str, int]:
        """Counters plus current sizes. Invariant: ``samples_added == samples_popped + samples_dropped +
        samples_held`` (held = in complete or incomplete groups)."""
        with self._lock:
            return {
                **self._counts,
                "groups_ready": len(self._complete),
                "groups_incomplete": len(self._incomplete),
                "samples_held": sum(len(g) for g in self._complete.values())
                + sum(len(g) for g in self._incomplete.values()),
                "dropped_pending": len(self._dropped),
            }

    def state_dict(self) -> dict[str, Any]:
        """Groups as plain dicts (``dataclasses.asdict``), dropped-pending groups, counters. Picklable as long as
        group ids and ``meta`` values are."""
        with self._lock:
            def enc(store):
                return [(gid, [asdict(s) for s in samples]) for gid, samples in store]

            return {
                "complete": enc(self._complete.items()),
                "incomplete": enc(self._incomplete.items()),
                "dropped": enc(self._dropped),
                "counts": dict(self._counts),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore into this EMPTY buffer (raises ``ValueError`` otherwise)."""
        for key in ("complete", "incomplete", "dropped", "counts"):
            if key not in state:
                raise ArgumentError(f"state: missing key {key!r}")

        def dec(entries):
            return [(gid, [PartialRollout(**d) for d in samples]) for gid, samples in entries]

        complete, incomplete, dropped = dec(state["complete"]), dec(state["incomplete"]), dec(state["dropped"])
        with self._lock:
            if self._complete or self._incomplete or self._dropped:
                raise ArgumentError("load_state_dict: expected an empty buffer (loading would lose its groups)")
            self._complete = dict(complete)
            self._incomplete = dict(incomplete)
            self._dropped = dropped
            self._counts = {k: int(state["counts"][k]) for k in self._counts}
