"""Client-side resumable generation over any :class:`~rlblocks.rollout.types.RolloutEngine` (AReaL ``agenerate``).

Contract (AReaL's partial-rollout loop, written out): keep ``(prompt, out_ids, out_logprobs, out_versions,
budget)``; whenever the engine returns ``finish_reason="abort"`` (pause for a weight update, a sleep, an explicit
abort), re-submit ``prompt + out_ids`` with ``max_new_tokens = budget - len(out_ids)`` and append what comes back.
The loop ends on ``"stop"``, ``"length"`` or when the budget is spent (an abort with no budget left is reported as
``"length"``). An abort before any token is not an error: the request is simply re-submitted. The resumed prefix
is re-prefilled by the engine under whatever weights it has then; the earlier tokens keep the version and logprob
of the policy that sampled them, so a generation can span several versions (``version_spans()``), and ``stale`` /
``loss_mask`` let the caller mask tokens produced under versions older than the final one.

Paused engines: a re-submission to a paused (or sleeping) engine either waits inside the engine (TorchEngine,
vLLM, SGLang) or comes back aborted with no token. In the latter case the loop waits, polling ``engine.is_paused``
when the engine has it and backing off exponentially otherwise, so a client loop survives pause ->
update_weights -> resume.
To stop a resumable generation for good, cancel its task (an engine-side abort only interrupts it).
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field

from rlblocks.errors import ArgumentError

from .moe_replay import concat_routing
from .types import Generation, GenerationRequest, RolloutEngine

__all__ = ["ResumableResult", "resumable_generate"]


@dataclass
class ResumableResult(Generation):
    """A :class:`Generation` stitched from one or more engine calls, plus how it was produced.

    ``final_version``: the version of the last token (the engine's version if there is none).
    ``stale[i]``: ``output_versions[i] < final_version``. ``loss_mask[i]``: ``not stale[i]`` when the call asked
    for ``mask_stale=True``, else ``True`` for every token. ``num_submissions``: engine calls made (1 + resumes);
    ``resubmitted_tokens``: prompt + partial tokens sent again on resumes (an upper bound on the re-prefill cost;
    an engine with a prefix cache may reuse part of it).
    """

    final_version: int = 0
    stale: list[bool] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    num_submissions: int = 0
    resubmitted_tokens: int = 0

    @property
    def num_stale_tokens(self) -> int:
        return sum(self.stale)


async def _wait_for_engine(engine: RolloutEngine, delay: float, poll_interval: float) -> None:
    paused = getattr(engine, "is_paused", None)
    if isinstance(paused, bool):
        while getattr(engine, "is_paused", False):
            await asyncio.sleep(poll_interval)
    else:
        await asyncio.sleep(delay)


async def resumable_generate(
    engine: RolloutEngine,
    request: GenerationRequest,
    *,
    mask_stale: bool = False,
    max_submissions: int | None = None,
    poll_interval: float = 0.01,
    max_backoff: float = 1.0,
) -> ResumableResult:
    """Generate ``request`` to completion across aborts, re-submitting ``prompt + partial`` each time.

    Args:
        engine: any engine of the protocol (the same one is used for every re-submission; a Router keeps the
            request on one engine through ``session_id``).
        request: ``request.sampling.max_new_tokens`` is the total budget; the same ``request_id``, ``seed`` and
            ``session_id`` are used for every re-submission.
        mask_stale: set ``loss_mask`` to False for tokens whose version is older than the final one.
        max_submissions: most engine calls (``None``: unbounded). When reached after an abort, the partial
            result is returned with ``finish_reason="abort"``.
        poll_interval: seconds between ``engine.is_paused`` polls while waiting for a resume.
        max_backoff: cap of the exponential back-off after aborts that produced no token.

    Returns:
        A :class:`ResumableResult` whose ``prompt_ids`` is the original prompt and whose outputs are the
        concatenation of every call's outputs (ids, fp32 logprobs, versions: never dropped).
    """
    if not isinstance(request, GenerationRequest):
        raise ArgumentError(f"request: expected a GenerationRequest, got {type(request).__name__}")
    if max_submissions is not None and max_submissions < 1:
        raise ArgumentError(f"max_submissions: expected >= 1 or None, got {max_submissions}")
    prompt = list(request.prompt_ids)
    budget = request.sampling.max_new_tokens
    out_ids: list[int] = []
    out_lps: list[float] = []
    out_vers: list[int] = []
    routing: list = []  # each call's routed_experts (from position 0); merged first-record-wins
    submissions = 0
    resubmitted = 0
    backoff = poll_interval
    reason = "length"
    while True:
        left = budget - len(out_ids)
        if left <= 0:
            reason = "length"
            break
        if max_submissions is not None and submissions >= max_submissions:
            reason = "abort"
            break
        sub = dataclasses.replace(
            request,
            prompt_ids=prompt + out_ids,
            sampling=dataclasses.replace(request.sampling, max_new_tokens=left),
        )
        if submissions:
            resubmitted += len(sub.prompt_ids)
        submissions += 1
        gen = await engine.generate(sub)
        out_ids += gen.output_ids
        out_lps += gen.output_logprobs
        out_vers += gen.output_versions
        if gen.routed_experts is not None:
            routing.append(gen.routed_experts)
        if gen.finish_reason != "abort":
            reason = gen.finish_reason
            break
        if gen.output_ids:
            backoff = poll_interval
        else:  # aborted before any token: the engine may be paused; wait before re-submitting
            await _wait_for_engine(engine, backoff, poll_interval)
            backoff = min(2 * backoff, max_backoff)
    final = out_vers[-1] if out_vers else int(engine.version)
    stale = [v < final for v in out_vers]
    return ResumableResult(
        request_id=request.request_id,
        prompt_ids=prompt,
        output_ids=out_ids,
        output_logprobs=out_lps,
        output_versions=out_vers,
        finish_reason=reason,
        final_version=final,
        stale=stale,
        loss_mask=[not s for s in stale] if mask_stale else [True] * len(stale),
        num_submissions=submissions,
        resubmitted_tokens=resubmitted,
        routed_experts=concat_routing(routing) if routing else None,
    )
