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

import json
import math
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from rlblocks.errors import ArgumentError

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
    Tensors without an adapter pass through unchanged (same object). Raises ValueError when an A has no B (or the
    reverse), a shape does not fit, or, at the end of the iteration, when an adapter matched no base tensor
    (nothing is silently dropped). Input tensors are not modified.
    """
    try:
        tensors, config = lora_state["tensors"], lora_state["config"]
    except (KeyError, TypeError):
        raise ArgumentError("lora_state: expected the dict returned by lora_state(peft_model)") from None
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
    used: set[str] = set()
    items = base_named_tensors.items() if isinstance(base_named_tensors, Mapping) else base_named_tensors
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
    are not kept).
    """
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    base, adapters, meta = {}, {}, None
    for name, t in items:
        if name == CONFIG_TENSOR:
            meta = json.loads(bytes(t.cpu().tolist()).decode())
        elif name.startswith(PEFT_PREFIX) and _PAIR.match(name):
            adapters[name] = t.clone()
        else:
            base[name] = t.clone()
    if meta is None:
        raise ArgumentError(f"named_tensors: no {CONFIG_TENSOR!r} entry: not a LoraSyncer message")
    if meta["kind"] == "adapter" and base:
        raise ArgumentError(f"named_tensors: an adapter-only message carries {len(base)} base tensor(s)")
    info = {"kind": meta["kind"], "version": meta["version"], "base_version": meta["base_version"]}
    return base, {"tensors": adapters, "config": meta["config"], "adapter_name": meta["adapter_name"]}, info


class LoraSyncer:
    """Decides what a LoRA run sends: the base weights once, then only the adapters.

    ``send(named_tensors, version)`` is any transport, e.g. ``WeightSender(group).send``. Every message carries the
    adapter tensors plus a ``uint8`` tensor named :data:`CONFIG_TENSOR` (JSON: LoRA config, kind, versions); the
    first one (and the first after :meth:`reset`) also carries the base weights under HF names. Receivers use
    :func:`split_lora_message`. ``keep`` is how many recent adapter versions are tracked in :attr:`live_versions`
    (set it to ``max_staleness + 1`` so a rollout can finish under the adapter it started with).
    The base is assumed frozen (LoRA training); call :meth:`reset` if it changes.
    """

    def __init__(self, send: Callable[[Iterable[tuple[str, Tensor]], int], Any], *, keep: int = 2):
        if not callable(send):
            raise ArgumentError(f"send: expected a callable (named_tensors, version), got {type(send).__name__}")
        if not isinstance(keep, int) or keep < 1:
            raise ArgumentError(f"keep: expected an int >= 1, got {keep!r}")
        self.send = send
        self.base_version: int | None = None
        self.live_versions: deque[int] = deque(maxlen=keep)
        self.sent_bytes: list[int] = []

    def reset(self) -> None:
        """Send the base again at the next :meth:`sync` (e.g. a rollout engine restarted)."""
        self.base_version = None
        self.live_versions.clear()

    def sync(self, peft_model: Any, version: int, adapter_name: str = "default") -> str:
        """Send ``version``: ``"base+adapter"`` the first time, ``"adapter"`` afterwards; returns the kind sent."""
        if not isinstance(version, int):
            raise ArgumentError(f"version: expected an int, got {type(version).__name__}")
        if self.live_versions and version <= self.live_versions[-1]:
            raise ArgumentError(f"version: expected > {self.live_versions[-1]} (the last synced), got {version}")
        state = lora_state(peft_model, adapter_name)
        kind = "base+adapter" if self.base_version is None else "adapter"
        base_version = version if self.base_version is None else self.base_version
        meta = {
            "kind": kind,
            "version": version,
            "base_version": base_version,
            "config": state["config"],
            "adapter_name": adapter_name,
        }
        named: list[tuple[str, Tensor]] = list(base_state(peft_model)) if kind == "base+adapter" else []
        named += list(state["tensors"].items())
        named.append((CONFIG_TENSOR, _config_tensor(meta)))
        self.send(named, version)
        self.sent_bytes.append(sum(t.numel() * t.element_size() for _, t in named))
        self.base_version = base_version
        self.live_versions.append(version)
        return kind
