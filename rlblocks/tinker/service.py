"""The Tinker service without its HTTP layer: sessions, training models, sampling sessions, futures, checkpoints.

Every method takes the request body the SDK sends (already parsed) and returns the JSON-ready answer; bad input
raises :class:`~rlblocks.errors.RequestError` (the HTTP layer answers it with its status and message) before
anything is queued or changed. Long requests return ``{"request_id": ...}`` (see :mod:`rlblocks.tinker.futures`).

Ordering: every training request (create, forward, forward_backward, optim_step, save_weights,
save_weights_for_sampler, load_weights) of one base model goes through one FIFO worker, in arrival order. The SDK
sends the requests of a training client one after the other (each waits for the previous submission to be
acknowledged), so arrival order is submission order: a ``forward_backward`` submitted before an ``optim_step`` runs
before it, and ``forward_backward`` calls add their gradients until the step. The compute runs in a worker thread,
so sampling (which has its own engine and weights) and HTTP keep going while a training request runs.

One file: :class:`TinkerService` is the one object that holds the service's state (sessions, models, samplers,
futures, checkpoints) and checks each request against it; the HTTP layer (``server.py``), training
(``training.py``), sampling (``sampling.py``) and storage (``store.py``) are already modules of their own.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import math
import time
import traceback
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np
import torch

from rlblocks.errors import ArgumentError, RequestError
from rlblocks.tinker.futures import FutureRecord, FutureStore
from rlblocks.tinker.losses import (
    STABLE_REINFORCE_TARGETS,
    check_loss_config,
    check_loss_inputs,
    mapped_metric,
    nonfinite_inputs,
    resolve_loss_fn,
)
from rlblocks.tinker.sampling import SamplerHost, Snapshot
from rlblocks.tinker.store import CheckpointStore, TinkerPath, check_name
from rlblocks.tinker.training import LoraSpec, TrainingHost, check_adam
from rlblocks.tinker.wire import WireForwardBackward, encode_forward_backward_output

log = logging.getLogger("rlblocks.tinker")


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat()


@dataclass
class _Session:
    session_id: str
    user_metadata: dict | None
    display_name: str | None
    created: float
    finished: str | None = None
    last_seen: float = 0.0
    models: list[str] = field(default_factory=list)
    samplers: list[str] = field(default_factory=list)


@dataclass
class _Model:
    model_id: str
    base: str
    session_id: str
    spec: LoraSpec
    created: float
    user_metadata: dict | None = None
    last_request: float = 0.0
    snapshots: list[str] = field(default_factory=list)  # unnamed sampler snapshots, oldest first
    mapped_pending: bool = False  # gradients of a mapped stable_reinforce request await the next optim_step


@dataclass
class _Sampler:
    sampler_id: str
    session_id: str
    snapshot_key: str
    base_model: str
    model_path: str | None
    clients: int = 1


@dataclass
class _Host:
    name: str
    path: str
    training: TrainingHost
    sampler: SamplerHost
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    worker: asyncio.Task | None = None
    # one thread runs every training request: the allocator keeps one heap for their activations (a pool thread per
    # request would grow one heap per thread, each holding a forward's peak)
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tinker-train"))
    untrimmed: bool = False  # a training request ran since the heap's free pages last went back to the OS


def _return_free_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere): a forward_backward's
    activations are freed when it ends, but glibc keeps the pages, and the sampler then grows its own."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _load_libc()


class TinkerService:
    """The service (see the module docstring).

    Args:
        models: served model name -> HF checkpoint directory.
        state_dir: where checkpoints live (see :mod:`rlblocks.tinker.store`).
        engine: ``"torch"`` (TorchEngine) or ``"vllm"`` (VLLMEngine with LoRA adapters).
        device: training and TorchEngine device (default CUDA if available, else CPU).
        dtype: base weights' dtype (default bfloat16 on CUDA, float32 on CPU).
        keep_snapshots: unnamed sampler snapshots kept per training model (older ones expire: their sampling
            sessions answer 404); named ones live on disk.
        max_batch_tokens: padded tokens per training micro-batch.
        trim_idle_s: once the training requests of a model have stopped for this many seconds, their worker hands
            the heap's free pages (a step's freed activations) back to the OS (glibc ``malloc_trim``): an idle
            server shrinks, a training loop does not fault its step's memory in again every step.
        prefix_share: forward the token prefixes that a request's datums share once (a GRPO group's prompt;
            :class:`~rlblocks.tinker.training.TrainingHost`); ``False``: one padded row per datum.
        engine_args: extra arguments of the sampling engine (``VLLMEngine.from_pretrained`` keywords).
        max_num_samples: most ``num_samples`` of one sample request (more answers 400).
        max_request_tokens: most tokens one sample request may ask for, ``num_samples × (prompt length +
            max_tokens)`` (more answers 400): one request cannot hold the sampler for minutes.
        stable_reinforce_as: ``None`` (``loss_fn="stable_reinforce"`` is refused), or the documented objective it
            runs as (one of ``STABLE_REINFORCE_TARGETS``), announced in :meth:`capabilities` and in the metrics of
            every ``forward_backward`` and ``optim_step`` answer (:func:`~rlblocks.tinker.losses.mapped_metric`).
    """

    def __init__(self, models: dict[str, str], *, state_dir: str, engine: str = "torch",
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                 keep_snapshots: int = 16, max_batch_tokens: int = 16384,
                 engine_args: dict[str, Any] | None = None, max_num_samples: int = 1024,
                 max_request_tokens: int = 1 << 22, stable_reinforce_as: str | None = None,
                 prefix_share: bool = True, trim_idle_s: float = 300.0) -> None:
        if not models:
            raise RequestError("--model: expected at least one NAME=HF_DIR")
        for flag, v in (("--max-num-samples", max_num_samples), ("--max-request-tokens", max_request_tokens),
                        ("--max-batch-tokens", max_batch_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ArgumentError(f"{flag}: expected an integer >= 1, got {v!r}")
        if isinstance(trim_idle_s, bool) or not isinstance(trim_idle_s, int | float) or not 0 <= trim_idle_s < math.inf:
            raise ArgumentError(f"--trim-idle-s: expected a finite number of seconds >= 0, got {trim_idle_s!r}")
        self.trim_idle_s = float(trim_idle_s)
        if stable_reinforce_as is not None and stable_reinforce_as not in STABLE_REINFORCE_TARGETS:
            raise ArgumentError(f"--stable-reinforce-as: expected one of {list(STABLE_REINFORCE_TARGETS)}, got "
                                f"{stable_reinforce_as!r}")
        self.max_num_samples, self.max_request_tokens = max_num_samples, max_request_tokens
        self.stable_reinforce_as = stable_reinforce_as
        self.model_dirs = dict(models)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.engine_kind = engine
        self.keep_snapshots = int(keep_snapshots)
        self.max_batch_tokens = max_batch_tokens
        self.prefix_share = bool(prefix_share)
        self.engine_args = dict(engine_args or {})
        self.store = CheckpointStore(state_dir)
        self.futures = FutureStore()
        self.hosts: dict[str, _Host] = {}
        self.sessions: dict[str, _Session] = {}
        self.models: dict[str, _Model] = {}
        self.samplers: dict[str, _Sampler] = {}
        self._snapshots: OrderedDict[str, Snapshot] = OrderedDict()  # key -> snapshot (unnamed and loaded)
        self._path_keys: OrderedDict[str, str] = OrderedDict()  # tinker path -> key of its cached snapshot
        self._tasks: set[asyncio.Task] = set()
        self.telemetry = {"batches": 0, "events": 0}
        self.started = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        for name, path in self.model_dirs.items():
            training = await asyncio.to_thread(TrainingHost, name, path, device=self.device, dtype=self.dtype,
                                               max_batch_tokens=self.max_batch_tokens,
                                               prefix_share=self.prefix_share)
            sampler = SamplerHost(name, path, engine=self.engine_kind, device=self.device, dtype=self.dtype,
                                  engine_args=self.engine_args)
            await sampler.start()
            host = _Host(name, path, training, sampler)
            host.worker = asyncio.create_task(self._work(host), name=f"tinker-train-{name}")
            self.hosts[name] = host
        self.started = True

    async def close(self) -> None:
        for host in self.hosts.values():
            if host.worker is not None:
                host.worker.cancel()
            host.executor.shutdown(wait=False, cancel_futures=True)
            await host.sampler.close()
        for t in list(self._tasks):
            t.cancel()

    async def _work(self, host: _Host) -> None:
        """Run the training requests of one base model, one at a time, in arrival order; once no request has come
        for ``trim_idle_s`` after one ran, hand the heap's free pages back to the OS (on the worker thread).

        Not after every request: the next ``forward_backward`` would fault the same pages in again (on a 135M model,
        ~200k page faults, ~5 % of a step), and a training loop sends one every few seconds."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                if host.untrimmed:
                    rec, fn = await asyncio.wait_for(host.queue.get(), self.trim_idle_s)
                else:
                    rec, fn = await host.queue.get()
            except asyncio.TimeoutError:  # the builtin TimeoutError from Python 3.11 on
                await loop.run_in_executor(host.executor, _return_free_memory)
                host.untrimmed = False
                continue
            if not rec.pending:  # cancelled while queued
                continue
            host.untrimmed = True
            try:
                result = await loop.run_in_executor(host.executor, fn)
            except RequestError as e:
                self.futures.fail(rec, str(e), category="user")
            except Exception as e:  # a server-side failure: the request fails, the server keeps serving
                log.error("training request %s failed:\n%s", rec.request_id, traceback.format_exc())
                self.futures.fail(rec, f"{type(e).__name__}: {e}", category="server")
            else:
                proto = isinstance(result, bytes)
                self.futures.finish(rec, result, proto=proto)

    def _seen(self, key: Any) -> dict | None:
        """The answer to a retried submission: the first one's request id (checked before anything else, so a
        retry of a request that already ran is not refused by the state that request created)."""
        rec = self.futures.lookup(key)
        return None if rec is None else {"request_id": rec.request_id}

    def _enqueue(self, host: _Host, kind: str, key: Any, fn: Callable[[], Any]) -> dict:
        rec, new = self.futures.create(kind, key)
        if new:
            host.queue.put_nowait((rec, fn))
        return {"request_id": rec.request_id}

    def _spawn(self, rec: FutureRecord, coro) -> None:
        async def run():
            try:
                result = await coro
            except asyncio.CancelledError:
                self.futures.fail(rec, "cancelled", category="user")
                raise
            except RequestError as e:
                self.futures.fail(rec, str(e), category="user")
            except Exception as e:
                log.error("request %s failed:\n%s", rec.request_id, traceback.format_exc())
                self.futures.fail(rec, f"{type(e).__name__}: {e}", category="server")
            else:
                self.futures.finish(rec, result, proto=isinstance(result, bytes))

        task = asyncio.create_task(run())
        rec.task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ lookups
    def _host(self, base_model: str, field: str = "base_model") -> _Host:
        host = self.hosts.get(base_model)
        if host is None:
            raise RequestError(f"{field}: unknown model {base_model!r}; this server serves {sorted(self.hosts)}",
                               status=404)
        return host

    def _model(self, model_id: object) -> _Model:
        m = self.models.get(model_id) if isinstance(model_id, str) else None
        if m is None:
            known = " (it is a training run of an earlier server process: load one of its checkpoints)" if (
                isinstance(model_id, str) and self.store.read_run(model_id)) else ""
            raise RequestError(f"model_id: unknown model {model_id!r}{known}", status=404)
        m.last_request = time.time()
        return m

    def _session(self, session_id: object, *, live: bool = True) -> _Session:
        s = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if s is None:
            raise RequestError(f"session_id: unknown session {session_id!r}", status=404)
        if live and s.finished:
            raise RequestError(f"session_id: session {session_id!r} has finished ({s.finished})", status=410)
        return s

    # ------------------------------------------------------------------ service routes
    def capabilities(self) -> dict:
        """The SDK's ``GetServerCapabilitiesResponse``, plus this server's ``loss_fn_mappings`` (``{"stable_reinforce":
        objective}`` when the operator mapped it, else ``{}``) and ``limits`` (fields the SDK's type ignores)."""
        return {"supported_models": [
            {"model_name": n, "max_context_length": h.training.max_len, "trainable": True, "sampleable": True}
            for n, h in self.hosts.items()],
            "loss_fn_mappings": ({"stable_reinforce": self.stable_reinforce_as} if self.stable_reinforce_as else {}),
            "limits": {"max_num_samples": self.max_num_samples, "max_request_tokens": self.max_request_tokens}}

    def client_config(self) -> dict:
        # Every flag this server answers differently from the SDK's defaults, with the reason:
        return {
            "pjwt_auth_enabled": False,  # API keys only (no JWT exchange)
            "custom_loss_server_side": False,  # forward_backward_custom runs its loss client-side
            "sample_use_retrieve_futures": False,  # each sample polls retrieve_future (long-polled here)
            "sample_join_sampling_session": True,  # unpickled sampling clients get their clone id from us
            "proto_compress_fwdbwd": False,  # local links: compression costs more than it saves
        }

    def create_session(self, body: Any) -> dict:
        sid = f"s{uuid.uuid4().hex[:16]}"
        now = time.time()
        self.sessions[sid] = _Session(sid, body.user_metadata, body.display_name, now, last_seen=now)
        return {"type": "create_session", "session_id": sid}

    def heartbeat(self, session_id: str) -> dict:
        self._session(session_id).last_seen = time.time()
        return {"type": "session_heartbeat"}

    def finish_session(self, session_id: str, body: dict) -> None:
        s = self._session(session_id, live=False)
        if s.finished is None:
            reason = body.get("reason") if isinstance(body, dict) else None
            s.finished = (reason or {}).get("type", "success") if isinstance(reason, dict) else "success"

    def get_session(self, session_id: str) -> dict:
        s = self._session(session_id, live=False)
        return {"training_run_ids": list(s.models), "sampler_ids": list(s.samplers),
                "user_metadata": s.user_metadata, "display_name": s.display_name}

    # ------------------------------------------------------------------ models
    def _run_info(self, m: _Model) -> dict:
        return {"training_run_id": m.model_id, "base_model": m.base, "session_id": m.session_id,
                "lora": m.spec.as_dict(), "created": m.created, "user_metadata": m.user_metadata}

    def _spec_of(self, lora: Any) -> LoraSpec:
        if lora is None:
            raise RequestError("lora_config: required (this server trains LoRA adapters; full fine-tuning is not "
                               "served)")
        if not 1 <= lora.rank <= 1024:
            raise RequestError(f"lora_config.rank: expected a value in [1, 1024], got {lora.rank}")
        if not (lora.train_mlp or lora.train_attn or lora.train_unembed):
            raise RequestError("lora_config: at least one of train_mlp, train_attn, train_unembed must be true")
        return LoraSpec(int(lora.rank), lora.seed, bool(lora.train_mlp), bool(lora.train_attn),
                        bool(lora.train_unembed))

    def _check_optimizer(self, cfg: Any) -> None:
        kind = getattr(cfg, "type", "adamw")
        if kind != "adamw":
            raise RequestError(f"optimizer_config.type: this server serves 'adamw' only, got {kind!r}")

    def create_model(self, body: Any) -> dict:
        session = self._session(body.session_id)
        host = self._host(body.base_model)
        spec = self._spec_of(body.lora_config)
        self._check_optimizer(body.optimizer_config)
        model_id = f"{body.session_id}:train:{body.model_seq_id}"
        key = ("create_model", model_id)
        if (seen := self._seen(key)) is not None:
            return seen

        def run():
            if model_id not in self.models:
                host.training.create(model_id, spec)
                m = _Model(model_id, host.name, session.session_id, spec, time.time(), body.user_metadata)
                self.models[model_id] = m
                session.models.append(model_id)
                self.store.write_run(model_id, self._run_info(m))
            return {"type": "create_model", "model_id": model_id}

        return self._enqueue(host, "CreateModel", key, run)

    def get_info(self, body: Any) -> dict:
        m = self._model(body.model_id)
        host = self.hosts[m.base]
        return {"type": "get_info", "model_id": m.model_id, "model_name": m.base, "is_lora": True,
                "lora_rank": m.spec.rank, "optimizer_config": {"type": "adamw"},
                "model_data": {"arch": host.training.arch, "model_name": m.base, "tokenizer_id": host.path}}

    # ------------------------------------------------------------------ training requests
    def forward_backward(self, fb: WireForwardBackward) -> dict:
        if (seen := self._seen(("train", fb.model_id, fb.seq_id))) is not None:
            return seen
        m = self._model(fb.model_id)
        host = self.hosts[m.base]
        loss_fn = resolve_loss_fn(fb.loss_fn, self.stable_reinforce_as)
        config = check_loss_config(loss_fn, fb.loss_fn_config)
        if not fb.data:
            raise RequestError("data: expected at least one datum, got none")
        if not self._check_columns(fb, host, loss_fn):
            self._check_data(fb, host, loss_fn)
        mapped = loss_fn != fb.loss_fn

        def run():
            outputs, metrics = host.training.forward_backward(m.model_id, fb.data, loss_fn, config,
                                                              fb.forward_only)
            if mapped and not fb.forward_only:
                m.mapped_pending = True  # announced again by the optim_step that applies these gradients
            if self.stable_reinforce_as is not None:
                metrics[mapped_metric(self.stable_reinforce_as)] = float(mapped)
            return encode_forward_backward_output(outputs, metrics)

        kind = "Forward" if fb.forward_only else "ForwardBackward"
        return self._enqueue(host, kind, ("train", m.model_id, fb.seq_id), run)

    @staticmethod
    def _check_data(fb: WireForwardBackward, host: _Host, loss_fn: str) -> None:
        """Every datum checked on its own (raises ``RequestError`` naming the first bad datum and field); then, once
        every datum is well formed, non-finite float inputs are refused naming every datum that holds one."""
        vocab, max_len = host.training.vocab_size, host.training.max_len
        for i, d in enumerate(fb.data):
            n = len(d.tokens)
            if n == 0:
                raise RequestError(f"data[{i}].model_input: expected at least one token, got none")
            if n > max_len:
                raise RequestError(f"data[{i}].model_input: {n} tokens exceed the context length {max_len}")
            toks = np.asarray(d.tokens)
            if toks.min() < 0 or toks.max() >= vocab:
                bad = toks[(toks < 0) | (toks >= vocab)].tolist()
                raise RequestError(f"data[{i}].model_input: token ids must be in [0, {vocab}), got {bad[:5]}")
            check_loss_inputs(loss_fn, f"data[{i}]", n, d.inputs, check_finite=False)
            tgt = np.asarray(d.inputs["target_tokens"])
            if tgt.size and (tgt.min() < 0 or tgt.max() >= vocab):
                raise RequestError(f"data[{i}].loss_fn_inputs['target_tokens']: token ids must be in [0, {vocab})")
        bad = [(i, name, j, v) for i, d in enumerate(fb.data) for name, j, v in nonfinite_inputs(d.inputs)]
        if bad:
            i, name, j, v = bad[0]
            where = sorted({i for i, *_ in bad})
            listed = ", ".join(f"data[{i}].{name}[{j}]={v}" for i, name, j, v in bad[:8])
            raise RequestError(f"data[{i}].loss_fn_inputs[{name!r}][{j}]: expected a finite number, got {v}; "
                               f"{len(where)} of {len(fb.data)} datums hold non-finite inputs ({listed}"
                               f"{', ...' if len(bad) > 8 else ''}); nothing was computed or accumulated")

    @staticmethod
    def _check_columns(fb: WireForwardBackward, host: _Host, loss_fn: str) -> bool:
        """The checks of :meth:`_check_data` once over the whole request (:class:`~rlblocks.tinker.wire.WireColumns`):
        true when every datum passes them. False when something is off or the request has no columns; the caller
        then runs the per-datum checks, which find and name the bad datum."""
        cols = fb.columns
        if cols is None:
            return False
        vocab, max_len = host.training.vocab_size, host.training.max_len
        lengths = cols.lengths
        if lengths.min() < 1 or lengths.max() > max_len or cols.tokens.min() < 0 or cols.tokens.max() >= vocab:
            return False
        # every field 1-D with one value per input token: the concatenation is then one datum of sum(lengths)
        # tokens, and check_loss_inputs on it checks names, dtypes and (per position) the gspo mask rule
        if any(not np.array_equal(r, lengths) for r in cols.rows.values()):
            return False
        try:
            check_loss_inputs(loss_fn, "data", int(lengths.sum()), cols.inputs)
        except RequestError:
            return False
        tgt = cols.inputs["target_tokens"]
        return not (tgt.size and (tgt.min() < 0 or tgt.max() >= vocab))

    def optim_step(self, body: Any) -> dict:
        if (seen := self._seen(("train", body.model_id, body.seq_id))) is not None:
            return seen
        m = self._model(body.model_id)
        host = self.hosts[m.base]
        params = body.optim_params
        if getattr(params, "type", None) not in (None, "adamw") or not hasattr(params, "beta2"):
            raise RequestError(f"optim_params: this server serves AdamParams only, got "
                               f"{getattr(params, 'type', type(params).__name__)!r}")
        adam = check_adam(params.model_dump())

        def run():
            mapped, m.mapped_pending = m.mapped_pending, False
            metrics = host.training.optim_step(m.model_id, adam,
                                               where=f"optim_step of model {m.model_id!r} (seq_id {body.seq_id})")
            if self.stable_reinforce_as is not None:
                metrics[mapped_metric(self.stable_reinforce_as)] = float(mapped)
            return {"type": "optim_step", "metrics": metrics}

        return self._enqueue(host, "OptimStep", ("train", m.model_id, body.seq_id), run)

    def save_weights(self, body: Any) -> dict:
        if (seen := self._seen(("train", body.model_id, body.seq_id))) is not None:
            return seen
        m = self._model(body.model_id)
        host = self.hosts[m.base]
        name = check_name(body.path if body.path is not None else f"step-{int(time.time() * 1000)}")
        path = TinkerPath(m.model_id, "training", name)
        ttl = self._ttl(body.ttl_seconds)
        if self.store.exists(path) and not body.overwrite:
            raise RequestError(f"path: checkpoint {path.checkpoint_id!r} of {m.model_id!r} already exists (pass "
                               "overwrite=True to replace it)", status=409)

        def run():
            self.store.save(path, host.training.adapter_state(m.model_id), host.training.optimizer_state(m.model_id),
                            overwrite=body.overwrite, ttl_seconds=ttl, user_metadata=body.user_metadata)
            return {"type": "save_weights", "path": str(path)}

        return self._enqueue(host, "SaveWeights", ("train", m.model_id, body.seq_id), run)

    def _ttl(self, ttl: int | None) -> int | None:
        if ttl is not None and ttl <= 0:
            raise RequestError(f"ttl_seconds: expected a positive number of seconds or null, got {ttl}")
        return ttl

    def save_weights_for_sampler(self, body: Any) -> dict:
        if (seen := self._seen(("train", body.model_id, body.seq_id))) is not None:
            return seen
        m = self._model(body.model_id)
        host = self.hosts[m.base]
        ttl = self._ttl(body.ttl_seconds)
        if body.path is not None:
            path = TinkerPath(m.model_id, "sampler", check_name(body.path))

            def run():
                state = host.training.adapter_state(m.model_id)
                self.store.save(path, state, None, overwrite=True, ttl_seconds=ttl, user_metadata=body.user_metadata)
                self._remember_path(str(path), Snapshot(self._path_key(path), m.base, state, str(path)))
                return {"type": "save_weights_for_sampler", "path": str(path)}
        else:
            if body.sampling_session_seq_id is None:
                raise RequestError("path: expected a name, or sampling_session_seq_id for an unnamed snapshot")
            session = self._session(m.session_id)
            sampler_id = f"{m.session_id}:sample:{body.sampling_session_seq_id}"

            def run():
                if sampler_id not in self.samplers:
                    key = f"snap:{m.model_id}:{uuid.uuid4().hex[:12]}"
                    self._remember(Snapshot(key, m.base, host.training.adapter_state(m.model_id)))
                    m.snapshots.append(key)
                    while len(m.snapshots) > self.keep_snapshots:
                        self._snapshots.pop(m.snapshots.pop(0), None)
                    self.samplers[sampler_id] = _Sampler(sampler_id, session.session_id, key, m.base, None)
                    session.samplers.append(sampler_id)
                return {"type": "save_weights_for_sampler", "sampling_session_id": sampler_id}

        return self._enqueue(host, "SaveWeightsForSampler", ("train", m.model_id, body.seq_id), run)

    def _remember(self, snap: Snapshot) -> None:
        self._snapshots[snap.key] = snap
        self._snapshots.move_to_end(snap.key)

    def _path_key(self, path: TinkerPath) -> str:
        # unique per saved content: a checkpoint saved again under its name is a new snapshot (the engine may still
        # hold the old one under the old key)
        return f"path:{path}#{uuid.uuid4().hex[:8]}"

    def _remember_path(self, path: str, snap: Snapshot) -> None:
        """Cache a named checkpoint's adapter (the last 32 used; an evicted one is read from disk again)."""
        old = self._path_keys.pop(path, None)
        if old is not None:
            self._snapshots.pop(old, None)
        self._path_keys[path] = snap.key
        self._remember(snap)
        while len(self._path_keys) > 32:
            _, key = self._path_keys.popitem(last=False)
            self._snapshots.pop(key, None)

    def load_weights(self, body: Any) -> dict:
        key = (("train", body.model_id, body.seq_id) if body.model_id is not None else
               ("create_model", f"{body.session_id}:train:{body.model_seq_id}"))
        if (seen := self._seen(key)) is not None:
            return seen
        path = TinkerPath.parse(body.path)
        run_info = self.store.read_run(path.run)
        if run_info is None:
            raise RequestError(f"path: no training run {path.run!r} in this server's state directory", status=404)
        if not self.store.exists(path):
            raise RequestError(f"path: no checkpoint {str(path)!r}", status=404)
        if path.kind != "training" and body.optimizer:
            raise RequestError(f"path: {str(path)!r} is a sampler checkpoint, which holds no optimizer state")
        if body.model_id is not None:  # into an existing training client
            m = self._model(body.model_id)
            host = self.hosts[m.base]
            if run_info["base_model"] != m.base:
                raise RequestError(f"path: the checkpoint's base model is {run_info['base_model']!r}, this model's is "
                                   f"{m.base!r}")
            key = ("train", m.model_id, body.seq_id)
        else:  # a new training client from the checkpoint (create_training_client_from_state*)
            session = self._session(body.session_id)
            if body.model_seq_id is None:
                raise RequestError("model_seq_id: required with session_id")
            base = body.base_model or run_info["base_model"]
            host = self._host(base)
            self._check_optimizer(body.optimizer_config)
            saved = run_info["lora"]
            spec = LoraSpec(saved["rank"], saved.get("seed"), saved["train_mlp"], saved["train_attn"],
                            saved["train_unembed"])
            model_id = f"{body.session_id}:train:{body.model_seq_id}"
            key = ("create_model", model_id)
            m = None

        def run():
            nonlocal m
            if m is None:
                if model_id not in self.models:
                    host.training.create(model_id, spec)
                    new = _Model(model_id, host.name, session.session_id, spec, time.time(), body.user_metadata)
                    self.models[model_id] = new
                    session.models.append(model_id)
                    self.store.write_run(model_id, self._run_info(new))
                m = self.models[model_id]
            adapter, opt = self.store.load(path, optimizer=bool(body.optimizer))
            host.training.load_state(m.model_id, adapter["tensors"], opt)
            return {"type": "load_weights", "path": str(path), "model_id": m.model_id}

        return self._enqueue(host, "LoadWeights", key, run)

    # ------------------------------------------------------------------ sampling
    def _snapshot_for_path(self, model_path: str) -> Snapshot:
        """The weights a named checkpoint holds now (cached; read from disk when not)."""
        path = TinkerPath.parse(model_path, "model_path")
        key = self._path_keys.get(str(path))
        if key is not None and key in self._snapshots:
            self._path_keys.move_to_end(str(path))
            return self._snapshots[key]
        run_info = self.store.read_run(path.run)
        if run_info is None or not self.store.exists(path):
            raise RequestError(f"model_path: no checkpoint {model_path!r}", status=404)
        adapter, _ = self.store.load(path, optimizer=False)
        snap = Snapshot(self._path_key(path), run_info["base_model"], adapter, str(path))
        self._host(snap.base_model, "model_path")
        self._remember_path(str(path), snap)
        return snap

    def create_sampling_session(self, body: Any) -> dict:
        session = self._session(body.session_id)
        sampler_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
        if sampler_id in self.samplers:  # a retried creation
            return {"type": "create_sampling_session", "sampling_session_id": sampler_id}
        if (body.model_path is None) == (body.base_model is None):
            raise RequestError("model_path / base_model: expected exactly one of them")
        if body.model_path is not None:
            snap = self._snapshot_for_path(body.model_path)
        else:
            self._host(body.base_model)
            snap = self._base_snapshot(body.base_model)
        self.samplers[sampler_id] = _Sampler(sampler_id, session.session_id, snap.key, snap.base_model,
                                             body.model_path)
        session.samplers.append(sampler_id)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def _base_snapshot(self, base_model: str) -> Snapshot:
        key = f"base:{base_model}"
        if key not in self._snapshots:
            self._snapshots[key] = Snapshot(key, base_model)
        return self._snapshots[key]

    def join_sampling_session(self, body: Any) -> dict:
        s = self._sampler(body.sampling_session_id)
        count = s.clients
        s.clients += 1
        return {"type": "join_sampling_session", "client_counter": count}

    def _sampler(self, sampler_id: object, field: str = "sampling_session_id") -> _Sampler:
        s = self.samplers.get(sampler_id) if isinstance(sampler_id, str) else None
        if s is None:
            raise RequestError(f"{field}: unknown sampling session {sampler_id!r}", status=404)
        return s

    def get_sampler(self, sampler_id: str) -> dict:
        s = self._sampler(sampler_id, "sampler_id")
        return {"sampler_id": s.sampler_id, "base_model": s.base_model, "model_path": s.model_path}

    def asample(self, body: Any) -> dict:
        if body.sampling_session_id is not None:
            s = self._sampler(body.sampling_session_id)
            # a session made from a checkpoint path samples what that checkpoint holds (saved again: the new weights)
            snap = self._snapshot_for_path(s.model_path) if s.model_path else self._snapshots.get(s.snapshot_key)
            if snap is None:
                raise RequestError(f"sampling_session_id: the weights of {s.sampler_id!r} expired (this server keeps "
                                   f"the last {self.keep_snapshots} unnamed snapshots of a training model; save with "
                                   "a name to keep one)", status=404)
            key = ("sample", s.sampler_id, body.seq_id) if body.seq_id is not None else None
        elif body.model_path is not None:
            snap, key = self._snapshot_for_path(body.model_path), None
        elif body.base_model is not None:
            self._host(body.base_model)
            snap, key = self._base_snapshot(body.base_model), None
        else:
            raise RequestError("sampling_session_id: required (or model_path / base_model)")
        host = self.hosts[snap.base_model]
        if key is not None and (rec := self.futures.lookup(key)) is not None:
            return {"request_id": rec.request_id, "sample_sequence_ids": rec.extra["sequence_ids"]}
        if body.record_stability_info and self.stable_reinforce_as is not None:
            # the mapped objective needs no stability information: sample as usual, record nothing
            body = body.model_copy(update={"record_stability_info": False})
        spec = host.sampler.check(body)
        if spec.num_samples > self.max_num_samples:
            raise RequestError(f"num_samples: {spec.num_samples} exceeds this server's limit of "
                               f"{self.max_num_samples} samples per request (--max-num-samples); send several "
                               "requests")
        tokens = spec.num_samples * (len(spec.prompt) + spec.max_tokens)
        if tokens > self.max_request_tokens:
            raise RequestError(f"num_samples × (prompt + sampling_params.max_tokens): {spec.num_samples} × "
                               f"({len(spec.prompt)} + {spec.max_tokens}) = {tokens} tokens exceeds this server's "
                               f"limit of {self.max_request_tokens} tokens per sample request "
                               "(--max-request-tokens); lower num_samples or max_tokens")
        rec, new = self.futures.create("Sample", key)
        seq_ids = [f"{rec.request_id}:{i}" for i in range(spec.num_samples)]
        if new:
            rec.extra["sequence_ids"] = seq_ids
            self._spawn(rec, host.sampler.sample(rec.request_id, snap, spec))
        return {"request_id": rec.request_id, "sample_sequence_ids": rec.extra.get("sequence_ids", seq_ids)}

    def cancel(self, request_id: str) -> None:
        rec = self.futures.get(request_id)
        if rec.pending and rec.task is not None:
            rec.task.cancel()

    # ------------------------------------------------------------------ REST (runs and checkpoints)
    def _run(self, run_id: str) -> dict:
        info = self.store.read_run(run_id)
        if info is None:
            raise RequestError(f"training_run_id: unknown training run {run_id!r}", status=404)
        return info

    def training_run(self, run_id: str) -> dict:
        info = self._run(run_id)
        cps = self.store.checkpoints(run_id)
        last = {k: next((c for c in reversed(cps) if c["checkpoint_type"] == k), None) for k in ("training", "sampler")}
        m = self.models.get(run_id)
        last_request = m.last_request if m and m.last_request else info["created"]
        return {"training_run_id": run_id, "base_model": info["base_model"], "model_owner": "local", "is_lora": True,
                "corrupted": False, "lora_rank": info["lora"]["rank"], "last_request_time": _iso(last_request),
                "last_checkpoint": last["training"], "last_sampler_checkpoint": last["sampler"],
                "user_metadata": info.get("user_metadata")}

    def training_runs(self, limit: int, offset: int) -> dict:
        runs = sorted(self.store.runs(), key=lambda r: r["created"], reverse=True)
        page = runs[offset: offset + limit]
        return {"training_runs": [self.training_run(r["training_run_id"]) for r in page],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}}

    def checkpoints(self, run_id: str) -> dict:
        self._run(run_id)
        return {"checkpoints": self.store.checkpoints(run_id)}

    def all_checkpoints(self, limit: int, offset: int) -> dict:
        cps = sorted((c for r in self.store.runs() for c in self.store.checkpoints(r["training_run_id"])),
                     key=lambda c: c["time"], reverse=True)
        return {"checkpoints": cps[offset: offset + limit],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(cps)}}

    def delete_checkpoint(self, run_id: str, checkpoint_id: str) -> None:
        self._run(run_id)
        path = TinkerPath.parse(f"tinker://{run_id}/{checkpoint_id}", "checkpoint_id")
        self.store.delete(path)
        key = self._path_keys.pop(str(path), None)
        if key is not None:
            self._snapshots.pop(key, None)

    def weights_info(self, body: dict) -> dict:
        path = TinkerPath.parse(body.get("tinker_path") if isinstance(body, dict) else None, "tinker_path")
        info = self._run(path.run)
        if not self.store.exists(path):
            raise RequestError(f"tinker_path: no checkpoint {str(path)!r}", status=404)
        lora = info["lora"]
        return {"base_model": info["base_model"], "optimizer_config": {"type": "adamw"}, "is_lora": True,
                "lora_rank": lora["rank"], "train_unembed": lora["train_unembed"], "train_mlp": lora["train_mlp"],
                "train_attn": lora["train_attn"]}

    def stats(self) -> dict:
        return {"futures": dict(self.futures.stats), "telemetry": dict(self.telemetry),
                "samplers": {n: dict(h.sampler.stats) for n, h in self.hosts.items()},
                "queued_training_requests": {n: h.queue.qsize() for n, h in self.hosts.items()}}


__all__ = ["TinkerService"]
