"""Math answers: extract the final answer, check it against the reference with ``math-verify``, under a real timeout.

Extraction (:func:`extract_answer`): the content of the LAST ``\\boxed{...}`` (a response that opens a ``\\boxed{``
but never closes one has NO answer: a truncated response is not rewarded by a number found elsewhere); otherwise the
last of a LaTeX math span (taken whole, unless it reads as prose: ``$5 and $6`` is money), a bare LaTeX fraction or
root, or a plain number. The digits inside a LaTeX expression are never read as a number of their own.

Checking (:func:`check_math`): the reference (a ``\\boxed{}`` or a GSM8K-style ``#### 72`` tail in it is extracted
the same way) and the answer are each parsed by ``math-verify`` and compared by ``math_verify.verify(gold,
answer)`` (symbolic and numeric equality, sets, intervals, equations, percentages, units dropped). ``score = 1.0``
if equal, else ``0.0`` (also when no answer was found: a wrong response, not a failure); a reference that does not
parse is a failure (``error`` set). ``details``: ``answer``, ``answer_source`` and ``reason``.

Timeout: ``math-verify`` can run for minutes inside C code on pathological input, where no signal reaches, so
:class:`MathReward` runs :func:`check_math` in killable worker processes
(:class:`~rlblocks.reward.workers.ProcessWorkers`) and kills the worker at the timeout (an error result).
``math-verify``'s own ``signal.alarm`` timeouts are switched off (they turn a timeout into a silent 0).

``math_verify`` is imported only inside :func:`check_math` (an optional extra: ``pip install rlblocks[reward]``).
Every rule with its examples: ``docs/reward.md`` (Math answers).
"""

from __future__ import annotations

import os
import re
import time

from rlblocks._checks import check_bool, check_int, check_seconds
from rlblocks.errors import ArgumentError, RewardTimeout, WorkerCrashed, WorkerError
from rlblocks.reward.types import RewardResult, Sample
from rlblocks.reward.workers import ProcessWorkers

__all__ = ["MathReward", "check_math", "extract_answer", "math_reward"]

_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
# LaTeX math spans, in the order a reader meets them: $$..$$ before $..$ (an escaped \$ is a dollar sign)
_MATH_SPAN = re.compile(r"\$\$(.+?)\$\$|\\\[(.+?)\\\]|\\\((.+?)\\\)|(?<!\\)\$(.+?)(?<!\\)\$", re.DOTALL)
_TEXT_GROUP = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{[^{}]*\}")
_COMMAND = re.compile(r"\\[A-Za-z]+")
_ARG = r"(?:\{[^{}]*\}|\d)"
_BARE_LATEX = re.compile(rf"-?(?:\d+\s*)?\\sqrt\s*{_ARG}|-?\\[dt]?frac\s*{_ARG}\s*{_ARG}")


def _boxed_contents(text: str) -> tuple[list[str], bool]:
    """Contents of every well-formed ``\\boxed`` in ``text``, and whether any ``\\boxed`` occurred at all."""
    found: list[str] = []
    seen = False
    for m in _BOX.finditer(text):
        seen = True
        i = m.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                c = text[j]
                if c == "\\":  # an escaped character (\{ \} \\) never opens or closes a group
                    j += 2
                    continue
                if c == "{":
                    depth += 1
                elif c == "}":
                    depth -= 1
                    if depth == 0:
                        found.append(text[i + 1 : j].strip())
                        break
                j += 1
        elif i > m.end():  # "\boxed 5": the brace-less form takes one token
            tok = re.match(r"[^\s$]+", text[i:])
            if tok:
                found.append(tok.group(0))
    return found, seen


def _last_number(text: str) -> tuple[str | None, int]:
    """The last number of ``text`` (thousands separators removed) and the position where it ends (-1: none)."""
    last, end = None, -1
    for m in _NUMBER.finditer(text):
        s = m.group(0)
        # A minus right after a word character or a closing bracket is a subtraction, not a sign: "5-3" ends in 3.
        if s.startswith("-") and m.start() > 0 and (text[m.start() - 1].isalnum() or text[m.start() - 1] in ")]}"):
            s = s[1:]
        last, end = s.replace(",", ""), m.end()
    return last, end


