"""A fake SGLang 0.5.23 server (``http.server`` on 127.0.0.1) that enforces what the real server enforces.

Every body is checked against SGLang's own types (vendored verbatim in ``sglang_0_5_23``): ``/generate`` through
``api_types.GenerateRequest.from_json_value`` (the contract gate of ``srt/entrypoints/http_server.py``
``generate_request``) and ``sampling_params.SamplingParams(**...).verify(vocab)`` + ``normalize(None)`` (what the
tokenizer manager runs); control calls through pydantic's parse of the ``io_struct`` class, which is what FastAPI
does with SGLang's ``msgspec_struct_pydantic_core_schema``. The real server silently ignores keys it does not know;
the fake refuses them (HTTP 422), because a key SGLang ignores is a bug of the client. Every ``/generate`` and
``/model_info`` answer is checked against ``GenerateResponse`` / ``GetModelInfoResponse`` before it is sent.

Rules, with the SGLang 0.5.23 lines they come from (paths inside the ``sglang`` package):

- **Weight-update session** (``srt/managers/scheduler_components/weight_updater.py`` 187-273, 309-335):
  ``update_weights_from_tensor`` / ``update_weights_from_distributed`` outside ``begin_weight_update`` ...
  ``end_weight_update`` fail; a second ``begin`` fails while a session is open ("a weight-update session is already
  open"); ``end`` without a session fails. ``update_weights_from_disk`` needs no session (``weight_updater.py``
  140-167).
- **400 with success: false** (``srt/entrypoints/http_server.py`` 1300-1506): every weight-update endpoint and the
  session endpoints answer ``{"success": false, "message"}`` with HTTP 400 on failure.
- **Flush after a load** (``weight_updater.py`` 120-132, ``srt/managers/scheduler.py`` 5518-5546): after a
  successful load the version is recorded, then the cache is flushed; the flush fails while requests run (or are
  queued, unless the scheduler is paused), and the call then fails *after* the weights and the version changed.
- **Weight-version spans** (``srt/utils/weight_versions.py``; ``scheduler.py`` 5636-5656, 6398-6409): a version
  change records an event on every live request with output, and each answer carries ``weight_versions`` computed by
  SGLang's own ``compute_weight_version_spans`` / ``add_weight_versions_to_meta_info`` (vendored).
- **ignore_eos** (``srt/managers/schedule_batch.py`` 1856-1878, ``update_finish_state`` 2000-2045): with
  ``ignore_eos`` no token stops a request, ``stop_token_ids`` included; without it ``stop_token_ids`` and the model's
  EOS ids (``eos_token_ids``) stop it, the stop token kept; token stops are checked before the length cap.
- **Prefix abort** (``srt/managers/tokenizer_manager.py`` 2241-2265, ``scheduler.py`` 5675-5805): ``/abort_request``
  with an id unknown to the tokenizer manager, or one it already forwarded, is dropped; a known id goes to the
  scheduler, which aborts every request it holds whose id *starts with* it. Queued requests return at once, running
  ones after their next step; both keep their partial output. A request still waiting for a paused tokenizer manager
  is registered there (``TokenizerManager.generate_request`` 926-939: ``_init_req_state`` before the pause wait) but
  unknown to the scheduler: its abort is lost and it runs after ``/continue_generation``.
- **Duplicate ids** (``tokenizer_manager.py`` 3833-3837): a ``/generate`` whose ``rid`` is in flight fails with
  HTTP 400 ("Duplicate request ID detected").
- **Pause modes** (``tokenizer_manager.py`` 2267-2287, ``scheduler.py`` 5817-5932): ``abort`` pauses the tokenizer
  manager and aborts every request (the scheduler itself is not paused); ``retract`` and ``in_place`` also pause the
  scheduler, ``retract`` moving running requests back to the queue. New requests wait in the tokenizer manager until
  ``/continue_generation``.
- **Idle requirement of memory release** (``weight_updater.py`` 337-341): ``release_memory_occupation`` asserts that
  the scheduler is idle (queued requests ignored only while it is paused); a failed assert kills the scheduler
  process, so the fake then answers every call with HTTP 500. ``resume_memory_occupation`` of a tag that was not
  released kills it too (``weight_updater.py`` 383-389: ``offload_tags.remove``). Without ``--enable-memory-saver``
  both are no-ops (``srt/utils/torch_memory_saver_adapter.py``).
- **Aborts carrying an HTTP status** (``tokenizer_manager.py`` 1891-1921): e.g. a sampling support wider than
  ``--sampling-mask-max-tokens`` (``scheduler_components/batch_result_processor.py`` 1326-1341) fails the call with
  HTTP 400 instead of returning an abort.

The model: token ``i`` of a request continues ``(last token + 1) % vocab`` (so prompt ``[..., 60]`` gives ``61, 62,
63, 0, 1, 2, ...``; ``2`` is the model's EOS); its logprob is ``-((prefix length) % 7 + 1) / 8`` (a function of the
absolute position, so a continued generation has the same logprobs as an uninterrupted one), and with the sampling
mask ``output_token_sampling_logprobs`` is that minus ``0.01``. One token per running request per step.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgspec
from pydantic import TypeAdapter, ValidationError
from sglang_0_5_23 import _support, api_types, io_struct
from sglang_0_5_23.sampling_params import SamplingParams

VOCAB = 64
EOS = 2

CONTROL_TYPES = {
    "/pause_generation": io_struct.PauseGenerationReqInput,
    "/continue_generation": io_struct.ContinueGenerationReqInput,
    "/abort_request": io_struct.AbortReq,
    "/begin_weight_update": io_struct.BeginWeightUpdateReqInput,
    "/end_weight_update": io_struct.EndWeightUpdateReqInput,
    "/update_weights_from_tensor": io_struct.UpdateWeightsFromTensorReqInput,
    "/update_weights_from_distributed": io_struct.UpdateWeightsFromDistributedReqInput,
    "/update_weights_from_disk": io_struct.UpdateWeightFromDiskReqInput,
    "/init_weights_update_group": io_struct.InitWeightsUpdateGroupReqInput,
    "/release_memory_occupation": io_struct.ReleaseMemoryOccupationReqInput,
    "/resume_memory_occupation": io_struct.ResumeMemoryOccupationReqInput,
}


def validate_control(path: str, body: Any) -> Any:
    """Parse ``body`` as FastAPI does for ``path`` (raises ``ValueError``); unknown keys are refused here."""
    cls = CONTROL_TYPES[path]
    fields = {f.name for f in msgspec.structs.fields(cls)}
    unknown = sorted(set(body) - fields) if isinstance(body, dict) else []
    if unknown:
        raise ValueError(f"{path}: keys {unknown} are not fields of SGLang's {cls.__name__}: the server ignores them")
    try:
        return TypeAdapter(cls).validate_python(body)
    except ValidationError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def validate_generate(body: Any) -> SamplingParams:
    """The checks the server runs on a ``/generate`` body; returns the parsed sampling parameters."""
    api_types.GenerateRequest.from_json_value(body)  # JsonContractError (a ValueError) -> HTTP 400
    known = set(api_types.GenerateRequest.__struct_fields__)
    unknown = sorted(set(body) - known)
    if unknown:
        raise ValueError(f"/generate: keys {unknown} are not fields of SGLang's GenerateRequest")
    sp = SamplingParams(**body["sampling_params"])
    sp.verify(VOCAB)
    sp.normalize(None)  # a server started with --skip-tokenizer-init has no tokenizer
    return sp


@dataclass(eq=False)
class Req:
    rid: str
    prompt: list[int]
    sp: SamplingParams
    sampling_mask: bool
    out: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    events: list = field(default_factory=list)  # SGLang's WeightVersionEvent
    finish: dict | None = None
    to_finish: dict | None = None
    abort_sent: bool = False  # tokenizer manager: a second abort of the same rid is dropped
    done: threading.Event = field(default_factory=threading.Event)


class FakeSGLang:
    """See the module docstring. Knobs: ``tp_size``, ``memory_saver``, ``weights_cpu_backup``, ``deterministic``,
    ``reject_update`` (a message: the next loads fail with it), ``fail_flush`` (the next loads succeed, then their
    flush fails as with requests running), ``step_s`` (seconds per scheduler step)."""

    def __init__(self, *, tp_size=1, memory_saver=True, weights_cpu_backup=False, deterministic=False, step_s=0.002):
        self.tp_size = tp_size
        self.memory_saver = memory_saver
        self.weights_cpu_backup = weights_cpu_backup
        self.deterministic = deterministic
        self.step_s = step_s
        self.version = "default"  # --weight-version default (srt/arg_groups/fields/serving.py)
        self.reject_update = None
        self.fail_flush = False  # the next loads change the weights, then their cache flush fails
        self.sampling_mask_max_tokens = 4096
        self.cond = threading.Condition()
        self.requests: list[tuple[str, str, Any]] = []  # (method, path, body) of every call
        self.rid_to_req: dict[str, Req] = {}  # tokenizer manager's rid_to_state
        self.running: list[Req] = []
        self.waiting: list[Req] = []
        self.tokenizer_paused = False
        self.engine_paused = False
        self.session_open = False
        self.offload_tags: set[str] = set()
        self.dead: str | None = None
        self.loaded: list[tuple[str, Any]] = []  # (path, parsed request) of every load that changed weights
        self.aborted: list[str] = []  # rids the scheduler aborted
        self.stop = False
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, code, obj):
                data = b"" if obj is None else (obj if isinstance(obj, bytes) else json.dumps(obj).encode())
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                with fake.cond:
                    fake.requests.append(("GET", self.path, None))
                self._reply(*fake.handle_get(self.path))

            def do_POST(self):
                n = int(self.headers.get("Content-Length", 0))
                raw = self.rfile.read(n)
                body = json.loads(raw) if raw else None
                with fake.cond:
                    fake.requests.append(("POST", self.path, body))
                self._reply(*fake.handle_post(self.path, body))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        serve = lambda: self.server.serve_forever(poll_interval=0.02)  # shutdown() waits for one poll
        self.http_thread = threading.Thread(target=serve, daemon=True)
        self.scheduler = threading.Thread(target=self._schedule, daemon=True)

    # ------------------------------------------------------------------ inspection helpers of the tests
    def posts(self, path):
        with self.cond:
            return [b for m, p, b in self.requests if m == "POST" and p == path]

    def calls(self):
        with self.cond:
            return [p for _, p, _ in self.requests]

    def num_tokens(self, rid_prefix):
        with self.cond:
            return max((len(r.out) for r in self.rid_to_req.values() if r.rid.startswith(rid_prefix)), default=None)

    # ------------------------------------------------------------------ scheduler (one token per running request)
    def _idle(self, ignore_waiting):
        return not self.running and (ignore_waiting or not self.waiting)

    def _schedule(self):
        while not self.stop:
            time.sleep(self.step_s)
            with self.cond:
                if self.engine_paused or self.dead:
                    continue
                self.running += self.waiting
                self.waiting = []
                for req in list(self.running):
                    self._step(req)
                self.cond.notify_all()

    def _step(self, req: Req):
        if req.to_finish is not None:
            self._finish(req, req.to_finish)
            return
        prefix = req.prompt + req.out
        tok = (prefix[-1] + 1) % VOCAB
        req.out.append(tok)
        req.lps.append(-((len(prefix)) % 7 + 1) / 8)
        sp = req.sp
        if not sp.ignore_eos and ((sp.stop_token_ids and tok in sp.stop_token_ids) or tok == EOS):
            self._finish(req, {"type": "stop", "matched": tok})
        elif len(req.out) >= sp.max_new_tokens:
            self._finish(req, {"type": "length", "length": sp.max_new_tokens})

    def _finish(self, req: Req, reason: dict):
        req.finish = reason
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        req.done.set()

    def _abort(self, prefix: str, abort_all: bool):
        for req in list(self.waiting):  # popped at once (scheduler.py "Abort method 1")
            if abort_all or req.rid.startswith(prefix):
                self.aborted.append(req.rid)
                self._finish(req, {"type": "abort", "message": "Abort in waiting queue"})
        for req in self.running:  # finished at the next step (scheduler.py "Abort method 3")
            if req.finish is None and (abort_all or req.rid.startswith(prefix)):
                self.aborted.append(req.rid)
                req.to_finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        self.cond.notify_all()

    def _record_version(self, new):
        if new is None or new == self.version:
            return
        old = self.version
        self.version = new
        for req in self.running + self.waiting:
            if req.out:
                req.events.append(_support.WeightVersionEvent(old_version=old, num_output_tokens=len(req.out)))

    # ------------------------------------------------------------------ HTTP
    def handle_get(self, path):
        if self.dead:
            return 500, {"error": {"message": self.dead}}
        if path == "/health":  # srt/entrypoints/http_server.py health: 200 while the scheduler lives
            return 200, None
        if path.startswith("/_test/num_tokens/"):  # not SGLang's: a test in another process watches a request
            return 200, {"num_tokens": self.num_tokens(path.removeprefix("/_test/num_tokens/"))}
        if path == "/model_info":
            body = {"model_path": "/ckpt", "weight_version": self.version, "is_generation": True}
            api_types.GetModelInfoResponse.from_json_value(body)
            return 200, body
        if path == "/server_info":
            return 200, {
                "version": "0.5.23",
                "enable_memory_saver": self.memory_saver,
                "enable_weights_cpu_backup": self.weights_cpu_backup,
                "enable_deterministic_inference": self.deterministic,
            }
        return 404, {"detail": "Not Found"}

    def handle_post(self, path, body):
        if self.dead:
            return 500, {"error": {"message": self.dead}}
        if path == "/generate":
            try:
                sp = validate_generate(body)
            except ValueError as exc:
                return 400, {"error": str(exc)}
            return self._generate(body, sp)
        if path == "/flush_cache":
            with self.cond:
                if self._idle(ignore_waiting=self.engine_paused):
                    return 200, b"Cache flushed."
                return 400, b"Cache not flushed because there are pending requests."
        if path not in CONTROL_TYPES:
            return 404, {"detail": "Not Found"}
        try:
            obj = validate_control(path, body)
        except ValueError as exc:
            return 422, {"detail": str(exc)}
        with self.cond:
            return self._control(path, obj)

    def _generate(self, body, sp):
        rid = body["rid"]
        with self.cond:
            if rid in self.rid_to_req:
                return 400, {"error": {"message": f"Duplicate request ID detected: {rid}"}}
            mask = bool(body.get("return_sampling_mask"))
            if mask and sp.top_k > self.sampling_mask_max_tokens and sp.top_p >= 1.0:
                return 400, {"error": {"message": "Sampling support exceeds --sampling-mask-max-tokens"}}
            req = Req(rid, list(body["input_ids"]), sp, mask)
            self.rid_to_req[rid] = req
            while self.tokenizer_paused and not self.stop:  # new requests wait in the tokenizer manager
                self.cond.wait(0.05)
            self.waiting.append(req)
        req.done.wait(30)
        with self.cond:
            self.rid_to_req.pop(rid, None)
            if self.dead:
                return 500, {"error": {"message": self.dead}}
            ids = list(req.out)
            meta = {
                "id": rid,
                "finish_reason": req.finish or {"type": "abort", "message": "timeout"},
                "prompt_tokens": len(req.prompt),
                "completion_tokens": len(ids),
                "cached_tokens": 0,
                "weight_version": self.version,
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(req.lps, ids)],
            }
            spans = _support.compute_weight_version_spans(req.events, current_version=self.version,
                                                          num_output_tokens=len(ids))
            _support.add_weight_versions_to_meta_info(meta, spans, num_output_tokens=len(ids))
            if req.sampling_mask:
                meta["output_token_sampling_logprobs"] = [lp - 0.01 for lp in req.lps]
                meta["output_token_sampling_mask"] = [[t] for t in ids]
        out = {"text": "", "output_ids": ids, "meta_info": meta}
        api_types.GenerateResponse.from_json_value(out)
        return 200, out

    def _result(self, success, message):
        return (200 if success else 400), {"success": success, "message": message}

    def _control(self, path, obj):
        if path == "/pause_generation":
            self.tokenizer_paused = True
            if obj.mode == "abort":
                self._abort("", abort_all=True)
            else:
                self.engine_paused = True
                if obj.mode == "retract":
                    self.waiting = [r for r in self.running if r.finish is None] + self.waiting
                    self.running = []
            return 200, {"message": "Generation paused successfully.", "status": "ok"}
        if path == "/continue_generation":
            self.tokenizer_paused = False
            self.engine_paused = False
            self.cond.notify_all()
            return 200, {"message": "Generation continued successfully.", "status": "ok"}
        if path == "/abort_request":
            if not obj.abort_all:
                req = self.rid_to_req.get(obj.rid)
                if req is None or req.abort_sent:
                    return 200, None  # unknown to the tokenizer manager, or already sent: dropped
                req.abort_sent = True
            self._abort(obj.rid, obj.abort_all)  # the scheduler: prefix match over the requests it holds
            return 200, None
        if path == "/begin_weight_update":
            if self.session_open:
                return self._result(False, "a weight-update session is already open; call end_weight_update() first")
            self.session_open = True
            return self._result(True, "Success")
        if path == "/end_weight_update":
            if not self.session_open:
                return self._result(False, "no weight-update session is open; call begin_weight_update() first")
            self.session_open = False
            return self._result(True, "Success")
        if path in ("/update_weights_from_tensor", "/update_weights_from_distributed", "/update_weights_from_disk"):
            return self._load(path, obj)
        if path == "/init_weights_update_group":
            return self._result(True, "Succeeded to initialize custom process group.")
        if path == "/release_memory_occupation":
            if not self._idle(ignore_waiting=self.engine_paused):
                return self._die("release_memory_occupation should be called only when server is idle.")
            tags = obj.tags or ["kv_cache", "weights", "cuda_graph"]
            if self.memory_saver:
                self.offload_tags.update(tags)
            return 200, None
        if path == "/resume_memory_occupation":
            tags = obj.tags or ["kv_cache", "weights", "cuda_graph"]
            if self.memory_saver:
                if not set(tags) <= self.offload_tags:
                    return self._die(f"KeyError: {sorted(set(tags) - self.offload_tags)}")
                self.offload_tags -= set(tags)
            return 200, None
        raise AssertionError(path)

    def _die(self, message):
        """The scheduler process is gone: every call, those waiting included, now fails."""
        self.dead = f"{message} (the scheduler process died)"
        for req in self.rid_to_req.values():
            req.done.set()
        self.cond.notify_all()
        return 500, {"error": {"message": self.dead}}

    def _load(self, path, obj):
        name = path.removeprefix("/")
        if path != "/update_weights_from_disk" and not self.session_open:
            return self._result(False, f"{name} must run between begin_weight_update() and end_weight_update()")
        if path == "/update_weights_from_tensor":
            if len(obj.serialized_named_tensors) != self.tp_size:  # each rank opens serialized_named_tensors[rank]
                return self._result(False, f"expected {self.tp_size} payloads (one per TP rank), got "
                                           f"{len(obj.serialized_named_tensors)}")
        if self.reject_update:
            return self._result(False, self.reject_update)
        self.loaded.append((path, obj))
        self._record_version(obj.weight_version)
        if obj.flush_cache and (self.fail_flush or not self._idle(ignore_waiting=self.engine_paused)):
            return self._result(False, "Weights were updated, but the cache was not flushed because requests are "
                                       "still running or queued. Retract or finish them, then call /flush_cache.")
        return self._result(True, "Succeeded to update model weights.")

    # ------------------------------------------------------------------ lifetime
    def __enter__(self):
        self.http_thread.start()
        self.scheduler.start()
        return self

    def __exit__(self, *exc):
        with self.cond:
            self.stop = True
            for req in list(self.rid_to_req.values()):
                req.done.set()
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()


def decode_payload(b64: str) -> bytes:
    """The raw ``ForkingPickler`` bytes of one serialized payload (strict base64, as ``Base64Bytes`` decodes)."""
    return base64.b64decode(b64, validate=True)


__all__ = ["EOS", "VOCAB", "FakeSGLang", "decode_payload", "validate_control", "validate_generate"]
