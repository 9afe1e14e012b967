"""SGLangEngine against SGLang 0.5.23: contract tests against SGLang's own request/response types and
sampling-parameter checks (vendored in ``sglang_0_5_23``), and behaviour tests against ``fake_sglang``, a fake server
that enforces what the real one enforces (see its docstring for the source line of each rule). A machine without
registry access cannot install SGLang either, so these are the check; ``test_real_sglang_server_*`` runs only with
RLBLOCKS_SGLANG_URL set."""

import asyncio
import base64
import io
import json
import os
import pickle
import urllib.request

import msgspec
import pytest
import torch
from fake_sglang import CONTROL_TYPES, EOS, VOCAB, FakeSGLang, validate_control, validate_generate
from sglang_0_5_23 import _support, api_types, io_struct

from rlblocks.errors import ArgumentError, EngineError, SGLangError, WeightUpdateError
from rlblocks.rollout import GenerationRequest, SamplingParams, resumable_generate
from rlblocks.rollout.engines import SGLangEngine
from rlblocks.rollout.engines.sglang_weights import serialize_named_tensors
from rlblocks.rollout.types import RolloutEngine


def run(coro, timeout=30.0):
    async def main():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(main())


def raw_post(url, path, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


@pytest.fixture
def fake():
    with FakeSGLang() as f:
        yield f


def cpu_payloads(eng):
    """Serialize CPU tensors (same-host shared memory) so that the update sequence can run on a CPU machine; the
    engine itself refuses CPU tensors, which an unrelated server process cannot open."""

    def payloads(items):
        return [serialize_named_tensors(items, device_uuid=False) for _ in range(eng.tp_size)], [t for _, t in items]

    eng._tensor_payloads = payloads
    return eng


async def wait_tokens(fake, prefix, k):
    while (fake.num_tokens(prefix) or 0) < k:
        await asyncio.sleep(0.002)


# ---------------------------------------------------------------- contract: what the client sends
SAMPLINGS = [
    SamplingParams(temperature=0.0, max_new_tokens=4),
    SamplingParams(temperature=0.7, max_new_tokens=8, stop_token_ids=(50, 2), seed=11),
    SamplingParams(temperature=1.3, top_k=5, top_p=0.9, max_new_tokens=1),
    SamplingParams(temperature=1.0, top_p=0.5, max_new_tokens=300, seed=-3),
]


@pytest.mark.parametrize("sp", SAMPLINGS)
def test_generate_payload_passes_sglangs_contract_gate_and_sampling_checks(sp):
    payload = SGLangEngine("http://127.0.0.1:1").build_generate_payload(GenerationRequest("a", [1, 40], sp), rid="w")
    parsed = api_types.GenerateRequest.from_json_value(payload)  # the gate /generate runs on the body
    assert parsed.input_ids == [1, 40] and parsed.rid == "w" and parsed.return_logprob is True
    assert set(payload) <= set(api_types.GenerateRequest.__struct_fields__)
    assert set(payload["sampling_params"]) <= set(api_types.SamplingParams.__struct_fields__)
    validated = validate_generate(payload)  # SGLang's SamplingParams(**...).verify(vocab) and normalize()
    assert validated.max_new_tokens == sp.max_new_tokens
    assert validated.stop_token_ids == (set(sp.stop_token_ids) or None)
    # ignore_eos turns off stop_token_ids on SGLang: only a request without stop ids may set it
    assert validated.ignore_eos is (not sp.stop_token_ids)
    assert payload["sampling_params"].get("sampling_seed") == sp.seed
    if sp.temperature == 0:
        assert validated.top_k == 1  # SGLang's greedy
    else:
        assert validated.temperature == sp.temperature
    assert payload.get("return_sampling_mask", False) is (sp.temperature > 0 and (sp.top_k > 0 or sp.top_p < 1))


def test_contract_gate_refuses_what_the_client_must_never_send():
    good = SGLangEngine("http://127.0.0.1:1").build_generate_payload(GenerationRequest("a", [1], SamplingParams()))
    bad_sp = dict(good, sampling_params={**good["sampling_params"], "ignore_eos_tokens": True})
    with pytest.raises(api_types.JsonContractError, match="unknown field `ignore_eos_tokens`"):
        api_types.GenerateRequest.from_json_value(bad_sp)
    with pytest.raises(api_types.JsonContractError):
        api_types.GenerateRequest.from_json_value(dict(good, input_ids="12"))
    with pytest.raises(ValueError, match="top_p"):
        validate_generate(dict(good, sampling_params={**good["sampling_params"], "top_p": 0.0}))


def test_every_control_payload_is_a_valid_sglang_request_type(fake):
    """Every control call the client makes goes through the fake, which parses it as FastAPI parses SGLang's
    io_struct types and refuses unknown keys; here each path is also checked by name against the recorded bodies."""
    fake.tp_size = 2
    eng = cpu_payloads(SGLangEngine(fake.url, tp_size=2))

    async def main():
        await eng.generate(GenerationRequest("g", [1, 10], SamplingParams(max_new_tokens=3)))
        t = asyncio.ensure_future(eng.generate(GenerationRequest("h", [1, 10], SamplingParams(max_new_tokens=500))))
        await wait_tokens(fake, "h@", 2)
        await eng.abort(["h"])
        await t
        await eng.pause("keep")
        await eng.resume()
        await eng.pause("abort")
        await eng.resume()
        await eng.update_weights([("w", torch.ones(2))], version=1)
        await eng.update_weights_from_disk("/ckpt/step2", version=2)
        await eng.init_weights_update_group("10.0.0.1", 29500, 1, 2)
        await eng.update_weights_from_distributed(["w"], [torch.bfloat16], [[2]], version=3)
        await eng.sleep(2)
        await eng.wake()
        await eng.update_weights([("w", torch.ones(2))], version=4)
        await eng.flush_cache()
        return await eng.refresh_version()

    assert run(main()) == 4
    sent = {p for m, p, _ in fake.requests if m == "POST"} - {"/generate", "/flush_cache"}
    assert sent == set(CONTROL_TYPES)  # every control type the client speaks was exercised
    for m, path, body in fake.requests:
        if m == "POST" and path not in ("/generate", "/flush_cache"):
            validate_control(path, body)  # raises if SGLang's type refuses it
    tensor_body = fake.posts("/update_weights_from_tensor")[0]
    assert len(tensor_body["serialized_named_tensors"]) == 2  # one payload per TP rank
    assert fake.posts("/init_weights_update_group")[0]["master_address"] == "10.0.0.1"  # SGLang's field name


def test_response_fields_the_client_reads_exist_in_sglangs_response_types():
    """The names the client reads, against SGLang's own types (and, for the two fields outside the generated
    types, against the source lines that produce them)."""
    meta = set(api_types.GenerateMetaInfo.__struct_fields__)
    assert {"finish_reason", "output_token_logprobs", "weight_version", "weight_versions", "prompt_tokens",
            "cached_tokens"} <= meta
    assert "output_ids" in api_types.GenerateResponse.__struct_fields__
    assert {"version", "start", "end"} <= set(api_types.WeightVersionSpan.__struct_fields__)
    assert list(api_types.LogprobEntry.__struct_fields__) == ["logprob", "token_id", "text"]  # [lp, id, text]
    assert "weight_version" in api_types.GetModelInfoResponse.__struct_fields__
    assert "matched" in api_types.FinishStop.__struct_fields__  # the token a stop matched
    for cls in (io_struct.UpdateWeightsFromTensorReqOutput, io_struct.BeginWeightUpdateReqOutput,
                io_struct.EndWeightUpdateReqOutput, io_struct.InitWeightsUpdateGroupReqOutput):
        assert {"success", "message"} <= {f.name for f in msgspec.structs.fields(cls)}
    lines = _support.SOURCE_LINES
    assert any("output_token_sampling_logprobs" in x for x in lines["sglang/srt/managers/tokenizer_manager.py"])
    assert any("already open" in x for x in lines["sglang/srt/managers/scheduler_components/weight_updater.py"])
    flags = "".join(lines["sglang/srt/arg_groups/fields/exec_.py"])
    for flag in ("enable_memory_saver", "enable_weights_cpu_backup", "enable_deterministic_inference"):
        assert flag in flags
    tags = "".join(lines["sglang/srt/constants.py"])
    for tag in ("kv_cache", "weights", "cuda_graph"):
        assert f'"{tag}"' in tags


def test_parse_reads_spans_and_refuses_inconsistent_responses():
    eng = SGLangEngine("http://127.0.0.1:1", version=5)
    req = GenerationRequest("a", [1], SamplingParams(max_new_tokens=3))
    meta = {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None]],
            "weight_version": "6", "weight_versions": [{"version": "default", "start": 0, "end": 1},
                                                       {"version": "6", "start": 1, "end": 2}]}
    body = {"text": "", "output_ids": [7, 8], "meta_info": meta}
    api_types.GenerateResponse.from_json_value(body)  # a body of the real shape
    gen = eng.parse_generate_response(req, body)
    assert gen.output_versions == [5, 6]  # "default" (the server's initial label) -> the constructed version
    with pytest.raises(SGLangError, match="disagree"):
        eng.parse_generate_response(req, {"output_ids": [8, 8], "meta_info": meta})
    with pytest.raises(SGLangError, match="cover 1 of the 2"):
        eng.parse_generate_response(req, {"meta_info": {**meta, "weight_versions": meta["weight_versions"][:1]}})
    with pytest.raises(SGLangError, match="finish_reason"):
        eng.parse_generate_response(req, {"meta_info": {**meta, "finish_reason": {"type": "weird"}}})
    with pytest.raises(SGLangError, match="meta_info"):
        eng.parse_generate_response(req, {"text": "x"})
    with pytest.raises(ArgumentError, match="base_url"):
        SGLangEngine("localhost:30000")


