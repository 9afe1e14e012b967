"""Rewards for every loop: ``--reward verifier|math|code|rm|rg|rg-exact|module:function``, and ``--tools``.

``--reward``:

- ``verifier``: exact match. 1.0 iff the response ended with EOS (in an agent episode: the final answer) and its text
  (special tokens and spaces removed) equals the reference's; else 0.0. On the toy tasks this is their own reward.
- ``math``: ``rlblocks.reward.math_reward``; ``code``: ``rlblocks.reward.code_reward`` (tests in the sandbox).
- ``rg``: the reasoning-gym dataset's own ``score_answer`` on the answer in the ``--answer-format`` the prompt asked
  for (0.0 when it is missing), for ``--prompts rg:...`` (``cookbook/rgym.py``). ``rg-exact``: 1.0 iff that score
  is 1.0 (some datasets' partial credit can be gamed, e.g. ``basic_arithmetic`` pays an answer padded with digits).
- ``rm``: ``rlblocks.reward.RewardModel`` on ``--reward-model`` (an HF sequence-classification checkpoint).
- ``module:function`` or ``path/to/file.py:function``: your ``fn(sample: rlblocks.reward.Sample) -> float |
  RewardResult``; ``async def`` runs on the loop's event loop, a plain function in killable worker processes.

Every reward runs through a :class:`~rlblocks.reward.RewardPool` (bounded concurrency, input order, a timeout, one
retry on a fresh worker). A call that still fails is counted (``reward_failures``), never dropped: every training
loop fails its whole group (:meth:`Reward.group_scores`), which is not trained and is counted in
``samples_failed_reward`` / ``groups_failed_reward``, since a group baseline computed without it, or with it read
as 0, would be biased. :meth:`Reward.scores` (a failed call scores 0.0) is for measures that are no baseline, such
as a held-out accuracy. ``--eval-reward`` scores the held-out evaluation (default ``--reward``; ``rm`` is evaluated
with ``verifier`` on a toy task and ``math`` on a file).

``--tools module:function,...`` (agent loops): each a ``rlblocks.rollout.agents.Tool``, a function returning one
(``rlblocks.rollout.agents:calculator_tool``), or a plain function wrapped by ``Tool.from_function``. The flags'
reference with examples: ``docs/cookbook/index.md``.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlblocks.errors import ArgumentError

from .flags import opt

KINDS = ("verifier", "math", "code", "rm", "rg", "rg-exact")


@dataclass
class RewardFlags:
    """The reward and evaluation flags every loop shares (a loop's ``Config`` inherits them)."""

    reward: str = opt("verifier", "verifier: exact match; math: math_reward; code: code_reward (tests in the "
                                  "sandbox); rg: the reasoning-gym dataset's score_answer (--prompts rg:...); "
                                  "rg-exact: 1 iff that score is 1 (no partial credit); rm: "
                                  "--reward-model; module:function or file.py:function: your fn(sample) -> float | "
                                  "RewardResult")
    reward_model: str = opt("", "--reward rm: an HF sequence-classification checkpoint")
    reward_timeout: float = opt(60.0, "seconds one reward call may take (then it fails, counted, and its group is "
                                         "not trained)")
    eval_reward: str = opt("", "reward of the held-out evaluation; empty: --reward (rm: verifier on a toy task, "
                                "math on a file)")
    eval_k: int = opt(1, "held-out pass@k and mean@k: k samples per prompt")
    eval_temperature: float = opt(0.0, "held-out sampling temperature (0: greedy)")


def check_reward_spec(spec: str, flag: str = "--reward") -> None:
    """A ``--reward`` value: one of :data:`KINDS` or ``module:function`` / ``file.py:function`` (resolved here,
    so a typo is refused before anything starts)."""
    if spec in KINDS:
        return
    if ":" not in spec:
        raise ArgumentError(f"{flag}: expected one of {'|'.join(KINDS)} or module:function (file.py:function), "
                            f"got {spec!r}")
    fn = load_object(spec, flag)
    if not callable(fn):
        raise ArgumentError(f"{flag}: expected {spec} to be a function of a Sample, got {type(fn).__name__}")


def check_reward_flags(cfg: Any, *, rm_built_here: bool = False) -> None:
    """The reward and evaluation flags, refused before anything is loaded (``rm_built_here``: the loop trains
    its own reward model when ``--reward-model`` is empty, as ``ppo.py`` does on its toy task)."""
    check_reward_spec(cfg.reward)
    if cfg.eval_reward:
        check_reward_spec(cfg.eval_reward, "--eval-reward")
    if "rm" in (cfg.reward, cfg.eval_reward) and not cfg.reward_model and not rm_built_here:
        raise ArgumentError("--reward-model: --reward rm needs a reward-model checkpoint"
                            + (" (the reward-model stage here trains one for the toy task only)"
                               if hasattr(cfg, "rm_steps") else ""))
    rg = {"rg", "rg-exact"} & {cfg.reward, cfg.eval_reward}
    if rg and not str(getattr(cfg, "prompts", "")).startswith("rg:"):
        raise ArgumentError(f"--reward {min(rg)}: scores reasoning-gym items, expected --prompts rg:NAME?..., "
                            f"got --prompts {getattr(cfg, 'prompts', '')!r}")
    if cfg.reward_model and "rm" not in (cfg.reward, cfg.eval_reward):
        raise ArgumentError(f"--reward-model: only --reward rm reads it, got --reward {cfg.reward}")
    if cfg.eval_k < 1:
        raise ArgumentError(f"--eval-k: expected an int >= 1, got {cfg.eval_k}")
    if not cfg.eval_temperature >= 0:
        raise ArgumentError(f"--eval-temperature: expected a number >= 0, got {cfg.eval_temperature}")
    if not cfg.reward_timeout > 0:
        raise ArgumentError(f"--reward-timeout: expected seconds > 0, got {cfg.reward_timeout}")


def eval_reward_spec(cfg: Any) -> str:
    """The held-out evaluation's reward (see the module docstring)."""
    if cfg.eval_reward:
        return cfg.eval_reward
    if cfg.reward == "rm":
        return "math" if cfg.prompts else "verifier"
    return cfg.reward


def needs_reference(*specs: str) -> bool:
    """Whether prompts must carry a reference for these rewards (a learned reward model needs none)."""
    return any(s != "rm" for s in specs)


def load_object(spec: str, flag: str) -> Any:
    """The object named by ``module:attr`` or ``path/to/file.py:attr`` (the file's directory is put first on
    ``sys.path`` and the file imported as a module of that name, so worker processes can import it by name)."""
    mod_name, _, attr = spec.rpartition(":")
    if not mod_name or not attr:
        raise ArgumentError(f"{flag}: expected module:name or file.py:name, got {spec!r}")
    if mod_name.endswith(".py"):
        path = Path(mod_name).resolve()
        if not path.is_file():
            raise ArgumentError(f"{flag}: expected {mod_name} to be a Python file, got no such file")
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
        mod_name = path.stem
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ArgumentError(f"{flag}: could not import {mod_name!r} for {spec!r} ({e})") from None
    if not hasattr(module, attr):
        raise ArgumentError(f"{flag}: module {mod_name!r} has no {attr!r} (for {spec!r})")
    return getattr(module, attr)


# ------------------------------------------------------------------------------------------------ rewards
class ExactMatch:
    """``--reward verifier`` as a :class:`~rlblocks.reward.RewardFn`: 1.0 iff ``metadata["finish_reason"]`` is
    ``"stop"`` (when present) and the text, spaces removed and stripped, equals the reference's."""

    async def __call__(self, sample):
        from rlblocks.reward import RewardResult

        if sample.metadata.get("finish_reason", "stop") != "stop":
            return RewardResult(0.0, details={"reason": "cut by the length budget"})
        want = str(sample.reference).replace(" ", "").strip()
        return RewardResult(float(sample.response.replace(" ", "").strip() == want))


def code_tests(reference: Any) -> Any:
    """A code reward's reference as a list of tests: a list of tests as is, ``{"inputs": [...], "outputs": [...]}``
    as stdin/stdout pairs, either as a JSON string too (verl and PRIME store them so)."""
    if isinstance(reference, str):
        try:
            reference = json.loads(reference)
        except json.JSONDecodeError:
            return reference  # the code reward refuses it, as an error result naming the reference
    if isinstance(reference, Mapping) and "inputs" in reference and "outputs" in reference:
        return [{"input": i, "output": o} for i, o in zip(reference["inputs"], reference["outputs"])]
    return reference


class Reward:
    """A loop's reward: ``await reward.scores(prompts, output_ids)`` (the loops) or ``await reward.ascore(samples)``
    (``rlblocks.reward.evaluate``), ``await reward.score_answer(prompt, text)`` (an agent episode's final answer).

    ``spec``: a ``--reward`` value; ``tokenizer`` decodes responses; ``reward_model`` and ``device``: ``rm``'s
    checkpoint and device; ``timeout``: seconds per call. ``failures`` counts the calls that failed (their retries
    ran out), ``groups_failed`` the groups :meth:`group_scores` failed whole for them; ``stats()`` adds the pool's
    counters; ``close()`` stops worker processes (idempotent).
    """

    def __init__(self, spec: str, tokenizer, *, reward_model: str = "", device: Any = "cpu",
                 max_concurrency: int = 64, timeout: float = 60.0) -> None:
        from rlblocks.reward import RewardPool

        check_reward_spec(spec)
        self.spec, self.tok, self.failures, self.groups_failed = spec, tokenizer, 0, 0
        self._closers: list[Any] = []
        self._earlier: dict[str, Any] = {}  # a resumed run's counters of its earlier starts (load_state_dict)
        if spec == "verifier":
            fn = ExactMatch()
        elif spec == "math":
            from rlblocks.reward import math_reward

            fn = math_reward
            self._closers.append(math_reward)
        elif spec == "code":
            from rlblocks.reward import code_reward

            fn = code_reward
        elif spec == "rg":
            import rgym

            fn = rgym.score  # synchronous: in worker processes
        elif spec == "rg-exact":
            import rgym

            fn = rgym.score_exact
        elif spec == "rm":
            from rlblocks.reward import RewardModel

            # REAL MODEL: a reward model of the policy's size is one more full copy here; serve it on its own
            # devices (an async reward calling it is a `module:function` reward) or shard it.
            fn = RewardModel.from_pretrained(reward_model, device=device)
        else:
            fn = load_object(spec, "--reward")  # async: on the event loop; sync: in worker processes
        self.fn = fn
        self.pool = RewardPool(fn, max_concurrency=max_concurrency, timeout=timeout, retries=1)
        self._closers.insert(0, self.pool)

    def text(self, output_ids: Sequence[int]) -> str:
        return self.tok.decode(list(output_ids), skip_special_tokens=True)

    def _reference(self, reference: Any) -> Any:
        return code_tests(reference) if self.spec == "code" else reference

    async def ascore(self, samples: Sequence[Any]) -> list[Any]:
        """One :class:`~rlblocks.reward.RewardResult` per sample, in order (failures included, and counted)."""
        from rlblocks.reward import Sample

        if self.spec == "code":
            samples = [Sample(s.response, self._reference(s.reference), s.prompt, s.response_len, s.metadata)
                       for s in samples]
        results = await self.pool.ascore(samples)
        self.failures += sum(1 for r in results if not r.ok)
        return results

    async def results(self, prompts: Sequence[Any], output_ids: Sequence[Sequence[int]]) -> list[Any]:
        """One :class:`~rlblocks.reward.RewardResult` per response (prompt ``i``'s response ``output_ids[i]``), in
        order; failed calls included and counted in ``failures``."""
        from rlblocks.reward import Sample

        if len(prompts) != len(output_ids):
            raise ArgumentError(f"output_ids: expected one response per prompt ({len(prompts)}), "
                                f"got {len(output_ids)}")
        eos = self.tok.eos_token_id
        samples = [Sample(self.text(ids), reference=p.reference, prompt=p.text, response_len=len(ids),
                          metadata={**p.metadata, "finish_reason": "stop" if ids and ids[-1] == eos else "length"})
                   for p, ids in zip(prompts, output_ids)]
        return await self.ascore(samples)

    async def scores(self, prompts: Sequence[Any], output_ids: Sequence[Sequence[int]]) -> tuple[list[float], int]:
        """``(scores, failures)``: one score per response (a failed call scores 0.0) and how many calls failed."""
        results = await self.results(prompts, output_ids)
        return [r.score if r.ok else 0.0 for r in results], sum(1 for r in results if not r.ok)

    async def group_scores(self, prompts: Sequence[Any], output_ids: Sequence[Sequence[int]],
                           group_size: int) -> tuple[list[float], list[bool], int]:
        """``(scores, keep, failures)`` for responses in groups of ``group_size`` consecutive ones (the samples of
        one prompt): a group with a failed call is failed whole (``keep`` False for each of its responses, their
        scores 0.0 placeholders that must not be trained on; counted in ``groups_failed``), so that no group's
        baseline is computed without one of its samples or with a failed one read as 0. ``failures``: the calls
        that failed."""
        from rlblocks.reward import GroupResult

        if group_size < 1 or len(output_ids) % group_size:
            raise ArgumentError(f"group_size: expected a divisor of the {len(output_ids)} responses, got "
                                f"{group_size}")
        results = await self.results(prompts, output_ids)
        scores, keep = [], []
        for g in range(0, len(results), group_size):
            group = GroupResult.of(results[g:g + group_size])
            scores += group.scores if group.ok else [0.0] * group_size
            keep += [group.ok] * group_size
            self.groups_failed += not group.ok
        return scores, keep, sum(1 for r in results if not r.ok)

    async def score_answer(self, prompt: Any, answer: str, counts: Any = None) -> float:
        """The score of an agent episode's final answer (a failed call returns a 0.0 placeholder and is counted,
        also in ``counts["reward_failures"]`` when a ``Counter`` is given: a training loop fails the episode's
        group on it, never trains the placeholder)."""
        from rlblocks.reward import Sample

        (r,) = await self.ascore([Sample(answer, reference=prompt.reference, prompt=prompt.text,
                                         metadata=dict(prompt.metadata))])
        if not r.ok and counts is not None:
            counts["reward_failures"] += 1
        return r.score if r.ok else 0.0

    def stats(self) -> dict[str, Any]:
        """The counters of the whole run: this process's plus those of the earlier starts a resumed run loaded
        (:meth:`load_state_dict`); ``max_in_flight`` is the largest, ``in_flight`` and ``pending`` are this
        process's."""
        pool = self.pool.stats()
        for k, v in self._earlier.get("pool", {}).items():
            if k == "max_in_flight":
                pool[k] = max(pool.get(k, 0), v)
            elif k not in ("in_flight", "pending"):
                pool[k] = pool.get(k, 0) + v
        return {"reward": self.spec, "failures": self.failures + self._earlier.get("failures", 0),
                "groups_failed": self.groups_failed + self._earlier.get("groups_failed", 0), "pool": pool}

    def state_dict(self) -> dict[str, Any]:
        """The run's counters so far (:meth:`stats`), for the run checkpoint."""
        return self.stats()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resumed run's counters start from the checkpoint's (``state``: a :meth:`state_dict`); this process's
        calls add to them."""
        if not isinstance(state, dict) or state.get("reward") != self.spec:
            raise ArgumentError(f"state: expected the counters of a --reward {self.spec} (Reward.state_dict()), got "
                                f"{state!r:.80}")
        self._earlier = {"failures": int(state.get("failures", 0)), "groups_failed": int(state.get("groups_failed", 0)),
                         "pool": dict(state.get("pool", {}))}

    def close(self) -> None:
        for c in self._closers:
            c.close()


# ------------------------------------------------------------------------------------------------ tools
def load_tools(spec: str, flag: str = "--tools") -> list[Any]:
    """The tools of ``--tools module:function,...`` (see the module docstring), names distinct."""
    from rlblocks.rollout.agents import Tool

    tools = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        obj = load_object(item, flag)
        if isinstance(obj, Tool):
            tool = obj
        elif callable(obj) and _returns_tool(obj):
            tool = obj()
            if not isinstance(tool, Tool):
                raise ArgumentError(f"{flag}: {item} is annotated -> Tool but returned {type(tool).__name__}")
        elif callable(obj):
            tool = Tool.from_function(obj)
        else:
            raise ArgumentError(f"{flag}: expected {item} to be a Tool, a function returning one, or a function, got "
                                f"{type(obj).__name__}")
        tools.append(tool)
    if not tools:
        raise ArgumentError(f"{flag}: expected at least one module:function, got {spec!r}")
    names = [t.name for t in tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ArgumentError(f"{flag}: tool names must differ, got {', '.join(dup)} more than once")
    return tools


def _returns_tool(fn: Any) -> bool:
    try:
        ann = inspect.signature(fn).return_annotation
    except (TypeError, ValueError):
        return False
    name = getattr(ann, "__name__", ann)
    return ann is not inspect.Signature.empty and name in ("Tool", "rlblocks.rollout.agents.Tool")
