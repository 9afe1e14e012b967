"""Code rewards: run the candidate program against test cases in the sandbox; score = fraction of tests passed.

The program never runs in this process: every test is one run of :func:`rlblocks.sandbox.arun_python` — a fresh
interpreter in a bubblewrap sandbox (see :mod:`rlblocks.sandbox`; ``details["isolation"]`` holds the layers in
force). The program is the last fenced code block of the response, or the whole response when it has none.

A test (:class:`CodeTest`) is stdin/stdout (APPS, CodeContests style: exit status 0 and matching stdout), an
assertion (HumanEval, MBPP style: ``"assert add(2, 3) == 5"``), or both. An assertion runs after the program in a
checker process of the same sandbox that the program's process never shares, reaching the program's top-level
names through a narrow channel (calls, attributes, items, iteration; plain built-in values come back), so the
assertion, its constants and the verdict are nowhere the program can look, and it passes only on the checker's
verdict (:attr:`~rlblocks.sandbox.SandboxResult.checks_passed`): a program that exits early, returns an object
equal to everything, shadows a builtin, or prints a verdict scores 0 for that test, with the reason recorded.

Per-test outcomes (``details["tests"]``): ``passed``, ``wrong_answer``, ``runtime_error``, ``early_exit``,
``timeout`` (never a wrong answer), ``cpu_limit``, ``memory_limit``, ``file_size_limit``, ``disk_limit``,
``output_limit``. ``score = passed / total``; ``components``: ``pass_rate`` and ``all_passed``. A test the sandbox
could not run makes the whole result an error (the infrastructure failed, not the program), as does a reference
that is not a list of tests. The channel's rules and limits in full: ``docs/reward.md`` (Code tests).
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlblocks._checks import check_bool, check_int
from rlblocks.errors import ArgumentError, SandboxUnavailable
from rlblocks.reward.types import RewardResult, Sample
from rlblocks.sandbox import SandboxLimits, SandboxResult, arun_python

__all__ = ["CodeReward", "CodeTest", "code_reward", "extract_code", "outputs_match"]

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_COMPARES = ("lines", "tokens", "exact")
_STDERR_TAIL = 500


@dataclass(frozen=True)
class CodeTest:
    """One test: ``stdin`` and the expected ``stdout``, or an ``assertion`` run after the program (or both)."""

    stdin: str = ""
    stdout: str | None = None
    assertion: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.stdin, str):  # the program's input: "" for none, never None
            raise ArgumentError(f"stdin: expected a str (\"\" for no input), got {type(self.stdin).__name__}")
        for name in ("stdout", "assertion"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ArgumentError(f"{name}: expected None or a str, got {type(v).__name__}")
        if self.stdout is None and self.assertion is None:
            raise ArgumentError("stdout/assertion: expected at least one of them (a test must check something)")

    @classmethod
    def of(cls, obj: CodeTest | Mapping[str, Any]) -> CodeTest:
        """A :class:`CodeTest`, or a mapping with ``input``/``output`` (or ``stdin``/``stdout``) and/or
        ``assertion`` (or ``assert``)."""
        if isinstance(obj, CodeTest):
            return obj
        if not isinstance(obj, Mapping):
            raise ArgumentError(f"test: expected a CodeTest or a mapping, got {type(obj).__name__}")
        known = {"input", "output", "stdin", "stdout", "assertion", "assert"}
        unknown = set(obj) - known
        if unknown:
            raise ArgumentError(f"test: expected keys among {sorted(known)}, got unknown {sorted(unknown)}")
        for a, b in (("stdin", "input"), ("stdout", "output"), ("assertion", "assert")):
            if a in obj and b in obj:  # which one was meant? using either would silently drop the other
                raise ArgumentError(f"test: expected one of {a!r} and its alias {b!r}, got both")
        stdin = obj.get("stdin", obj.get("input", ""))
        return cls(stdin="" if stdin is None else stdin, stdout=obj.get("stdout", obj.get("output")),
                   assertion=obj.get("assertion", obj.get("assert")))


def extract_code(response: str) -> str:
    """The last fenced Python (or untagged) code block of ``response``, else ``response`` itself."""
    if not isinstance(response, str):
        raise ArgumentError(f"response: expected a str, got {type(response).__name__}")
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def _lines(s: str) -> list[str]:
    out = [line.rstrip() for line in s.replace("\r\n", "\n").split("\n")]
    while out and not out[-1]:
        out.pop()
    return out


def outputs_match(got: str, expected: str, compare: str = "lines") -> bool:
    """``"lines"``: equal after dropping trailing whitespace on each line and trailing empty lines;
    ``"tokens"``: equal whitespace-separated tokens; ``"exact"``: byte-for-byte. Any other ``compare`` is an
    :class:`~rlblocks.errors.ArgumentError` (it used to fall through to ``"exact"``)."""
    if compare not in _COMPARES:
        raise ArgumentError(f"compare: expected one of {_COMPARES}, got {compare!r}")
    for name, v in (("got", got), ("expected", expected)):
        if not isinstance(v, str):
            raise ArgumentError(f"{name}: expected a str, got {type(v).__name__}")
    if compare == "lines":
        return _lines(got) == _lines(expected)
    if compare == "tokens":
        return got.split() == expected.split()
    return got == expected


_LIMIT_STATUS = {"wall": "timeout", "cpu": "cpu_limit", "memory": "memory_limit", "file_size": "file_size_limit",
                 "disk": "disk_limit"}


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def _outcome(test: CodeTest, r: SandboxResult, compare: str) -> dict[str, Any]:
    rec: dict[str, Any] = {"seconds": round(r.seconds, 4), "returncode": r.returncode}
    if r.error is not None:
        rec["status"] = "sandbox_error"
        rec["error"] = r.error
        return rec
    unfinished = test.assertion is not None and not r.checks_passed
    before = " before the assertions had finished" if unfinished else ""
    if r.limit in _LIMIT_STATUS:
        rec["status"] = _LIMIT_STATUS[r.limit]
        rec["reason"] = f"stopped by the {r.limit} limit{before}"
    elif unfinished and r.returncode == 0:
        rec["status"] = "early_exit"
        rec["reason"] = ("the program ended its process with status 0 before every assertion had run (no "
                         "verdict from the checker)")
    elif unfinished or r.returncode != 0:
        rec["status"] = "runtime_error"
        err = _last_line(r.stderr)
        how = f"killed by {r.signal}{before}" if r.signal else f"exit status {r.returncode}"
        rec["reason"] = how + (f": {err}" if err else "")
    elif test.stdout is not None and r.stdout_truncated_bytes:
        rec["status"] = "output_limit"
        rec["reason"] = f"stdout longer than {len(r.stdout)} bytes ({r.stdout_truncated_bytes} more were dropped)"
    elif test.stdout is not None and not outputs_match(r.stdout, test.stdout, compare):
        rec["status"] = "wrong_answer"
        rec["reason"] = f"stdout differs from the expected output ({compare} comparison)"
    else:
        rec["status"] = "passed"
    if rec["status"] != "passed":
        rec["stderr"] = r.stderr[-_STDERR_TAIL:]
        if rec["status"] == "wrong_answer":
            rec["stdout"] = r.stdout[:_STDERR_TAIL]
    return rec


class CodeReward:
    """Async :class:`~rlblocks.reward.RewardFn`: the fraction of ``sample.reference``'s tests the program passes.

    Args:
        limits: :class:`~rlblocks.sandbox.SandboxLimits` of EACH test run (default: 2 s CPU, 6 s wall, 512 MiB,
            16 MiB files, 64 MiB scratch, no subprocesses, no network, strict isolation; assertion tests need
            ``allow_subprocesses=False``).
        compare: stdout comparison, ``"lines"`` (default), ``"tokens"`` or ``"exact"`` (see
            :func:`outputs_match`).
        concurrency: tests of one sample run at once (default 1; the pool already runs samples concurrently).
        extract: take the last fenced code block of the response (default), or run the response as it is.
        python: interpreter for the sandbox (default: this one).

    ``sample.reference``: a non-empty sequence of :class:`CodeTest` or mappings (see :meth:`CodeTest.of`).
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        compare: str = "lines",
        concurrency: int = 1,
        extract: bool = True,
        python: str | None = None,
    ) -> None:
        if limits is None:
            limits = SandboxLimits(cpu_seconds=2.0, wall_seconds=6.0, memory_bytes=512 << 20)
        if not isinstance(limits, SandboxLimits):
            raise ArgumentError(f"limits: expected a SandboxLimits, got {type(limits).__name__}")
        if compare not in _COMPARES:
            raise ArgumentError(f"compare: expected one of {_COMPARES}, got {compare!r}")
        self.limits = limits
        self.compare = compare
        self.concurrency = check_int("concurrency", concurrency, minimum=1)
        self.extract = check_bool("extract", extract)
        if python is not None and not isinstance(python, (str, os.PathLike)):
            raise ArgumentError(f"python: expected None or the path of an interpreter, got {type(python).__name__}")
        self.python = python

    @staticmethod
    def _tests(reference: object) -> list[CodeTest]:
        if isinstance(reference, (str, bytes, Mapping)) or not isinstance(reference, Sequence) or not reference:
            raise ArgumentError(
                f"reference: expected a non-empty sequence of tests (CodeTest or mappings), got {reference!r:.200}"
            )
        return [CodeTest.of(t) for t in reference]

    async def __call__(self, sample: Sample) -> RewardResult:
        if not isinstance(sample, Sample):
            raise ArgumentError(f"sample: expected a rlblocks.reward.Sample, got {type(sample).__name__}")
        t0 = time.perf_counter()
        try:
            tests = self._tests(sample.reference)
        except ArgumentError as e:
            return RewardResult.failure(f"ArgumentError: {e}", seconds=time.perf_counter() - t0)
        program = extract_code(sample.response) if self.extract else sample.response
        gate = asyncio.Semaphore(self.concurrency)

        async def run(test: CodeTest) -> SandboxResult:
            checks = None if test.assertion is None else [test.assertion]
            async with gate:
                try:
                    return await arun_python(program, stdin=test.stdin, limits=self.limits, python=self.python,
                                             checks=checks)
                except (SandboxUnavailable, ArgumentError) as e:  # the infrastructure, not the program
                    return SandboxResult(None, "", "", 0.0, error=f"{type(e).__name__}: {e}")

        runs = await asyncio.gather(*(run(t) for t in tests))
        outcomes = [_outcome(t, r, self.compare) for t, r in zip(tests, runs)]
        details: dict[str, Any] = {"tests": outcomes, "isolation": runs[0].isolation, "program_chars": len(program)}
        broken = [i for i, o in enumerate(outcomes) if o["status"] == "sandbox_error"]
        seconds = time.perf_counter() - t0
        if broken:
            first = outcomes[broken[0]]["error"]
            return RewardResult.failure(f"sandbox could not run test(s) {broken}: {first}", seconds=seconds,
                                        details=details)
        passed = sum(o["status"] == "passed" for o in outcomes)
        score = passed / len(tests)
        components = {"pass_rate": score, "all_passed": float(passed == len(tests))}
        return RewardResult(score, components, seconds=seconds, details=details)


code_reward = CodeReward()
"""The default :class:`CodeReward` (2 s CPU, 6 s wall, 512 MiB per test)."""