# ---------------------------------------------------------------- the stricter fake: stops and ignore_eos
def test_fake_skips_stop_ids_under_ignore_eos_and_stops_on_eos_without_it(fake):
    base = SGLangEngine(fake.url).build_generate_payload(GenerationRequest("x", [1, 60], SamplingParams()), rid="r1")
    body = dict(base, sampling_params={**base["sampling_params"], "max_new_tokens": 8, "stop_token_ids": [63],
                                        "ignore_eos": True})
    status, out = raw_post(fake.url, "/generate", body)
    assert status == 200 and out["output_ids"] == [61, 62, 63, 0, 1, 2, 3, 4]  # not even 63 stopped it
    body = dict(body, rid="r2", sampling_params={**body["sampling_params"], "stop_token_ids": [5],
                                                   "ignore_eos": False})
    status, out = raw_post(fake.url, "/generate", body)
    assert out["output_ids"] == [61, 62, 63, 0, 1, EOS] and out["meta_info"]["finish_reason"]["matched"] == EOS


def test_generation_ends_on_its_stop_id_and_continues_past_the_models_eos(fake):
    eng = SGLangEngine(fake.url)

    def gen(rid, last, n, stops=()):
        return eng.generate(GenerationRequest(rid, [1, last], SamplingParams(max_new_tokens=n, stop_token_ids=stops)))

    async def main():
        stop = await gen("s", 40, 20, (44,))
        # 61, 62, 63, 0, 1, 2 (the model's EOS: not a stop id here), 3, 4, 5 (the stop id)
        cont = await gen("e", 60, 20, (5,))
        free = await gen("f", 60, 9)
        eos_stop = await gen("q", 60, 20, (EOS, 5))
        at_budget = await gen("b", 60, 6, (5,))
        return stop, cont, free, eos_stop, at_budget

    stop, cont, free, eos_stop, at_budget = run(main())
    assert stop.output_ids == [41, 42, 43, 44] and stop.finish_reason == "stop"
    assert cont.output_ids == [61, 62, 63, 0, 1, 2, 3, 4, 5] and cont.finish_reason == "stop"
    assert cont.output_ids == free.output_ids and cont.output_logprobs == free.output_logprobs  # as ignore_eos would
    assert free.finish_reason == "length"
    assert eos_stop.output_ids == [61, 62, 63, 0, 1, 2] and eos_stop.finish_reason == "stop"
    assert at_budget.output_ids == [61, 62, 63, 0, 1, 2] and at_budget.finish_reason == "length"
    assert eng.stats()["eos_continuations"] == 1 and eng.stats()["requests"] == 5
    assert all(b["sampling_params"]["ignore_eos"] is False for b in fake.posts("/generate")[:2])
    free_body = next(b for b in fake.posts("/generate") if b["rid"].startswith("f@"))
    assert free_body["sampling_params"]["ignore_eos"] is True  # no stop ids


