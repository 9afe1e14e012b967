"""Inputs an attacker or a careless loop sends: non-finite advantages and gradients, sample requests too large to
serve, a LoRA rank of the wrong JSON type. Each is refused with a message naming the field or the request, through
the official SDK where the SDK can send it (raw HTTP otherwise); the adapter stays finite and unchanged."""

from __future__ import annotations

import math

import httpx
import pytest
import torch
from tinker_testlib import MODEL

TIMEOUT = 120
SEQS = [[1, 40, 41, 42, 43, 44, 2], [1, 50, 51, 52, 2], [1, 60, 61, 62, 63, 2]]


def _types():
    from tinker import types

    return types


def rl_datum(tokens, advantage: float, logprob: float = -1.0):
    types = _types()
    n = len(tokens) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(list(tokens[:-1])),
                       loss_fn_inputs={"target_tokens": list(tokens[1:]), "logprobs": [logprob] * n,
                                       "advantages": [advantage] * n})


@pytest.fixture(scope="module")
def tc(service_client):
    """A training client that has taken one normal step (so its Adam moments are not empty)."""
    types = _types()
    tc = service_client.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result(TIMEOUT)
    tc.forward_backward([rl_datum(s, 1.0) for s in SEQS], "importance_sampling")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(TIMEOUT)
    return tc


def _adapter(server, tc):
    training = server.service.hosts[MODEL].training
    ad = training._adapters[tc.model_id]
    return ({k: v.detach().clone() for k, v in ad.params.items()}, training.optimizer_state(tc.model_id), ad.steps)


def _forward(tc):
    out = tc.forward([rl_datum(s, 0.0) for s in SEQS], "importance_sampling").result(TIMEOUT)
    return [o["logprobs"].to_torch() for o in out.loss_fn_outputs]


def test_a_nan_advantage_is_refused_naming_every_datum_and_nothing_accumulates(server, tc):
    import tinker

    types = _types()
    before, _, steps = _adapter(server, tc)
    data = [rl_datum(SEQS[0], 1.0), rl_datum(SEQS[1], math.nan), rl_datum(SEQS[2], 1.0, logprob=-math.inf)]
    with pytest.raises(tinker.BadRequestError) as e:
        tc.forward_backward(data, "importance_sampling").result(TIMEOUT)
    msg = str(e.value)
    assert "data[1].loss_fn_inputs['advantages'][0]: expected a finite number, got nan" in msg
    assert "2 of 3 datums hold non-finite inputs" in msg and "data[2].logprobs[0]=-inf" in msg
    # nothing was accumulated: the next step has no gradient, moves nothing and reports a number, not null
    step = tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(TIMEOUT)
    assert step.metrics == {"grad_norm": 0.0}
    after, _, steps_after = _adapter(server, tc)
    assert steps_after == steps and all(torch.equal(before[k], after[k]) for k in before)


def test_non_finite_gradients_are_refused_and_leave_adapter_and_adam_unchanged(server, tc):
    """Finite inputs whose gradient overflows (advantages of 3e38): the step is refused with an error the SDK
    surfaces (not a pydantic validation error), the adapter and Adam moments are bit for bit what they were, the
    forward after equals the forward before, and the client keeps training."""
    import tinker

    types = _types()
    lp_before = _forward(tc)
    before, opt_before, steps = _adapter(server, tc)
    fb = tc.forward_backward([rl_datum(s, 3e38) for s in SEQS], "importance_sampling").result(TIMEOUT)
    assert not math.isfinite(fb.metrics["loss:sum"])  # a number (inf), never null
    with pytest.raises(tinker.RequestFailedError) as e:
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(TIMEOUT)
    msg = str(e.value)
    assert f"optim_step of model {tc.model_id!r}" in msg and "refused" in msg and "NaN or inf" in msg
    assert "the adapter, its Adam moments and its step count" in msg and "ValidationError" not in msg
    after, opt_after, steps_after = _adapter(server, tc)
    assert steps_after == steps
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert opt_before.keys() == opt_after.keys() and all(torch.equal(opt_before[k], opt_after[k]) for k in opt_before)
    assert all(bool(torch.isfinite(v).all()) for v in after.values())
    for x, y in zip(lp_before, _forward(tc)):
        assert torch.equal(x, y)
    # the refused gradients were discarded: a normal step afterwards trains from finite gradients only
    tc.forward_backward([rl_datum(s, 1.0) for s in SEQS], "importance_sampling")
    step = tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(TIMEOUT)
    assert 0 < step.metrics["grad_norm"] < 1e6
    assert all(bool(torch.isfinite(v).all()) for v in _adapter(server, tc)[0].values())


def test_sample_requests_over_the_server_caps_are_refused(service_client, server):
    import tinker

    types = _types()
    sc = service_client.create_sampling_client(base_model=MODEL).result(TIMEOUT)
    prompt = types.ModelInput.from_ints([1, 40])
    with pytest.raises(tinker.BadRequestError, match=r"num_samples: 257 exceeds this server's limit of 256 samples "
                                                      r"per request \(--max-num-samples\)"):
        sc.sample(prompt, 257, types.SamplingParams(max_tokens=1)).result(TIMEOUT)
    with pytest.raises(tinker.BadRequestError, match=r"200 × \(2 \+ 400\) = 80400 tokens exceeds this server's limit "
                                                      r"of 65536 tokens per sample request \(--max-request-tokens\)"):
        sc.sample(prompt, 200, types.SamplingParams(max_tokens=400)).result(TIMEOUT)
    # without max_tokens a sample may run to the context length (512), which counts against the cap too
    with pytest.raises(tinker.BadRequestError, match=r"--max-request-tokens"):
        sc.sample(prompt, 200, types.SamplingParams()).result(TIMEOUT)
    caps = httpx.get(f"{server.base_url}/api/v1/get_server_capabilities").json()
    assert caps["limits"] == {"max_num_samples": 256, "max_request_tokens": 65536}
    assert len(sc.sample(prompt, 4, types.SamplingParams(max_tokens=2)).result(TIMEOUT).sequences) == 4


@pytest.mark.parametrize("rank,expected", [(True, "expected an integer, got true (bool)"),
                                           (4.0, "expected an integer, got 4.0 (float)"),
                                           ("4", 'expected an integer, got "4" (str)'),
                                           (4.5, "Input should be a valid integer")])
def test_a_lora_rank_that_is_not_an_integer_is_refused(server, rank, expected):
    """The SDK's own LoraConfig would coerce these client-side, so they are sent as raw JSON."""
    url = f"{server.base_url}/api/v1"
    session = {"tags": [], "user_metadata": None, "sdk_version": "0.38"}
    sid = httpx.post(f"{url}/create_session", json=session, timeout=TIMEOUT).json()["session_id"]
    body = {"session_id": sid, "model_seq_id": 0, "base_model": MODEL, "lora_config": {"rank": rank}}
    r = httpx.post(f"{url}/create_model", json=body, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["detail"].startswith("lora_config.rank: ") and expected in r.json()[
        "detail"], r.text
    body["lora_config"]["rank"] = 4  # the same request with an integer rank is served
    assert "request_id" in httpx.post(f"{url}/create_model", json=body, timeout=TIMEOUT).json()
