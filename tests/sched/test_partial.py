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
    buf = PartialRolloutBuffer(max_staleness=2, on_drop=lambda gid, samples: dropped.append((gid, len(samples))))
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
    buf2 = PartialRolloutBuffer(max_staleness=0)
    buf2.put_group([sample("g", [0])])
    assert buf2.drop_stale(1) == 1
    assert [gid for gid, _ in buf2.drain_dropped()] == ["g"]


def test_state_dict_round_trip():
    buf = PartialRolloutBuffer(group_size=2, max_staleness=3)
    buf.put_group([sample(0, [1, 2]), sample(0, [2], finished=True, remaining=0)])
    buf.add(sample(1, [3]))
    buf.put_group([sample(2, [0]), sample(2, [0])])
    buf.drop_stale(4)
    state = pickle.loads(pickle.dumps(buf.state_dict()))
    buf2 = PartialRolloutBuffer(group_size=2, max_staleness=3)
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
    with pytest.raises(ValueError, match="max_staleness"):
        PartialRolloutBuffer(max_staleness=-1)
    buf = PartialRolloutBuffer()
    with pytest.raises(ValueError, match="n"):
        buf.pop_groups(0)
    with pytest.raises(ValueError, match="group_size"):
        buf.add(sample("a", [0]))
    with pytest.raises(ValueError, match="PartialRollout"):
        buf.put_group([object()])
    with pytest.raises(ValueError, match="remaining_tokens"):
        sample("a", [0], remaining=-1)


# ---------------------------------------------------------------------------------------- regressions
def test_duplicate_request_id_cannot_complete_a_group():
    """Two copies of one request used to count as two samples, so a group of 2 completed with one real sample."""
    buf = PartialRolloutBuffer(group_size=2)
    first = PartialRollout(group_id="g", prompt_ids=[1], request_id="g/0")
    assert buf.add(first) is False
    with pytest.raises(ValueError, match=r"request_id.*'g/0'.*already held"):
        buf.add(PartialRollout(group_id="g", prompt_ids=[1], request_id="g/0"))
    with pytest.raises(ValueError, match="already in group"):
        buf.add(first)  # the very same object, even without a request id
    s = buf.stats()
    assert (s["groups_ready"], s["groups_incomplete"], s["samples_held"]) == (0, 1, 1)
    assert buf.add(PartialRollout(group_id="g", prompt_ids=[1], request_id="g/1")) is True
    # a request id held in another group, or twice within one put_group, is refused too
    with pytest.raises(ValueError, match=r"request_id.*'g/1'"):
        buf.add(PartialRollout(group_id="h", prompt_ids=[1], request_id="g/1"))
    with pytest.raises(ValueError, match=r"samples\[1\]\.request_id"):
        buf.put_group([PartialRollout(group_id="k", prompt_ids=[1], request_id="k/0"),
                       PartialRollout(group_id="k", prompt_ids=[1], request_id="k/0")])
    # once popped, the request id may come back (a group resumed and interrupted again)
    (group,) = buf.pop_groups(1)
    assert [x.request_id for x in group] == ["g/0", "g/1"]
    assert buf.add(PartialRollout(group_id="g", prompt_ids=[1], request_id="g/0")) is False


def test_load_state_dict_refuses_an_incomplete_complete_group():
    buf = PartialRolloutBuffer(group_size=3)
    buf.put_group([sample("a", [0]), sample("a", [0]), sample("a", [1])])
    buf.add(sample("b", [0]))
    good = buf.state_dict()
    short = pickle.loads(pickle.dumps(good))
    short["complete"][0][1].pop()  # a "complete" group with 2 of its 3 samples
    short["counts"]["samples_added"] -= 1
    with pytest.raises(ValueError, match=r"state\['complete'\]\[0\]: expected a whole group of group_size=3"):
        PartialRolloutBuffer(group_size=3).load_state_dict(short)
    full_incomplete = pickle.loads(pickle.dumps(good))
    full_incomplete["incomplete"][0][1].extend([good["incomplete"][0][1][0]] * 2)
    full_incomplete["counts"]["samples_added"] += 2
    with pytest.raises(ValueError, match=r"state\['incomplete'\]\[0\]: expected fewer than group_size=3"):
        PartialRolloutBuffer(group_size=3).load_state_dict(full_incomplete)
    wrong_gid = pickle.loads(pickle.dumps(good))
    wrong_gid["complete"][0][1][2]["group_id"] = "z"
    with pytest.raises(ValueError, match="expected group_id 'a'"):
        PartialRolloutBuffer(group_size=3).load_state_dict(wrong_gid)
    lost = pickle.loads(pickle.dumps(good))
    lost["counts"]["samples_added"] += 1  # a sample counted in but held nowhere
    with pytest.raises(ValueError, match="samples_added == samples_popped"):
        PartialRolloutBuffer(group_size=3).load_state_dict(lost)
    with pytest.raises(ValueError, match="group_size"):
        PartialRolloutBuffer(group_size=4).load_state_dict(good)
    bad_token = pickle.loads(pickle.dumps(good))
    bad_token["complete"][0][1][0]["output_ids"] = [1.5]
    with pytest.raises(ValueError, match="output_ids"):
        PartialRolloutBuffer(group_size=3).load_state_dict(bad_token)
    ok = PartialRolloutBuffer(group_size=3)
    ok.load_state_dict(good)  # the untouched state still loads
    assert ok.stats() == buf.stats()


def test_one_spelling_of_each_argument():
    """``max_staleness=`` and ``n`` are the only spellings; a missing ``n`` is refused by name."""
    buf = PartialRolloutBuffer(max_staleness=1)
    buf.put_group([sample("a", [0])])
    buf.put_group([sample("b", [2])])
    assert [g[0].group_id for g in buf.pop_groups(n=5, current_version=2)] == ["b"]
    with pytest.raises(TypeError, match="max_age"):
        PartialRolloutBuffer(max_age=1)
    with pytest.raises(TypeError, match="k"):
        buf.pop_groups(k=1)
    with pytest.raises(ValueError, match="n: expected an int > 0"):
        buf.pop_groups(None)
    assert not hasattr(buf, "max_age")