def test_sampling_mask_gives_processed_logprobs_with_top_k_top_p(fake):
    eng = SGLangEngine(fake.url)
    sp = SamplingParams(temperature=0.8, top_k=5, max_new_tokens=3)
    gen = run(eng.generate(GenerationRequest("k", [1, 10], sp)))
    raw = run(SGLangEngine(fake.url, allow_unprocessed_logprobs=True).generate(GenerationRequest("u", [1, 10], sp)))
    assert fake.posts("/generate")[0]["return_sampling_mask"] is True and "return_sampling_mask" not in fake.posts(
        "/generate")[1]
    assert [round(a - b, 6) for a, b in zip(gen.output_logprobs, raw.output_logprobs)] == [-0.01] * 3


def test_seeded_requests_need_deterministic_inference(fake):
    sp = SamplingParams(temperature=1.0, max_new_tokens=2, seed=3)
    with pytest.raises(ArgumentError, match="enable-deterministic-inference"):
        run(SGLangEngine(fake.url).generate(GenerationRequest("s", [1, 2], sp)))
    fake.deterministic = True
    gen = run(SGLangEngine(fake.url).generate(GenerationRequest("s", [1, 2], sp)))
    assert gen.num_output_tokens == 2 and fake.posts("/generate")[-1]["sampling_params"]["sampling_seed"] == 3


