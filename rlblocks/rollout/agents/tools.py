"""Tools with JSON-schema descriptions (:class:`Tool`), the environment of tools (:class:`ToolEnv`), and two
ready-made tools: an exact calculator (:func:`calculator_tool`) and sandboxed Python (:func:`python_tool`).

An async tool is awaited (and cancelled at its timeout). A sync tool runs each call in a daemon thread of
its own, so a call that hangs never holds a shared pool: a timed-out call cannot be killed, it is abandoned and keeps
its thread until it returns (counted in ``Tool.hung``); a tool with ``max_hung`` such calls refuses new ones with
:class:`~rlblocks.errors.ToolUnavailable` (an ``error: ...`` observation for the model) until some return, which
bounds the threads one broken tool can hold. Share one ``Tool`` across episodes to share that bound.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import math
import operator
import re
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlblocks._checks import check_int, check_seconds, check_str_pair
from rlblocks.errors import ArgumentError, ToolUnavailable

from .episode import StepResult
from .tool_calls import TOOL_CALL_TAGS, parse_tool_calls

__all__ = ["Tool", "ToolEnv", "calculator", "calculator_tool", "python_tool"]


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
    "object": (dict,), "null": (type(None),),
}


def _check_arguments(schema: Mapping[str, Any], args: Mapping[str, Any]) -> str | None:
    """A short reason why ``args`` does not fit the JSON-schema object ``schema`` (top-level keys and types:
    required keys, unknown keys when ``additionalProperties`` is false, ``type`` and ``enum`` of each value), or
    None when it fits."""
    props = schema.get("properties", {}) or {}
    missing = [k for k in schema.get("required", []) if k not in args]
    if missing:
        return f"missing required argument(s) {missing}"
    if schema.get("additionalProperties", True) is False:
        extra = [k for k in args if k not in props]
        if extra:
            return f"unknown argument(s) {extra}; expected only {sorted(props)}"
    for k, v in args.items():
        spec = props.get(k)
        if not isinstance(spec, Mapping):
            continue
        want = spec.get("type")
        kinds = [want] if isinstance(want, str) else list(want or [])
        if kinds:
            ok = False
            for kind in kinds:
                py = _JSON_TYPES.get(kind)
                if py is None:
                    ok = True  # a type this check does not know: let the tool decide
                elif isinstance(v, py) and not (kind in ("integer", "number") and isinstance(v, bool)):
                    ok = True
            if not ok:
                return f"argument {k!r}: expected {want}, got {type(v).__name__} {v!r:.60}"
        if "enum" in spec and v not in spec["enum"]:
            return f"argument {k!r}: expected one of {spec['enum']}, got {v!r:.60}"
    return None


_PY_TO_JSON = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


@dataclass
class Tool:
    """A callable the model may call, with its JSON-schema description.

    ``fn(**arguments)`` may be sync or async; its result is converted to text (``str`` as is, anything else with
    ``json.dumps``). ``parameters`` is a JSON-schema object. :meth:`schema` is the OpenAI-style description the
    chat template renders. Calling the tool validates the arguments against ``parameters`` first.

    ``timeout``: seconds per call (None: no limit). A sync ``fn`` runs each call in a thread of its own; a call
    that times out (or whose caller is cancelled) is abandoned and keeps its thread until ``fn`` returns. While
    ``max_hung`` abandoned calls are still running, a new call raises :class:`~rlblocks.errors.ToolUnavailable`
    at once instead of starting another thread (module docstring). ``hung`` is the current count.
    """

    name: str
    fn: Callable[..., Any]
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    timeout: float | None = None
    max_hung: int = 8
    _hung: int = field(default=0, init=False, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.name):
            raise ArgumentError(f"name: expected 1-64 letters, digits, '_', '.' or '-', got {self.name!r}")
        if not callable(self.fn):
            raise ArgumentError(f"fn: expected a callable, got {type(self.fn).__name__}")
        if not isinstance(self.description, str):
            raise ArgumentError(f"description: expected a str, got {type(self.description).__name__}")
        # a timeout <= 0 fires at once, "1" fails only at the first call: both are refused here
        self.timeout = check_seconds("timeout", self.timeout, allow_none=True)
        self.max_hung = check_int("max_hung", self.max_hung, minimum=1)
        if not isinstance(self.parameters, dict) or self.parameters.get("type", "object") != "object":
            raise ArgumentError(f"parameters: expected a JSON-schema object ({{'type': 'object', ...}}), got "
                                f"{self.parameters!r:.80}")

    @classmethod
    def from_function(cls, fn: Callable[..., Any], *, name: str | None = None, description: str | None = None,
                      parameters: dict[str, Any] | None = None, timeout: float | None = None,
                      max_hung: int = 8) -> Tool:
        """A tool from a function: name from ``fn.__name__``, description from the first docstring paragraph,
        parameters (when not given) from the signature (``str``/``int``/``float``/``bool``/``list``/``dict``
        annotations; parameters without a default are required)."""
        if not callable(fn):
            raise ArgumentError(f"fn: expected a function, got {type(fn).__name__}")
        if parameters is None:
            props: dict[str, Any] = {}
            required = []
            for p in inspect.signature(fn).parameters.values():
                if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                    continue
                ann = p.annotation
                if isinstance(ann, str):
                    ann = {"str": str, "int": int, "float": float, "bool": bool, "list": list, "dict": dict}.get(ann)
                props[p.name] = {"type": _PY_TO_JSON[ann]} if ann in _PY_TO_JSON else {}
                if p.default is p.empty:
                    required.append(p.name)
            parameters = {"type": "object", "properties": props, "required": required}
        doc = inspect.getdoc(fn) or ""
        return cls(name or fn.__name__, fn, description if description is not None else doc.split("\n\n")[0],
                   parameters, timeout, max_hung)

    def schema(self) -> dict[str, Any]:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    @property
    def hung(self) -> int:
        """Calls that timed out (or were cancelled) and whose thread is still running ``fn``."""
        with self._lock:
            return self._hung

    async def __call__(self, arguments: Mapping[str, Any]) -> str:
        """Run the tool; raises ``ArgumentError`` when the arguments do not fit the schema, ``asyncio.TimeoutError``
        after ``timeout``, :class:`~rlblocks.errors.ToolUnavailable` when ``max_hung`` calls are still hung."""
        problem = _check_arguments(self.parameters, arguments)
        if problem:
            raise ArgumentError(f"{self.name}: {problem}")
        if inspect.iscoroutinefunction(self.fn):
            coro = self.fn(**arguments)
            out = await (coro if self.timeout is None else asyncio.wait_for(coro, self.timeout))
        else:
            out = await self._in_thread(arguments)
        return out if isinstance(out, str) else json.dumps(out)

    async def _in_thread(self, arguments: Mapping[str, Any]) -> Any:
        """A sync call in a daemon thread of its own (not a shared pool, which hung calls would fill)."""
        with self._lock:
            if self._hung >= self.max_hung:
                raise ToolUnavailable(f"{self.name}: {self._hung} earlier calls timed out and are still running "
                                      f"(max_hung={self.max_hung}); this call was not started")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        state = {"done": False, "abandoned": False}  # guarded by self._lock

        def work() -> None:
            try:
                result, error = self.fn(**arguments), None
            except BaseException as e:  # handed to the caller, as a pool thread would
                result, error = None, e
            with self._lock:
                state["done"] = True
                if state["abandoned"]:
                    self._hung -= 1
                    return
            try:
                loop.call_soon_threadsafe(_settle, fut, result, error)
            except RuntimeError:  # the loop was closed meanwhile: nobody waits for the result
                pass

        threading.Thread(target=work, name=f"rlblocks-tool:{self.name}", daemon=True).start()
        try:
            return await (fut if self.timeout is None else asyncio.wait_for(fut, self.timeout))
        except BaseException:
            with self._lock:
                if not state["done"]:
                    state["abandoned"] = True
                    self._hung += 1
            raise


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if not fut.done():
        if error is None:
            fut.set_result(result)
        else:
            fut.set_exception(error)


class ToolEnv:
    """An environment of tools: the model calls them with Hermes/Qwen tool calls until it answers.

    ``step(action)``: tool calls in ``action`` are run in order (at most ``max_calls_per_turn``) and their results
    come back as ``tool`` messages (``{"role": "tool", "name": ..., "content": ...}``); a malformed call, an unknown
    tool, arguments that do not fit the schema, a tool that raises or times out each give a ``tool`` message with
    ``"error: ..."`` (the model sees what went wrong; ``info["tool_errors"]`` counts them). A turn without any tool
    call is the final answer: ``reward_fn(answer)`` (sync or async) is the reward and the episode is done; its
    exceptions propagate (they are environment errors, reported by :func:`run_episode`).

    Args:
        messages: the first messages (returned by ``reset``).
        tools: :class:`Tool` s or plain functions (wrapped by :meth:`Tool.from_function`).
        reward_fn: answer text -> reward (default: 0.0).
    """

    def __init__(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Tool | Callable[..., Any]],
        *,
        reward_fn: Callable[[str], float | Awaitable[float]] | None = None,
        max_calls_per_turn: int = 8,
        tags: tuple[str, str] = TOOL_CALL_TAGS,
    ) -> None:
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages or not all(
                isinstance(m, Mapping) for m in messages):
            raise ArgumentError(f"messages: expected a non-empty list of chat messages (dicts), got {messages!r:.80}")
        self.messages = [dict(m) for m in messages]
        if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
            raise ArgumentError(f"tools: expected a list of Tool or functions, got {type(tools).__name__}")
        self._tools = {}
        for i, t in enumerate(tools):
            if not isinstance(t, Tool) and not callable(t):
                raise ArgumentError(f"tools[{i}]: expected a Tool or a function, got {type(t).__name__}")
            tool = t if isinstance(t, Tool) else Tool.from_function(t)
            if tool.name in self._tools:
                raise ArgumentError(f"tools: the name {tool.name!r} appears more than once")
            self._tools[tool.name] = tool
        if reward_fn is not None and not callable(reward_fn):
            raise ArgumentError(f"reward_fn: expected None or a function of the answer, got {type(reward_fn).__name__}")
        self.reward_fn = reward_fn
        self.max_calls_per_turn = check_int("max_calls_per_turn", max_calls_per_turn, minimum=1)
        self.tags = check_str_pair("tags", tags)
        self.answer: str | None = None

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The OpenAI-style schemas of the tools (what the chat template renders)."""
        return [t.schema() for t in self._tools.values()]

    async def reset(self) -> list[dict[str, Any]]:
        self.answer = None
        return [dict(m) for m in self.messages]

    async def step(self, action: str) -> StepResult:
        calls, errors, content = parse_tool_calls(action, tags=self.tags)
        if not calls and not errors:
            self.answer = content
            r = self.reward_fn(content) if self.reward_fn is not None else 0.0
            if inspect.isawaitable(r):
                r = await r
            return StepResult((), float(r), True, {"answer": content, "tool_calls": 0})
        obs: list[dict[str, Any]] = [{"role": "tool", "name": "error", "content": f"error: {e}"} for e in errors]
        n_err = len(errors)
        for i, call in enumerate(calls):
            tool = self._tools.get(call.name)
            if i >= self.max_calls_per_turn:
                text = f"error: at most {self.max_calls_per_turn} tool calls per turn; this one was not run"
            elif tool is None:
                text = f"error: unknown tool {call.name!r}; available: {sorted(self._tools)}"
            else:
                try:
                    text = await tool(call.arguments)
                except asyncio.TimeoutError:
                    text = f"error: {call.name} timed out after {tool.timeout} s"
                except Exception as e:  # a failing tool is an observation for the model, not an env failure
                    text = f"error: {type(e).__name__}: {e}"
            n_err += text.startswith("error: ")
            obs.append({"role": "tool", "name": call.name, "content": text})
        return StepResult(obs, 0.0, False, {"tool_calls": len(calls), "tool_errors": n_err})


