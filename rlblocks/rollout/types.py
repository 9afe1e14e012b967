"""Types shared by every rollout engine: sampling parameters, requests, generations, and the engine protocol.

Conventions
-----------
- ``output_logprobs[i]`` is ``log p(output_ids[i] | prefix)`` under the **sampling distribution actually used**:
  logits divided by ``temperature``, then restricted by top-k and top-p and renormalised ("processed" logprobs,
  vLLM's ``logprobs_mode="processed_logprobs"``). With temperature 1 and no top-k/top-p this is the model's
  log-softmax. The values are fp32 numbers (stored as Python floats that are exactly representable in fp32).
- ``output_versions[i]`` is the policy (weight) version that produced token ``i``. A generation interrupted by a
  weight update carries several versions; :meth:`Generation.version_spans` lists them.
- ``finish_reason``: ``"stop"`` (a stop token was sampled; it is included in ``output_ids``), ``"length"``
  (``max_new_tokens`` reached) or ``"abort"`` (interrupted; the partial output is kept, never dropped).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch
from torch import Tensor

from rlblocks._checks import check_int, check_int_list, check_logprob_list, check_real, check_token_ids
from rlblocks.errors import ArgumentError

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings.

    ``top_k <= 0`` and ``top_p == 1.0`` disable those filters. ``temperature == 0`` means greedy decoding; its
    logprobs are then those of the untempered distribution (temperature 1), as in vLLM.
    ``seed`` makes sampling reproducible per request where the engine supports it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        temperature = check_real("temperature", self.temperature)
        if not (math.isfinite(temperature) and temperature >= 0.0):
            raise ArgumentError(f"temperature: expected a finite number >= 0, got {self.temperature!r}")
        top_p = check_real("top_p", self.top_p)
        if not (0.0 < top_p <= 1.0):
            raise ArgumentError(f"top_p: expected a value in (0, 1], got {self.top_p!r}")
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "top_k", check_int("top_k", self.top_k, what="an int (<= 0 disables it)"))
        object.__setattr__(self, "max_new_tokens", check_int("max_new_tokens", self.max_new_tokens, minimum=0))
        if self.seed is not None:
            object.__setattr__(self, "seed", check_int("seed", self.seed))
        ids = tuple(check_int(f"stop_token_ids[{i}]", t, minimum=0) for i, t in enumerate(self.stop_token_ids))
        object.__setattr__(self, "stop_token_ids", ids)


@dataclass
class GenerationRequest:
    """One prompt to complete. ``session_id`` groups requests that should land on the same engine (prefix cache)."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    session_id: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ArgumentError(f"request_id: expected a non-empty str, got {self.request_id!r}")
        # one pass over a list of plain ints: a per-token check that builds a name string per token dominated the
        # gateway's per-request CPU time on long prompts
        self.prompt_ids = check_token_ids("prompt_ids", self.prompt_ids)
        if len(self.prompt_ids) == 0:
            raise ArgumentError("prompt_ids: expected at least one token, got an empty list")