# ---------------------------------------------------------------- ids: prefix abort, duplicates
def test_prefix_colliding_abort_stops_only_the_named_request(fake):
    eng = SGLangEngine(fake.url)
    long = SamplingParams(max_new_tokens=400)

    async def main():
        t1 = asyncio.ensure_future(eng.generate(GenerationRequest("uid/1", [1, 3], long)))
        short = SamplingParams(max_new_tokens=60)
        t10 = asyncio.ensure_future(eng.generate(GenerationRequest("uid/10", [1, 3], short)))
        await wait_tokens(fake, "uid/1@", 3)
        await wait_tokens(fake, "uid/10@", 3)
        assert await eng.abort(["uid/1", "nope"]) == ["uid/1"]
        return await t1, await t10

    g1, g10 = run(main())
    assert g1.finish_reason == "abort" and 3 <= g1.num_output_tokens < 400
    assert g10.finish_reason == "length" and g10.num_output_tokens == 60
    assert all(r.startswith("uid/1@") for r in fake.aborted)
    # the server itself matches by prefix: a raw abort of a short id takes the longer one with it
    with FakeSGLang() as other:
        e2 = SGLangEngine(other.url)

        async def raw():
            a = asyncio.ensure_future(e2.generate(GenerationRequest("p", [1, 3], long)))
            await wait_tokens(other, "p@", 2)
            wire = next(iter(other.rid_to_req))
            b_body = e2.build_generate_payload(GenerationRequest("b", [1, 3], long), rid=wire + "0")
            b = asyncio.get_running_loop().run_in_executor(None, raw_post, other.url, "/generate", b_body)
            await wait_tokens(other, wire + "0", 2)
            raw_post(other.url, "/abort_request", {"rid": wire, "abort_all": False})
            return await a, await b

        a, (_, b) = run(raw())
        assert a.finish_reason == "abort" and b["meta_info"]["finish_reason"]["type"] == "abort"


