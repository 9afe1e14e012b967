"""LoRA-only weight sync: send the base once, then only the adapters; merge on the receiver when needed.

Names
-----
peft wraps a model as ``PeftModel.base_model (LoraModel).model (the HF model)``; its adapter state dict
(``get_peft_model_state_dict``, adapter name removed) therefore names the A/B matrices of the HF module
``model.layers.0.self_attn.q_proj`` as ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` /
``...lora_B.weight``. The wrapped base weight of that module is ``...q_proj.base_layer.weight`` inside the peft
model and ``model.layers.0.self_attn.q_proj.weight`` in the plain HF model (what engines load). So:

    HF base name = peft key  - leading "base_model.model."  - ".lora_A.weight" / ".lora_B.weight"  + ".weight"

and ``.base_layer.`` is dropped from any base name handed to :func:`merge_lora`.

Merge
-----
``W' = W + s * (B @ A)`` (transposed when ``fan_in_fan_out``; for embeddings ``W' = W + s * (B @ A)^T`` with peft's
``lora_embedding_A [r, num_embeddings]``, ``lora_embedding_B [dim, r]``), with ``s = lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with ``use_rslora``; ``r`` is the module's actual rank (``A.shape[0]``, so ``rank_pattern``
is honoured) and ``lora_alpha`` follows ``alpha_pattern`` when a pattern matches the module. ``B @ A`` and the sum
are computed in float32 and rounded once to ``W``'s dtype (as peft does for fp32; within one rounding of it for
bf16/fp16).

peft itself is imported only inside the functions that need a peft model.
"""

from __future__ import annotations

import inspect
import json
import math
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from rlblocks._checks import check_int, check_version
from rlblocks.errors import ArgumentError, WeightUpdateError

PEFT_PREFIX = "base_model.model."
CONFIG_TENSOR = "__rlblocks_lora__"
"""Name of the uint8 tensor carrying the adapter config (JSON) inside a LoRA sync message."""

_PAIR = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B)(?:\.weight)?$")
_JSON_CONFIG_KEYS = (
    "r",
    "lora_alpha",
    "use_rslora",
    "fan_in_fan_out",
    "rank_pattern",
    "alpha_pattern",
    "target_modules",
    "peft_type",
    "base_model_name_or_path",
    "bias",
    "use_dora",
)


def _jsonable(v: Any) -> Any:
    if isinstance(v, (set, frozenset, tuple)):
        return sorted(v) if isinstance(v, (set, frozenset)) else list(v)
    if hasattr(v, "value"):  # enums such as PeftType
        return v.value
    return v


def lora_state(peft_model: Any, adapter_name: str = "default") -> dict:
    """Adapter tensors of ``peft_model`` only: ``{"tensors": {peft_key: tensor}, "config": {...}, "adapter_name"}``.

    ``tensors`` are peft's adapter state dict (adapter name removed, keys as described in the module docstring;
    detached, not copied). ``config`` holds the JSON-able LoRA settings (``r``, ``lora_alpha``, ``use_rslora``,
    ``fan_in_fan_out``, ``rank_pattern``, ``alpha_pattern``, ``target_modules``...). Refuses DoRA, bias training and
    non-LoRA adapters, whose merge is not ``W + s * B @ A``.
    """
    from peft import get_peft_model_state_dict

    configs = getattr(peft_model, "peft_config", None)
    if not isinstance(configs, Mapping) or adapter_name not in configs:
        raise ArgumentError(f"peft_model: expected a peft model with adapter {adapter_name!r}, got {type(peft_model)}")
    cfg = configs[adapter_name].to_dict()
    config = {k: _jsonable(cfg.get(k)) for k in _JSON_CONFIG_KEYS}
    if config["peft_type"] != "LORA":
        raise ArgumentError(f"peft_model: expected a LoRA adapter, got peft_type {config['peft_type']!r}")
    if config["use_dora"]:
        raise ArgumentError("peft_model: DoRA adapters (use_dora=True) are not supported: their merge is not W + s*B@A")
    if config["bias"] not in (None, "none"):
        raise ArgumentError(f"peft_model: bias={config['bias']!r} trains biases too; only bias='none' is supported")
    sd = get_peft_model_state_dict(peft_model, adapter_name=adapter_name, save_embedding_layers=False)
    tensors = {k: v.detach() for k, v in sd.items()}
    for k in tensors:
        if not _PAIR.match(k):
            raise ArgumentError(f"peft_model: adapter tensor {k!r} is not a LoRA A/B matrix (e.g. modules_to_save)")
    return {"tensors": tensors, "config": config, "adapter_name": adapter_name}


