"""Sampling runs while training runs; futures answer try-again while pending, the same result on every poll, a clear
error for a failed request, and a retried submission is never run twice."""

from __future__ import annotations

import math
import threading

import httpx
import pytest
from tinker_testlib import MODEL

TIMEOUT = 120


def _types():
    from tinker import types

    return types


def datum(tokens):
    types = _types()
    return types.Datum(model_input=types.ModelInput.from_ints(list(tokens[:-1])),
                       loss_fn_inputs={"target_tokens": list(tokens[1:]), "weights": [1.0] * (len(tokens) - 1)})


DATA = [datum([1, 40, 41, 42, 43, 2]), datum([1, 50, 51, 52, 2])]


@pytest.fixture
def blocked_training(server, monkeypatch):
    """Training requests of the served model wait inside the worker until ``release`` is set."""
    training = server.service.hosts[MODEL].training
    started, release = threading.Event(), threading.Event()
    original = training.forward_backward

    def forward_backward(*args, **kwargs):
        started.set()
        if not release.wait(TIMEOUT):
            raise TimeoutError("the test never released the training request")
        return original(*args, **kwargs)

    monkeypatch.setattr(training, "forward_backward", forward_backward)
    yield started, release
    release.set()


def test_32_concurrent_samples_complete_during_a_forward_backward(service_client, blocked_training):
    types = _types()
    started, release = blocked_training
    tc = service_client.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result(TIMEOUT)
    sampler = tc.save_weights_and_get_sampling_client().result(TIMEOUT)
    fb = tc.forward_backward(DATA, "cross_entropy")
    assert started.wait(TIMEOUT)  # the forward_backward is running (held inside the worker)
    futures = [sampler.sample(types.ModelInput.from_ints([1, 40 + i % 20]), 1,
                              types.SamplingParams(max_tokens=12, seed=i)) for i in range(32)]
    results = [f.result(TIMEOUT) for f in futures]  # all 32 come back while the training request is still held
    assert not fb.future().done()
    for r in results:
        (s,) = r.sequences
        assert 1 <= len(s.tokens) <= 12 and len(s.logprobs) == len(s.tokens)
        assert all(math.isfinite(x) and x <= 0 for x in s.logprobs)
    release.set()
    assert fb.result(TIMEOUT).metrics["loss:sum"] > 0


def test_pending_futures_answer_try_again_then_the_same_result(server, service_client, blocked_training,
                                                               monkeypatch):
    started, release = blocked_training
    monkeypatch.setattr(server.service.futures, "poll_seconds", 0.05)
    tc = service_client.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result(TIMEOUT)
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.types import ForwardBackwardInput, ForwardBackwardRequest

    req = ForwardBackwardRequest(forward_backward_input=ForwardBackwardInput(data=DATA, loss_fn="cross_entropy"),
                                 model_id=tc.model_id, seq_id=1000)
    body = forward_backward_request_to_proto(req).SerializeToString()
    url = f"{server.base_url}/api/v1"
    proto = {"content-type": "application/x-protobuf"}
    first = httpx.post(f"{url}/forward_backward", content=body, headers=proto).json()
    assert started.wait(TIMEOUT)
    retried = httpx.post(f"{url}/forward_backward", content=body, headers=proto).json()
    assert retried["request_id"] == first["request_id"]  # the same submission: answered once, not run twice
    poll = httpx.post(f"{url}/retrieve_future", json={"request_id": first["request_id"]}, timeout=TIMEOUT)
    assert poll.json() == {"type": "try_again", "request_id": first["request_id"], "queue_state": "active"}
    release.set()
    monkeypatch.setattr(server.service.futures, "poll_seconds", TIMEOUT)
    answers = [httpx.post(f"{url}/retrieve_future", json={"request_id": first["request_id"]}, timeout=TIMEOUT)
               for _ in range(2)]
    assert all(a.headers["content-type"] == "application/x-protobuf" for a in answers)
    assert answers[0].content == answers[1].content and len(answers[0].content) > 0
    from tinker.proto.response_conv import deserialize_forward_backward_output

    out = deserialize_forward_backward_output(answers[0].content)
    assert len(out.loss_fn_outputs) == 2 and out.metrics["loss:sum"] > 0


