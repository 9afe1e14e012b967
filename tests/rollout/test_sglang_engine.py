"""SGLangEngine against a local fake SGLang server (http.server on 127.0.0.1) that records requests and answers
with SGLang's documented response shapes; plus a real-server integration test (gpu, needs RLBLOCKS_SGLANG_URL)."""

import asyncio
import base64
import io
import json
import os
import pickle
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from rlblocks.rollout import GenerationRequest, SamplingParams, SGLangEngine, resumable_generate
from rlblocks.rollout.sglang_engine import SGLangError, serialize_named_tensors


def run(coro, timeout=30.0):
    async def main():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(main())


class FakeSGLang:
    """Answers like an SGLang server. /generate emits token ``prompt[-1] + 1 + i`` with logprob ``-(i + 1) / 8``;
    requests whose prompt starts with 99 block until aborted (then return the ``hold`` tokens with type abort)."""

    def __init__(self):
        self.requests = []  # (method, path, json body)
        self.version = "0"
        self.reject_update = None
        self.aborted = {}  # rid -> threading.Event
        self.running = threading.Event()  # cleared while paused: new /generate calls wait, as on SGLang
        self.running.set()
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                fake.requests.append(("GET", self.path, None))
                if self.path == "/model_info":
                    return self._reply(200, {"model_path": "x", "weight_version": fake.version})
                return self._reply(404, {"detail": "Not Found"})

            def do_POST(self):
                n = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(n) or b"{}")
                with fake.lock:
                    fake.requests.append(("POST", self.path, body))
                code, obj = fake.handle(self.path, body)
                self._reply(code, obj)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def handle(self, path, body):
        if path == "/generate":
            self.running.wait(10)
            sp = body["sampling_params"]
            prompt = body["input_ids"]
            n = sp["max_new_tokens"]
            reason = {"type": "length", "length": n}
            if prompt[0] == 99:
                ev = self.aborted.setdefault(body["rid"], threading.Event())
                ev.wait(10)
                n = min(n, 2)
                reason = {"type": "abort", "message": "Abort request"}
            ids = [prompt[-1] + 1 + i for i in range(n)]
            for i, t in enumerate(ids):
                if t in sp["stop_token_ids"]:
                    ids = ids[: i + 1]
                    reason = {"type": "stop", "matched": t}
                    break
            meta = {
                "id": body["rid"],
                "finish_reason": reason,
                "prompt_tokens": len(prompt),
                "completion_tokens": len(ids),
                "cached_tokens": 0,
                "output_token_logprobs": [[-(i + 1) / 8, t, None] for i, t in enumerate(ids)],
                "weight_version": self.version,
            }
            return 200, {"text": "", "output_ids": ids, "meta_info": meta}
        if path == "/abort_request":
            targets = list(self.aborted) if body.get("abort_all") else [body["rid"]]
            for rid in targets:
                self.aborted.setdefault(rid, threading.Event()).set()
            return 200, {}
        if path == "/pause_generation":
            self.running.clear()
            if body.get("mode") == "abort":
                for ev in self.aborted.values():
                    ev.set()
            return 200, {}
        if path in ("/update_weights_from_tensor", "/update_weights_from_disk", "/update_weights_from_distributed"):
            if self.reject_update:
                return 200, {"success": False, "message": self.reject_update}
            self.version = body["weight_version"]
            return 200, {"success": True, "message": "Succeeded to update model weights."}
        if path == "/init_weights_update_group":
            return 200, {"success": True, "message": "Succeeded to initialize custom process group."}
        if path == "/continue_generation":
            self.running.set()
            return 200, {}
        if path in ("/flush_cache", "/release_memory_occupation", "/resume_memory_occupation"):
            return 200, {}
        return 404, {"detail": "Not Found"}

    def posts(self, path):
        return [b for m, p, b in self.requests if m == "POST" and p == path]

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.running.set()
        for ev in self.aborted.values():
            ev.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake():
    with FakeSGLang() as f:
        yield f


def test_generate_request_formation_and_parsing(fake):
    eng = SGLangEngine(fake.url)
    sp = SamplingParams(temperature=0.7, max_new_tokens=4, stop_token_ids=(50,), seed=11)
    gen = run(eng.generate(GenerationRequest("a", [1, 40], sp)))
    body = fake.posts("/generate")[0]
    assert body["input_ids"] == [1, 40] and body["rid"] == "a" and body["return_logprob"] is True
    assert body["logprob_start_len"] == -1 and body["stream"] is False
    assert body["sampling_params"] == {
        "max_new_tokens": 4,
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": -1,
        "stop_token_ids": [50],
        "ignore_eos": True,
        "no_stop_trim": True,
        "sampling_seed": 11,
    }
    assert gen.output_ids == [41, 42, 43, 44] and gen.finish_reason == "length"
    assert gen.output_logprobs == [-0.125, -0.25, -0.375, -0.5] and gen.output_versions == [0] * 4
    stopped = run(eng.generate(GenerationRequest("b", [1, 47], sp)))
    assert stopped.output_ids == [48, 49, 50] and stopped.finish_reason == "stop"