def base_state(peft_model: Any) -> Iterator[tuple[str, Tensor]]:
    """The frozen base weights of ``peft_model`` under plain HF names (``.base_layer`` dropped, LoRA tensors out)."""
    base = peft_model.get_base_model()
    for name, t in base.state_dict().items():
        if ".lora_" in name:
            continue
        yield name.replace(".base_layer.", "."), t.detach()


def _pattern_value(module: str, patterns: Mapping[str, Any] | None, default: Any) -> Any:
    """peft's pattern rule: a key matches a module whose dotted name ends with it (regex allowed)."""
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def lora_delta(
    a: Float[Tensor, "r fan_in"],
    b: Float[Tensor, "fan_out r"],
    *,
    lora_alpha: float,
    use_rslora: bool = False,
) -> Float[Tensor, "fan_out fan_in"]:
    """``s * (B @ A)`` in float32, ``s = lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA), ``r = A.shape[0]``."""
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
        raise ArgumentError(f"lora A/B: expected A [r, in] and B [out, r], got {list(a.shape)} and {list(b.shape)}")
    r = a.shape[0]
    scale = lora_alpha / (math.sqrt(r) if use_rslora else r)
    return (b.float() @ a.float()) * scale


def merge_lora(
    base_named_tensors: Iterable[tuple[str, Tensor]] | Mapping[str, Tensor],
    lora_state: Mapping[str, Any],
) -> Iterator[tuple[str, Tensor]]:
    """Yield the base weights with every LoRA pair merged in (``W + s * B @ A``, see the module docstring).

    ``base_named_tensors`` may use plain HF names or peft's ``.base_layer.`` names (normalised to HF names).
    Tensors without an adapter pass through unchanged (same object). Raises ArgumentError (a ValueError) when an
    A has no B (or the reverse), a shape does not fit, or, at the end of the iteration, when an adapter matched no
    base tensor (nothing is silently dropped). Input tensors are not modified. ``lora_state`` is checked at the
    call, not at the first ``next()``.
    """
    try:
        tensors, config = lora_state["tensors"], lora_state["config"]
    except (KeyError, TypeError):
        raise ArgumentError("lora_state: expected the dict returned by lora_state(peft_model)") from None
    if not isinstance(tensors, Mapping) or not isinstance(config, Mapping):
        raise ArgumentError("lora_state: expected the dict returned by lora_state(peft_model) (a 'tensors' dict and "
                            "a 'config' dict)")
    pairs: dict[str, dict[str, Tensor]] = {}
    for key, t in tensors.items():
        m = _PAIR.match(key)
        if m is None:
            raise ArgumentError(f"lora_state['tensors']: {key!r} is not a LoRA A/B matrix")
        module = m["module"][len(PEFT_PREFIX) :] if m["module"].startswith(PEFT_PREFIX) else m["module"]
        pairs.setdefault(module, {})[m["kind"]] = t
    for module, p in pairs.items():
        kinds = set(p)
        if kinds not in ({"lora_A", "lora_B"}, {"lora_embedding_A", "lora_embedding_B"}):
            raise ArgumentError(f"lora_state['tensors']: module {module!r} has {sorted(kinds)}, expected an A and a B")
    items = base_named_tensors.items() if isinstance(base_named_tensors, Mapping) else base_named_tensors
    return _merge(items, pairs, config)


def _merge(
    items: Iterable[tuple[str, Tensor]], pairs: dict[str, dict[str, Tensor]], config: Mapping[str, Any]
) -> Iterator[tuple[str, Tensor]]:
    used: set[str] = set()
    for name, w in items:
        name = name.replace(".base_layer.", ".")
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        p = pairs.get(module) if module is not None else None
        if p is None:
            yield name, w
            continue
        alpha = _pattern_value(module, config.get("alpha_pattern"), config["lora_alpha"])
        rslora = bool(config.get("use_rslora"))
        if "lora_A" in p:
            delta = lora_delta(p["lora_A"], p["lora_B"], lora_alpha=alpha, use_rslora=rslora)
            if config.get("fan_in_fan_out"):
                delta = delta.T
        else:
            delta = lora_delta(p["lora_embedding_A"], p["lora_embedding_B"], lora_alpha=alpha, use_rslora=rslora).T
        if delta.shape != w.shape:
            raise ArgumentError(f"base_named_tensors[{name!r}]: shape {list(w.shape)} does not fit LoRA delta "
                             f"{list(delta.shape)}")
        used.add(module)
        yield name, (w.float() + delta.to(w.device)).to(w.dtype)
    unused = sorted(set(pairs) - used)
    if unused:
        raise ArgumentError(f"base_named_tensors: no '<module>.weight' for LoRA module(s) {unused[:4]}")


