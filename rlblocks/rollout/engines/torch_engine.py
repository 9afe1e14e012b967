"""TorchEngine: an in-process reference rollout engine over any Hugging Face causal LM (CPU or GPU).

It implements the whole :class:`~rlblocks.rollout.types.RolloutEngine` protocol with plain PyTorch:

- **Continuous batching.** A background asyncio task runs the engine loop. Every engine *step* gives each running
  sequence exactly one new token: new requests are prefilled (prompts of equal length are batched together), the
  others are decoded together in one forward over a left-padded KV cache (attention mask + explicit position ids).
  Requests submitted while a step runs join at the next step. The forward runs in a worker thread
  (``asyncio.to_thread``) so the event loop stays responsive; all state changes (abort, pause, weight update) happen
  under one lock, i.e. *between* steps.
- **Processed logprobs.** ``output_logprobs[i] = log_softmax(process(logits / T))[token]`` where ``process`` keeps
  the top-k logits (ties at the k-th value are kept), then the smallest set of most probable tokens whose probability
  mass reaches top-p (the most probable token is always kept); everything else is ``-inf``. Computed in fp32 from
  fp32 logits. Greedy (``temperature == 0``) takes the argmax of the raw logits and reports the untempered,
  unfiltered log-softmax.
- **Seeds.** Sampling is by inverse CDF (float64) with a *counter-based* uniform number: the token at absolute
  position ``p`` (index in prompt + output) uses ``u = splitmix64(seed, p) / 2**63`` — a stateless generator (as
  Philox is), rather than a stateful per-request ``torch.Generator``. The draw therefore depends only on
  (seed, position), not on how many tokens this call produced, so a seeded request interrupted and re-submitted
  with the same seed draws the same numbers. Requests without a seed get a random one.
- **Versions.** Each token is tagged with the weight version of the step that produced it.

Exactness of interrupt + resume (why a greedy resumed generation is bit-identical)
----------------------------------------------------------------------------------
CPU/GPU GEMM kernels do not give a row the same bits for every batch size (measured here on CPU: rows computed with
M = 1..3, 5..7 and 9..11 differ in the last bits from M = 4, 8 or >= 12), and a prefill of ``prompt + partial`` does
not give the partial positions the bits of the one-token decode steps that produced them. Two mechanisms make
interrupt + resume exact anyway:

1. **Prefix cache of aborted requests.** When a request is aborted its KV cache (covering ``prompt + output[:-1]``)
   is kept, keyed by those token ids and the weight version. A later request whose prompt extends that key (the
   resume re-submission ``prompt + output``) starts from that exact KV state and feeds the remaining token(s) as a
   one-token step, i.e. the *same* computation the uninterrupted request would have made (the same forward call with
   the same shapes and masks). With unchanged weights and the same batch composition (e.g. a lone request) this is
   bit-identical, and the resume costs zero re-prefill tokens. A weight update clears this cache (the KV belongs to
   the old policy). Bounded by ``prefix_cache_size`` entries (LRU); ``0`` disables it.
2. **``batch_invariant=True``**: every sequence runs in its own batch-of-one forward and every position (prompt
   tokens too) is computed by a one-token step. Token ``t``'s logits then depend only on tokens ``< t`` and the
   weights — not on other requests, not on where the prompt ended, not on the prefix cache — so greedy
   interrupt + resume is bit-identical under any concurrency. It costs one forward per sequence per token
   (about 30x slower than batched for a tiny model with 64 requests); use it for exactness tests and debugging.

With the default (batched) mode and other requests joining or leaving, the logits of a sequence can change in the
last bits with the batch composition (as in vLLM and SGLang); greedy tokens then only differ on near-ties.

Weight updates, pause, sleep and close
--------------------------------------
``update_weights`` materialises the iterable (dequantising weights sent in the block-FP8 format of
:mod:`rlblocks.sync.fp8`: the engine then computes with exactly an FP8 engine's weights) and checks it with the rule
every engine shares (see :mod:`rlblocks.rollout.engines._weights`: names, shapes, dtypes, finite values,
completeness unless ``partial=True``, tied aliases, versions only forward unless ``allow_rollback=True``) *before*
touching anything (:class:`~rlblocks.errors.WeightUpdateError`; weights and version unchanged). It then waits for
the current step to end, copies the tensors (``copy_`` with dtype cast), clears the prefix cache, drops the KV of
requests frozen by ``pause("keep")`` (they are re-prefilled under the new weights when resumed; their earlier tokens
keep their old version) and only then sets ``version``.
``sleep(level)`` follows the protocol (:class:`~rlblocks.rollout.types.RolloutEngine`): every request in flight
returns its partial output, every KV cache is dropped; level 1 moves the weights to CPU on CUDA (on CPU they are
already in host memory, so only the KV caches are freed) and ``wake()`` moves them back; level 2 frees the
parameters' storage on any device, and after ``wake()`` the engine generates again only once a complete update has
loaded weights (the re-allocated parameters hold NaN until then, so a leak would be visible). Each parameter is
re-allocated with the layout it had before the sleep: shape, strides, dtype, device and the alignment of its address
modulo 64 bytes. The alignment matters because BLAS kernels choose their code path, and with it the order in which
they add, by the operands' addresses: measured on a 2-core x86 CPU, MKL's SSE4.2 GEMV (a one-token decode step) gives
other last bits for a weight 8 bytes past a 16-byte boundary (where ``from_pretrained`` of a safetensors checkpoint
put every tensor) than for the same weight on a 64-byte boundary (where a fresh allocation lands). With the layout
kept, an engine given back the weights it had computes the same bits as before the sleep.
``close()`` returns the partial output of every request in flight (``finish_reason="abort"``) and frees the KV
caches; later calls raise :class:`~rlblocks.errors.EngineError`.
An engine is bound to one event loop at a time; using it from a new loop (a second ``asyncio.run``) abandons the
requests of the previous one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import random
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from rlblocks.errors import ArgumentError, EngineError

from ..moe_replay import RoutingRecorder
from ..types import Generation, GenerationRequest
from ._weights import WeightLayout, check_update_version, refuse
from .lifecycle import Lifecycle

__all__ = ["EngineStats", "TorchEngine", "processed_logprobs"]

KV = list[tuple[Tensor, Tensor]]  # per layer: keys, values, each [B, H_kv, T, D]

_MASK64 = (1 << 63) - 1


def _mix_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed from (request seed, absolute token position) (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK64


def _uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, position): counter-based, like Philox."""
    return (_mix_seed(seed, position) >> 10) * 2.0**-53


