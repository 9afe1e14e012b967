"""Code rewards: run the candidate program against test cases in the sandbox; score = fraction of tests passed.

The program never runs in this process: every test is one run of :func:`rlblocks.sandbox.arun_python` — a fresh
interpreter in a bubblewrap sandbox (namespaces, seccomp, a read-only root, CPU, memory, disk, process and
wall-clock limits; see :mod:`rlblocks.sandbox` and ``details["isolation"]`` for the layers in force).

A test (:class:`CodeTest`) is either

- stdin/stdout (APPS, CodeContests, LiveCodeBench style): the program reads ``stdin``; it passes when it exits with
  status 0 and its stdout equals ``stdout`` under the chosen comparison; or
- an assertion (HumanEval, MBPP style): ``assertion`` (e.g. ``"assert add(2, 3) == 5"``) runs after the program,
  as the sandbox's ``checks``: in a checker process of the same sandbox that the program's process never shares,
  with the program's top-level names reached through a narrow channel (calls, attributes, items, iteration; results
  come back as plain built-in values, so the comparison is the checker's own). The assertion, its constants and the
  verdict are nowhere the program can look: frame walks, tracebacks, generator frames, other threads, the garbage
  collector or ``inspect`` find none of them, and there is no code of the checks to re-run. It passes only on the
  checker's verdict (:attr:`~rlblocks.sandbox.SandboxResult.checks_passed`). A program that ends its process first
  (``os._exit(0)``, ``sys.exit(0)``, ``atexit.register(os._exit, 0)``, ``SystemExit`` raised inside the test),
  returns an object equal to everything (an object of the program's own class is equal only to itself; a subclass
  of a built-in type arrives as its base type), shadows a builtin the assertion uses (the checks keep their own),
  patches ``print`` or ``sys.stdout``, prints or writes a verdict, or kills the checker scores 0 for that test,
  with the reason recorded; or both (the program's stdout must also match).

The program is the last fenced code block of the response (```` ```python ````, ```` ```py ```` or a bare
```` ``` ````), or the whole response when it has none.

Per-test outcomes (``details["tests"]``, in test order): ``status`` is one of ``passed``, ``wrong_answer``,
``runtime_error``, ``early_exit`` (exit status 0 before every assertion had run), ``timeout`` (wall clock: never a
wrong answer), ``cpu_limit``, ``memory_limit``, ``file_size_limit``, ``disk_limit``, ``output_limit`` (stdout
longer than the sandbox keeps: cannot be checked, counts as failed); with ``seconds``, ``returncode``, and for
failures a ``reason`` and the tail of ``stderr``. ``score = passed / total``; ``components``: ``pass_rate`` and
``all_passed`` (1.0 or 0.0). A test that the sandbox could not run (no isolation here, an interpreter that would
not start) makes the whole result an error (the infrastructure failed, not the program), as does a reference that
is not a list of tests.

Limits of the channel: the checks cannot pass the program their own functions or objects of their own classes
(only built-in values and the program's objects travel); a list, dict, set or bytearray passed to a call is a copy,
updated in place from the program's copy when the call returns (a later change by the program is not seen); an
object of the program's own class supports calls, attributes, items, ``len``, ``bool``, iteration and ``str`` in
the checks, not operators or ``isinstance``.
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