def test_parse_rejects_inconsistent_responses(fake):
    eng = SGLangEngine(fake.url, version=5)
    req = GenerationRequest("a", [1], SamplingParams(max_new_tokens=3))
    meta = {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, 7, None]], "weight_version": "v7"}
    gen = eng.parse_generate_response(req, {"output_ids": [7], "meta_info": meta})
    assert gen.output_versions == [5]  # a non-integer server version keeps the client's
    with pytest.raises(SGLangError, match="disagree"):
        eng.parse_generate_response(req, {"output_ids": [8], "meta_info": meta})
    with pytest.raises(SGLangError, match="finish_reason"):
        eng.parse_generate_response(req, {"meta_info": {**meta, "finish_reason": {"type": "weird"}}})
    with pytest.raises(SGLangError, match="meta_info"):
        eng.parse_generate_response(req, {"text": "x"})
    with pytest.raises(ValueError, match="top_k"):
        eng.build_generate_payload(GenerationRequest("a", [1], SamplingParams(top_k=5)))
    ok = SGLangEngine(fake.url, allow_unprocessed_logprobs=True).build_generate_payload(
        GenerationRequest("a", [1], SamplingParams(top_k=5, top_p=0.9))
    )
    assert ok["sampling_params"]["top_k"] == 5 and ok["sampling_params"]["top_p"] == 0.9
    with pytest.raises(ValueError, match="base_url"):
        SGLangEngine("localhost:30000")


def test_abort_pause_resume_and_resumable_generate(fake):
    eng = SGLangEngine(fake.url)
    sp = SamplingParams(temperature=1.0, max_new_tokens=6)

    async def main():
        t = asyncio.ensure_future(eng.generate(GenerationRequest("h", [99, 10], sp)))
        while "h" not in fake.aborted:
            await asyncio.sleep(0.005)
        assert await eng.abort(["nope"]) == []
        assert await eng.abort(["h", "nope"]) == ["h"]
        part = await t
        # resumable over the fake: the first call blocks (prompt starts with 99) until pause(abort)
        task = asyncio.ensure_future(resumable_generate(eng, GenerationRequest("r", [99, 20], sp)))
        while "r" not in fake.aborted:
            await asyncio.sleep(0.005)
        await eng.pause("abort")
        await eng.update_weights([("w", torch.ones(2))], version=3)
        await eng.resume()
        return part, await task

    part, res = run(main())
    assert part.finish_reason == "abort" and part.output_ids == [11, 12]
    assert fake.posts("/abort_request")[0] == {"rid": "h", "abort_all": False}
    assert fake.posts("/pause_generation") == [{"mode": "abort"}] and fake.posts("/continue_generation") == [{}]
    # the re-submission carried prompt + partial and the remaining budget
    second = [b for b in fake.posts("/generate") if b["rid"] == "r"][1]
    assert second["input_ids"] == [99, 20, 21, 22] and second["sampling_params"]["max_new_tokens"] == 4
    # each call of the blocking prompt returns 2 tokens then abort: 3 calls spend the budget of 6
    assert res.output_ids == [21, 22, 23, 24, 25, 26] and res.finish_reason == "length" and res.num_submissions == 3
    assert res.output_versions == [0, 0, 3, 3, 3, 3] and res.stale == [True, True, False, False, False, False]


def test_update_weights_payload_and_rejection(fake):
    eng = SGLangEngine(fake.url, tp_size=2)
    w = torch.arange(6, dtype=torch.float32).view(2, 3)

    async def main():
        await eng.update_weights([("model.w", w)], version=4)  # not paused: pause(abort) -> load -> continue
        fake.reject_update = "Parameter model.bad not found"
        with pytest.raises(ValueError, match=r"model\.bad"):
            await eng.update_weights([("model.bad", w)], version=5)
        with pytest.raises(ValueError, match="more than once"):
            await eng.update_weights([("a", w), ("a", w)], version=6)
        with pytest.raises(ValueError, match="version"):
            await eng.update_weights([("a", w)], version="6")
        fake.reject_update = None
        await eng.update_weights_from_disk("/ckpt/step10", version=10)
        await eng.init_weights_update_group("10.0.0.1", 29500, 1, 2)
        await eng.update_weights_from_distributed(["model.w"], [torch.bfloat16], [[2, 3]], version=11)
        await eng.flush_cache()
        await eng.sleep()
        await eng.wake()
        return await eng.get_weight_version(), await eng.refresh_version()

    server_version, refreshed = run(main())
    body = fake.posts("/update_weights_from_tensor")[0]
    assert body["load_format"] is None and body["flush_cache"] is True and body["weight_version"] == "4"
    assert len(body["serialized_named_tensors"]) == 2
    named = pickle.loads(base64.b64decode(body["serialized_named_tensors"][0]))  # ForkingPickler format, same host
    assert named[0][0] == "model.w" and torch.equal(named[0][1], w)
    assert [b["mode"] for b in fake.posts("/pause_generation")][:1] == ["abort"]
    assert eng.version == 11 and server_version == "11" and refreshed == 11  # the rejected update left no trace
    assert fake.posts("/update_weights_from_disk")[0] == {
        "model_path": "/ckpt/step10",
        "load_format": None,
        "weight_version": "10",
    }
    assert fake.posts("/init_weights_update_group")[0] == {
        "master_address": "10.0.0.1",
        "master_port": 29500,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "weight_update_group",
        "backend": "nccl",
    }
    dist = fake.posts("/update_weights_from_distributed")[0]
    assert dist["dtypes"] == ["bfloat16"] and dist["shapes"] == [[2, 3]] and dist["names"] == ["model.w"]
    assert ("GET", "/get_weight_version", None) in fake.requests  # 404 here, then /model_info
    assert len(fake.posts("/release_memory_occupation")) == 1 and len(fake.posts("/resume_memory_occupation")) == 1


def test_serialize_named_tensors_roundtrip():
    t = torch.randn(3, 4)
    payload = serialize_named_tensors([("x", t)])
    obj = pickle.load(io.BytesIO(base64.b64decode(payload)))
    assert obj[0][0] == "x" and torch.equal(obj[0][1], t)


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