def test_retried_submissions_run_once(server, service_client):
    types = _types()
    tc = service_client.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result(TIMEOUT)
    tc.forward_backward(DATA, "cross_entropy").result(TIMEOUT)
    url = f"{server.base_url}/api/v1"
    step = {"model_id": tc.model_id, "seq_id": 5000, "optim_params": types.AdamParams(learning_rate=1e-3).model_dump()}
    ids = {httpx.post(f"{url}/optim_step", json=step).json()["request_id"] for _ in range(3)}
    assert len(ids) == 1
    (rid,) = ids
    res = httpx.post(f"{url}/retrieve_future", json={"request_id": rid}, timeout=TIMEOUT).json()
    assert res["metrics"]["grad_norm"] > 0
    assert server.service.hosts[MODEL].training._adapters[tc.model_id].steps == 1
    sampler = tc.save_weights_and_get_sampling_client().result(TIMEOUT)
    stats = server.service.hosts[MODEL].sampler.stats
    before = stats["requests"]
    sample = {"sampling_session_id": sampler._sampling_session_id, "seq_id": 77, "num_samples": 3,
              "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 40]}]},
              "sampling_params": {"max_tokens": 4}}
    answers = [httpx.post(f"{url}/asample", json=sample).json() for _ in range(2)]
    assert answers[0] == answers[1] and len(answers[0]["sample_sequence_ids"]) == 3
    res = httpx.post(f"{url}/retrieve_future", json={"request_id": answers[0]["request_id"]}, timeout=TIMEOUT)
    assert res.status_code == 200 and stats["requests"] == before + 1


def test_a_failed_request_raises_request_failed_and_the_server_keeps_serving(server, service_client, monkeypatch):
    import tinker

    tc = service_client.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result(TIMEOUT)
    training = server.service.hosts[MODEL].training
    original = training.forward_backward

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(training, "forward_backward", broken)
    with pytest.raises(tinker.RequestFailedError, match="RuntimeError: injected failure") as info:
        tc.forward_backward(DATA, "cross_entropy").result(TIMEOUT)
    assert info.value.category == tinker.types.RequestErrorCategory.Server
    monkeypatch.setattr(training, "forward_backward", original)
    assert tc.forward_backward(DATA, "cross_entropy").result(TIMEOUT).metrics["loss:sum"] > 0


def test_training_requests_run_on_one_thread_and_return_their_memory_when_idle(server, service_client, monkeypatch):
    """Every training request of a model runs on the same worker thread (one allocator heap for the activations,
    not one per pool thread). The heap's free pages go back to the OS (``malloc_trim``, on that thread) once no
    request has come for ``trim_idle_s``: not between requests that follow each other within it (each would fault
    the freed pages in again), after each one with 0."""
    import rlblocks.tinker.service as service_mod

    service = server.service
    training = service.hosts[MODEL].training
    threads, trims = [], []
    trimmed = threading.Semaphore(0)
    original = training.forward_backward

    def forward_backward(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return original(*args, **kwargs)

    def trim():
        trims.append(threading.current_thread().name)
        trimmed.release()

    monkeypatch.setattr(training, "forward_backward", forward_backward)
    monkeypatch.setattr(service_mod, "_return_free_memory", trim)
    monkeypatch.setattr(service, "trim_idle_s", 0.0)
    tc = service_client.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result(TIMEOUT)
    for _ in range(3):
        tc.forward_backward(DATA, "cross_entropy").result(TIMEOUT)
    assert len(threads) == 3 and len(set(threads)) == 1 and threads[0].startswith("tinker-train")
    for _ in range(4):  # create_model and each forward_backward, each followed by an idle queue
        assert trimmed.acquire(timeout=TIMEOUT)
    assert set(trims) == set(threads)
    trims.clear()
    monkeypatch.setattr(service, "trim_idle_s", 3600.0)
    for _ in range(3):
        tc.forward_backward(DATA, "cross_entropy").result(TIMEOUT)
    assert trims == []  # the requests came within the idle time: the worker kept its pages
    assert len(threads) == 6 and len(set(threads)) == 1