def processed_logprobs(
    logits: Float[Tensor, "B V"],
    temperature: Float[Tensor, " B"],
    top_k: Int[Tensor, " B"],
    top_p: Float[Tensor, " B"],
) -> Float[Tensor, "B V"]:
    """Log-probabilities of the sampling distribution actually used, per row; ``-inf`` outside its support.

    ``x = logits / T`` (rows with ``T == 0`` use ``T = 1``: greedy reports the untempered distribution); top-k keeps
    ``x >= kth largest`` (ties kept; ``k <= 0`` or ``k >= V`` disables it); top-p then sorts the survivors, and
    drops a token when the probability mass strictly before it is already ``>= top_p`` (``top_p == 1`` disables it;
    the most probable token is always kept); ``log_softmax`` renormalises. fp32 in, fp32 out.
    """
    x = logits.float() / torch.where(temperature > 0, temperature, torch.ones_like(temperature)).unsqueeze(-1)
    vocab = x.shape[-1]
    use_k = (top_k > 0) & (top_k < vocab)
    if bool(use_k.any()):
        k = torch.where(use_k, top_k, torch.full_like(top_k, vocab)).clamp(1, vocab)
        sorted_x = torch.sort(x, dim=-1, descending=True).values
        kth = sorted_x.gather(-1, (k - 1).unsqueeze(-1))
        x = torch.where(use_k.unsqueeze(-1) & (x < kth), torch.full_like(x, float("-inf")), x)
    use_p = top_p < 1.0
    if bool(use_p.any()):
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = (mass_before >= top_p.unsqueeze(-1)) & use_p.unsqueeze(-1)
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.log_softmax(x, dim=-1)