def test_duplicate_ids_are_refused(fake):
    eng = SGLangEngine(fake.url)

    async def main():
        t = asyncio.ensure_future(eng.generate(GenerationRequest("d", [1, 3], SamplingParams(max_new_tokens=300))))
        await wait_tokens(fake, "d@", 1)
        with pytest.raises(ArgumentError, match="already in flight"):
            await eng.generate(GenerationRequest("d", [1, 3], SamplingParams(max_new_tokens=3)))
        wire = next(iter(fake.rid_to_req))
        body = eng.build_generate_payload(GenerationRequest("x", [1], SamplingParams(max_new_tokens=2)), rid=wire)
        status, answer = await asyncio.get_running_loop().run_in_executor(None, raw_post, fake.url, "/generate", body)
        await eng.abort(["d"])
        await t
        return status, answer

    status, answer = run(main())
    assert status == 400 and "Duplicate request ID" in answer["error"]["message"]


# ---------------------------------------------------------------- weight updates
def test_update_without_session_is_refused_by_the_server_and_the_client_opens_one(fake):
    status, body = raw_post(fake.url, "/update_weights_from_distributed",
                            {"names": ["w"], "dtypes": ["float32"], "shapes": [[2]], "weight_version": "9"})
    assert status == 400 and body["success"] is False and "begin_weight_update" in body["message"]
    eng = cpu_payloads(SGLangEngine(fake.url))
    run(eng.update_weights([("w", torch.arange(3.0))], version=1))
    order = [p for p in fake.calls()[1:] if p != "/model_info"]
    assert order == ["/pause_generation", "/begin_weight_update", "/update_weights_from_tensor",
                     "/end_weight_update", "/continue_generation"]
    assert fake.posts("/pause_generation") == [{"mode": "retract"}]  # the flush after the load needs it
    assert eng.version == 1 and fake.version == "1" and not fake.session_open and not eng.is_paused
    named = pickle.loads(base64.b64decode(fake.posts("/update_weights_from_tensor")[0]["serialized_named_tensors"][0]))
    assert named[0][0] == "w" and torch.equal(named[0][1], torch.arange(3.0))


def test_a_session_left_open_is_recovered(fake):
    fake.session_open = True  # a client died between begin and end
    eng = SGLangEngine(fake.url)
    run(eng.update_weights_from_distributed(["w"], ["bfloat16"], [[2, 3]], version=2))
    assert eng.version == 2 and eng.stats()["sessions_recovered"] == 1 and not fake.session_open
    assert fake.posts("/update_weights_from_distributed")[0]["dtypes"] == ["bfloat16"]


def test_refused_update_is_a_weight_update_error_and_keeps_the_version(fake):
    eng = cpu_payloads(SGLangEngine(fake.url, version=3))
    fake.reject_update = "Parameter model.bad not found"
    with pytest.raises(WeightUpdateError, match=r"SGLangEngine.update_weights refused: .*HTTP 400.*model\.bad"):
        run(eng.update_weights([("model.bad", torch.ones(2))], version=4))
    assert eng.version == 3 and not fake.session_open and not eng.is_paused  # the session was closed all the same
    with pytest.raises(WeightUpdateError, match="more than once"):
        run(eng.update_weights([("a", torch.ones(1)), ("a", torch.ones(1))], version=4))
    with pytest.raises(WeightUpdateError, match="not finite"):
        run(eng.update_weights([("a", torch.tensor([float("nan")]))], version=4))
    with pytest.raises(WeightUpdateError, match="empty"):
        run(eng.update_weights([], version=4))
    with pytest.raises(WeightUpdateError, match="older than"):
        run(eng.update_weights([("a", torch.ones(1))], version=2))
    with pytest.raises(ArgumentError, match="version"):
        run(eng.update_weights([("a", torch.ones(1))], version="4"))


def test_cpu_tensors_are_refused_and_expected_weights_give_the_full_check(fake):
    eng = SGLangEngine(fake.url, expected_weights={"a": [2], "b": [3]})
    with pytest.raises(WeightUpdateError, match="CUDA IPC"):
        run(eng.update_weights([("a", torch.ones(2)), ("b", torch.ones(3))], version=1))
    with pytest.raises(WeightUpdateError, match="partial update covers 1 of"):
        run(eng.update_weights_from_distributed(["a"], [torch.float32], [[2]], version=1))
    with pytest.raises(WeightUpdateError, match="expected shape"):
        run(eng.update_weights_from_distributed(["a"], [torch.float32], [[5]], version=1, partial=True))
    run(eng.update_weights_from_distributed(["a"], [torch.float32], [[2]], version=1, partial=True))
    assert eng.version == 1 and fake.calls().count("/generate") == 0