@dataclass
class Generation:
    """The result of one request. Invariant: ``len(output_ids) == len(output_logprobs) == len(output_versions)``.

    Values no engine can produce are refused on construction with :class:`~rlblocks.errors.ArgumentError` naming
    the field and the element: a token id that is not an int ``>= 0``, a log-prob that is NaN or above 0 (fp32
    rounding up to ``1e-3`` above 0 passes unchanged: a log-softmax of a near-certain token can round there), a
    version that is not an int ``>= 0``. ``build_batch`` checks them again (and the vocabulary, given
    ``vocab_size``), since the lists may change after construction.
    """

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason = "length"
    # MoE routing replay: uint8/uint16 [positions, MoE layers, top_k], row j = sequence position j of
    # prompt_ids + output_ids (len(prompt) + len(output) - 1 rows once finished); see rlblocks.rollout.moe_replay.
    routed_experts: Tensor | None = None

    def __post_init__(self) -> None:
        check_outputs(self)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    def logprobs_tensor(self) -> Tensor:
        """``output_logprobs`` as a float32 tensor ``[num_output_tokens]``."""
        return torch.tensor(self.output_logprobs, dtype=torch.float32)

    def versions_tensor(self) -> Tensor:
        """``output_versions`` as an int64 tensor ``[num_output_tokens]``."""
        return torch.tensor(self.output_versions, dtype=torch.int64)

    def version_spans(self) -> list[tuple[int, int, int]]:
        """Runs of equal version as ``(version, start, end)`` over output positions, ``end`` exclusive."""
        spans: list[tuple[int, int, int]] = []
        for i, v in enumerate(self.output_versions):
            if spans and spans[-1][0] == v:
                spans[-1] = (v, spans[-1][1], i + 1)
            else:
                spans.append((v, i, i + 1))
        return spans


def check_outputs(g: Generation, *, name: str = "", vocab_size: int | None = None) -> None:
    """Check, in place, the values of a generation that no engine can produce, so that they never reach the
    training tensors: token ids (prompt and output) that are not ints ``>= 0`` (``< vocab_size`` when given),
    log-probs that are NaN or ``> 0`` (beyond :data:`~rlblocks._checks.LOGPROB_SLACK` of fp32 rounding, which
    passes unchanged), versions that are not ints ``>= 0``, lists of different lengths, an unknown
    ``finish_reason`` and a malformed ``routed_experts``. The lists are replaced by checked copies (plain ints and
    floats). Raises :class:`~rlblocks.errors.ArgumentError` naming the field (prefixed by ``name``, e.g.
    ``generations[3].``) and the first bad element. Run by ``Generation`` on construction and by ``build_batch``
    (a generation's lists may have changed since)."""
    g.prompt_ids = check_token_ids(f"{name}prompt_ids", g.prompt_ids, vocab_size=vocab_size)
    g.output_ids = check_token_ids(f"{name}output_ids", g.output_ids, vocab_size=vocab_size)
    g.output_logprobs = check_logprob_list(f"{name}output_logprobs", g.output_logprobs)
    versions = g.output_versions
    if not (type(versions) is list and set(map(type, versions)) <= {int} and (not versions or min(versions) >= 0)):
        versions = check_int_list(f"{name}output_versions", versions, minimum=0)
    g.output_versions = list(versions)
    n = len(g.output_ids)
    if len(g.output_logprobs) != n or len(g.output_versions) != n:
        raise ArgumentError(
            f"{name or 'Generation: '}output_ids, output_logprobs and output_versions must have one entry per "
            f"token, got {n}, {len(g.output_logprobs)} and {len(g.output_versions)}"
        )
    if g.finish_reason not in FINISH_REASONS:
        raise ArgumentError(f"{name}finish_reason: expected one of {FINISH_REASONS}, got {g.finish_reason!r}")
    r = g.routed_experts
    if r is not None and not (
        isinstance(r, Tensor) and r.dim() == 3 and r.dtype in (torch.uint8, torch.uint16)
        and r.shape[0] <= len(g.prompt_ids) + n
    ):
        got = list(r.shape) if isinstance(r, Tensor) else type(r).__name__
        raise ArgumentError(
            f"{name}routed_experts: expected a uint8/uint16 tensor [<= {len(g.prompt_ids) + n}, layers, top_k], "
            f"got {got}"
        )


