"""Multi-turn agent episodes over any :class:`~rlblocks.rollout.types.RolloutEngine`: an async ``Env`` protocol,
:func:`generate_turn` and :func:`run_episode`.

Episode loop (:func:`run_episode`): the environment's first messages are rendered with the tokenizer's chat
template into a :class:`~rlblocks.rollout.agents.Trajectory`; then, per turn,

1. the whole trajectory is the prompt of one :func:`generate_turn`: every engine call goes through
   :func:`~rlblocks.rollout.resume.resumable_generate`, so a weight update in the middle of a turn keeps the
   version and logprob of every token already sampled and the turn resumes under the new weights;
2. the turn ends on a stop token (the template's end-of-turn token) or on a closing tool-call tag
   (``</tool_call>``): a tag that is one token is a stop token; a multi-token tag stops generation on its last
   token and the turn ends only if the decoded turn then ends with the tag (otherwise generation continues);
3. the model's tokens are appended as they are (never re-tokenised); the decoded text is the action given to
   ``env.step``; the environment's observation messages are appended as a chat-template DELTA: the conversation
   is rendered to text and only what follows the trajectory's own text (the observation, the template's glue,
   the generation prompt) is tokenised and appended (:meth:`~rlblocks.rollout.agents.Trajectory.text_delta`);
   a template that rewrote history falls back to the token-level prefix check, and branches (counted).

Every request of one episode carries the episode's ``session_id``, so a :class:`~rlblocks.rollout.Router`
keeps the episode on one engine (prefix-cache locality). Budgets: ``max_turns`` and ``max_total_tokens`` (the
longest sequence the engine is asked to extend). An environment that raises, exceeds ``env_timeout`` or returns
a reward that is not a finite number (NaN, inf: refused, never summed into the episode's reward) ends the episode
with ``finish_reason`` ``"env_error"`` / ``"env_timeout"`` and the error text; an engine that fails or refuses a
turn ends it with ``"engine_error"``. The episode (with the trajectory so far) is returned and counted in
:class:`EpisodeStats`, never lost.

Tools and :class:`ToolEnv` are in ``tools.py``, the tool-call format in ``tool_calls.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import numbers
import time
import traceback
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

from rlblocks._checks import check_int, check_optional_int, check_seconds
from rlblocks.errors import ArgumentError

from ..resume import ResumableResult, resumable_generate
from ..types import GenerationRequest, RolloutEngine, SamplingParams
from .tool_calls import TOOL_CALL_TAGS
from .trajectory import OnMismatch, Trajectory, render_chat_text

__all__ = [
    "EPISODE_FINISH_REASONS",
    "Env",
    "Episode",
    "EpisodeStats",
    "StepResult",
    "generate_turn",
    "run_episode",
]

EPISODE_FINISH_REASONS = ("done", "max_turns", "max_tokens", "env_error", "env_timeout", "engine_error", "abort")
"""How an episode can end (:attr:`Episode.finish_reason`); a generation's own ends are ``types.FINISH_REASONS``."""
EPISODE_FAILURES = EPISODE_FINISH_REASONS[3:]
"""The ends of an episode that did not end normally (:attr:`Episode.failed`)."""


# ================================================================================================ environment
class StepResult(NamedTuple):
    """What ``Env.step`` returns (unpacks as ``observation, reward, done, info``).

    ``observation``: the messages to append before the next turn (e.g. ``[{"role": "tool", "content": "42"}]``;
    a ``str`` is taken as one ``user`` message); ignored when ``done``. ``reward``: this step's reward (the
    episode's reward is the sum). ``info``: free-form; ``info["tool_calls"]`` (int) is summed into
    ``Episode.num_tool_calls``.
    """

    observation: Sequence[Mapping[str, Any]] | str = ()
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, Any] = {}