def test_weights_loaded_but_flush_failed_moves_the_client_version_and_raises(fake):
    eng = cpu_payloads(SGLangEngine(fake.url))
    fake.fail_flush = True
    with pytest.raises(SGLangError, match=r"loaded the weights.*cache was not flushed"):
        run(eng.update_weights([("w", torch.ones(2))], version=7))
    assert eng.version == 7 and fake.version == "7"  # client and server agree


def test_update_keeps_requests_running_with_exact_version_spans(fake):
    eng = cpu_payloads(SGLangEngine(fake.url))

    async def main():
        first = await eng.generate(GenerationRequest("warm", [1, 2], SamplingParams(max_new_tokens=2)))
        assert first.output_versions == [0, 0]  # the server's "default" label -> the client's version 0
        t = asyncio.ensure_future(eng.generate(GenerationRequest("span", [1, 2], SamplingParams(max_new_tokens=120))))
        await wait_tokens(fake, "span@", 10)
        await eng.update_weights([("w", torch.ones(2))], version=1)  # retract, load, continue: no abort
        return await t

    gen = run(main())
    assert gen.finish_reason == "length" and gen.num_output_tokens == 120
    spans = gen.version_spans()
    assert [v for v, _, _ in spans] == [0, 1] and 10 <= spans[0][2] < 120
    assert fake.aborted == [] and fake.posts("/pause_generation") == [{"mode": "retract"}]


def test_without_spans_seen_an_update_aborts_this_clients_requests_first(fake):
    eng = cpu_payloads(SGLangEngine(fake.url))

    async def main():
        req = GenerationRequest("r", [1, 2], SamplingParams(max_new_tokens=80))
        task = asyncio.ensure_future(resumable_generate(eng, req))
        await wait_tokens(fake, "r@", 5)
        await eng.update_weights([("w", torch.ones(2))], version=3)
        return await task

    res = run(main())
    assert res.num_output_tokens == 80 and res.num_submissions >= 2 and len(fake.aborted) >= 1
    k = res.version_spans()[0][2]
    assert res.version_spans() == [(0, 0, k), (3, k, 80)]


# ---------------------------------------------------------------- pause, resume, resumable_generate
def test_abort_pause_resume_and_resumable_generate(fake):
    eng = cpu_payloads(SGLangEngine(fake.url))
    sp = SamplingParams(max_new_tokens=60)

    async def main():
        task = asyncio.ensure_future(resumable_generate(eng, GenerationRequest("r", [1, 20], sp)))
        await wait_tokens(fake, "r@", 4)
        await eng.pause("abort")
        assert eng.is_paused
        await eng.update_weights([("w", torch.ones(2))], version=3)
        assert eng.is_paused  # the caller's pause holds through the update
        await eng.resume()
        return await task

    res = run(main())
    assert res.finish_reason == "length" and res.num_output_tokens == 60
    assert res.output_ids == [(21 + i) % VOCAB for i in range(60)]
    k = res.version_spans()[0][2]
    assert 4 <= k < 60 and res.version_spans() == [(0, 0, k), (3, k, 60)]
    assert [b["mode"] for b in fake.posts("/pause_generation")] == ["abort", "retract"]
    assert len(fake.posts("/continue_generation")) == 1


def test_requests_sent_while_paused_wait_in_the_client_where_an_abort_reaches_them(fake):
    eng = SGLangEngine(fake.url)
    sp = SamplingParams(max_new_tokens=5)

    async def main():
        await eng.pause("keep")
        held = asyncio.ensure_future(eng.generate(GenerationRequest("held", [1, 3], sp)))
        kept = asyncio.ensure_future(eng.generate(GenerationRequest("kept", [1, 3], sp)))
        await asyncio.sleep(0.05)
        assert not held.done() and fake.calls().count("/generate") == 0  # nothing reached the server
        assert await eng.abort(["held"]) == ["held"]
        g_held = await held  # returned at once, as on every engine
        await eng.resume()
        return g_held, await kept

    g_held, g_kept = run(main())
    assert g_held.finish_reason == "abort" and g_held.output_ids == []
    assert g_kept.finish_reason == "length" and g_kept.output_ids == [4, 5, 6, 7, 8]