@runtime_checkable
class RolloutEngine(Protocol):
    """What every engine implements (TorchEngine, VLLMEngine, SGLangEngine, Router).

    Weight updates
    --------------
    ``update_weights(named_tensors, *, version, partial=False, allow_rollback=False)`` follows *quiesce, swap,
    commit, resume*: it runs only while the engine is paused (it pauses itself otherwise, and resumes afterwards if
    it did), loads every tensor, invalidates prefix/KV caches computed under the old weights, and only then makes
    ``version`` visible. Every engine checks the update with one rule before anything is touched (see
    :mod:`rlblocks.rollout.engines._weights`): an empty update, unknown names, duplicates, wrong shapes or dtypes,
    non-finite values, a partial update without ``partial=True``, tied aliases with different values and ``version <
    engine.version`` without ``allow_rollback=True`` raise :class:`~rlblocks.errors.WeightUpdateError`;
    ``version == engine.version`` re-loads the current version.

    Sleep and wake (one meaning on every engine)
    --------------------------------------------
    ``sleep(level=1)`` gives the accelerator memory back between rollout phases (e.g. a trainer on the same GPU):

    - **In-flight requests**: every request in flight — running, waiting, or frozen by ``pause("keep")`` — is
      aborted: its ``generate`` call returns the partial output with ``finish_reason="abort"`` (what
      :func:`~rlblocks.rollout.resume.resumable_generate` re-submits after the wake). Nothing survives a sleep, so
      no request can continue on weights the sleep discarded. Requests submitted while asleep wait, as while
      paused; ``is_paused`` is True.
    - **Caches**: prefix and KV caches are dropped at both levels.
    - **Level 1**: the weights are kept (offloaded to host memory where the engine can) and :meth:`wake` restores
      them; ``version`` is unchanged.
    - **Level 2**: the weights are discarded. ``version`` is unchanged (it names the weights the engine will be given
      back), but after :meth:`wake` the engine stays paused until a complete ``update_weights`` (``partial=False``)
      has loaded weights; that update resumes generation. Until then a partial update is refused
      (``WeightUpdateError``) and :meth:`resume` raises :class:`~rlblocks.errors.EngineError`.
    - **Wake** restores what the sleep released and resumes generation (for level 2: at the next complete update),
      unless the engine had been paused by :meth:`pause` before the sleep: that pause still holds after the wake.
    - Sleeping again at the same level and waking an awake engine are no-ops; sleeping at another level,
      ``update_weights`` and ``resume`` while asleep raise ``EngineError``.
    - An engine that cannot release memory (CPU builds) still follows every rule above; only the release itself is
      skipped (each engine documents what it frees).

    Release
    -------
    ``close()`` (sync, idempotent; ``aclose()`` inside the event loop) releases the engine. In-flight requests
    return their partial output (``finish_reason="abort"``) where the engine can still produce it; every later call
    raises ``EngineError``.
    """

    @property
    def version(self) -> int: ...

    @property
    def is_paused(self) -> bool:
        """True while the engine does not generate (paused, asleep, or waiting for weights after a level-2 sleep)."""
        ...

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet returned."""
        ...

    def stats(self) -> dict:
        """The engine's counters as a plain dict."""
        ...

    async def generate(self, request: GenerationRequest) -> Generation:
        """Complete one request. An aborted request returns its partial output with ``finish_reason="abort"``."""
        ...

    async def abort(self, request_ids: Iterable[str] | None = None) -> list[str]:
        """Abort the named in-flight requests (``None``: all). Returns the ids actually aborted. Never raises for
        an id that is not in flight: such an id is simply absent from the returned list (documented no-op)."""
        ...

    async def pause(self, mode: Literal["abort", "keep"] = "abort") -> None:
        """Stop generating. ``abort``: in-flight requests return their partial output (``finish_reason="abort"``).
        ``keep``: in-flight requests are frozen and continue after :meth:`resume`. New requests wait for resume."""
        ...

    async def resume(self) -> None: ...

    async def update_weights(
        self,
        named_tensors: Iterable[tuple[str, Tensor]],
        *,
        version: int,
        partial: bool = False,
        allow_rollback: bool = False,
    ) -> None: ...

    async def sleep(self, level: int = 1) -> None: ...

    async def wake(self) -> None: ...

    def close(self) -> None: ...
