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

from rlblocks._checks import (
    check_bool,
    check_int,
    check_int_list,
    check_logprob_list,
    check_optional_int,
    check_state_keys,
)
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

    ``output_logprobs[i]`` / ``output_versions[i]`` belong to ``output_ids[i]``; a log-prob is a number ``<= 0`` or
    ``−inf`` (NaN and ``+inf`` are refused, naming the index). ``remaining_tokens`` is the budget
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
        try:
            hash(self.group_id)
        except TypeError:
            raise ArgumentError(f"group_id: expected a hashable id, got {type(self.group_id).__name__}") from None
        # Token ids, versions and budgets are counts and positions: a float would be truncated and True read as 1.
        self.prompt_ids = check_int_list("prompt_ids", self.prompt_ids, minimum=0)
        if len(self.prompt_ids) == 0:
            raise ArgumentError("prompt_ids: expected at least one token, got an empty list")
        self.output_ids = check_int_list("output_ids", self.output_ids, minimum=0)
        # NaN or +inf is no log-probability: kept, it would turn the loss of the whole batch NaN steps later
        self.output_logprobs = check_logprob_list("output_logprobs", self.output_logprobs)
        self.output_versions = check_int_list("output_versions", self.output_versions, minimum=0)
        n = len(self.output_ids)
        if len(self.output_logprobs) != n or len(self.output_versions) != n:
            raise ArgumentError(
                "PartialRollout: output_ids, output_logprobs and output_versions need one entry per token, got "
                f"{n}, {len(self.output_logprobs)} and {len(self.output_versions)}"
            )
        self.remaining_tokens = check_int("remaining_tokens", self.remaining_tokens, minimum=0)
        check_bool("finished", self.finished)
        if self.request_id is not None and (not isinstance(self.request_id, str) or not self.request_id):
            raise ArgumentError(f"request_id: expected None or a non-empty str, got {self.request_id!r}")
        if not isinstance(self.meta, dict):
            raise ArgumentError(f"meta: expected a dict, got {type(self.meta).__name__}")

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
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=0)
        if max_new_tokens < n:
            raise ArgumentError(f"max_new_tokens: expected an int >= len(output_ids) = {n}, got {max_new_tokens}")
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
        max_staleness: ``eta``; if set, a group whose oldest token is more than ``eta`` versions older than
            ``current_version`` (passed to :meth:`pop_groups` / :meth:`drop_stale`) is dropped whole: trained at
            ``current_version`` or later it would break the staleness bound, so finishing it is wasted work.
            Counted in ``groups_dropped`` / ``samples_dropped``.
        on_drop: ``on_drop(group_id, samples)`` receives each dropped group; without it dropped groups are kept
            for :meth:`drain_dropped`. Nothing is discarded silently.

    A sample is one request: the same ``request_id`` (or the same :class:`PartialRollout` object) cannot be held
    twice, so a duplicate can never stand in for a missing sample and complete a group (``ArgumentError``).

    Thread-safe (one lock). Groups come out oldest-inserted first. Serve :meth:`pop_groups` before drawing new
    prompts, so resumed work is not starved.
    """

    def __init__(
        self,
        *,
        group_size: int | None = None,
        max_staleness: int | None = None,
        on_drop: Callable[[Hashable, list[PartialRollout]], None] | None = None,
    ) -> None:
        self.group_size = check_optional_int("group_size", group_size, minimum=1)
        self.max_staleness = check_optional_int("max_staleness", max_staleness, minimum=0)
        if on_drop is not None and not callable(on_drop):
            raise ArgumentError(f"on_drop: expected a callable(group_id, samples) or None, got {on_drop!r}")
        self.on_drop = on_drop
        self._lock = threading.Lock()
        self._complete: dict[Hashable, list[PartialRollout]] = {}
        self._incomplete: dict[Hashable, list[PartialRollout]] = {}
        self._dropped: list[tuple[Hashable, list[PartialRollout]]] = []
        self._rids: dict[str, Hashable] = {}  # request_id -> group of every held sample (duplicates are refused)
        self._counts = dict.fromkeys(_COUNTERS, 0)

    # ------------------------------------------------------------------ adding
    def _check_sample(self, s: object, name: str) -> PartialRollout:
        if not isinstance(s, PartialRollout):
            raise ArgumentError(
                f"{name}: expected a PartialRollout (use PartialRollout.from_generation), got {type(s).__name__}"
            )
        return s

    def _check_new_locked(self, samples: Sequence[PartialRollout], held: Sequence[PartialRollout], name: str) -> None:
        """Refuse a sample already held (same object or same request_id), in this group or any other."""
        seen: set[str] = set()
        for i, s in enumerate(samples):
            where = f"{name}[{i}]" if len(samples) > 1 else name
            if any(s is h for h in held) or any(s is o for o in samples[:i]):
                raise ArgumentError(f"{where}: this PartialRollout object is already in group {s.group_id!r}")
            rid = s.request_id
            if rid is None:
                continue
            if rid in self._rids or rid in seen:
                other = self._rids.get(rid, s.group_id)
                raise ArgumentError(
                    f"{where}.request_id: expected a request not already in the buffer, got {rid!r} which is "
                    f"already held in group {other!r} (a duplicate cannot complete a group)"
                )
            seen.add(rid)

    def _index_locked(self, samples: Sequence[PartialRollout]) -> None:
        for s in samples:
            if s.request_id is not None:
                self._rids[s.request_id] = s.group_id

    def _unindex_locked(self, samples: Sequence[PartialRollout]) -> None:
        for s in samples:
            if s.request_id is not None:
                self._rids.pop(s.request_id, None)

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
            self._check_new_locked(samples, (), "samples")
            self._complete[gid] = samples
            self._index_locked(samples)
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
        """Add one sample (needs ``group_size``). Returns True when this sample completed its group.

        Raises ``ArgumentError`` for a sample whose group is already whole, or that is already held (the same
        object, or the same ``request_id``): only ``group_size`` DISTINCT samples complete a group.
        """
        sample = self._check_sample(sample, "sample")
        if self.group_size is None:
            raise ArgumentError("sample: add() needs group_size to know when a group is whole; use put_group()")
        gid = sample.group_id
        with self._lock:
            if gid in self._complete:
                raise ArgumentError(f"sample: group {gid!r} is already whole ({self.group_size} samples)")
            group = self._incomplete.get(gid, [])
            self._check_new_locked([sample], group, "sample")
            self._incomplete[gid] = group
            group.append(sample)
            self._index_locked([sample])
            self._counts["samples_added"] += 1
            if len(group) < self.group_size:
                return False
            del self._incomplete[gid]
            self._complete[gid] = group
            self._counts["groups_added"] += 1
            return True

    # ------------------------------------------------------------------ taking
    def _drop_locked(self, current_version: int) -> list[tuple[Hashable, list[PartialRollout]]]:
        if self.max_staleness is None:
            return []
        limit = current_version - self.max_staleness
        dropped = []
        for store in (self._complete, self._incomplete):
            for gid in [g for g, samples in store.items() if (o := _group_oldest(samples)) is not None and o < limit]:
                dropped.append((gid, store.pop(gid)))
        for _, samples in dropped:
            self._unindex_locked(samples)
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
        """Drop (whole) every group older than ``max_staleness`` versions at ``current_version``. Returns how
        many groups were dropped."""
        current_version = check_int("current_version", current_version, minimum=0)
        with self._lock:
            dropped = self._drop_locked(current_version)
        self._deliver(dropped)
        return len(dropped)

    def pop_groups(
        self, n: int, *, current_version: int | None = None
    ) -> list[list[PartialRollout]]:
        """Up to ``n`` whole groups, oldest inserted first (each a list of its samples in insertion order).

        With ``current_version`` and ``max_staleness`` set, stale groups are dropped first (see
        :meth:`drop_stale`).
        """
        n = check_int("n", n, minimum=1, what="an int > 0 (how many groups to take)")
        if current_version is not None:
            current_version = check_int("current_version", current_version, minimum=0)
        with self._lock:
            dropped = self._drop_locked(current_version) if current_version is not None else []
            out = []
            for gid in list(self._complete)[:n]:
                out.append(self._complete.pop(gid))
            for g in out:
                self._unindex_locked(g)
            self._counts["groups_popped"] += len(out)
            self._counts["samples_popped"] += sum(len(g) for g in out)
        self._deliver(dropped)
        return out

    def pop_incomplete(self) -> list[list[PartialRollout]]:
        """Take every incomplete group (e.g. at shutdown, or when a sample was lost upstream). Counted as popped."""
        with self._lock:
            out = list(self._incomplete.values())
            self._incomplete.clear()
            for g in out:
                self._unindex_locked(g)
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
        """Groups as plain dicts (``dataclasses.asdict``), dropped-pending groups, counters and ``group_size``.
        Picklable as long as group ids and ``meta`` values are."""
        with self._lock:
            def enc(store):
                return [(gid, [asdict(s) for s in samples]) for gid, samples in store]

            return {
                "group_size": self.group_size,
                "complete": enc(self._complete.items()),
                "incomplete": enc(self._incomplete.items()),
                "dropped": enc(self._dropped),
                "counts": dict(self._counts),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore into this EMPTY buffer (raises ``ValueError`` otherwise).

        The state is checked as strictly as the calls that built it, so a corrupted or hand-edited checkpoint
        cannot smuggle in what :meth:`add` / :meth:`put_group` refuse: every sample is re-validated
        (:class:`PartialRollout`), each listed group's samples carry its ``group_id``, a *complete* group has
        exactly ``group_size`` samples and an *incomplete* one fewer, no group id or request id appears twice,
        ``group_size`` (when saved) matches this buffer's, and the counters satisfy ``samples_added ==
        samples_popped + samples_dropped + samples_held``.
        """
        where = "PartialRolloutBuffer.load_state_dict: state"
        check_state_keys(where, state, ("complete", "incomplete", "dropped", "counts"), ("group_size",))
        if "group_size" in state and state["group_size"] != self.group_size:
            raise ArgumentError(
                f"{where}['group_size']: expected {self.group_size} (this buffer's), got {state['group_size']!r}"
            )

        def dec(key):
            out = []
            groups = state[key]
            if not isinstance(groups, (list, tuple)):
                raise ArgumentError(f"{where}[{key!r}]: expected a list of (group_id, samples), got "
                                    f"{type(groups).__name__}")
            for j, entry in enumerate(groups):
                if not isinstance(entry, (list, tuple)) or len(entry) != 2 or not isinstance(entry[1], (list, tuple)):
                    raise ArgumentError(f"{where}[{key!r}][{j}]: expected a (group_id, samples) pair, got "
                                        f"{entry!r:.80}")
                gid, samples = entry
                group = []
                for i, d in enumerate(samples):
                    if not isinstance(d, dict):
                        raise ArgumentError(f"{where}[{key!r}][{j}] sample {i}: expected a dict of PartialRollout "
                                            f"fields, got {type(d).__name__}")
                    fields = tuple(PartialRollout.__dataclass_fields__)
                    check_state_keys(f"{where}[{key!r}][{j}] sample {i}", d, ("group_id", "prompt_ids"),
                                     fields[2:])
                    try:
                        s = PartialRollout(**d)
                    except (TypeError, ArgumentError) as e:
                        raise ArgumentError(f"{where}[{key!r}][{j}] sample {i}: {e}") from None
                    if s.group_id != gid:
                        raise ArgumentError(
                            f"{where}[{key!r}][{j}] sample {i}: expected group_id {gid!r}, got {s.group_id!r}"
                        )
                    group.append(s)
                if not group:
                    raise ArgumentError(f"{where}[{key!r}][{j}]: expected at least one sample in group {gid!r}")
                out.append((gid, group))
            return out

        complete, incomplete, dropped = dec("complete"), dec("incomplete"), dec("dropped")
        for j, (gid, group) in enumerate(complete):
            if self.group_size is not None and len(group) != self.group_size:
                raise ArgumentError(
                    f"{where}['complete'][{j}]: expected a whole group of group_size={self.group_size} samples, "
                    f"got {len(group)} in group {gid!r}"
                )
        for j, (gid, group) in enumerate(incomplete):
            if self.group_size is None:
                raise ArgumentError(f"{where}['incomplete']: a buffer without group_size holds no incomplete groups, "
                                    f"got group {gid!r}")
            if len(group) >= self.group_size:
                raise ArgumentError(
                    f"{where}['incomplete'][{j}]: expected fewer than group_size={self.group_size} samples, got "
                    f"{len(group)} in group {gid!r}"
                )
        gids = [gid for gid, _ in complete + incomplete]
        if len(set(gids)) != len(gids):
            dup = next(g for g in gids if gids.count(g) > 1)
            raise ArgumentError(f"{where}: expected each group id once among held groups, got {dup!r} twice")
        rids: dict[str, Hashable] = {}
        for gid, group in complete + incomplete:
            for s in group:
                if s.request_id is None:
                    continue
                if s.request_id in rids:
                    raise ArgumentError(
                        f"{where}: expected each request_id once, got {s.request_id!r} in group "
                        f"{rids[s.request_id]!r} and group {gid!r}"
                    )
                rids[s.request_id] = gid
        counts = check_state_keys(f"{where}['counts']", state["counts"], _COUNTERS)
        counts = {key: check_int(f"{where}['counts'][{key!r}]", counts[key], minimum=0) for key in _COUNTERS}
        held = sum(len(g) for _, g in complete + incomplete)
        if counts["samples_added"] != counts["samples_popped"] + counts["samples_dropped"] + held:
            raise ArgumentError(
                f"{where}['counts']: expected samples_added == samples_popped + samples_dropped + held, got "
                f"{counts['samples_added']} != {counts['samples_popped']} + {counts['samples_dropped']} + {held}"
            )
        with self._lock:
            if self._complete or self._incomplete or self._dropped:
                raise ArgumentError(
                    "PartialRolloutBuffer.load_state_dict: expected an empty buffer (loading would lose its groups)"
                )
            self._complete = dict(complete)
            self._incomplete = dict(incomplete)
            self._dropped = dropped
            self._rids = rids
            self._counts = counts


_COUNTERS = ("groups_added", "samples_added", "groups_popped", "samples_popped", "groups_dropped", "samples_dropped")