@dataclass
class EngineStats:
    """Counters since construction: tokens fed through prefill, tokens decoded, forwards, prefix-cache hits."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    forwards: int = 0
    steps: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_reused_tokens: int = 0


@dataclass(eq=False)
class _Seq:
    request: GenerationRequest
    future: asyncio.Future
    seed: int
    tokens: list[int]  # prompt + output so far
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    kv: KV | None = None  # own KV of tokens[:n_cached] when not a row of the decode batch; [1, H, n_cached, D]
    n_cached: int = 0
    routed: list[Tensor] = field(default_factory=list)  # record_routing: rows of the positions fed, in order
    done: bool = False

    @property
    def rid(self) -> str:
        return self.request.request_id


@dataclass
class _Batch:
    seqs: list[_Seq]
    keys: list[Tensor]  # per layer [B, H, T, D], left-padded
    values: list[Tensor]
    pads: list[int]

    @property
    def width(self) -> int:
        return int(self.keys[0].shape[-2])

    def row_kv(self, b: int) -> KV:
        p = self.pads[b]
        return [(k[b : b + 1, :, p:], v[b : b + 1, :, p:]) for k, v in zip(self.keys, self.values)]


def _left_pad_stack(kvs: list[KV]) -> tuple[list[Tensor], list[Tensor], list[int]]:
    """Stack per-sequence KV (each [1, H, t_i, D]) into [B, H, max t, D], left-padded with zeros (masked out)."""
    lengths = [int(kv[0][0].shape[-2]) for kv in kvs]
    width = max(lengths)
    keys, values = [], []
    for layer in range(len(kvs[0])):
        k0, v0 = kvs[0][layer]
        k = k0.new_zeros((len(kvs), k0.shape[1], width, k0.shape[3]))
        v = v0.new_zeros((len(kvs), v0.shape[1], width, v0.shape[3]))
        for b, kv in enumerate(kvs):
            k[b, :, width - lengths[b] :] = kv[layer][0][0]
            v[b, :, width - lengths[b] :] = kv[layer][1][0]
        keys.append(k)
        values.append(v)
    return keys, values, [width - t for t in lengths]


_ALIGN = 64  # bytes: a cache line, and the widest SIMD vector (AVX-512) a kernel may align its loads to


@dataclass(frozen=True)
class _Placement:
    """Where a level-2 sleep found a parameter: enough to re-allocate it so that kernels take the same path."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    misalign: int  # data_ptr() % _ALIGN

    @classmethod
    def of(cls, t: Tensor) -> _Placement:
        return cls(t.shape, t.stride(), t.dtype, t.data_ptr() % _ALIGN)

    def nan_tensor(self, device: torch.device) -> Tensor:
        """A NaN-filled tensor of this shape, strides and dtype whose first element is ``misalign`` bytes past a
        ``_ALIGN``-byte boundary (over-allocated by ``_ALIGN`` bytes to make room for the shift)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        span = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride)) if all(self.shape) else 0
        buf = torch.full((span + _ALIGN // itemsize,), float("nan"), dtype=self.dtype, device=device)
        shift = ((self.misalign - buf.data_ptr()) % _ALIGN) // itemsize
        return buf.as_strided(self.shape, self.stride, shift)


def _make_cache(kv: KV | None):
    """An HF ``DynamicCache`` holding ``kv`` without copying it (the model appends to it with ``torch.cat``)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    if kv is None:
        return cache
    try:
        from transformers.cache_utils import DynamicLayer

        for k, v in kv:
            layer = DynamicLayer()
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
            cache.layers.append(layer)
    except (ImportError, AttributeError, TypeError):  # other transformers versions: the copying constructor
        cache = DynamicCache(ddp_cache_data=kv)
    return cache