# ------------------------------------------------------------------------------------------------ ready-made tools
_CALC_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    ast.USub: operator.neg, ast.UAdd: operator.pos,
}


def _calc(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _calc(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _CALC_OPS:
        return _CALC_OPS[type(node.op)](_calc(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _CALC_OPS:
        a, b = _calc(node.left), _calc(node.right)
        if isinstance(node.op, ast.Pow) and (abs(b) > 64 or abs(a) > 10**6):
            raise ValueError("exponent or base too large")
        out = _CALC_OPS[type(node.op)](a, b)
        if isinstance(out, int) and abs(out) > 10**60:
            raise ValueError("result too large")
        return out
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculator(expr: str) -> str:
    """Evaluate an arithmetic expression (+ - * / // % ** and parentheses on numbers) and return the result.

    Parsed with ``ast`` and evaluated node by node (never ``eval``); integers stay exact; a float result is
    printed with ``repr`` (an integral float as an int).
    """
    if len(expr) > 200:
        raise ValueError("expression longer than 200 characters")
    value = _calc(ast.parse(expr.strip(), mode="eval"))
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("result is not finite")
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
    return str(value)


def calculator_tool(name: str = "calc") -> Tool:
    """A calculator :class:`Tool` (``{"expr": "<arithmetic expression>"}``), see :func:`calculator`."""
    return Tool(name, calculator, "Evaluate an arithmetic expression exactly, e.g. 347*912.",
                {"type": "object", "properties": {"expr": {"type": "string", "description": "the expression"}},
                 "required": ["expr"], "additionalProperties": False})


def python_tool(limits: Any = None, *, name: str = "python", max_result_chars: int = 4000) -> Tool:
    """A :class:`Tool` that runs Python code in :mod:`rlblocks.sandbox` (a separate, limited process; never in
    this one) and returns what it printed.

    ``limits``: a :class:`rlblocks.sandbox.SandboxLimits` (CPU time, wall clock, memory, file size, output bytes,
    no network where the kernel allows a network namespace). The result is stdout, then stderr when the program
    failed, then a bracketed note when a limit stopped it (``[stopped: cpu limit]``), when it exited non-zero, or
    when output was truncated; the whole text is cut at ``max_result_chars`` (counted in the note).
    """
    from rlblocks.sandbox import SandboxLimits, arun_python

    limits = SandboxLimits(cpu_seconds=5.0, wall_seconds=10.0, memory_bytes=512 << 20) if limits is None else limits
    if not isinstance(limits, SandboxLimits):
        raise ArgumentError(f"limits: expected a rlblocks.sandbox.SandboxLimits, got {type(limits).__name__}")
    max_result_chars = check_int("max_result_chars", max_result_chars, minimum=64)

    async def run(code: str) -> str:
        res = await arun_python(code, limits=limits)
        parts = [res.stdout.rstrip("\n")] if res.stdout else []
        if res.stderr and not res.ok:
            parts.append("stderr:\n" + res.stderr[-1500:].rstrip("\n"))
        if res.limit:
            parts.append(f"[stopped: {res.limit} limit]")
        elif res.error:
            parts.append(f"[sandbox error: {res.error}]")
        elif res.returncode not in (0, None):
            parts.append(f"[exit status {res.returncode}{', ' + res.signal if res.signal else ''}]")
        dropped = res.stdout_truncated_bytes + res.stderr_truncated_bytes
        if dropped:
            parts.append(f"[output truncated: {dropped} bytes not shown]")
        text = "\n".join(parts) if parts else "(no output)"
        if len(text) > max_result_chars:
            text = text[: max_result_chars - 48] + f"\n[result truncated: {len(text) - max_result_chars + 48} chars]"
        return text

    return Tool(name, run, "Run a Python program in a sandbox and return what it prints to stdout.",
                {"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                 "required": ["code"], "additionalProperties": False})