def test_control_calls_do_not_queue_behind_generations(fake):
    eng = SGLangEngine(fake.url, max_concurrency=2)

    async def main():
        sp = SamplingParams(max_new_tokens=500)
        gens = [asyncio.ensure_future(eng.generate(GenerationRequest(f"g{i}", [1, 3], sp))) for i in range(2)]
        await wait_tokens(fake, "g0@", 2)
        await wait_tokens(fake, "g1@", 2)
        # Both generate threads are busy: control has its own. Had the pause queued behind a generation, that
        # generation would have run to its 500 tokens first and returned "length" (an event, not a deadline).
        await eng.pause("abort")
        await eng.resume()
        return await asyncio.gather(*gens)

    gens = run(main())
    assert all(g.finish_reason == "abort" and g.num_output_tokens < 500 for g in gens)


# ---------------------------------------------------------------- sleep, wake, close, protocol
def test_sleep_pauses_and_aborts_before_releasing_so_the_scheduler_survives(fake):
    eng = SGLangEngine(fake.url, expected_weights={"w": [2]})

    async def main():
        t = asyncio.ensure_future(eng.generate(GenerationRequest("s", [1, 3], SamplingParams(max_new_tokens=400))))
        await wait_tokens(fake, "s@", 3)
        await eng.sleep()  # level 1
        part = await t
        assert fake.offload_tags == {"kv_cache", "cuda_graph"} and eng.is_paused
        await eng.wake()
        assert not eng.is_paused and fake.offload_tags == set()
        await eng.sleep(2)
        assert fake.offload_tags == {"kv_cache", "weights", "cuda_graph"}
        await eng.wake()
        waiting = asyncio.ensure_future(eng.generate(GenerationRequest("w", [1, 3], SamplingParams(max_new_tokens=3))))
        await asyncio.sleep(0.05)
        assert not waiting.done() and eng.is_paused  # weights were discarded: no generation until a complete update
        with pytest.raises(EngineError, match="discarded the weights"):
            await eng.resume()
        await eng.update_weights_from_distributed(["w"], [torch.float32], [[2]], version=1)
        return part, await waiting

    part, after = run(main())
    assert fake.dead is None
    assert part.finish_reason == "abort" and 3 <= part.num_output_tokens < 400
    assert after.num_output_tokens == 3 and after.output_versions == [1] * 3
    order = [p for p in fake.calls() if p in ("/pause_generation", "/abort_request", "/release_memory_occupation")]
    assert order[:3] == ["/pause_generation", "/abort_request", "/release_memory_occupation"]
    # what the client avoids: a release while a request runs kills the scheduler
    with FakeSGLang() as other:
        async def raw():
            e = SGLangEngine(other.url)
            t = asyncio.ensure_future(e.generate(GenerationRequest("x", [1, 3], SamplingParams(max_new_tokens=400))))
            await wait_tokens(other, "x@", 2)
            status, _ = raw_post(other.url, "/release_memory_occupation", {"tags": None})
            with pytest.raises(SGLangError, match="HTTP 500"):
                await t
            return status

        assert run(raw()) == 500 and other.dead


def test_level_1_releases_the_weights_with_a_cpu_backup(fake):
    fake.weights_cpu_backup = True
    eng = SGLangEngine(fake.url)
    run(eng.sleep(1))
    assert fake.offload_tags == {"kv_cache", "weights", "cuda_graph"}
    run(eng.wake())
    assert fake.offload_tags == set() and not eng.is_paused