def _is_prose(math: str) -> bool:
    """A ``$...$`` span that is words, not mathematics: two letters in a row once ``\\text{...}`` groups and
    LaTeX commands are removed (``5 and `` between two prices; ``x^2``, ``\\frac{a}{b}`` or ``5\\text{ cm}``
    are mathematics)."""
    return re.search(r"[A-Za-z]{2}", _COMMAND.sub(" ", _TEXT_GROUP.sub(" ", math))) is not None


def _last_latex(text: str) -> tuple[int, str, str | None, list[tuple[int, int]]]:
    """The LaTeX candidate that ends last: ``(end, answer, source, spans)``, ``end = -1`` when there is none;
    ``spans`` are the character ranges LaTeX occupies (no number is read inside them)."""
    best: tuple[int, str, str | None] = (-1, "", None)
    spans: list[tuple[int, int]] = []
    for m in _MATH_SPAN.finditer(text):
        body = next(g for g in m.groups() if g is not None).strip().rstrip(".,;").strip()
        if not body or _is_prose(body):
            continue  # not mathematics: its numbers count as plain numbers
        spans.append(m.span())
        if _NUMBER.fullmatch(body):
            best = (m.end(), body.replace(",", ""), "latex")
        else:
            best = (m.end(), body, "latex")
    for m in _BARE_LATEX.finditer(text):
        if any(a <= m.start() < b for a, b in spans):
            continue
        spans.append(m.span())
        if m.end() > best[0]:
            best = (m.end(), m.group(0), "latex")
    return (*best, spans)


def extract_answer(text: str) -> tuple[str | None, str | None]:
    """``(answer, source)``: the last ``\\boxed{}`` content (source ``"boxed"``), else whichever ends last of a
    LaTeX math span or bare LaTeX fraction/root (``"latex"``) and a number outside them (``"last_number"``), else
    ``(None, None)``. An unclosed ``\\boxed{`` gives ``(None, None)``. See the module docstring."""
    if not isinstance(text, str):
        raise ArgumentError(f"text: expected a str, got {type(text).__name__}")
    boxed, seen = _boxed_contents(text)
    if boxed:
        return boxed[-1], "boxed"
    if seen:
        return None, None
    end, latex, source, spans = _last_latex(text)
    # numbers outside the LaTeX: blank the spans out (same length, so positions stay comparable)
    plain = text
    for a, b in spans:
        plain = plain[:a] + " " * (b - a) + plain[b:]
    num, num_end = _last_number(plain)
    if num is not None and num_end > end:
        return num, "last_number"
    if source is not None:
        return latex, source
    return None, None


def _reference_text(reference: object) -> str:
    if isinstance(reference, bool) or not isinstance(reference, (str, int, float)):
        raise ArgumentError(f"reference: expected a str or a number, got {type(reference).__name__} {reference!r}")
    text = str(reference).strip()
    if "####" in text:  # GSM8K's answer field: the rationale, then "#### 72"
        text = text.rsplit("####", 1)[1].strip()
    boxed, _ = _boxed_contents(text)
    return boxed[-1] if boxed else text


def _verify_options(float_rounding: object, numeric_precision: object, strict: object) -> dict:
    """``math_verify.verify``'s options, checked (``strict="no"`` is truthy and would have meant strict)."""
    return {"float_rounding": check_int("float_rounding", float_rounding, minimum=1),
            "numeric_precision": check_int("numeric_precision", numeric_precision, minimum=1),
            "strict": check_bool("strict", strict)}


