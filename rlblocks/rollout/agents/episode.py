"""Multi-turn agent episodes over any :class:`~rlblocks.rollout.types.RolloutEngine`: an async ``Env`` protocol,
``run_episode``, tools with JSON-schema descriptions, ``ToolEnv`` (Hermes/Qwen tool calls) and a sandboxed Python
tool.

Episode loop (:func:`run_episode`): the environment's first messages are rendered with the tokenizer's chat
template into a :class:`~rlblocks.rollout.Trajectory`; then, per turn,

1. the whole trajectory is the prompt of one :func:`generate_turn`: every engine call goes through
   :func:`~rlblocks.rollout.resume.resumable_generate`, so a weight update in the middle of a turn keeps the
   version and logprob of every token already sampled and the turn resumes under the new weights;
2. the turn ends on a stop token (the template's end-of-turn token) or on a closing tool-call tag
   (``</tool_call>``): a tag that is one token is a stop token; a multi-token tag stops generation on its last
   token and the turn ends only if the decoded turn then ends with the tag (otherwise generation continues);
3. the model's tokens are appended as they are (never re-tokenised); the decoded text is the action given to
   ``env.step``; the environment's observation messages are appended as a chat-template DELTA: the conversation
   is rendered to text and only what follows the trajectory's own text (the observation, the template's glue,
   the generation prompt) is tokenised and appended (:meth:`~rlblocks.rollout.Trajectory.text_delta`);
   a template that rewrote history falls back to the token-level prefix check, and branches (counted).

Every request of one episode carries the episode's ``session_id``, so a :class:`~rlblocks.rollout.router.Router`
keeps the episode on one engine (prefix-cache locality). Budgets: ``max_turns`` and ``max_total_tokens`` (the
longest sequence the engine is asked to extend). An environment that raises, exceeds ``env_timeout`` or returns
a reward that is not a finite number (NaN, inf: refused, never summed into the episode's reward) ends the episode
with ``finish_reason`` ``"env_error"`` / ``"env_timeout"`` and the error text; an engine that fails or refuses a
turn ends it with ``"engine_error"``. The episode (with the trajectory so far) is returned and counted in
:class:`EpisodeStats`, never lost.

Tools: an async tool is awaited (and cancelled at its timeout). A sync tool runs each call in a daemon thread of
its own, so a call that hangs never holds a shared pool: a timed-out call cannot be killed, it is abandoned and keeps
its thread until it returns (counted in ``Tool.hung``); a tool with ``max_hung`` such calls refuses new ones with
:class:`~rlblocks.errors.ToolUnavailable` (an ``error: ...`` observation for the model) until some return, which
bounds the threads one broken tool can hold. Share one ``Tool`` across episodes to share that bound.

Tool calls use the Hermes/Qwen format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the
assistant's text; results come back as ``tool`` role messages (the chat template decides how they render).
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import inspect
import json
import math
import numbers
import operator
import re
import threading
import time
import traceback
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

from rlblocks._checks import check_int, check_optional_int, check_seconds, check_str_pair
from rlblocks.errors import ArgumentError, ToolUnavailable

from ..resume import ResumableResult, resumable_generate
from ..types import GenerationRequest, RolloutEngine, SamplingParams
from .trajectory import OnMismatch, Trajectory, render_chat_text

__all__ = [
    "EPISODE_FINISH_REASONS",
    "TOOL_CALL_TAGS",
    "Env",
    "Episode",
    "EpisodeStats",
    "StepResult",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "calculator_tool",
    "generate_turn",
    "parse_tool_calls",
    "python_tool",
    "run_episode",
]

TOOL_CALL_TAGS = ("<tool_call>", "</tool_call>")
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


# ================================================================================================ tools
@dataclass
class ToolCall:
    """One parsed call: ``name``, ``arguments`` (a dict), and ``raw`` (the text between the tags)."""

    name: str
    arguments: dict[str, Any]
    raw: str


def parse_tool_calls(text: str, *, tags: tuple[str, str] = TOOL_CALL_TAGS) -> tuple[list[ToolCall], list[str], str]:
    """Parse Hermes/Qwen tool calls ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` out of ``text``.

    ``arguments`` may also be a JSON string holding an object (OpenAI's wire form) or be called ``parameters``
    (Llama 3.1). Returns ``(calls, errors, content)``: the well-formed calls in order, one message per malformed
    block (invalid JSON, no name, arguments not an object, an opening tag never closed), and ``text`` with the
    well-formed blocks removed, stripped (malformed blocks stay in ``content``: nothing the model wrote is lost).
    """
    if not isinstance(text, str):
        raise ArgumentError(f"text: expected a str, got {type(text).__name__}")
    open_tag, close_tag = check_str_pair("tags", tags)
    calls: list[ToolCall] = []
    errors: list[str] = []
    pattern = re.compile(re.escape(open_tag) + r"(.*?)" + re.escape(close_tag), re.DOTALL)
    kept: list[str] = []  # the text outside well-formed calls
    pos = 0
    for m in pattern.finditer(text):
        n_calls = len(calls)
        _parse_one(m.group(1).strip(), calls, errors)
        if len(calls) > n_calls:
            kept.append(text[pos:m.start()])
            pos = m.end()
    kept.append(text[pos:])
    content = "".join(kept)
    rest = pattern.sub("", content)
    if open_tag in rest:  # an opening tag that was never closed (e.g. cut by the token budget)
        i = rest.rfind(open_tag)
        errors.append(f"unterminated tool call: {rest[i:i + 200]!r}")
    return calls, errors, content.strip()


def _parse_one(body: str, calls: list[ToolCall], errors: list[str]) -> None:
    """Parse one tool-call body into ``calls``, or describe why not into ``errors``."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        errors.append(f"could not parse the tool call as JSON ({e.msg} at character {e.pos}): {body[:200]!r}")
        return
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        errors.append(f"a tool call must be a JSON object with a string \"name\", got {body[:200]!r}")
        return
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            errors.append(f"tool {obj['name']!r}: arguments string is not JSON ({e.msg}): {args[:200]!r}")
            return
    if not isinstance(args, dict):
        errors.append(f"tool {obj['name']!r}: arguments must be a JSON object, got {type(args).__name__}")
        return
    calls.append(ToolCall(obj["name"], args, body))


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
