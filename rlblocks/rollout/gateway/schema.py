"""The OpenAI request and response shapes the gateway speaks: pydantic models that validate a request body, and the
builders of the JSON it answers.

Validation refuses rather than ignores: a field whose requested behaviour the engines cannot give (``n > 1``,
penalties, ``logit_bias``, ``top_logprobs > 0``, a forced ``tool_choice``, ``echo``, ``best_of > 1``) is a 400, as is
a malformed one. Every refusal is a :class:`~rlblocks.errors.GatewayError` whose ``param`` names the field the way
the OpenAI API does (``messages[2].content``, ``tools[0]``) and whose ``code`` is ``invalid_type``,
``invalid_value``, ``missing_required_parameter`` or ``unsupported_value``. ``null`` means "the default" for every
optional field, as in the OpenAI API. Unknown fields are ignored (clients send ``metadata``, ``store``,
``parallel_tool_calls``...).

The validators are plain functions (``PlainValidator``) so that each message says what was expected and what was
given; pydantic supplies the structure (nested messages, error locations) and the typed request objects.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, ValidationError, ValidationInfo
from pydantic_core import PydanticCustomError

from rlblocks.errors import GatewayError

from ..agents.tool_calls import parse_tool_calls

__all__ = [
    "ROLES",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "Reply",
    "RewardRequest",
    "assistant_reply",
    "bad_request",
    "chat_chunk",
    "chat_completion",
    "chat_logprobs",
    "parse",
    "text_completion",
    "text_logprobs",
]

ROLES = ("system", "developer", "user", "assistant", "tool")
_CODES = ("invalid_type", "invalid_value", "missing_required_parameter", "unsupported_value")


def bad_request(param: str, message: str, code: str | None = "invalid_value") -> GatewayError:
    """A 400 naming ``param`` (its message starts with the field's name)."""
    return GatewayError(400, f"{param}: {message}", param=param, code=code)


def _refuse(code: str, message: str, at: str = "") -> PydanticCustomError:
    """A validation error with our code and message; ``at`` is appended to the field's location (``[3]``)."""
    return PydanticCustomError(code, "{m}", {"m": message, "at": at})


def _show(v: Any, n: int = 80) -> str:
    try:
        return json.dumps(v)[:n]
    except (TypeError, ValueError):
        return repr(v)[:n]


# ------------------------------------------------------------------------------------------------ field validators
def _real(lo: float, hi: float, *, lo_open: bool = False) -> PlainValidator:
    def check(v: Any) -> float | None:
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _refuse("invalid_type", f"expected a number, got {type(v).__name__}")
        if not ((v > lo if lo_open else v >= lo) and v <= hi):  # NaN fails both comparisons
            raise _refuse("invalid_value", f"expected a value in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
        return float(v)

    return PlainValidator(check)


def _integer(lo: int, hi: int | None = None) -> PlainValidator:
    def check(v: Any) -> int | None:
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise _refuse("invalid_type", f"expected an integer, got {type(v).__name__}")
        if v < lo or (hi is not None and v > hi):
            raise _refuse("invalid_value", f"expected an integer in [{lo}, {hi if hi is not None else 'inf'}], "
                                           f"got {v}")
        return int(v)

    return PlainValidator(check)


def _boolean(v: Any) -> bool | None:
    if v is None or isinstance(v, bool):
        return v
    raise _refuse("invalid_type", f"expected a boolean, got {type(v).__name__}")


def _only_n_one(v: Any) -> None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):  # 1.0 == 1 == True: the type decides
        raise _refuse("invalid_type", f"expected an integer, got {_show(v, 40)} ({type(v).__name__})")
    if v not in (None, 1):
        raise _refuse("unsupported_value", f"only n=1 is supported (send one request per sample), got {v!r}")


def _zero_penalty(v: Any) -> None:
    if v not in (None, 0, 0.0) or isinstance(v, bool):
        raise _refuse("unsupported_value", "penalties are not supported by the rollout engines (use 0)")


def _no_logit_bias(v: Any) -> None:
    if v:
        raise _refuse("unsupported_value", "not supported by the rollout engines")


def _text_format(v: Any) -> None:
    if v is not None and not (isinstance(v, Mapping) and v.get("type") == "text"):
        raise _refuse("unsupported_value", "only {\"type\": \"text\"} is supported")


def _model_id(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise _refuse("missing_required_parameter", "expected the model id (a non-empty string)")
    return v


def _stops(v: Any) -> list[str]:
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise _refuse("invalid_value", "expected a non-empty string or an array of at most 4 of them")
    return list(stops)


def _stream_options(v: Any) -> dict[str, Any]:
    if not v:
        return {}
    if not isinstance(v, Mapping):
        raise _refuse("invalid_type", "expected an object")
    return dict(v)


def _user(v: Any) -> str | None:
    if v is not None and (not isinstance(v, str) or not v):
        raise _refuse("invalid_type", f"expected a non-empty string, got {_show(v, 40)}")
    return v


def _role(v: Any) -> str:
    if v not in ROLES:
        raise _refuse("invalid_value", f"expected one of {list(ROLES)}, got {v!r}")
    return v


def _content(v: Any, info: ValidationInfo) -> str | None:
    """A string, null, or a list of text parts (joined); null only for an assistant message."""
    if isinstance(v, list):
        parts = []
        for j, part in enumerate(v):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _refuse("invalid_value", "expected a text part {\"type\": \"text\", \"text\": ...} (only text is "
                              f"supported), got {_show(part)}", at=f"[{j}]")
            parts.append(part["text"])
        v = "".join(parts)
    elif v is not None and not isinstance(v, str):
        raise _refuse("invalid_type", f"expected a string, null or a list of text parts, got {type(v).__name__}")
    if v is None and info.data.get("role", "assistant") != "assistant":
        raise _refuse("missing_required_parameter", "expected a string")
    return v


def _message_tool_calls(v: Any, info: ValidationInfo) -> list[dict[str, Any]] | None:
    """An assistant's tool calls as it received them (other roles' tool_calls are ignored)."""
    if not v or info.data.get("role") != "assistant":
        return None
    if not isinstance(v, list):
        raise _refuse("invalid_type", "expected an array")
    for j, tc in enumerate(v):
        fn = tc.get("function") if isinstance(tc, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"),
                                                                                               str):
            raise _refuse("invalid_value", "expected {\"id\", \"type\": \"function\", \"function\": {\"name\": str, "
                          "\"arguments\": str}}", at=f"[{j}]")
    return [dict(tc) for tc in v]


def _str_or_none(v: Any) -> str | None:
    return v if isinstance(v, str) else None  # a non-string name is not rendered (as before: never an error)


def _messages(v: Any) -> Any:
    if not isinstance(v, list) or not v:
        raise _refuse("missing_required_parameter" if v is None else "invalid_value",
                      "expected a non-empty array of messages")
    for i, m in enumerate(v):
        if not isinstance(m, Mapping):
            raise _refuse("invalid_type", f"expected an object, got {type(m).__name__}", at=f"[{i}]")
    return v


def _tools(v: Any) -> list[dict[str, Any]] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise _refuse("invalid_type", "expected an array of tools")
    for i, t in enumerate(v):
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(t, Mapping) or t.get("type") != "function" or not isinstance(fn, Mapping) or \
                not isinstance(fn.get("name"), str):
            raise _refuse("invalid_value", "expected {\"type\": \"function\", \"function\": {\"name\": ...}}",
                          at=f"[{i}]")
    return [dict(t) for t in v] or None


def _tool_choice(v: Any) -> str | None:
    if v not in (None, "auto", "none"):
        raise _refuse("unsupported_value", "only \"auto\" and \"none\" are supported (forcing a call would need "
                      f"constrained decoding), got {_show(v)}")
    return v


_top_logprobs = _integer(0, 20).func
_lp_count = _integer(0, 5).func
_at_least_one = _integer(1).func


def _zero_top_logprobs(v: Any) -> int:
    n = _top_logprobs(v)
    if n:
        raise _refuse("unsupported_value", "only 0 is supported: the engines report the sampled token's log-prob, "
                      "not the alternatives")
    return 0


def _prompt(v: Any) -> str | list[int]:
    """One prompt: a non-empty string, or token ids >= 0 (token-in); a one-element batch is unwrapped."""
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]
    if isinstance(v, str):
        if not v:
            raise _refuse("invalid_value", "expected a non-empty prompt")
        return v
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
        return [int(t) for t in v]
    raise _refuse("missing_required_parameter" if v is None else "invalid_value",
                  "expected a string or an array of token ids >= 0 (one prompt)")


def _completion_logprobs(v: Any) -> int | None:
    n = _lp_count(v)
    if n:
        raise _refuse("unsupported_value", "only 0 is supported (the sampled tokens' log-probs), not alternatives")
    return n


def _no_echo(v: Any) -> None:
    if v:
        raise _refuse("unsupported_value", "not supported")


def _no_suffix(v: Any) -> None:
    if v is not None:
        raise _refuse("unsupported_value", "not supported")


def _best_of_one(v: Any) -> None:
    if _at_least_one(v) not in (None, 1):
        raise _refuse("unsupported_value", "only 1 is supported")


def _reward(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _refuse("missing_required_parameter" if v is None else "invalid_type",
                      f"expected a number, got {_show(v, 40)}")
    if v != v or v in (float("inf"), float("-inf")):  # json.loads reads NaN and Infinity
        raise _refuse("invalid_value", f"expected a finite number, got {v}")
    return float(v)


def _info(v: Any) -> dict[str, Any] | None:
    if v is not None and not isinstance(v, dict):
        raise _refuse("invalid_type", "expected an object")
    return v


def _required() -> Any:
    """A field whose absence is reported by its own validator (with its own message), not by pydantic's."""
    return Field(None, validate_default=True)


# ------------------------------------------------------------------------------------------------ request models
class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ChatMessage(_Body):
    """One message of ``messages`` (``developer`` is rendered as ``system``)."""

    role: Annotated[str, PlainValidator(_role)] = _required()
    content: Annotated[str | None, PlainValidator(_content)] = _required()
    tool_calls: Annotated[list[dict[str, Any]] | None, PlainValidator(_message_tool_calls)] = None
    name: Annotated[str | None, PlainValidator(_str_or_none)] = None
    tool_call_id: Annotated[str | None, PlainValidator(_str_or_none)] = None

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template sees it."""
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


class _Request(_Body):
    """The fields both completion routes share, in the order they are checked (the first refusal is answered)."""

    n: Annotated[None, PlainValidator(_only_n_one)] = None
    presence_penalty: Annotated[None, PlainValidator(_zero_penalty)] = None
    frequency_penalty: Annotated[None, PlainValidator(_zero_penalty)] = None
    logit_bias: Annotated[None, PlainValidator(_no_logit_bias)] = None
    response_format: Annotated[None, PlainValidator(_text_format)] = None
    stream: Annotated[bool | None, PlainValidator(_boolean)] = None
    model: Annotated[str, PlainValidator(_model_id)] = _required()
    temperature: Annotated[float | None, _real(0.0, 2.0)] = None
    top_p: Annotated[float | None, _real(0.0, 1.0, lo_open=True)] = None
    top_k: Annotated[int | None, _integer(-1)] = None
    max_tokens: Annotated[int | None, _integer(1)] = None
    seed: Annotated[int | None, _integer(-(1 << 63), (1 << 63) - 1)] = None
    stop: Annotated[list[str], PlainValidator(_stops)] = Field(default_factory=list)
    stream_options: Annotated[dict[str, Any], PlainValidator(_stream_options)] = Field(default_factory=dict)
    user: Annotated[str | None, PlainValidator(_user)] = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options.get("include_usage"))


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``: ``max_completion_tokens`` wins over ``max_tokens``; ``tool_choice`` defaults to
    ``"auto"`` when ``tools`` are given."""

    max_completion_tokens: Annotated[int | None, _integer(1)] = None
    messages: Annotated[list[ChatMessage], BeforeValidator(_messages)] = _required()
    tools: Annotated[list[dict[str, Any]] | None, PlainValidator(_tools)] = None
    tool_choice: Annotated[str | None, PlainValidator(_tool_choice)] = None
    logprobs: Annotated[bool | None, PlainValidator(_boolean)] = None
    top_logprobs: Annotated[int, PlainValidator(_zero_top_logprobs)] = 0

    @property
    def parse_tool_calls(self) -> bool:
        """Whether tool calls in the output are parsed into ``message.tool_calls``."""
        return bool(self.tools) and (self.tool_choice or "auto") == "auto"

    @property
    def budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Request):
    """``POST /v1/completions``: one prompt, as text or token ids; ``logprobs=0`` returns the sampled tokens'."""

    prompt: Annotated[str | list[int], PlainValidator(_prompt)] = _required()
    logprobs: Annotated[int | None, PlainValidator(_completion_logprobs)] = None
    echo: Annotated[None, PlainValidator(_no_echo)] = None
    suffix: Annotated[None, PlainValidator(_no_suffix)] = None
    best_of: Annotated[None, PlainValidator(_best_of_one)] = None

    @property
    def budget(self) -> int | None:
        return self.max_tokens


class RewardRequest(_Body):
    """``POST /v1/sessions/{id}/reward``: a finite ``reward`` and an optional ``info`` object."""

    reward: Annotated[float, PlainValidator(_reward)] = _required()
    info: Annotated[dict[str, Any] | None, PlainValidator(_info)] = None


def _param(loc: Sequence[Any], prefix: str = "") -> str:
    out = prefix
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _error(e: ValidationError, prefix: str = "") -> GatewayError:
    """The first refusal of a validation, as a 400 naming its field."""
    err = e.errors(include_url=False)[0]
    ctx = err.get("ctx") or {}
    param = _param(err["loc"], prefix) + str(ctx.get("at", ""))
    if err["type"] in _CODES:
        return bad_request(param, str(ctx.get("m", err["msg"])), err["type"])
    # pydantic's own checks (only reached for shapes our validators do not cover)
    return bad_request(param, f"{err['msg']}, got {_show(err.get('input'), 40)}", "invalid_value")


def parse(model: type[_Body], body: Any) -> Any:
    """Validate a decoded JSON body as ``model``; raises a 400 :class:`GatewayError` naming the first bad field."""
    if not isinstance(body, dict):
        raise GatewayError(400, "expected a JSON object as the request body", code="invalid_json")
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        raise _error(e) from None
    return req


# ------------------------------------------------------------------------------------------------ responses
class Reply:
    """What an assistant turn answers: ``text`` (None when only tool calls), OpenAI ``tool_calls`` and the
    ``finish_reason`` (``tool_calls``, ``stop`` or ``length``)."""

    __slots__ = ("finish", "text", "tool_calls")

    def __init__(self, text: str | None, tool_calls: list[dict[str, Any]], finish: str) -> None:
        self.text, self.tool_calls, self.finish = text, tool_calls, finish

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


def assistant_reply(raw: str, *, stopped_by: str | None, stops: Sequence[str], parse_calls: bool,
                    tags: tuple[str, str], engine_finish: str) -> Reply:
    """The reply to a turn whose decoded output is ``raw``: a stop sequence that ended it is left out (as OpenAI
    does), Hermes tool calls become ``tool_calls`` with fresh ids when ``parse_calls``."""
    text, calls = raw, []
    if stopped_by in stops:
        text = text[: len(text) - len(stopped_by)]
    if parse_calls:
        parsed, _errors, rest = parse_tool_calls(text, tags=tags)
        if parsed:
            text = rest
            calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in parsed]
    finish = "tool_calls" if calls else ("stop" if engine_finish == "stop" else "length")
    return Reply(text if (text or not calls) else None, calls, finish)


def chat_logprobs(tokens: Sequence[str], logprobs: Sequence[float]) -> dict[str, Any]:
    return {"content": [{"token": s, "logprob": float(x), "bytes": list(s.encode()), "top_logprobs": []}
                        for s, x in zip(tokens, logprobs)]}


def text_logprobs(tokens: Sequence[str], logprobs: Sequence[float]) -> dict[str, Any]:
    offsets, acc = [], 0
    for s in tokens:
        offsets.append(acc)
        acc += len(s)
    return {"tokens": list(tokens), "token_logprobs": [float(x) for x in logprobs], "top_logprobs": None,
            "text_offset": offsets}


def chat_completion(cid: str, created: int, model: str, reply: Reply, logprobs: Any, usage: dict[str, int],
                    ext: dict[str, Any]) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": reply.message(), "logprobs": logprobs, "finish_reason": reply.finish}],
            "usage": usage, "rlblocks": ext}


def chat_chunk(cid: str, created: int, model: str, delta: dict[str, Any], finish: str | None,
               logprobs: Any) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}


def text_completion(cid: str, created: int, model: str, text: str, logprobs: Any, finish: str | None
                    ) -> dict[str, Any]:
    return {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