def check_math(
    response: str, reference: object, *, float_rounding: int = 6, numeric_precision: int = 15, strict: bool = True
) -> RewardResult:
    """Score ``response`` against ``reference`` in THIS process (no timeout: use :class:`MathReward` for one).

    ``float_rounding``, ``numeric_precision`` and ``strict`` are ``math_verify.verify``'s (decimals kept for
    numeric comparison; sympy precision; ``strict=False`` also accepts e.g. a bare value for ``x = value``
    gold in either direction, see its documentation). Returns a :class:`RewardResult` (see the module docstring).
    """
    opts = _verify_options(float_rounding, numeric_precision, strict)
    import math_verify.grader as _grader
    import math_verify.parser as _parser
    from math_verify import parse, verify

    # The timeout is enforced outside (the worker process is killed), so math-verify's alarm-based timeouts are
    # off, and so is its one-time warning that says exactly that.
    _parser.TIMEOUT_WARNING_SHOWN = True
    _grader.TIMEOUT_WARNING_SHOWN = True

    t0 = time.perf_counter()
    if not isinstance(response, str):
        raise ArgumentError(f"response: expected a str, got {type(response).__name__}")
    ref = _reference_text(reference)
    gold = parse("\\boxed{" + ref + "}", parsing_timeout=None) if ref else []
    # math-verify falls back to the raw string when LaTeX does not parse; a reference that is ONLY that fallback
    # (e.g. "\\frac{") cannot be compared meaningfully.
    if not any(not isinstance(g, str) for g in gold):
        return RewardResult.failure(
            f"reference could not be parsed by math-verify: {ref!r}", seconds=time.perf_counter() - t0
        )
    answer, source = extract_answer(response)
    details: dict = {"answer": answer, "answer_source": source}
    if answer is None or not answer:
        details["reason"] = "unclosed \\boxed{" if answer is None and _BOX.search(response) else "no answer found"
        if answer == "":
            details["reason"] = "empty \\boxed{}"
        return RewardResult(0.0, {"correct": 0.0}, seconds=time.perf_counter() - t0, details=details)
    pred = parse("\\boxed{" + answer + "}", parsing_timeout=None)
    if not pred:
        details["reason"] = "answer could not be parsed"
        return RewardResult(0.0, {"correct": 0.0}, seconds=time.perf_counter() - t0, details=details)
    equal = verify(gold, pred, **opts, timeout_seconds=None)
    score = 1.0 if equal else 0.0
    return RewardResult(score, {"correct": score}, seconds=time.perf_counter() - t0, details=details)


class MathReward:
    """Async :class:`~rlblocks.reward.RewardFn` around :func:`check_math`, bounded by a timeout that kills.

    Args:
        timeout: seconds one check may run in its worker (from the moment the worker starts it); beyond it the
            worker process is killed and replaced, and the result is an error (``"RewardTimeout: ..."``).
        workers: worker processes, = checks running at once (default ``min(4, os.cpu_count())``); started on the
            first call, each importing math-verify once.
        memory_bytes: ``RLIMIT_AS`` of each worker (default 2 GiB): sympy expanding a huge power fails with
            ``MemoryError`` (an error result) instead of taking the machine's memory.
        float_rounding: passed to :func:`check_math`.
        numeric_precision: passed to :func:`check_math`.
        strict: passed to :func:`check_math`.

    ``sample.reference`` is the reference answer. ``close()`` stops the workers (idempotent; also at exit; a
    later call starts new ones). In a :class:`~rlblocks.reward.RewardPool`, give the pool a timeout well above
    this one: the pool's clock also runs while a call waits for a free worker, and while the first call starts
    one (importing math-verify takes about a second).
    """

    def __init__(
        self,
        *,
        timeout: float = 5.0,
        workers: int | None = None,
        memory_bytes: int | None = 2 << 30,
        float_rounding: int = 6,
        numeric_precision: int = 15,
        strict: bool = True,
    ) -> None:
        self.timeout = check_seconds("timeout", timeout)
        self.kwargs = _verify_options(float_rounding, numeric_precision, strict)
        n = min(4, os.cpu_count() or 1) if workers is None else workers
        self._workers = ProcessWorkers(n, memory_bytes=memory_bytes, preload=("math_verify",))

    async def __call__(self, sample: Sample) -> RewardResult:
        if not isinstance(sample, Sample):
            raise ArgumentError(f"sample: expected a rlblocks.reward.Sample, got {type(sample).__name__}")
        t0 = time.perf_counter()
        try:
            result = await self._workers.arun(check_math, sample.response, sample.reference, timeout=self.timeout,
                                              **self.kwargs)
        except (RewardTimeout, WorkerCrashed, WorkerError) as e:
            text = str(e) if isinstance(e, WorkerError) else f"{type(e).__name__}: {e}"
            return RewardResult.failure(text, seconds=time.perf_counter() - t0)
        result.seconds = time.perf_counter() - t0
        return result

    def stats(self) -> dict[str, int]:
        """The worker counters (``started``, ``calls``, ``timeouts``, ``crashes``, ``errors``, ``alive``)."""
        return self._workers.stats()

    def close(self) -> None:
        self._workers.close()


math_reward = MathReward()
"""The default :class:`MathReward` (5 s timeout); its workers start on the first call."""