def _config_tensor(payload: dict) -> Tensor:
    return torch.tensor(list(json.dumps(payload, sort_keys=True).encode()), dtype=torch.uint8)


def split_lora_message(named_tensors: Iterable[tuple[str, Tensor]] | Mapping[str, Tensor]) -> tuple[dict, dict, dict]:
    """Receiver side of :class:`LoraSyncer`: ``(base, lora_state, info)`` from one received message.

    ``base`` holds the base weights (HF names; empty after the first sync), ``lora_state`` is the same structure
    :func:`lora_state` returns (ready for :func:`merge_lora` or an engine's LoRA loader), ``info`` is
    ``{"kind": "base+adapter" | "adapter", "version", "base_version"}``. Received tensors are copied (bucket views
    are not kept). A message that is not a LoraSyncer message is refused with
    :class:`~rlblocks.errors.WeightUpdateError`, like every refused weight update on a receiver.
    """
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    base, adapters, meta = {}, {}, None
    for name, t in items:
        if name == CONFIG_TENSOR:
            try:
                meta = json.loads(bytes(t.cpu().tolist()).decode())
                if meta["kind"] not in ("base+adapter", "adapter"):
                    raise ValueError(f"kind {meta['kind']!r}")
                missing = [k for k in ("version", "base_version", "config", "adapter_name") if k not in meta]
                if missing:
                    raise KeyError(missing)
            except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
                raise WeightUpdateError(f"named_tensors[{CONFIG_TENSOR!r}]: not a LoraSyncer config ({e!r})") from e
        elif name.startswith(PEFT_PREFIX) and _PAIR.match(name):
            adapters[name] = t.clone()
        else:
            base[name] = t.clone()
    if meta is None:
        raise WeightUpdateError(f"named_tensors: no {CONFIG_TENSOR!r} entry: not a LoraSyncer message")
    if meta["kind"] == "adapter" and base:
        raise WeightUpdateError(f"named_tensors: an adapter-only message carries {len(base)} base tensor(s)")
    info = {"kind": meta["kind"], "version": meta["version"], "base_version": meta["base_version"]}
    return base, {"tensors": adapters, "config": meta["config"], "adapter_name": meta["adapter_name"]}, info


def _send_style(send: Callable[..., Any]) -> tuple[bool, bool]:
    """What ``send``'s signature accepts: (``version=``, ``partial=``)."""
    try:
        params = inspect.signature(send).parameters
    except (TypeError, ValueError):  # no signature (some builtins): the project's convention
        return True, False
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    by_kw = var_kw or ("version" in params and params["version"].kind in kinds)
    partial = "partial" in params and params["partial"].kind in kinds
    return by_kw, partial


def _is_async(send: Callable[..., Any]) -> bool:
    # a callable object with ``async def __call__`` too
    return inspect.iscoroutinefunction(send) or inspect.iscoroutinefunction(type(send).__call__)