def test_protocol_members_close_and_errors(fake):
    eng = SGLangEngine(fake.url)
    assert isinstance(eng, RolloutEngine)

    async def main():
        t = asyncio.ensure_future(eng.generate(GenerationRequest("c", [1, 3], SamplingParams(max_new_tokens=400))))
        await wait_tokens(fake, "c@", 2)
        n = eng.num_in_flight
        await eng.aclose()
        part = await t
        with pytest.raises(EngineError, match="closed"):
            await eng.generate(GenerationRequest("late", [1], SamplingParams(max_new_tokens=2)))
        with pytest.raises(EngineError, match="closed"):
            await eng.pause()
        eng.close()  # idempotent
        paused = SGLangEngine(fake.url)
        await paused.pause("keep")
        held = asyncio.ensure_future(paused.generate(GenerationRequest("h", [1], SamplingParams(max_new_tokens=2))))
        await asyncio.sleep(0.02)
        paused.close()
        with pytest.raises(EngineError, match="closed"):
            await held  # a request held in the client does not wait forever
        return n, part

    n, part = run(main())
    assert type(n) is int and n == 1 and part.finish_reason == "abort" and eng.num_in_flight == 0
    assert eng.stats()["requests"] == 1 and isinstance(eng.stats(), dict)
    down = SGLangEngine("http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(SGLangError, match="no answer"):
        run(down.generate(GenerationRequest("x", [1], SamplingParams(max_new_tokens=2))))
    run(SGLangEngine(fake.url).init_weights_update_group(master_addr="1.2.3.4", master_port=1, rank_offset=1,
                                                        world_size=2))
    assert fake.posts("/init_weights_update_group")[-1]["master_address"] == "1.2.3.4"
    with pytest.raises(TypeError, match="master_address"):  # the one spelling is master_addr
        run(SGLangEngine(fake.url).init_weights_update_group(master_address="1.2.3.4", master_port=1, rank_offset=1,
                                                            world_size=2))


def test_a_cancelled_caller_aborts_its_request_on_the_server(fake):
    eng = SGLangEngine(fake.url)

    async def main():
        t = asyncio.ensure_future(eng.generate(GenerationRequest("gone", [1, 3], SamplingParams(max_new_tokens=400))))
        await wait_tokens(fake, "gone@", 2)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        while not fake.aborted:
            await asyncio.sleep(0.005)
        return eng.num_in_flight

    assert run(main()) == 0 and fake.aborted[0].startswith("gone@")


def test_serialize_named_tensors_roundtrip_and_device_uuid():
    t = torch.randn(3, 4)
    for uuid in (True, False):  # CPU tensors: no device to rewrite
        obj = pickle.load(io.BytesIO(base64.b64decode(serialize_named_tensors([("x", t)], device_uuid=uuid))))
        assert obj[0][0] == "x" and torch.equal(obj[0][1], t)


@pytest.mark.gpu
def test_cuda_payload_names_the_device_by_uuid():
    """SGLang's patched rebuild maps the device argument (a GPU UUID) to its own index (srt/utils/patch_torch.py)."""
    t = torch.arange(6.0, device="cuda")
    raw = base64.b64decode(serialize_named_tensors([("x", t)]))
    assert str(torch.cuda.get_device_properties(t.device).uuid).encode() in raw


@pytest.mark.gpu
def test_real_sglang_server_greedy_resume_and_update():
    """Needs a running server: RLBLOCKS_SGLANG_URL=http://127.0.0.1:30000 (started with --model-path <hf dir>)."""
    url = os.environ.get("RLBLOCKS_SGLANG_URL")
    if not url:
        pytest.skip("set RLBLOCKS_SGLANG_URL to a running SGLang server")
    eng = SGLangEngine(url)
    sp = SamplingParams(temperature=0.0, max_new_tokens=32)
    req = GenerationRequest("it0", [1, 2, 3, 4], sp)

    async def main():
        await eng.refresh_version()
        ref = await eng.generate(GenerationRequest("ref", req.prompt_ids, sp))
        task = asyncio.ensure_future(resumable_generate(eng, req))
        await asyncio.sleep(0.05)
        await eng.pause("abort")
        await eng.resume()
        return ref, await task

    ref, res = run(main(), timeout=300)
    assert ref.num_output_tokens == 32 and res.num_output_tokens == 32
    assert res.output_ids == ref.output_ids
    assert all(lp <= 0 for lp in res.output_logprobs)
