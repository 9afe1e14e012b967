"""PartialRolloutBuffer: whole groups, FIFO, age-based drops counted, checkpointing, Generation adapter."""

from __future__ import annotations

import pickle

import pytest

from rlblocks.rollout.types import Generation
from rlblocks.sched import PartialRollout, PartialRolloutBuffer


def sample(gid, versions, *, remaining=4, finished=False, prompt=(1, 2)):
    n = len(versions)
    return PartialRollout(
        group_id=gid, prompt_ids=list(prompt), output_ids=list(range(10, 10 + n)),
        output_logprobs=[-0.5] * n, output_versions=list(versions), remaining_tokens=remaining, finished=finished,
    )


def test_from_generation_and_resume_prompt():
    gen = Generation(request_id="r0", prompt_ids=[5, 6], output_ids=[7, 8, 9], output_logprobs=[-1.0, -2.0, -0.5],
                     output_versions=[3, 3, 4], finish_reason="abort")
    p = PartialRollout.from_generation(gen, group_id="g", max_new_tokens=10)
    assert (p.remaining_tokens, p.finished, p.oldest_version, p.request_id) == (7, False, 3, "r0")
    assert p.resume_prompt_ids == [5, 6, 7, 8, 9]
    done = Generation(request_id="r1", prompt_ids=[5, 6], output_ids=[7], output_logprobs=[-1.0],
                      output_versions=[4], finish_reason="stop")
    q = PartialRollout.from_generation(done, group_id="g", max_new_tokens=10)
    assert (q.remaining_tokens, q.finished) == (0, True)
    with pytest.raises(ValueError, match="max_new_tokens"):
        PartialRollout.from_generation(gen, group_id="g", max_new_tokens=2)
    with pytest.raises(ValueError, match="output_ids"):
        PartialRollout(group_id="g", prompt_ids=[1], output_ids=[1, 2], output_logprobs=[0.0], output_versions=[0])
    buf = PartialRolloutBuffer(group_size=2)
    buf.put_generations([gen, done], group_id="g", max_new_tokens=10)
    (group,) = buf.pop_groups(1)
    assert [(s.request_id, s.finished, s.remaining_tokens) for s in group] == [("r0", False, 7), ("r1", True, 0)]


def test_groups_stay_whole_and_fifo():
    buf = PartialRolloutBuffer(group_size=3)
    assert buf.add(sample("a", [0])) is False
    assert buf.add(sample("b", [0])) is False
    assert buf.pop_groups(5) == []  # incomplete groups are never served
    buf.add(sample("b", [1]))
    assert buf.add(sample("b", [1], finished=True, remaining=0)) is True
    buf.put_group([sample("c", [2]), sample("c", [2]), sample("c", [2])])
    buf.add(sample("a", [0]))
    buf.add(sample("a", [0]))
    groups = buf.pop_groups(2)
    assert [[s.group_id for s in g] for g in groups] == [["b"] * 3, ["c"] * 3]  # completion order
    assert [len(g) for g in buf.pop_groups(2)] == [3]
    s = buf.stats()
    assert (s["groups_added"], s["samples_added"], s["groups_popped"], s["samples_popped"]) == (3, 9, 3, 9)
    with pytest.raises(ValueError, match="group_size"):
        buf.put_group([sample("d", [0])])
    with pytest.raises(ValueError, match="group_id"):
        PartialRolloutBuffer().put_group([sample("d", [0]), sample("e", [0])])
    buf.add(sample("z", [0]))
    assert [[s.group_id for s in g] for g in buf.pop_incomplete()] == [["z"]]


def test_drop_old_groups_whole_and_counted():
    dropped = []
    buf = PartialRolloutBuffer(max_age=2, on_drop=lambda gid, samples: dropped.append((gid, len(samples))))
    buf.put_group([sample("old", [5]), sample("old", [1, 5])])  # oldest token is version 1
    buf.put_group([sample("new", [4]), sample("new", [])])  # a sample without tokens has no age
    buf.put_group([sample("empty", [])])
    groups = buf.pop_groups(10, current_version=4)
    assert [g[0].group_id for g in groups] == ["new", "empty"]
    assert dropped == [("old", 2)]
    s = buf.stats()
    assert (s["groups_dropped"], s["samples_dropped"]) == (1, 2)
    assert s["samples_added"] == s["samples_popped"] + s["samples_dropped"] + s["samples_held"]
    # without a callback dropped groups are kept for drain_dropped()
    buf2 = PartialRolloutBuffer(max_age=0)
    buf2.put_group([sample("g", [0])])
    assert buf2.drop_stale(1) == 1
    assert [gid for gid, _ in buf2.drain_dropped()] == ["g"]


def test_state_dict_round_trip():
    buf = PartialRolloutBuffer(group_size=2, max_age=3)
    buf.put_group([sample(0, [1, 2]), sample(0, [2], finished=True, remaining=0)])
    buf.add(sample(1, [3]))
    buf.put_group([sample(2, [0]), sample(2, [0])])
    buf.drop_stale(4)
    state = pickle.loads(pickle.dumps(buf.state_dict()))
    buf2 = PartialRolloutBuffer(group_size=2, max_age=3)
    buf2.load_state_dict(state)
    assert buf2.stats() == buf.stats()
    assert buf2.pop_groups(5) == buf.pop_groups(5)
    assert buf2.pop_incomplete() == buf.pop_incomplete()
    assert buf2.drain_dropped() == buf.drain_dropped()
    with pytest.raises(ValueError, match="empty buffer"):
        buf3 = PartialRolloutBuffer(group_size=2)
        buf3.add(sample(9, [0]))
        buf3.load_state_dict(state)


def test_bad_arguments():
    with pytest.raises(ValueError, match="group_size"):
        PartialRolloutBuffer(group_size=0)
    with pytest.raises(ValueError, match="max_age"):
        PartialRolloutBuffer(max_age=-1)
    buf = PartialRolloutBuffer()
    with pytest.raises(ValueError, match="k"):
        buf.pop_groups(0)
    with pytest.raises(ValueError, match="group_size"):
        buf.add(sample("a", [0]))
    with pytest.raises(ValueError, match="PartialRollout"):
        buf.put_group([object()])
    with pytest.raises(ValueError, match="remaining_tokens"):
        sample("a", [0], remaining=-1)