class TorchEngine:
    """In-process rollout engine over a Hugging Face causal LM (see the module docstring for the semantics).

    Args:
        model: an HF ``*ForCausalLM`` module with a standard (``DynamicCache``) KV cache. Put it on its device and
            dtype first; the engine calls ``eval()`` and never tracks gradients.
        batch_invariant: one forward per sequence and per token (exact under any concurrency, slow).
        prefix_cache_size: number of aborted requests whose KV is kept for resumption (LRU); 0 disables it.
        max_batch_size: most sequences stepped together; more requests wait for a free slot.
        max_model_len: longest prompt + output (default ``config.max_position_embeddings``); a generation reaching
            it ends with ``"length"``.
        version: initial weight version.
        record_routing: MoE models: record the experts each fed position was routed to
            (``Generation.routed_experts``, see :mod:`rlblocks.rollout.routing`); kept with the prefix cache;
            a re-prefill from position 0 (after a weight update) records every position again.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        batch_invariant: bool = False,
        prefix_cache_size: int = 64,
        max_batch_size: int = 256,
        max_model_len: int | None = None,
        version: int = 0,
        record_routing: bool = False,
    ) -> None:
        if max_batch_size < 1:
            raise ArgumentError(f"max_batch_size: expected >= 1, got {max_batch_size}")
        if prefix_cache_size < 0:
            raise ArgumentError(f"prefix_cache_size: expected >= 0, got {prefix_cache_size}")
        self.model = model.eval()
        cfg = getattr(model, "config", None)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        if max_model_len is None:
            max_model_len = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
        self.max_model_len = int(max_model_len)
        self.batch_invariant = bool(batch_invariant)
        self.prefix_cache_size = int(prefix_cache_size)
        self.max_batch_size = int(max_batch_size)
        self._version = int(version)
        params = inspect.signature(model.forward).parameters
        self._supports_logits_to_keep = "logits_to_keep" in params
        # transformers >= 5.24 names the KV-cache argument ``cache`` (``past_key_values=`` warns there and is
        # removed in 5.40); earlier releases only know ``past_key_values``. Pass whichever the model's forward takes.
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._device = next(model.parameters()).device
        self._layout = WeightLayout.from_module(model)
        self._stats = EngineStats()
        self._state = Lifecycle("TorchEngine")
        self._discarded: list[tuple[torch.nn.Parameter, _Placement]] = []  # level-2 sleep
        self._routing = RoutingRecorder(model) if record_routing else None
        self._seqs: dict[str, _Seq] = {}  # every request in flight, in submission order
        self._batch: _Batch | None = None  # the decode batch (batched mode)
        self._prefix: OrderedDict[tuple[int, ...], tuple[KV, int, Tensor | None]] = OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._lock: asyncio.Lock | None = None
        self._wake: asyncio.Event | None = None

    @classmethod
    def from_pretrained(
        cls, path: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device | None = None, **options: Any
    ) -> TorchEngine:
        """Load ``AutoModelForCausalLM`` from a checkpoint directory (``dtype``, ``device``: default CUDA if
        available, else CPU) and wrap it; ``options`` go to :class:`TorchEngine`."""
        from transformers import AutoModelForCausalLM

        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        return cls(model, **options)

    # ------------------------------------------------------------------ protocol
    @property
    def version(self) -> int:
        """The weight version that new tokens are tagged with (changes only after a whole update is loaded)."""
        return self._version

    @property
    def is_paused(self) -> bool:
        """True while the engine does not step: paused by :meth:`pause`, asleep, waiting for weights after a
        level-2 sleep, or inside an update that paused it."""
        return self._state.paused

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet returned (running, frozen or waiting)."""
        return len(self._seqs)

    def stats(self) -> dict:
        """The counters of :class:`EngineStats` as a dict."""
        return dataclasses.asdict(self._stats)

    def num_output_tokens(self, request_id: str) -> int | None:
        """Tokens generated so far by an in-flight request, or ``None`` if it is not in flight."""
        seq = self._seqs.get(request_id)
        return None if seq is None else len(seq.output_ids)

    async def generate(self, request: GenerationRequest) -> Generation:
        """Complete ``request``; returns its partial output with ``finish_reason="abort"`` if aborted. Requests
        submitted while paused (or asleep) wait for generation to resume. Raises
        :class:`~rlblocks.errors.ArgumentError` for a request id already in flight, token ids outside the vocabulary
        or a prompt of ``max_model_len`` tokens or more, and :class:`~rlblocks.errors.EngineError` once closed."""
        self._state.check_open()
        self._bind_loop()
        if not isinstance(request, GenerationRequest):
            raise ArgumentError(f"request: expected a GenerationRequest, got {type(request).__name__}")
        rid = request.request_id
        if rid in self._seqs:
            raise ArgumentError(f"request_id: {rid!r} is already in flight")
        bad = [t for t in request.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ArgumentError(f"prompt_ids: expected token ids in [0, {self.vocab_size}), got {bad[:5]}")
        if request.sampling.max_new_tokens == 0:
            return Generation(rid, list(request.prompt_ids), finish_reason="length")
        if len(request.prompt_ids) >= self.max_model_len:
            raise ArgumentError(
                f"prompt_ids: expected fewer than max_model_len={self.max_model_len} tokens, "
                f"got {len(request.prompt_ids)}"
            )
        seed = request.sampling.seed if request.sampling.seed is not None else random.getrandbits(62)
        seq = _Seq(request, self._loop.create_future(), int(seed), list(request.prompt_ids))
        self._seqs[rid] = seq
        self._wake.set()
        try:
            return await asyncio.shield(seq.future)
        except asyncio.CancelledError:
            if not seq.done:  # the caller went away: drop the request (its rows leave the batch next step)
                seq.done = True
                self._seqs.pop(rid, None)
            raise

    async def abort(self, request_ids: Iterable[str] | None = None) -> list[str]:
        """Abort in-flight requests (``None``: all) between steps; each returns its partial output with
        ``finish_reason="abort"``. Ids not in flight are ignored (documented no-op) and absent from the result."""
        self._state.check_open()
        self._bind_loop()
        wanted = None if request_ids is None else ([request_ids] if isinstance(request_ids, str) else list(request_ids))
        async with self._lock:
            return self._abort_locked(wanted)

    async def pause(self, mode: Literal["abort", "keep"] = "abort") -> None:
        """Stop stepping at the end of the current step. ``abort``: every request submitted before this call
        returns its partial output (``"abort"``); ``keep``: they are frozen (KV kept) and continue after
        :meth:`resume`. Requests submitted after this call wait for :meth:`resume`."""
        if mode not in ("abort", "keep"):
            raise ArgumentError(f"mode: expected 'abort' or 'keep', got {mode!r}")
        self._state.check_open()
        self._bind_loop()
        self._state.user_paused = True
        before = list(self._seqs)
        async with self._lock:
            if mode == "abort":
                self._abort_locked(before)

    async def resume(self) -> None:
        """Continue stepping (frozen and waiting requests proceed). Raises
        :class:`~rlblocks.errors.EngineError` while asleep or while a level-2 sleep's weights are missing."""
        self._state.check_resume()
        self._bind_loop()
        self._state.user_paused = False
        self._wake.set()

    async def update_weights(
        self,
        named_tensors: Iterable[tuple[str, Tensor]],
        *,
        version: int,
        partial: bool = False,
        allow_rollback: bool = False,
    ) -> None:
        """Load ``named_tensors`` (``state_dict()`` names) between steps and set ``version`` afterwards.

        The whole update is checked first (:mod:`rlblocks.rollout.engines._weights`; a refusal raises
        :class:`~rlblocks.errors.WeightUpdateError` with weights, caches and version unchanged). Pauses itself
        (keep) if not paused and resumes afterwards. After a level-2 sleep, a complete update is what lets the
        engine generate again. Weights may come in the block-FP8 wire format (``rlblocks.sync.quantize_named``):
        they are dequantised into the engine's dtype first (see :meth:`_dequantize_fp8`)."""
        self._state.check_open()
        self._bind_loop()
        version = check_update_version("TorchEngine", version, self._version, allow_rollback=allow_rollback)
        self._state.check_update(partial)
        items = self._layout.validate(self._dequantize_fp8(list(named_tensors)), engine="TorchEngine", partial=partial)
        targets = self._targets()
        self._state.updating += 1
        try:
            async with self._lock:
                # another update may have committed while this one waited for the step to end
                version = check_update_version("TorchEngine", version, self._version, allow_rollback=allow_rollback)
                self._state.check_update(partial)
                with torch.no_grad():
                    for name, t in items:
                        targets[name].copy_(t.to(targets[name].device))
                self._invalidate_kv()
                self._version = version
                if not partial:
                    self._state.on_complete_update()
        finally:
            self._state.updating -= 1
            self._wake.set()

    def _dequantize_fp8(self, items: list) -> list:
        """FP8 hook of :meth:`update_weights`: an update in the block-FP8 wire format of :mod:`rlblocks.sync.fp8`
        (``name`` as ``float8_e4m3fn`` plus ``name + "_scale_inv"``, 128 x 128 blocks) is dequantised here, each pair
        into one tensor of the weight's own dtype (``float32(q) * scale`` rounded once), so the engine computes with
        exactly the weights an FP8 engine holds. Anything else passes through untouched. A float8 tensor without its
        scales, or scales without their weight, is refused like any other bad update."""
        from rlblocks.sync.fp8 import FP8_DTYPE, SCALE_SUFFIX, dequantize_named

        specs = self._layout.specs
        if not any(
            isinstance(it, tuple | list) and len(it) == 2 and isinstance(it[0], str) and isinstance(it[1], Tensor)
            and (it[1].dtype == FP8_DTYPE or (it[0].endswith(SCALE_SUFFIX) and it[0] not in specs))
            for it in items
        ):
            return items
        own = {n: s.dtype or torch.float32 for n, s in specs.items()}
        try:
            return dequantize_named(items, dtype=own, own=own)
        except ArgumentError as e:
            raise refuse("TorchEngine", str(e)) from None

    def _targets(self) -> dict[str, Tensor]:
        """Every tensor an update may write, by ``state_dict()`` name (buffers included)."""
        targets = dict(self.model.state_dict(keep_vars=True))
        targets.update(dict(self.model.named_buffers()))
        return targets

    async def sleep(self, level: int = 1) -> None:
        """Sleep as the protocol defines it: every request in flight returns its partial output
        (``finish_reason="abort"``), every KV cache is dropped, new requests wait. Level 1 keeps the weights (moved
        to CPU on CUDA; :meth:`wake` moves them back). Level 2 frees the parameters' storage: after :meth:`wake`,
        a complete :meth:`update_weights` must load weights before the engine generates again. Sleeping again at
        the same level is a no-op."""
        if not self._state.check_sleep(level):
            return
        self._bind_loop()
        self._state.on_sleep(level)  # paused from here on: no new step starts
        async with self._lock:
            self._abort_locked(None, keep_kv=False)
            self._invalidate_kv()
            on_device = self._device.type != "cpu"
            if level == 1 and on_device:
                self.model.to("cpu")
            if level == 2:
                self._discarded = [(p, _Placement.of(p)) for p in self.model.parameters()]
                for p, placement in self._discarded:
                    p.data = torch.empty(0, dtype=placement.dtype, device=p.device)
            if on_device and torch.cuda.is_available():
                torch.cuda.empty_cache()

    async def wake(self) -> None:
        """Undo :meth:`sleep`: level 1 brings the weights back and generation resumes (unless :meth:`pause` was
        called before the sleep); level 2 re-allocates the parameters (NaN-filled, each with the shape, strides,
        dtype and 64-byte address alignment it had before the sleep, so that kernels take the same code path) and
        generation resumes after the next complete :meth:`update_weights`. A no-op when awake."""
        self._state.check_open()
        self._bind_loop()
        async with self._lock:
            if not self._state.sleep_level:
                return
            if self._state.sleep_level == 1 and self._device.type != "cpu":
                self.model.to(self._device)
            if self._state.sleep_level == 2:
                for p, placement in self._discarded:  # the layout of before the sleep: the same kernel paths
                    p.data = placement.nan_tensor(self._device)
                self._discarded = []
                self.model.to(self._device)  # buffers too, had they moved
            self._state.on_wake()
        self._wake.set()

    def close(self) -> None:
        """Release the engine: every request in flight returns its partial output (``finish_reason="abort"``),
        the KV caches are freed, the engine loop stops, and every later call raises
        :class:`~rlblocks.errors.EngineError`. Idempotent; callable from any thread or after the event loop ended."""
        if self._state.closed:
            return
        self._state.closed = True
        loop = self._loop
        if loop is None or loop.is_closed():
            self._close_now(resolve=False)  # no one can await these futures any more
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not loop and loop.is_running():
            loop.call_soon_threadsafe(self._close_now)
        else:
            self._close_now()

    async def aclose(self) -> None:
        """:meth:`close` from inside the engine's event loop, waiting for the current step to end first."""
        if self._state.closed:
            return
        if self._lock is not None and self._loop is asyncio.get_running_loop():
            async with self._lock:
                self.close()
        else:
            self.close()
        task = self._task
        if task is not None and not task.done() and task.get_loop() is asyncio.get_running_loop():
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _close_now(self, resolve: bool = True) -> None:
        for seq in list(self._seqs.values()):
            if resolve:
                self._finish(seq, "abort")
            else:
                seq.done = True
        self._seqs.clear()
        self._batch = None
        self._prefix.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def __enter__(self) -> TorchEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ loop
    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop = loop
            self._lock = asyncio.Lock()
            self._wake = asyncio.Event()
            self._seqs.clear()
            self._batch = None
            self._task = None
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run())

    def _has_work(self) -> bool:
        return not self._state.paused and bool(self._seqs)

    async def _run(self) -> None:
        while True:
            if not self._has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self._lock:
                if not self._has_work():
                    continue
                try:
                    plan = self._plan()
                    result = await asyncio.to_thread(self._compute, plan)
                    self._apply(result)
                except Exception as exc:  # fail every waiting caller rather than hang; the loop lives on
                    err = EngineError(
                        f"TorchEngine: a forward step failed ({type(exc).__name__}: {exc}); the "
                        f"{len(self._seqs)} request(s) in flight failed with it and the engine goes on"
                    )
                    err.__cause__ = exc
                    for seq in list(self._seqs.values()):
                        seq.done = True
                        if not seq.future.done():
                            seq.future.set_exception(err)
                    self._seqs.clear()
                    self._batch = None
            await asyncio.sleep(0)  # let pause/abort/update take the lock between steps

    # ------------------------------------------------------------------ scheduling (event loop, under lock)
    def _plan(self) -> list[_Seq]:
        """The sequences stepped this step (at most ``max_batch_size``, oldest first); prefix-cache lookup for
        newcomers."""
        live = [s for s in self._seqs.values() if not s.done][: self.max_batch_size]
        for seq in live:
            if seq.kv is None and seq.n_cached == 0 and not self._in_batch(seq):
                self._lookup_prefix(seq)
        return live

    def _in_batch(self, seq: _Seq) -> bool:
        return self._batch is not None and any(s is seq for s in self._batch.seqs)

    def _lookup_prefix(self, seq: _Seq) -> None:
        if not self._prefix:
            return
        best = None
        for key, (_kv, ver, _routed) in self._prefix.items():
            n = len(key)
            if ver == self._version and n < len(seq.tokens) and (best is None or n > len(best)):
                if tuple(seq.tokens[:n]) == key:
                    best = key
        if best is not None:
            kv, _, routed = self._prefix.pop(best)
            seq.kv, seq.n_cached = kv, len(best)
            seq.routed = [] if routed is None else [routed]
            self._stats.prefix_cache_hits += 1
            self._stats.prefix_cache_reused_tokens += len(best)

    def _store_prefix(self, seq: _Seq, kv: KV | None, n_cached: int) -> None:
        if self.prefix_cache_size == 0 or kv is None or n_cached == 0:
            return
        key = tuple(seq.tokens[:n_cached])
        routed = torch.cat(seq.routed)[:n_cached] if self._routing is not None and seq.routed else None
        self._prefix[key] = ([(k.clone(), v.clone()) for k, v in kv], self._version, routed)  # own memory
        self._prefix.move_to_end(key)
        while len(self._prefix) > self.prefix_cache_size:
            self._prefix.popitem(last=False)

    def _take_kv(self, seq: _Seq) -> tuple[KV | None, int]:
        """The KV of ``seq`` (its own, or its row of the decode batch) and how many tokens it covers."""
        if self._batch is not None:
            for b, s in enumerate(self._batch.seqs):
                if s is seq:
                    return self._batch.row_kv(b), self._batch.width - self._batch.pads[b]
        return seq.kv, seq.n_cached

    def _abort_locked(self, wanted: list[str] | None, *, keep_kv: bool = True) -> list[str]:
        """Abort ``wanted`` (``None``: all); with ``keep_kv`` their KV goes to the prefix cache for the resume."""
        ids = list(self._seqs) if wanted is None else [r for r in wanted if r in self._seqs]
        for rid in ids:
            seq = self._seqs.pop(rid)
            if keep_kv:
                kv, n = self._take_kv(seq)
                self._store_prefix(seq, kv, n)
            self._finish(seq, "abort")
        if ids and self._batch is not None:
            self._batch = self._drop_rows(self._batch)
        return ids

    def _invalidate_kv(self) -> None:
        """Forget every KV computed under the current weights: prefix cache, decode batch, frozen requests."""
        self._prefix.clear()
        self._batch = None
        for seq in self._seqs.values():
            seq.kv, seq.n_cached = None, 0

    def _finish(self, seq: _Seq, reason: str) -> None:
        seq.done = True
        seq.kv = None
        if not seq.future.done():
            seq.future.set_result(
                Generation(
                    seq.rid,
                    list(seq.request.prompt_ids),
                    seq.output_ids,
                    seq.output_logprobs,
                    seq.output_versions,
                    finish_reason=reason,
                    routed_experts=None if self._routing is None else self._routing_record(seq),
                )
            )

    def _routing_record(self, seq: _Seq) -> Tensor:
        spec = self._routing.spec
        return torch.cat(seq.routed) if seq.routed else torch.empty((0, spec.num_layers, spec.top_k), dtype=spec.dtype)

    def _drop_rows(self, batch: _Batch) -> _Batch | None:
        return self._select_rows(batch, [s for s in batch.seqs if not s.done])

    # ------------------------------------------------------------------ compute (worker thread)
    def _forward(
        self, input_ids: Tensor, kv: KV | None, attention_mask: Tensor, position_ids: Tensor, seqs: list[_Seq],
        restart: bool = False,
    ):
        cache = _make_cache(kv)
        kwargs: dict[str, Any] = {self._cache_arg: cache, "use_cache": True}
        if self._supports_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        with self._routing if self._routing is not None else contextlib.nullcontext():
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        if self._routing is not None:  # row b of this forward: the routing of seqs[b]'s fed positions
            rows = self._routing.take().view(*input_ids.shape, self._routing.spec.num_layers, -1)
            for b, seq in enumerate(seqs):
                if restart:  # a prefill from position 0 (e.g. after a weight update) replaces the old rows
                    seq.routed = []
                seq.routed.append(rows[b])
        self._stats.forwards += 1
        # A Cache is updated in place by the forward: read the keys and values from the object we passed rather
        # than from the output, whose field is also being renamed (``past_key_values`` -> ``cache``).
        new_kv = [(layer.keys, layer.values) for layer in cache.layers]
        return out.logits[:, -1, :].float(), new_kv

    def _compute(self, live: list[_Seq]) -> list[tuple[_Seq, int, float] | None]:
        try:
            with torch.inference_mode():
                return self._compute_invariant(live) if self.batch_invariant else self._compute_batched(live)
        finally:
            if self._state.closed:  # closed while this step ran: do not keep its decode batch alive
                self._batch = None

    def _prefill_group(self, group: list[_Seq], n_cached: int, m: int) -> tuple[Tensor, KV]:
        dev = self._device
        ids = torch.tensor([s.tokens[n_cached : n_cached + m] for s in group], device=dev)
        pos = torch.arange(n_cached, n_cached + m, device=dev).unsqueeze(0).expand(len(group), m)
        mask = torch.ones((len(group), n_cached + m), dtype=torch.long, device=dev)
        kv = None
        if n_cached > 0:
            kv = [
                (torch.cat([s.kv[layer][0] for s in group]), torch.cat([s.kv[layer][1] for s in group]))
                for layer in range(len(group[0].kv))
            ]
        self._stats.prefill_tokens += len(group) * m
        return self._forward(ids, kv, mask, pos, group, restart=n_cached == 0)

    def _compute_invariant(self, live: list[_Seq]) -> list[tuple[_Seq, int, float] | None]:
        """One forward per sequence, one token each: tokens[n_cached] is fed; sample if it was the last one."""
        self._batch = None
        sampled: list[tuple[_Seq, Tensor]] = []
        for seq in live:
            logits, kv = self._prefill_group([seq], seq.n_cached, 1)
            seq.kv, seq.n_cached = kv, seq.n_cached + 1
            if seq.n_cached == len(seq.tokens):
                sampled.append((seq, logits))
        out: list[tuple[_Seq, int, float] | None] = []
        if sampled:
            out.extend(self._sample([s for s, _ in sampled], torch.cat([lg for _, lg in sampled])))
        return out

    def _compute_batched(self, live: list[_Seq]) -> list[tuple[_Seq, int, float] | None]:
        in_batch = set()
        if self._batch is not None:
            in_batch = {id(s) for s in self._batch.seqs}
        decode = [s for s in live if id(s) in in_batch]
        newcomers = [s for s in live if id(s) not in in_batch]
        seqs: list[_Seq] = []
        logits_parts: list[Tensor] = []
        # 1) decode the batch (rows that left are dropped; the remaining ones each feed their last token)
        if self._batch is not None:
            batch = self._batch
            if len(decode) != len(batch.seqs):  # rows of cancelled requests leave
                batch = self._select_rows(batch, decode)
            self._batch = batch
            if batch is not None:
                logits, kv = self._decode(batch)
                batch.keys = [k for k, _ in kv]
                batch.values = [v for _, v in kv]
                seqs.extend(batch.seqs)
                logits_parts.append(logits)
        # 2) prefill newcomers, grouped by (cached length, tokens to feed) so that no padding is needed
        groups: dict[tuple[int, int], list[_Seq]] = {}
        for s in newcomers:
            groups.setdefault((s.n_cached, len(s.tokens) - s.n_cached), []).append(s)
        joined: list[_Seq] = []
        for (n_cached, m), group in groups.items():
            logits, kv = self._prefill_group(group, n_cached, m)
            for b, s in enumerate(group):
                s.kv = [(k[b : b + 1], v[b : b + 1]) for k, v in kv]
                s.n_cached = n_cached + m
            seqs.extend(group)
            joined.extend(group)
            logits_parts.append(logits)
        # 3) the newcomers join the decode batch for the next step
        if joined:
            members = ([] if self._batch is None else list(self._batch.seqs)) + joined
            kvs = [self._batch.row_kv(b) for b in range(len(self._batch.seqs))] if self._batch is not None else []
            kvs += [s.kv for s in joined]
            keys, values, pads = _left_pad_stack(kvs)
            self._batch = _Batch(members, keys, values, pads)
            for s in joined:
                s.kv = None
        if not seqs:
            return []
        return self._sample(seqs, torch.cat(logits_parts))

    def _select_rows(self, batch: _Batch, keep_seqs: list[_Seq]) -> _Batch | None:
        pos = {id(s): b for b, s in enumerate(batch.seqs)}
        keep = [pos[id(s)] for s in keep_seqs]
        if not keep:
            return None
        idx = torch.tensor(keep, device=batch.keys[0].device)
        trim = min(batch.pads[b] for b in keep)
        return _Batch(
            [batch.seqs[b] for b in keep],
            [k.index_select(0, idx)[:, :, trim:] for k in batch.keys],
            [v.index_select(0, idx)[:, :, trim:] for v in batch.values],
            [batch.pads[b] - trim for b in keep],
        )

    def _decode(self, batch: _Batch) -> tuple[Tensor, KV]:
        dev = self._device
        width, n = batch.width, len(batch.seqs)
        ids = torch.tensor([[s.tokens[-1]] for s in batch.seqs], device=dev)
        mask = torch.ones((n, width + 1), dtype=torch.long, device=dev)
        for b, p in enumerate(batch.pads):
            if p:
                mask[b, :p] = 0
        pos = torch.tensor([[width - p] for p in batch.pads], device=dev)
        self._stats.decode_tokens += n
        return self._forward(ids, list(zip(batch.keys, batch.values)), mask, pos, batch.seqs)

    def _sample(self, seqs: list[_Seq], logits: Float[Tensor, "B V"]) -> list[tuple[_Seq, int, float]]:
        """Pick one token per row (greedy argmax or inverse-CDF draw from the processed distribution)."""
        dev = logits.device
        sp = [s.request.sampling for s in seqs]
        temp = torch.tensor([p.temperature for p in sp], dtype=torch.float32, device=dev)
        greedy = temp == 0
        top_k = torch.tensor([-1 if p.temperature == 0 else p.top_k for p in sp], dtype=torch.long, device=dev)
        top_p = torch.tensor([1.0 if p.temperature == 0 else p.top_p for p in sp], dtype=torch.float32, device=dev)
        logp = processed_logprobs(logits, temp, top_k, top_p)
        tokens = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            u = torch.tensor([_uniform(s.seed, len(s.tokens)) for s in seqs], dtype=torch.float64)
            cdf = torch.cumsum(logp.double().exp(), dim=-1)
            target = (u.to(dev) * cdf[:, -1]).unsqueeze(-1)
            drawn = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_max(logits.shape[-1] - 1)
            # never return a token outside the support (only reachable through float rounding at the very top)
            drawn = torch.where(
                torch.isfinite(logp.gather(-1, drawn.unsqueeze(-1)).squeeze(-1)), drawn, logp.argmax(dim=-1)
            )
            tokens = torch.where(greedy, tokens, drawn)
        lps = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return list(zip(seqs, tokens.tolist(), lps.tolist()))

    # ------------------------------------------------------------------ results (event loop, under lock)
    def _apply(self, result: list[tuple[_Seq, int, float] | None]) -> None:
        self._stats.steps += 1
        finished = False
        for item in result:
            if item is None:
                continue
            seq, token, lp = item
            if seq.done:
                finished = True
                continue
            seq.tokens.append(token)
            seq.output_ids.append(token)
            seq.output_logprobs.append(lp)
            seq.output_versions.append(self._version)
            sp = seq.request.sampling
            reason = None
            if token in sp.stop_token_ids:
                reason = "stop"
            elif len(seq.output_ids) >= sp.max_new_tokens or len(seq.tokens) >= self.max_model_len:
                reason = "length"
            if reason is not None:
                self._seqs.pop(seq.rid, None)
                self._finish(seq, reason)
                finished = True
        if finished and self._batch is not None:
            self._batch = self._drop_rows(self._batch)
