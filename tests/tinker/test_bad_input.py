"""Bad input gets a 4xx naming the field, the SDK raises a clear error (never hangs), and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest
from tinker_testlib import MODEL

TIMEOUT = 60


def _types():
    from tinker import types

    return types


def datum(tokens, **inputs):
    types = _types()
    return types.Datum(model_input=types.ModelInput.from_ints(list(tokens[:-1])),
                       loss_fn_inputs={"target_tokens": list(tokens[1:]), **inputs})


@pytest.fixture(scope="module")
def tc(service_client):
    return service_client.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result(TIMEOUT)


def _post(server, route, **kw):
    return httpx.post(f"{server.base_url}/api/v1/{route}", timeout=TIMEOUT, **kw)


def test_malformed_oversized_and_wrong_type_bodies(server):
    r = _post(server, "create_session", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "body: not valid JSON" in r.json()["detail"]
    r = _post(server, "create_model", json={"base_model": MODEL})
    assert r.status_code == 400 and "session_id: Field required" in r.json()["detail"]
    big = b"x" * (9 << 20)  # the test server's limit is 8 MiB
    r = _post(server, "asample", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "exceeds the limit" in r.json()["detail"]
    r = _post(server, "asample", content=(big[i:i + (1 << 20)] for i in range(0, len(big), 1 << 20)),
              headers={"content-type": "application/json"})  # chunked: no Content-Length to refuse it early
    assert r.status_code == 413
    r = _post(server, "forward_backward", json={"model_id": "x"})
    assert r.status_code == 415 and "Content-Type: expected application/x-protobuf" in r.json()["detail"]
    proto = {"content-type": "application/x-protobuf"}
    r = _post(server, "forward_backward", content=b"\xff\x00garbage", headers=proto)
    assert r.status_code == 400 and "not a protobuf ForwardBackwardRequest" in r.json()["detail"]
    r = _post(server, "retrieve_future", json={"request_id": "nope"})
    assert r.status_code == 404 and "request_id: unknown or expired request 'nope'" in r.json()["detail"]


def test_unknown_and_refused_routes_answer_404_with_the_reason(server, tc):
    import tinker

    r = httpx.get(f"{server.base_url}/api/v1/no_such_route")
    assert r.status_code == 404 and "unknown route" in r.json()["detail"]
    r = _post(server, "create_custom_loss", json={})
    assert r.status_code == 404 and "server-side custom losses are not served" in r.json()["detail"]
    with pytest.raises(tinker.NotFoundError, match="external"):
        tc.save_weights_external("exported").result(TIMEOUT)


def test_unknown_model_ids_name_the_field(server, service_client):
    import tinker

    with pytest.raises(tinker.NotFoundError, match="base_model: unknown model 'no/such-model'"):
        service_client.create_lora_training_client(base_model="no/such-model").result(TIMEOUT)
    r = _post(server, "get_info", json={"model_id": "nope:train:0"})
    assert r.status_code == 404 and "model_id: unknown model 'nope:train:0'" in r.json()["detail"]
    with pytest.raises(tinker.NotFoundError, match="model_path: no checkpoint"):
        service_client.create_sampling_client(model_path="tinker://nope:train:0/weights/x").result(TIMEOUT)
    with pytest.raises(tinker.BadRequestError, match=r"lora_config\.rank"):
        service_client.create_lora_training_client(base_model=MODEL, rank=0).result(TIMEOUT)


def test_training_bad_inputs_raise_clear_sdk_errors_and_the_client_keeps_working(tc):
    import tinker

    types = _types()
    seq = [1, 40, 41, 42, 2]
    with pytest.raises(tinker.BadRequestError, match=r"data\[0\]\.loss_fn_inputs\['weights'\]: expected shape \[4\]"):
        tc.forward_backward([datum(seq, weights=[1.0] * 3)], "cross_entropy").result(TIMEOUT)
    with pytest.raises(tinker.BadRequestError, match="loss_fn: expected one of"):
        tc.forward_backward([datum(seq, weights=[1.0] * 4)], "no_such_loss").result(TIMEOUT)
    with pytest.raises(tinker.BadRequestError, match="'stable_reinforce' is not supported"):
        tc.forward_backward([datum(seq, logprobs=[0.0] * 4, advantages=[1.0] * 4)], "stable_reinforce").result(TIMEOUT)
    with pytest.raises(tinker.BadRequestError, match=r"loss_fn_config\['clip_high_threshold'\]: expected a ratio"):
        tc.forward_backward([datum(seq, logprobs=[0.0] * 4, advantages=[1.0] * 4)], "ppo",
                            {"clip_high_threshold": 0.5}).result(TIMEOUT)
    with pytest.raises(tinker.BadRequestError, match=r"model_input: token ids must be in \[0, 128\)"):
        tc.forward([datum([1, 500, 2], weights=[1.0, 1.0])], "cross_entropy").result(TIMEOUT)
    with pytest.raises(tinker.BadRequestError, match=r"optim_params\.learning_rate: expected a value >= 0\.0"):
        tc.optim_step(types.AdamParams(learning_rate=-1.0)).result(TIMEOUT)
    with pytest.raises(tinker.BadRequestError, match=r"optim_params\.beta2"):
        tc.optim_step(types.AdamParams(beta2=1.5)).result(TIMEOUT)
    with pytest.raises(tinker.BadRequestError, match="path: expected a checkpoint name"):
        tc.save_state("no/slashes").result(TIMEOUT)
    # every refusal changed nothing and the same client keeps training
    out = tc.forward_backward([datum(seq, weights=[1.0] * 4)], "cross_entropy")
    step = tc.optim_step(types.AdamParams(learning_rate=1e-3))
    assert out.result(TIMEOUT).metrics["loss:sum"] > 0 and step.result(TIMEOUT).metrics["grad_norm"] > 0


def test_sampling_bad_inputs(service_client):
    import tinker

    types = _types()
    sc = service_client.create_sampling_client(base_model=MODEL).result(TIMEOUT)
    with pytest.raises(tinker.BadRequestError, match=r"prompt: token ids must be in \[0, 128\)"):
        sc.sample(types.ModelInput.from_ints([1, 999]), 1, types.SamplingParams(max_tokens=2)).result(TIMEOUT)
    with pytest.raises(tinker.BadRequestError, match=r"sampling_params\.temperature"):
        sc.sample(types.ModelInput.from_ints([1, 9]), 1, types.SamplingParams(max_tokens=2,
                                                                                temperature=-1.0)).result(TIMEOUT)
    with pytest.raises(tinker.BadRequestError, match="leave no room to sample"):
        sc.sample(types.ModelInput.from_ints([5] * 512), 1, types.SamplingParams(max_tokens=2)).result(TIMEOUT)
    with pytest.raises(tinker.BadRequestError, match="record_stability_info: not supported"):
        rs = service_client.create_sampling_client(base_model=MODEL, record_stability_info=True).result(TIMEOUT)
        rs.sample(types.ModelInput.from_ints([1, 9]), 1, types.SamplingParams(max_tokens=2)).result(TIMEOUT)
    ok = sc.sample(types.ModelInput.from_ints([1, 9]), 2, types.SamplingParams(max_tokens=3)).result(TIMEOUT)
    assert len(ok.sequences) == 2


def test_server_still_healthy(server):
    assert httpx.get(f"{server.base_url}/api/v1/healthz").json() == {"status": "ok"}
    stats = httpx.get(f"{server.base_url}/api/v1/stats").json()
    assert stats["futures"]["submitted"] > 0


def test_every_route_in_the_sdk_is_served_or_refused_with_its_reason(server):
    """Every ``/api/v1`` path written in the SDK's source (its REST resources and clients) reaches a route here: a
    served one, or a refusal that gives the reason; never the generic unknown-route 404."""
    import re
    from pathlib import Path

    import tinker

    root = Path(tinker.__file__).parent
    paths = set()
    for f in [*root.glob("resources/*.py"), *root.glob("lib/**/*.py")]:
        if not f.name.endswith("_test.py"):
            paths |= set(re.findall(r"""["'](/api/v1/[A-Za-z0-9_/{}.-]+)["']""", f.read_text()))
    assert len(paths) > 25, sorted(paths)
    for path in sorted(paths):
        url = server.base_url + re.sub(r"\{[^}]+\}", "x", path)
        for method in ("GET", "POST"):
            r = httpx.request(method, url, json={}, timeout=TIMEOUT)
            detail = r.json().get("detail", "") if r.headers.get("content-type", "").startswith("application/json") \
                and isinstance(r.json(), dict) else ""
            assert "unknown route" not in str(detail), (method, path, detail)


def test_server_flags_name_the_bad_value(tmp_path, capsys):
    from rlblocks.errors import ArgumentError
    from rlblocks.tinker.__main__ import parse_args
    from rlblocks.tinker.service import TinkerService

    base = ["--model", f"m={tmp_path}"]
    for flag in ("--max-batch-tokens", "--max-num-samples"):
        with pytest.raises(SystemExit):
            parse_args([*base, flag, "0"])
        assert f"{flag}: expected an integer >= 1, got 0" in capsys.readouterr().err
    args = parse_args([*base, "--no-prefix-share", "--max-batch-tokens", "4096"])
    assert (args.prefix_share, args.max_batch_tokens) == (False, 4096)
    assert parse_args(base).prefix_share is True
    with pytest.raises(ArgumentError, match=r"--max-batch-tokens: expected an integer >= 1, got 0"):
        TinkerService({"m": str(tmp_path)}, state_dir=str(tmp_path / "s"), max_batch_tokens=0)
    for bad in (-1.0, float("nan"), float("inf"), "5", True):
        with pytest.raises(ArgumentError, match=r"--trim-idle-s: expected a finite number of seconds >= 0, got "):
            TinkerService({"m": str(tmp_path)}, state_dir=str(tmp_path / "s"), trim_idle_s=bad)
    with pytest.raises(SystemExit):
        parse_args([*base, "--trim-idle-s", "-1"])
    assert "--trim-idle-s: expected a finite number of seconds >= 0, got -1.0" in capsys.readouterr().err
    assert parse_args(base).trim_idle_s == 300.0 and parse_args([*base, "--trim-idle-s", "0"]).trim_idle_s == 0.0
