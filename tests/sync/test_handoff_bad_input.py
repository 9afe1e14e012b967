"""Bad input to the colocated handoff and the directory transport: ArgumentError on the sender's side, a
WeightUpdateError for a malformed message reaching the engine side (never a TypeError from inside), and no
wait that can never end."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rlblocks.errors import ArgumentError, WeightUpdateError
from rlblocks.sync.delta_transport import DirectoryTransport
from rlblocks.sync.handoff import HandoffSender, open_handoff


@pytest.fixture
def sender():
    s = HandoffSender()
    yield s
    s.close()


def _open(msg):
    with open_handoff(msg) as named:
        return [n for n, _ in named]


def test_sender_arguments(sender):
    for call, arg in ((lambda: sender.prepare([], version=1), "named_tensors"),  # an update of nothing
                      (lambda: sender.prepare(5, version=1), "named_tensors"),
                      (lambda: sender.prepare([("a", 5)], version=1), "a"),
                      (lambda: sender.prepare([("a", torch.ones(2))], version=True), "version"),
                      (lambda: HandoffSender(device="bogus"), "device"),
                      (lambda: HandoffSender(bucket_bytes=1.5), "bucket_bytes")):
        with pytest.raises(ArgumentError, match=arg):
            call()
    assert sender.stats()["prepared"] == 0 and sender.stats()["buffers_allocated"] == 0  # nothing was taken


def test_a_malformed_message_is_a_refused_update(sender):
    msg = sender.prepare([("a", torch.arange(4.0))], version=1)
    b = msg.buckets[0]
    bad = {
        "handle": dataclasses.replace(msg, buckets=(dataclasses.replace(b, handle=123),)),
        "tensors": dataclasses.replace(msg, buckets=(dataclasses.replace(b, tensors=(5,)),)),
        "nbytes": dataclasses.replace(msg, buckets=(dataclasses.replace(b, nbytes=-1),)),
        "buckets": dataclasses.replace(msg, buckets=5),
        "device": dataclasses.replace(msg, device="tpu"),
    }
    for what, m in bad.items():
        with pytest.raises(WeightUpdateError, match=what):
            _open(m)
    assert _open(msg) == ["a"]  # the real one still opens
    sender.release(msg)


def test_wait_next_refuses_a_timeout_that_never_ends(tmp_path):
    t = DirectoryTransport(tmp_path)
    with pytest.raises(ArgumentError, match="timeout"):
        t.wait_next(current_version=None, timeout=math.nan)  # NaN: the deadline never passed
    with pytest.raises(ArgumentError, match="poll"):
        t.wait_next(current_version=None, timeout=1, poll=-1)
    with pytest.raises(TimeoutError):
        t.wait_next(current_version=None, timeout=0.05, poll=0.01)