@runtime_checkable
class Env(Protocol):
    """An asynchronous environment of one episode.

    ``reset()`` returns the first messages (system/user); ``step(action)`` receives the decoded text of one model
    turn and returns a :class:`StepResult` (or a 4-tuple ``(observation, reward, done, info)``). An optional
    ``tools`` attribute (a list of OpenAI-style function schemas) is passed to the chat template.
    """

    async def reset(self) -> Sequence[Mapping[str, Any]]: ...

    async def step(self, action: str) -> StepResult: ...

# ================================================================================================ one turn
def _stop_texts(value: object) -> tuple[str, ...]:
    """Stop texts: a sequence of non-empty str. A bare str is refused: iterated, every character of it would have
    become a stop text."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ArgumentError(f"stop_texts: expected a list of str (e.g. ['</tool_call>']), got {value!r:.60}")
    for i, t in enumerate(value):
        if not isinstance(t, str) or not t:
            raise ArgumentError(f"stop_texts[{i}]: expected a non-empty str, got {t!r}")
    return tuple(value)


def _stop_plan(tokenizer: Any, stop_texts: Sequence[str]) -> tuple[dict[int, str], list[str], set[int]]:
    """Single-token stop texts (id -> text), multi-token stop texts, and the last ids of the multi-token ones."""
    single: dict[int, str] = {}
    multi: list[str] = []
    last_ids: set[int] = set()
    for text in stop_texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1:
            single[int(ids[0])] = text
        elif ids:
            multi.append(text)
            last_ids.add(int(ids[-1]))
    return single, multi, last_ids


async def generate_turn(
    engine: RolloutEngine,
    prompt_ids: Sequence[int],
    sampling: SamplingParams,
    *,
    request_id: str,
    session_id: str | None = None,
    stop_texts: Sequence[str] = (),
    tokenizer: Any = None,
    mask_stale: bool = False,
    max_submissions: int | None = None,
) -> tuple[ResumableResult, str | None]:
    """Generate one model turn: until a stop token, a stop text (e.g. ``"</tool_call>"``), or
    ``sampling.max_new_tokens``, with every engine call through ``resumable_generate``.

    A stop text that is one token is added to the stop ids. A multi-token stop text adds its last token: when it
    is sampled and the decoded output does not end with the text, generation continues from ``prompt + output``
    with the remaining budget (the re-sent tokens are counted in ``resubmitted_tokens``).

    Returns ``(result, stopped_by)``: ``result`` is one :class:`ResumableResult` over the whole turn (ids, fp32
    logprobs and versions of every piece, concatenated; ``finish_reason`` ``"stop"`` when a stop token or text
    ended the turn); ``stopped_by`` is the stop text that ended it, or ``None`` (a stop token id from
    ``sampling.stop_token_ids``, the length budget, or an abort).
    """
    if not isinstance(sampling, SamplingParams):
        raise ArgumentError(f"sampling: expected a SamplingParams, got {type(sampling).__name__}")
    if not isinstance(request_id, str) or not request_id:
        raise ArgumentError(f"request_id: expected a non-empty str, got {request_id!r}")
    stop_texts = _stop_texts(stop_texts)
    if stop_texts and tokenizer is None:
        raise ArgumentError("tokenizer: expected a tokenizer to encode stop_texts, got None")
    single, multi, last_ids = _stop_plan(tokenizer, stop_texts) if stop_texts else ({}, [], set())
    true_stops = set(sampling.stop_token_ids) | set(single)
    all_stops = tuple(sorted(true_stops | last_ids))
    prompt = [int(t) for t in prompt_ids]
    budget = sampling.max_new_tokens
    out_ids: list[int] = []
    out_lps: list[float] = []
    out_vers: list[int] = []
    own_mask: list[bool] = []
    submissions = resubmitted = 0
    reason, stopped_by, piece = "length", None, 0
    while True:
        left = budget - len(out_ids)
        if left <= 0:
            reason = "length"
            break
        req = GenerationRequest(
            request_id if piece == 0 else f"{request_id}/c{piece}",
            prompt + out_ids,
            dataclasses.replace(sampling, max_new_tokens=left, stop_token_ids=all_stops),
            session_id=session_id,
        )
        if piece:
            resubmitted += len(req.prompt_ids)
        res = await resumable_generate(engine, req, mask_stale=mask_stale, max_submissions=max_submissions)
        out_ids += res.output_ids
        out_lps += res.output_logprobs
        out_vers += res.output_versions
        own_mask += res.loss_mask
        submissions += res.num_submissions
        resubmitted += res.resubmitted_tokens
        reason = res.finish_reason
        if reason != "stop":
            break
        last = out_ids[-1]
        if last in true_stops:
            stopped_by = single.get(last)
            break
        text = tokenizer.decode(out_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        hit = next((t for t in multi if text.endswith(t)), None)
        if hit is not None:
            stopped_by = hit
            break
        piece += 1  # the last token of a tag, but not the tag: keep generating
    final = out_vers[-1] if out_vers else int(engine.version)
    stale = [v < final for v in out_vers]
    result = ResumableResult(
        request_id=request_id, prompt_ids=prompt, output_ids=out_ids, output_logprobs=out_lps,
        output_versions=out_vers, finish_reason=reason, final_version=final, stale=stale,
        loss_mask=[not s for s in stale] if mask_stale else own_mask,
        num_submissions=submissions, resubmitted_tokens=resubmitted,
    )
    return result, stopped_by


# ================================================================================================ episodes
@dataclass
class Episode:
    """The outcome of :func:`run_episode`.

    ``trajectory`` is None only when ``env.reset()`` itself failed. ``reward`` is the sum of the step rewards.
    ``finish_reason``: ``"done"`` (the environment ended it), ``"max_turns"``, ``"max_tokens"`` (no room left in
    ``max_total_tokens``), ``"env_error"`` / ``"env_timeout"`` (``error`` holds the text; a non-finite step reward
    is an ``env_error``), ``"engine_error"`` (the engine failed or refused a turn; ``error`` holds the text), or
    ``"abort"`` (a turn came back aborted after ``max_submissions`` engine calls). Only ``"done"``,
    ``"max_turns"`` and ``"max_tokens"`` are complete episodes; :attr:`failed` says the others are not.
    ``turn_finish`` lists each turn's end: the stop text, ``"stop"`` (stop token), ``"length"`` or ``"abort"``.
    """

    session_id: str
    trajectory: Trajectory | None
    reward: float = 0.0
    rewards: list[float] = field(default_factory=list)
    finish_reason: str = "done"
    error: str | None = None
    num_turns: int = 0
    num_tool_calls: int = 0
    turn_finish: list[str] = field(default_factory=list)
    infos: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def prefix_mismatches(self) -> int:
        return 0 if self.trajectory is None else self.trajectory.prefix_mismatches

    @property
    def failed(self) -> bool:
        """The episode did not end normally (an environment or engine error, a timeout, an abort)."""
        return self.finish_reason in EPISODE_FAILURES


class EpisodeStats:
    """Counters over recorded episodes; :meth:`stats` returns a plain dict.

    Keys: ``episodes``, ``turns``, ``tool_calls``, ``env_errors``, ``env_timeouts``, ``engine_errors``,
    ``prefix_mismatches``, ``branches``, ``model_tokens``, ``env_tokens``, ``reward_sum``, ``finish_reasons``
    (reason -> count) and ``last_errors`` (the 16 most recent ``(session_id, finish_reason, error)``; every error
    is also in its :class:`Episode`).
    """

    def __init__(self) -> None:
        self._c: Counter[str] = Counter()
        self._reward = 0.0
        self._reasons: Counter[str] = Counter()
        self._errors: deque[tuple[str, str, str]] = deque(maxlen=16)

    def record(self, episode: Episode) -> None:
        if not isinstance(episode, Episode):
            raise ArgumentError(f"episode: expected an Episode, got {type(episode).__name__}")
        c = self._c
        c["episodes"] += 1
        c["turns"] += episode.num_turns
        c["tool_calls"] += episode.num_tool_calls
        c["env_errors"] += episode.finish_reason == "env_error"
        c["env_timeouts"] += episode.finish_reason == "env_timeout"
        c["engine_errors"] += episode.finish_reason == "engine_error"
        t = episode.trajectory
        if t is not None:
            c["prefix_mismatches"] += t.prefix_mismatches
            c["branches"] += len(t.branches)
            c["model_tokens"] += sum(s.num_model_tokens for s in t.segments())
            c["env_tokens"] += sum(s.num_env_tokens for s in t.segments())
        self._reward += episode.reward
        self._reasons[episode.finish_reason] += 1
        if episode.error is not None:
            self._errors.append((episode.session_id, episode.finish_reason, episode.error))

    def merge(self, other: EpisodeStats) -> None:
        """Add ``other``'s counts, reward sum and finish reasons to these (its errors are appended in order, the
        16 most recent kept); ``other`` is unchanged. Lets a caller count a unit of work (say one group) on its own
        and fold it into a running total once it knows how the unit ended."""
        if not isinstance(other, EpisodeStats):
            raise ArgumentError(f"other: expected an EpisodeStats, got {type(other).__name__}")
        self._c.update(other._c)
        self._reward += other._reward
        self._reasons.update(other._reasons)
        self._errors.extend(other._errors)

    def stats(self) -> dict[str, Any]:
        keys = ("episodes", "turns", "tool_calls", "env_errors", "env_timeouts", "engine_errors", "prefix_mismatches",
                "branches", "model_tokens", "env_tokens")
        out: dict[str, Any] = {k: int(self._c[k]) for k in keys}
        out["reward_sum"] = self._reward
        out["finish_reasons"] = dict(self._reasons)
        out["last_errors"] = list(self._errors)
        return out


def _error_text(e: BaseException) -> str:
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__, limit=6))
    return f"{type(e).__name__}: {e}\n{tb}"


def _as_messages(obs: Any) -> list[dict[str, Any]]:
    if isinstance(obs, str):
        return [{"role": "user", "content": obs}]
    if isinstance(obs, Mapping):
        return [dict(obs)]
    if obs is None:
        return []
    if isinstance(obs, Sequence) and all(isinstance(m, Mapping) for m in obs):
        return [dict(m) for m in obs]
    raise TypeError(f"observation: expected a str, a message dict or a list of them, got {type(obs).__name__}")


def _as_step(out: Any) -> StepResult:
    """``env.step``'s return value, checked: an environment that returns a reward of None, a done flag that is not
    a bool or an info that is not a mapping ends its episode with ``"env_error"`` (it used to escape
    :func:`run_episode` as a raw exception, and the episode was never recorded)."""
    if isinstance(out, tuple) and len(out) == 4:
        out = StepResult(*out)
    else:
        raise TypeError(f"env.step: expected a StepResult or a 4-tuple (observation, reward, done, info), got "
                        f"{type(out).__name__}")
    obs, reward, done, info = out
    if isinstance(reward, (bool, str, bytes)) or not isinstance(reward, numbers.Real):
        raise TypeError(f"env.step: reward: expected a real number, got {type(reward).__name__} {reward!r:.40}")
    try:
        value = float(reward)
    except OverflowError:  # an int beyond the float range
        value = math.inf
    if not math.isfinite(value):  # a NaN/inf reward would poison its group's advantages: never summed
        raise ArgumentError(f"env.step: reward: expected a finite real number, got {reward!r:.40}")
    if not isinstance(done, bool) and type(done).__name__ != "bool_":  # numpy's bool from gym-style envs is fine
        raise TypeError(f"env.step: done: expected True or False, got {type(done).__name__} {done!r:.40}")
    info = {} if info is None else info
    if not isinstance(info, Mapping):
        raise TypeError(f"env.step: info: expected a mapping, got {type(info).__name__}")
    calls = info.get("tool_calls", 0) or 0
    if isinstance(calls, bool) or not isinstance(calls, numbers.Integral) or calls < 0:
        raise TypeError(f"env.step: info['tool_calls']: expected an int >= 0, got {calls!r:.40}")
    return StepResult(obs, value, bool(done), info)


async def _timed(coro: Awaitable[Any], timeout: float | None) -> Any:
    return await (coro if timeout is None else asyncio.wait_for(coro, timeout))


async def run_episode(
    engine: RolloutEngine,
    env: Env,
    tokenizer: Any,
    *,
    sampling: SamplingParams | None = None,
    max_turns: int = 8,
    max_total_tokens: int | None = None,
    session_id: str | None = None,
    group_id: int | None = None,
    env_timeout: float | None = 60.0,
    on_mismatch: OnMismatch = "branch",
    stop_texts: Sequence[str] = (TOOL_CALL_TAGS[1],),
    mask_stale: bool = False,
    max_submissions: int | None = None,
    stats: EpisodeStats | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> Episode:
    """Run one episode of ``env`` on ``engine`` (the loop is described in the module docstring).

    Args:
        sampling: per-turn sampling (``max_new_tokens`` is the per-turn budget; ``stop_token_ids`` defaults to
            the tokenizer's EOS, which should be the chat template's end-of-turn token). Give each episode of a
            group its own ``seed`` (or none): equal seeds sample equal episodes.
        max_turns: most model turns.
        max_total_tokens: most tokens in the sequence the engine extends (default: the engine's ``max_model_len``
            when it has one, so a long episode ends with ``"max_tokens"`` instead of a refused request).
        session_id: sent with every request (default: a fresh uuid); ``group_id`` is stored on the trajectory.
        env_timeout: seconds for each ``reset``/``step`` (None: no limit).
        on_mismatch: what to do when the chat template rewrote history, so that an observation's rendering
            extends the trajectory neither as text nor token for token (``"branch"``: keep the segment, start a
            new one, count it; ``"raise"``: raise :class:`~rlblocks.errors.PrefixMismatchError`).
        stop_texts: texts that end a turn (the closing tool-call tag).
        mask_stale: passed to :func:`generate_turn`.
        max_submissions: passed to :func:`generate_turn`.
        stats: an :class:`EpisodeStats` that records the episode.
        template_kwargs: extra variables for the chat template.
    """
    max_turns = check_int("max_turns", max_turns, minimum=1)
    max_total_tokens = check_optional_int("max_total_tokens", max_total_tokens, minimum=2)
    env_timeout = check_seconds("env_timeout", env_timeout, allow_none=True)
    if on_mismatch not in ("raise", "branch"):
        raise ArgumentError(f"on_mismatch: expected 'raise' or 'branch', got {on_mismatch!r}")
    stop_texts = _stop_texts(stop_texts)
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise ArgumentError(f"sampling: expected None or a SamplingParams, got {type(sampling).__name__}")
    if stats is not None and not isinstance(stats, EpisodeStats):
        raise ArgumentError(f"stats: expected None or an EpisodeStats, got {type(stats).__name__}")
    for name in ("apply_chat_template", "encode", "decode"):
        if not callable(getattr(tokenizer, name, None)):
            raise ArgumentError(f"tokenizer: expected a Hugging Face tokenizer with a chat template (it has no "
                                f"{name}()), got {type(tokenizer).__name__}")
    if max_total_tokens is None:
        limit = getattr(engine, "max_model_len", None)
        max_total_tokens = int(limit) if isinstance(limit, int) and not isinstance(limit, bool) else None
    sampling = SamplingParams() if sampling is None else sampling
    if not sampling.stop_token_ids:
        if tokenizer.eos_token_id is None:
            raise ArgumentError("sampling.stop_token_ids: expected the end-of-turn token id (the tokenizer has no "
                                "EOS), got ()")
        sampling = dataclasses.replace(sampling, stop_token_ids=(int(tokenizer.eos_token_id),))
    stop_ids = set(sampling.stop_token_ids)
    sid = session_id if session_id is not None else uuid.uuid4().hex
    t0 = time.perf_counter()
    ep = Episode(sid, None)

    def finish(reason: str, error: str | None = None) -> Episode:
        ep.finish_reason, ep.error = reason, error
        ep.reward = float(sum(ep.rewards))
        if ep.trajectory is not None:
            ep.num_turns = ep.trajectory.num_turns
            ep.trajectory.reward = ep.reward
            ep.trajectory.info.update({"finish_reason": reason, "error": error})
        ep.seconds = time.perf_counter() - t0
        if stats is not None:
            stats.record(ep)
        return ep

    try:
        first = _as_messages(await _timed(env.reset(), env_timeout))
    except asyncio.TimeoutError:
        return finish("env_timeout", f"env.reset() did not return within {env_timeout} s")
    except Exception as e:
        return finish("env_error", _error_text(e))
    try:  # the first messages could not be rendered: the environment's fault
        traj = Trajectory.from_messages(tokenizer, first, tools=getattr(env, "tools", None), session_id=sid,
                                        group_id=group_id, **dict(template_kwargs or {}))
    except Exception as e:
        return finish("env_error", _error_text(e))
    ep.trajectory = traj
    for turn in range(max_turns):
        budget = sampling.max_new_tokens
        if max_total_tokens is not None:
            budget = min(budget, max_total_tokens - len(traj))
            if budget <= 0:
                return finish("max_tokens")
        try:  # an engine that fails or refuses ends the episode, which is still returned and counted
            res, stopped_by = await generate_turn(
                engine, traj.token_ids, dataclasses.replace(sampling, max_new_tokens=budget),
                request_id=f"{sid}/t{turn}", session_id=sid, stop_texts=stop_texts, tokenizer=tokenizer,
                mask_stale=mask_stale, max_submissions=max_submissions,
            )
            body = res.output_ids[:-1] if res.output_ids and res.output_ids[-1] in stop_ids else res.output_ids
            text = tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            traj.append_generation(res, message={"role": "assistant", "content": text})
        except Exception as e:
            return finish("engine_error", f"turn {turn}: {_error_text(e)}")
        ep.turn_finish.append(stopped_by or res.finish_reason)
        if res.finish_reason == "abort":
            return finish("abort", f"turn {turn} was still aborted after {res.num_submissions} engine calls")
        try:
            step = _as_step(await _timed(env.step(text), env_timeout))
            obs = _as_messages(step.observation) if not step.done else []
        except asyncio.TimeoutError:
            return finish("env_timeout", f"env.step() did not return within {env_timeout} s (turn {turn})")
        except Exception as e:
            return finish("env_error", _error_text(e))
        ep.rewards.append(step.reward)
        info = dict(step.info)
        ep.infos.append(info)
        ep.num_tool_calls += int(info.get("tool_calls", 0) or 0)
        if step.done:
            return finish("done")
        if turn + 1 == max_turns:
            break
        full = [*traj.messages, *obs]
        try:
            text = render_chat_text(tokenizer, full, tools=traj.tools, **traj.template_kwargs)
        except Exception as e:  # the observation could not be rendered: the environment's fault
            return finish("env_error", _error_text(e))
        # the observation's delta after the engine's ids; only a template that rewrote history needs the whole
        # rendering's ids (checked as a prefix, or branched)
        delta = traj.text_delta(tokenizer, text)
        ids = None if delta is not None else list(tokenizer.encode(text, add_special_tokens=False))
        if max_total_tokens is not None and (len(traj) + len(delta) if ids is None else len(ids)) >= max_total_tokens:
            # no room for another model token: the observation is kept in the info, not in the token sequence
            traj.info["observation_over_budget"] = obs
            return finish("max_tokens")
        if ids is None:
            traj.append_env(delta)
            traj.messages = full
        else:
            traj.extend_to(ids, on_mismatch=on_mismatch, messages=full, tokenizer=tokenizer)
    return finish("max_turns")