class LoraSyncer:
    """Decides what a LoRA run sends: the base weights once, then only the adapters (or merged weights).

    ``send(named_tensors, *, version)`` is any transport with the project's weight-update signature:
    ``WeightSender(group).send``, or an engine's ``update_weights`` (``async def``: use :meth:`async_sync`).

    Two message kinds, chosen by ``merge``:

    * ``merge=False`` (adapter messages, for receivers that merge or load LoRA themselves): every message carries
      the adapter tensors plus a ``uint8`` tensor named :data:`CONFIG_TENSOR` (JSON: LoRA config, kind, versions);
      the first one (and the first after :meth:`reset`) also carries the base weights under HF names. Receivers
      use :func:`split_lora_message`.
    * ``merge=True`` (for an engine that loads plain HF weights): the trainer merges, ``W + s * B @ A``
      (:func:`merge_lora`), and sends HF names only. The first message carries every base weight; later ones only
      the merged weights of modules with an adapter, passed with ``partial=True`` when ``send`` accepts a
      ``partial`` keyword (an engine that refuses partial updates by default), else every weight again.
    * ``merge=None`` (default): ``True`` when ``send`` is named ``update_weights`` (an engine's loader, which takes
      plain HF weights), ``False`` otherwise.

    ``keep`` is how many recent adapter versions are tracked in :attr:`live_versions` (set it to
    ``max_staleness + 1`` so a rollout can finish under the adapter it started with). The base is assumed frozen
    (LoRA training); call :meth:`reset` if it changes. Bookkeeping (:attr:`live_versions`, :attr:`sent_bytes`)
    changes only once ``send`` has returned (been awaited) without raising.
    """

    def __init__(self, send: Callable[..., Any], *, keep: int = 2, merge: bool | None = None):
        if not callable(send):
            raise ArgumentError(f"send: expected a callable (named_tensors, *, version), got {type(send).__name__}")
        keep = check_int("keep", keep, minimum=1)
        if merge is not None and not isinstance(merge, bool):  # 1 == True, but 1 is no flag
            raise ArgumentError(f"merge: expected None, True or False, got {merge!r}")
        self.send = send
        self.merge = getattr(send, "__name__", None) == "update_weights" if merge is None else merge
        by_keyword, self._partial = _send_style(send)
        if not by_keyword:
            raise ArgumentError(
                "send: expected a callable taking `version` by keyword (named_tensors, *, version), got one whose "
                "signature has no `version` parameter"
            )
        self.is_async = _is_async(send)
        self.base_version: int | None = None
        self.live_versions: deque[int] = deque(maxlen=keep)
        self.sent_bytes: list[int] = []

    def reset(self) -> None:
        """Send the base again at the next :meth:`sync` (e.g. a rollout engine restarted)."""
        self.base_version = None
        self.live_versions.clear()

    def _message(self, peft_model: Any, version: int, adapter_name: str) -> tuple[str, list, dict]:
        version = check_version("version", version)
        if self.live_versions and version <= self.live_versions[-1]:
            raise ArgumentError(f"version: expected > {self.live_versions[-1]} (the last synced), got {version}")
        state = lora_state(peft_model, adapter_name)
        first = self.base_version is None
        kind = "base+adapter" if first else "adapter"
        kwargs: dict[str, Any] = {}
        if self.merge:
            base = list(base_state(peft_model))
            merged = list(merge_lora(base, state))
            if first or not self._partial:
                named = merged
            else:  # merge_lora passes a tensor without an adapter through as the same object
                named = [(n, m) for (n, m), (_, b) in zip(merged, base) if m is not b]
                kwargs["partial"] = True
        else:
            meta = {
                "kind": kind,
                "version": version,
                "base_version": version if first else self.base_version,
                "config": state["config"],
                "adapter_name": adapter_name,
            }
            named = list(base_state(peft_model)) if first else []
            named += list(state["tensors"].items())
            named.append((CONFIG_TENSOR, _config_tensor(meta)))
        return kind, named, kwargs

    def _call(self, named: list, version: int, kwargs: dict) -> Any:
        return self.send(named, version=version, **kwargs)

    def _done(self, kind: str, named: list, version: int) -> str:
        self.sent_bytes.append(sum(t.numel() * t.element_size() for _, t in named))
        if self.base_version is None:
            self.base_version = version
        self.live_versions.append(version)
        return kind

    def sync(self, peft_model: Any, *, version: int, adapter_name: str = "default") -> str:
        """Send ``version``: ``"base+adapter"`` the first time, ``"adapter"`` afterwards; returns the kind sent.

        For a ``send`` that is ``async def`` (an engine's ``update_weights``) use ``await`` :meth:`async_sync`;
        here it is refused before anything is sent.
        """
        if self.is_async:
            raise ArgumentError("send: is async (e.g. engine.update_weights); use `await syncer.async_sync(...)`")
        kind, named, kwargs = self._message(peft_model, version, adapter_name)
        out = self._call(named, version, kwargs)
        if inspect.isawaitable(out):  # a sync wrapper around a coroutine function: nothing has run yet
            if inspect.iscoroutine(out):
                out.close()
            raise ArgumentError("send: returned an awaitable, nothing was sent; use `await syncer.async_sync(...)`")
        return self._done(kind, named, version)

    async def async_sync(self, peft_model: Any, *, version: int, adapter_name: str = "default") -> str:
        """:meth:`sync` for an async ``send`` such as ``engine.update_weights`` (a plain ``send`` works too).

        Returns once ``send`` has finished (the engine has loaded the weights); the kind sent.
        """
        kind, named, kwargs = self._message(peft_model, version, adapter_name)
        out = self._call(named, version, kwargs)
        if inspect.isawaitable(out):
            await out
        return self._done(kind, named, version)
