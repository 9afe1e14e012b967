"""Routing replay (R3) for mixture-of-experts models: record the experts each token was routed to, force them later.

An MoE layer's router picks ``top_k`` experts per token from near-tied scores, so an engine and a trainer that differ
in the last bits (kernels, batch shape, bf16 vs fp32, a small weight update) route some tokens to other experts,
and a flipped route moves a token's log-prob by far more than the rounding that caused it. Rollout routing replay
(R3, as in prime-rl, ROLL, NeMo-RL, Miles and ART, and megatron-core's ``moe_enable_routing_replay``) records the
experts the engine used and makes the training forward use the same ones. Only the discrete *selection* is
replayed: the gate weights are recomputed from the live router over the recorded experts, with the model's own
normalisation, so the router keeps getting gradients.

**Record layout** (one generation): ``routed_experts``: an unsigned integer tensor ``[n, layers, top_k]``, ``uint8``
when the model has at most 256 experts, else ``uint16`` (:func:`routing_dtype`; the same rule as vLLM's). Row ``j``
is the routing of sequence position ``j`` of ``prompt_ids + output_ids`` (prompt positions included: every later
token attends to them, so they must be replayed too). An engine feeds every token except the last sampled one, so a
finished generation has ``n = len(prompt_ids) + len(output_ids) - 1`` rows, vLLM's convention. Within a row, the
experts are in the order the router ranked them. The ``layers`` axis holds the model's MoE layers in model order
(dense layers have no router and no entry); :func:`replay_routing` also accepts one entry per decoder layer (vLLM's
layout, whose rows for dense layers are ignored).

Records of one sequence are merged by :func:`concat_routing` and right-padded into ``[B, L, layers, top_k]`` by
:func:`pad_routing` (``-1``: no record), which is what :func:`replay_routing` takes.
Supported routers: the Hugging Face transformers (5.x) MoE routers of Qwen2/3-MoE, Qwen3-Next, Qwen3.5-MoE,
Qwen3-VL-MoE, OLMoE, FlexOlmo, Mixtral, MiniMax, GPT-OSS, DeepSeek-V3 and GLM-4-MoE, each replayed with its own
gate-weight rule, and megatron-core's ``TopKRouter`` (through its ``router_replay`` hook). A router class not in
this list is refused rather than replayed partially. Each rule, and the token orders: ``docs/rollout/moe_replay.md``.
One file: the recorder and the replay share the router discovery and the gate rules, and the record helpers
(~200 lines) exist only for them.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor, nn

from rlblocks.errors import ArgumentError

__all__ = [
    "RoutingRecorder",
    "RoutingSpec",
    "concat_routing",
    "pad_routing",
    "replay_routing",
    "response_routing",
    "route_flip_fraction",
    "routing_dtype",
    "routing_spec",
]

# ----------------------------------------------------------------------------------------------------------- records


def routing_dtype(num_experts: int) -> torch.dtype:
    """The compact dtype of a routing record: ``torch.uint8`` for at most 256 experts, else ``torch.uint16``
    (at most 65536). Raises :class:`~rlblocks.errors.ArgumentError` otherwise."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ArgumentError(f"num_experts: expected an int >= 1, got {num_experts!r}")
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 65536:
        return torch.uint16
    raise ArgumentError(f"num_experts: at most 65536 experts fit a uint16 record, got {num_experts}")


def _check_record(name: str, x: object, *, layers: int | None = None, top_k: int | None = None) -> Tensor:
    if not isinstance(x, Tensor):
        raise ArgumentError(f"{name}: expected a tensor [tokens, layers, top_k], got {type(x).__name__}")
    if x.dim() != 3:
        raise ArgumentError(f"{name}: expected a 3-D tensor [tokens, layers, top_k], got shape {list(x.shape)}")
    if x.dtype not in (torch.uint8, torch.uint16):
        raise ArgumentError(f"{name}: expected dtype uint8 or uint16 (see routing_dtype), got {x.dtype}")
    if layers is not None and (x.shape[1] != layers or x.shape[2] != top_k):
        raise ArgumentError(
            f"{name}: expected [tokens, {layers}, {top_k}] like the first record, got {list(x.shape)}"
        )
    return x


def concat_routing(
    records: Sequence[Shaped[Tensor, "n layers top_k"]], *, starts: Sequence[int] | None = None
) -> Shaped[Tensor, "N layers top_k"]:
    """Merge routing records of one sequence into one record covering positions ``[0, N)``.

    ``records[i]`` covers sequence positions ``[starts[i], starts[i] + len(records[i]))`` (``starts`` defaults to
    all zeros: every record starts at position 0, as an engine's record of a resubmitted ``prompt + partial`` does).
    A position covered by several records takes the **first** record's row: the routing under which that
    position was first computed, which the tokens sampled right after it saw (vLLM's ``routed_experts_prompt_start``
    makes each turn return only its new positions, which gives the same result). To favour the latest call instead
    (e.g. when the earlier tokens are masked as stale), use the last record alone: it covers every position.

    The records must leave no gap (``starts[0] == 0`` and each starts at or before the end so far) and share
    ``layers`` and ``top_k``; uint8 and uint16 records merge to uint16. Returns a new tensor on the first record's
    device. Raises :class:`~rlblocks.errors.ArgumentError` on an empty list, bad shapes/dtypes or a gap.
    """
    if not isinstance(records, Sequence) or isinstance(records, Tensor) or len(records) == 0:
        raise ArgumentError(f"records: expected a non-empty sequence of routing records, got {type(records).__name__}")
    first = _check_record("records[0]", records[0])
    layers, top_k = int(first.shape[1]), int(first.shape[2])
    for i, r in enumerate(records[1:], start=1):
        _check_record(f"records[{i}]", r, layers=layers, top_k=top_k)
    if starts is None:
        starts = [0] * len(records)
    starts = list(starts)
    if len(starts) != len(records):
        raise ArgumentError(f"starts: expected {len(records)} values (one per record), got {len(starts)}")
    dtype = torch.uint16 if any(r.dtype == torch.uint16 for r in records) else torch.uint8
    parts: list[Tensor] = []
    end = 0
    for i, (r, s) in enumerate(zip(records, starts)):
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ArgumentError(f"starts[{i}]: expected an int >= 0, got {s!r}")
        if s > end:
            raise ArgumentError(
                f"starts[{i}]: record {i} starts at position {s} but the records before it end at {end}: "
                "positions in between would have no routing"
            )
        new = r[end - s :]
        if len(new):
            parts.append(new.to(device=first.device, dtype=dtype))
            end = s + int(r.shape[0])
    if not parts:
        return first.new_empty((0, layers, top_k), dtype=dtype)
    return torch.cat(parts, dim=0)


def pad_routing(
    records: Sequence[Shaped[Tensor, "n layers top_k"] | None], *, seq_len: int
) -> Int[Tensor, "B L layers top_k"]:
    """Right-pad per-row routing records into ``[B, L, layers, top_k]`` aligned with ``RolloutBatch.input_ids``.

    Row ``b``, position ``j < len(records[b])`` holds ``records[b][j]`` (the routing of sequence position ``j``);
    every other entry is ``-1``, which :func:`replay_routing` reads as "no record: the live router decides"
    (padding, the last sampled token, or a whole row given as ``None``). ``L = seq_len`` (pass
    ``batch.input_ids.shape[1]``). dtype: ``int16`` when every record is uint8, ``int32`` when one is uint16 (ids
    up to 65535 need it). Raises :class:`~rlblocks.errors.ArgumentError` for an empty list, bad records, mixed
    ``layers``/``top_k``, all rows ``None``, or a record longer than ``seq_len`` (it belongs to another layout).
    """
    if not isinstance(records, Sequence) or isinstance(records, Tensor) or len(records) == 0:
        raise ArgumentError(f"records: expected a non-empty sequence (one record or None per row), got {records!r:.60}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ArgumentError(f"seq_len: expected an int >= 1, got {seq_len!r}")
    present = [(b, r) for b, r in enumerate(records) if r is not None]
    if not present:
        raise ArgumentError("records: every row is None; there is no routing to pad")
    b0, r0 = present[0]
    _check_record(f"records[{b0}]", r0)
    layers, top_k = int(r0.shape[1]), int(r0.shape[2])
    for b, r in present[1:]:
        _check_record(f"records[{b}]", r, layers=layers, top_k=top_k)
    wide = any(r.dtype == torch.uint16 for _, r in present)
    out = torch.full((len(records), seq_len, layers, top_k), -1, dtype=torch.int32 if wide else torch.int16)
    for b, r in present:
        n = int(r.shape[0])
        if n > seq_len:
            raise ArgumentError(f"records[{b}]: {n} positions do not fit seq_len={seq_len}")
        out[b, :n] = r.to(device="cpu", dtype=out.dtype)
    return out.to(r0.device)


def response_routing(
    routed_experts: Int[Tensor, "B L layers top_k"], prompt_lens: Int[Tensor, " B"], num_response: int
) -> Int[Tensor, "B T layers top_k"]:
    """The response-aligned view ``[B, T, layers, top_k]`` of a padded routing tensor (:func:`pad_routing`).

    Position ``t`` of row ``b`` is the routing of the token at sequence position ``P_b + t`` (``P_b =
    prompt_lens[b]``), the same alignment as ``RolloutBatch.response_ids``; ``-1`` beyond ``L``. This is a view for
    per-token bookkeeping (flip statistics over response tokens, per-turn slices); :func:`replay_routing` needs the
    full ``[B, L, ...]`` tensor, since prompt positions are routed too. No host sync.
    """
    if not isinstance(routed_experts, Tensor) or routed_experts.dim() != 4:
        got = list(routed_experts.shape) if isinstance(routed_experts, Tensor) else type(routed_experts).__name__
        raise ArgumentError(f"routed_experts: expected a 4-D tensor [B, L, layers, top_k], got {got}")
    if routed_experts.dtype.is_floating_point or routed_experts.dtype in (torch.bool, torch.uint8, torch.uint16):
        raise ArgumentError(
            f"routed_experts: expected a signed integer tensor (pad_routing's), got {routed_experts.dtype}"
        )
    b, seq = int(routed_experts.shape[0]), int(routed_experts.shape[1])
    if not isinstance(prompt_lens, Tensor) or prompt_lens.shape != (b,) or prompt_lens.dtype.is_floating_point:
        got = list(prompt_lens.shape) if isinstance(prompt_lens, Tensor) else type(prompt_lens).__name__
        raise ArgumentError(f"prompt_lens: expected an integer tensor [{b}], got {got}")
    if isinstance(num_response, bool) or not isinstance(num_response, int) or num_response < 0:
        raise ArgumentError(f"num_response: expected an int >= 0, got {num_response!r}")
    pos = prompt_lens.to(routed_experts.device).long().unsqueeze(1) + torch.arange(
        num_response, device=routed_experts.device
    )
    inside = pos < seq
    idx = torch.where(inside, pos, torch.zeros_like(pos))
    gathered = routed_experts.gather(
        1, idx[:, :, None, None].expand(-1, -1, routed_experts.shape[2], routed_experts.shape[3])
    )
    return torch.where(inside[:, :, None, None], gathered, torch.full_like(gathered, -1))


def route_flip_fraction(
    routed_a: Int[Tensor, "*tokens layers top_k"],
    routed_b: Int[Tensor, "*tokens layers top_k"],
    mask: Bool[Tensor, "*tokens"] | None = None,
) -> Float[Tensor, ""]:
    """Fraction of (token, layer) routes whose expert **set** differs between ``routed_a`` and ``routed_b``.

    The order within a row does not matter (the same experts in another order is the same route). Entries where
    either side is ``-1`` (no record) are left out, as are tokens where ``mask`` is False. Returns a float32 0-dim
    tensor (NaN when nothing is compared). Accepts uint8/uint16 records and signed padded tensors; no host sync.
    """
    for name, x in (("routed_a", routed_a), ("routed_b", routed_b)):
        if not isinstance(x, Tensor) or x.dim() < 2 or x.dtype.is_floating_point or x.dtype == torch.bool:
            raise ArgumentError(f"{name}: expected an integer tensor [..., layers, top_k], got {x!r:.60}")
    if routed_a.shape != routed_b.shape:
        raise ArgumentError(
            f"routed_b: expected the shape of routed_a {list(routed_a.shape)}, got {list(routed_b.shape)}"
        )
    a = torch.sort(routed_a.to(torch.int32), dim=-1).values
    b = torch.sort(routed_b.to(routed_a.device, torch.int32), dim=-1).values
    valid = (a[..., 0] >= 0) & (b[..., 0] >= 0)
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.shape != routed_a.shape[:-2]:
            got = list(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            raise ArgumentError(f"mask: expected shape {list(routed_a.shape[:-2])} (the token axes), got {got}")
        valid = valid & mask.to(valid.device, torch.bool).unsqueeze(-1)
    flipped = (a != b).any(dim=-1) & valid
    return flipped.sum().float() / valid.sum().float()


# ----------------------------------------------------------------------------------------------------------- routers

_HF_RULES: dict[str, tuple[str, dict[str, Any]]] = {
    # class name -> (rule, options); each entry mirrors that class's forward in transformers 5.x line by line.
    "Qwen3MoeTopKRouter": ("softmax_topk", {"renorm": "norm_topk_prob", "cast": True}),
    "Qwen2MoeTopKRouter": ("softmax_topk", {"renorm": "norm_topk_prob", "cast": True}),
    "OlmoeTopKRouter": ("softmax_topk", {"renorm": "norm_topk_prob", "cast": True}),
    "Qwen3NextTopKRouter": ("softmax_topk", {"renorm": "norm_topk_prob", "cast": True}),
    "FlexOlmoTopKRouter": ("softmax_topk", {"renorm": "norm_topk_prob", "cast": True}),
    "Qwen3_5MoeTopKRouter": ("softmax_topk", {"renorm": True, "cast": True}),
    "Qwen3VLMoeTextTopKRouter": ("softmax_topk", {"renorm": True, "cast": True}),
    "MixtralTopKRouter": ("softmax_topk", {"renorm": True, "cast": False}),
    "MiniMaxTopKRouter": ("softmax_topk", {"renorm": True, "cast": False}),
    "GptOssTopKRouter": ("topk_softmax", {}),
    "DeepseekV3TopkRouter": ("sigmoid", {}),
    "Glm4MoeTopkRouter": ("sigmoid", {}),
}
# Module classes that look like MoE routers; one of these that is not supported is refused, never skipped.
_ROUTER_LIKE = re.compile(r"(Top\d*[Kk]?Router|Router|TopkGate|MoeGate)$")
_LAYER_IN_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class _Router:
    name: str
    module: nn.Module
    backend: str  # "hf" | "megatron"
    rule: str
    options: dict[str, Any]
    num_experts: int
    top_k: int
    decoder_layer: int | None


@dataclass(frozen=True)
class RoutingSpec:
    """What a model's routing records look like.

    ``num_layers``: MoE layers (the ``layers`` axis of a record); ``top_k``; ``num_experts``; ``dtype`` (the
    record dtype, :func:`routing_dtype`); ``decoder_layers[i]``: the decoder-layer index of MoE layer ``i``
    (``None`` when unknown); ``num_decoder_layers``: the model's decoder layers (``None`` when unknown);
    ``names``: the router modules' names; ``backend``: ``"hf"`` or ``"megatron"``.
    """

    num_layers: int
    top_k: int
    num_experts: int
    dtype: torch.dtype
    decoder_layers: tuple[int | None, ...]
    num_decoder_layers: int | None
    names: tuple[str, ...]
    backend: str


def _is_megatron_topk_router(module: nn.Module) -> bool:
    cls = type(module)
    if not cls.__module__.startswith("megatron.core") or "Router" not in cls.__name__:
        return False
    from megatron.core.transformer.moe.router import TopKRouter

    return isinstance(module, TopKRouter)


def _megatron_router(name: str, module: nn.Module) -> _Router:
    cfg = module.config
    if getattr(cfg, "moe_router_fusion", False):
        raise ArgumentError(
            f"model: router {name!r} uses moe_router_fusion=True, whose fused top-k kernel bypasses megatron's "
            "router_replay hook; build the model with moe_router_fusion=False to record or replay routing"
        )
    if getattr(module, "routing_type", None) == "sinkhorn":
        raise ArgumentError(f"model: router {name!r} uses sinkhorn load balancing, which has no top-k to replay")
    if not hasattr(module, "router_replay"):
        raise ArgumentError(
            f"model: router {name!r} has no router_replay slot (megatron-core too old: routing replay needs >= 0.15)"
        )
    layer_number = getattr(module, "layer_number", None)
    return _Router(
        name=name,
        module=module,
        backend="megatron",
        rule="megatron",
        options={},
        num_experts=int(cfg.num_moe_experts),
        top_k=int(module.topk),
        decoder_layer=None if layer_number is None else int(layer_number) - 1,
    )


def _hf_router(name: str, module: nn.Module) -> _Router:
    rule, options = _HF_RULES[type(module).__name__]
    options = dict(options)
    renorm = options.get("renorm")
    if isinstance(renorm, str):
        if not hasattr(module, renorm):
            raise ArgumentError(f"model: router {name!r} ({type(module).__name__}) has no attribute {renorm!r}")
        options["renorm"] = bool(getattr(module, renorm))
    if rule == "sigmoid":
        options["renorm"] = bool(module.norm_topk_prob)
        options["scale"] = float(module.routed_scaling_factor)
    m = _LAYER_IN_NAME.search(name + ".")
    return _Router(
        name=name,
        module=module,
        backend="hf",
        rule=rule,
        options=options,
        num_experts=int(module.num_experts),
        top_k=int(module.top_k),
        decoder_layer=int(m.group(1)) if m else None,
    )


def _find_routers(model: object) -> list[_Router]:
    if not isinstance(model, nn.Module):
        raise ArgumentError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    routers: list[_Router] = []
    unknown: list[str] = []
    for name, module in model.named_modules():
        cls = type(module).__name__
        if cls in _HF_RULES:
            routers.append(_hf_router(name, module))
        elif _is_megatron_topk_router(module):
            routers.append(_megatron_router(name, module))
        elif _ROUTER_LIKE.search(cls) and cls not in ("Router",):
            unknown.append(f"{name} ({cls})")
    if unknown:
        raise ArgumentError(
            f"model: unsupported MoE router module(s) {unknown[:4]}; supported: {sorted(_HF_RULES)} and "
            "megatron-core TopKRouter"
        )
    if not routers:
        raise ArgumentError(
            f"model: no recognised MoE router in {type(model).__name__}; supported: {sorted(_HF_RULES)} and "
            "megatron-core TopKRouter"
        )
    if len({r.backend for r in routers}) != 1:
        raise ArgumentError("model: mixes Hugging Face and megatron-core routers")
    for r in routers[1:]:
        if r.top_k != routers[0].top_k or r.num_experts != routers[0].num_experts:
            raise ArgumentError(
                f"model: routers disagree on (num_experts, top_k): {routers[0].name} has "
                f"({routers[0].num_experts}, {routers[0].top_k}), {r.name} has ({r.num_experts}, {r.top_k})"
            )
    return routers


def _num_decoder_layers(model: nn.Module) -> int | None:
    cfg = getattr(model, "config", None)
    for attr in ("num_hidden_layers", "num_layers"):
        value = getattr(cfg, attr, None)
        if isinstance(value, int):
            return value
    text_cfg = getattr(cfg, "text_config", None)
    value = getattr(text_cfg, "num_hidden_layers", None)
    return value if isinstance(value, int) else None


def routing_spec(model: nn.Module) -> RoutingSpec:
    """The :class:`RoutingSpec` of ``model`` (an HF transformers MoE model or a megatron-core MoE model).

    Raises :class:`~rlblocks.errors.ArgumentError` when ``model`` has no recognised MoE router, or has a router
    class that cannot be replayed (see the module docstring for the supported ones)."""
    return _spec(model, _find_routers(model))


def _spec(model: nn.Module, routers: list[_Router]) -> RoutingSpec:
    return RoutingSpec(
        num_layers=len(routers),
        top_k=routers[0].top_k,
        num_experts=routers[0].num_experts,
        dtype=routing_dtype(routers[0].num_experts),
        decoder_layers=tuple(r.decoder_layer for r in routers),
        num_decoder_layers=_num_decoder_layers(model),
        names=tuple(r.name for r in routers),
        backend=routers[0].backend,
    )


# ------------------------------------------------------------------------------------------------- gate-weight rules


def _hf_gate_weights(router: _Router, logits: Tensor, experts: Tensor) -> Tensor:
    """Gate weights of the ``experts [N, k]`` (int64) from the router logits ``[N, E]``, by the router's own rule.

    Each branch repeats the operations (and dtypes) of that router's forward with ``topk`` replaced by a gather,
    so forcing the experts the router would pick anyway gives its own weights bit for bit."""
    opt = router.options
    if router.rule == "softmax_topk":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights = probs.gather(1, experts)
        if opt["renorm"]:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype) if opt["cast"] else weights
    if router.rule == "topk_softmax":
        top = logits.gather(1, experts)
        return torch.softmax(top, dim=1, dtype=top.dtype)
    if router.rule == "sigmoid":
        weights = logits.sigmoid().gather(1, experts)
        if opt["renorm"]:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * opt["scale"]
    raise AssertionError(router.rule)


# -------------------------------------------------------------------------------------------------- hooks (internal)

_SLOT_LOCK = threading.Lock()
_HF_REPLAYING: set[int] = set()  # id() of HF router modules under replay_routing (replays do not nest)


class _MegatronSlot:
    """Stands in megatron's ``TopKRouter.router_replay`` slot while rlblocks records or replays.

    ``topk_routing_with_score_function`` calls ``get_replay_topk(scores, topk, num_groups, group_topk,
    default_compute_topk)`` and then applies its own score rule (softmax over the selected logits, or the selected
    softmax/sigmoid scores, normalisation, scaling) to the returned indices, so replay only hands back the forced
    indices and their scores. Stateless per call: activation recomputation calls it again with the same tokens and
    gets the same answer. One slot per router, shared by a recorder and a replay active at the same time."""

    def __init__(self, router: _Router) -> None:
        self.router = router
        self.saved = router.module.router_replay  # megatron's own RouterReplay (or None), restored afterwards
        self.users = 0
        self.shape: tuple[int, int] | None = None  # (L, B) of the current forward, from the pre-hook
        self.target: Tensor | None = None  # [B, L, k] compact signed ints, batch-major; -1 rows: live
        self.records: list[Tensor] | None = None
        self._device_target: tuple[torch.device, Tensor] | None = None
        self.pre_hook = router.module.register_forward_pre_hook(self._pre_hook)

    def _pre_hook(self, module, args) -> None:
        x = args[0]
        self.shape = (int(x.shape[0]), int(x.shape[1]))  # megatron routers take [L, B, H]

    def set_target(self, target: Tensor | None) -> None:
        self.target, self._device_target = target, None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        own_scores, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        seq, b = self.shape if self.shape is not None else (-1, -1)
        if self.target is not None:
            tb, tseq = int(self.target.shape[0]), int(self.target.shape[1])
            if (seq, b) != (tseq, tb) or scores.shape[0] != tb * tseq:
                raise ArgumentError(
                    f"routed_experts: router {self.router.name!r} routes {scores.shape[0]} tokens of [L, B] = "
                    f"[{seq}, {b}] but the routing is for [B, L] = [{tb}, {tseq}] (sequence or context parallel "
                    "shards are not supported)"
                )
            if self._device_target is None or self._device_target[0] != scores.device:
                flat = self.target.transpose(0, 1).reshape(tseq * tb, -1).to(scores.device)  # megatron: [L, B]
                self._device_target = (scores.device, flat)
            forced = self._device_target[1].long()
            idx = torch.where(forced[:, :1] >= 0, forced, idx)
            own_scores = scores.gather(1, idx)
        if self.records is not None:
            self.records.append(idx.view(seq, b, -1).transpose(0, 1).reshape(seq * b, -1))  # batch-major
        return own_scores, idx


@contextlib.contextmanager
def _megatron_slots(routers: list[_Router]) -> Iterator[list[_MegatronSlot]]:
    """Install (or share) a :class:`_MegatronSlot` on every router; the last user restores megatron's own."""
    slots: list[_MegatronSlot] = []
    with _SLOT_LOCK:
        for r in routers:
            slot = r.module.router_replay
            if not isinstance(slot, _MegatronSlot):
                slot = _MegatronSlot(r)
                r.module.router_replay = slot
            slot.users += 1
            slots.append(slot)
    try:
        yield slots
    finally:
        with _SLOT_LOCK:
            for r, slot in zip(routers, slots):
                slot.users -= 1
                if slot.users == 0:
                    slot.pre_hook.remove()
                    r.module.router_replay = slot.saved


# ---------------------------------------------------------------------------------------------------------- record


class RoutingRecorder:
    """Records the experts every MoE router of ``model`` selects, forward after forward (a context manager).

    ``with recorder: model(...)`` installs forward hooks on the routers (Hugging Face) or takes the
    ``router_replay`` slot of megatron-core's ``TopKRouter``, and removes them on exit; the model is otherwise
    untouched. :meth:`take` returns what was recorded since the previous take::

        recorder = RoutingRecorder(model)          # validates the model once (ArgumentError if no MoE router)
        with recorder:
            logits = model(input_ids).logits       # [B, S] tokens
        rows = recorder.take().view(B, S, recorder.spec.num_layers, recorder.spec.top_k)

    An engine wraps each forward (prefill and decode steps) and appends row ``b`` to sequence ``b``'s record.
    Hooks run in whatever thread runs the forward (e.g. an engine's worker thread); :meth:`take` must not race
    with a forward. Inside :func:`replay_routing` the recorder records the forced experts.
    """

    def __init__(self, model: nn.Module) -> None:
        self._routers = _find_routers(model)
        self.spec = _spec(model, self._routers)
        self._records: list[list[Tensor]] = [[] for _ in self._routers]
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> RoutingRecorder:
        if self._stack is not None:
            raise ArgumentError("recorder: this RoutingRecorder is already active (it does not nest)")
        stack = contextlib.ExitStack()
        if self.spec.backend == "hf":
            for i, r in enumerate(self._routers):
                stack.callback(r.module.register_forward_hook(self._hf_hook(i)).remove)
        else:
            slots = stack.enter_context(_megatron_slots(self._routers))
            for i, slot in enumerate(slots):
                if slot.records is not None:
                    stack.close()
                    raise ArgumentError(f"model: router {slot.router.name!r} is already being recorded")
                slot.records = self._records[i]

            def release() -> None:
                for slot in slots:
                    slot.records = None

            stack.callback(release)
        self._stack = stack
        return self

    def __exit__(self, *exc: object) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def _hf_hook(self, i: int):
        records = self._records[i]

        def hook(module, args, output):
            records.append(output[2])  # (router_logits, gate_weights, expert_indices [N, top_k])

        return hook

    def take(self) -> Shaped[Tensor, "tokens layers top_k"]:
        """Everything recorded since the previous take, as one record ``[tokens, layers, top_k]`` on CPU in the
        compact dtype (``spec.dtype``); forwards in call order, tokens batch-major within a forward (``B * S``
        rows for an input ``[B, S]``). Clears the recorder. Raises :class:`~rlblocks.errors.ArgumentError` (and
        drops what was recorded) when the routers were called unequally, e.g. by a forward that raised."""
        calls = {len(r) for r in self._records}
        if len(calls) != 1:
            for r in self._records:
                r.clear()
            raise ArgumentError(
                f"recorder: routers were called unequally since the last take ({sorted(calls)} calls); the record "
                "was dropped"
            )
        if calls == {0}:
            return torch.empty((0, self.spec.num_layers, self.spec.top_k), dtype=self.spec.dtype)
        per_layer = [torch.cat(r, dim=0) if len(r) > 1 else r[0] for r in self._records]
        for r in self._records:
            r.clear()
        stacked = torch.stack(per_layer, dim=1)  # [tokens, layers, k] int64 on the model's device
        # int32 first: uint16 has no conversion from int64 on every backend; one device-to-host copy.
        return stacked.to(torch.int32).cpu().to(self.spec.dtype)


# ---------------------------------------------------------------------------------------------------------- replay


def _validate_target(routed_experts: object, spec: RoutingSpec) -> Tensor:
    """``[B, L, num_layers, top_k]`` (MoE-layer axis) in a compact signed dtype, values checked."""
    if not isinstance(routed_experts, Tensor):
        raise ArgumentError(
            f"routed_experts: expected a tensor [B, L, layers, top_k], got {type(routed_experts).__name__}"
        )
    x = routed_experts
    if x.dim() == 3:
        x = x.unsqueeze(0)
    if x.dim() != 4:
        raise ArgumentError(
            f"routed_experts: expected [B, L, layers, top_k] (or [tokens, layers, top_k] for one row), got shape "
            f"{list(routed_experts.shape)}"
        )
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise ArgumentError(f"routed_experts: expected an integer dtype, got {x.dtype}")
    if x.shape[-1] != spec.top_k:
        raise ArgumentError(f"routed_experts: expected top_k={spec.top_k} in the last axis, got {x.shape[-1]}")
    n_layers = int(x.shape[-2])
    if n_layers == spec.num_layers:
        layer_index = list(range(spec.num_layers))
    elif n_layers == spec.num_decoder_layers and all(d is not None for d in spec.decoder_layers):
        layer_index = [int(d) for d in spec.decoder_layers]  # one entry per decoder layer (vLLM's layout)
    else:
        other = f" or {spec.num_decoder_layers} (one per decoder layer)" if spec.num_decoder_layers else ""
        raise ArgumentError(
            f"routed_experts: expected {spec.num_layers} layers (one per MoE layer){other}, got {n_layers}"
        )
    x = x.to(torch.int64)[:, :, layer_index]  # checked in int64: no wrap-around of huge ids
    live = x < 0
    if bool((live & (x != -1)).any()):
        raise ArgumentError("routed_experts: negative expert ids other than -1 (no record)")
    if bool((live.any(-1) & ~live.all(-1)).any()):
        raise ArgumentError("routed_experts: a row mixes -1 (no record) with expert ids; -1 must fill a whole row")
    if bool((x >= spec.num_experts).any()):
        raise ArgumentError(
            f"routed_experts: expert ids must be < num_experts={spec.num_experts}, got max {int(x.max())}"
        )
    if spec.top_k > 1:
        s = torch.sort(x, dim=-1).values
        if bool(((s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)).any()):
            raise ArgumentError("routed_experts: a row names the same expert twice")
    # kept compact (int16 / int32) for the whole context; each forward widens one layer's slice to int64
    return x.to(torch.int16 if spec.num_experts <= 32767 else torch.int32)


@contextlib.contextmanager
def replay_routing(model: nn.Module, routed_experts: Int[Tensor, "B L layers top_k"]) -> Iterator[RoutingSpec]:
    """Make every forward of ``model`` inside the block route token ``(b, j)`` of MoE layer ``i`` to the experts
    ``routed_experts[b, j, i]`` (R3). Yields the model's :class:`RoutingSpec`.

    - ``routed_experts``: any integer dtype; ``[B, L, layers, top_k]`` for an input ``[B, L]`` (e.g.
      :func:`pad_routing` for ``RolloutBatch.input_ids``), or ``[tokens, layers, top_k]`` for one row (``B = 1``).
      ``layers`` is one entry per MoE layer, or one per decoder layer (vLLM's layout; also the one to use on a
      megatron pipeline stage, whose routers know their global layer numbers). A row of ``-1`` means no record:
      that token keeps the live router's choice (padding, the last sampled token). Checked on entry (a few host
      syncs): ids in ``[0, num_experts)`` or whole ``-1`` rows, no expert twice in a row.
    - The gate weights are recomputed from the live router logits over the forced experts with the model's own
      rule (table in the module docstring), so gradients reach the router weights; forcing the experts the
      router picks anyway reproduces its gate weights bit for bit.
    - Every forward inside the block must route exactly ``B * L`` tokens per router, else it raises
      :class:`~rlblocks.errors.ArgumentError`. Activation checkpointing is fine (the recomputed forward is forced
      the same way). Hooks are removed on exit, also on error. Replays of one model do not nest.

    Raises :class:`~rlblocks.errors.ArgumentError` when ``model`` has no supported MoE router or when
    ``routed_experts`` has the wrong shape, dtype or values.
    """
    routers = _find_routers(model)
    spec = _spec(model, routers)
    target = _validate_target(routed_experts, spec)
    b, seq = int(target.shape[0]), int(target.shape[1])
    with contextlib.ExitStack() as stack:
        if spec.backend == "hf":
            with _SLOT_LOCK:
                busy = [r.name for r in routers if id(r.module) in _HF_REPLAYING]
                if busy:
                    raise ArgumentError(f"model: router {busy[0]!r} is already replaying (replays do not nest)")
                _HF_REPLAYING.update(id(r.module) for r in routers)

            def release() -> None:
                with _SLOT_LOCK:
                    _HF_REPLAYING.difference_update(id(r.module) for r in routers)

            stack.callback(release)
            for i, r in enumerate(routers):
                hook = _hf_replay_hook(r, target[:, :, i].reshape(b * seq, spec.top_k), b, seq)
                # prepend: a RoutingRecorder's hook (registered before or after) then sees the forced experts
                stack.callback(r.module.register_forward_hook(hook, prepend=True).remove)
        else:
            slots = stack.enter_context(_megatron_slots(routers))
            busy = [s.router.name for s in slots if s.target is not None]
            if busy:
                raise ArgumentError(f"model: router {busy[0]!r} is already replaying (replays do not nest)")
            for i, slot in enumerate(slots):
                slot.set_target(target[:, :, i])

            def clear() -> None:
                for slot in slots:
                    slot.set_target(None)

            stack.callback(clear)
        yield spec


def _hf_replay_hook(router: _Router, flat: Tensor, b: int, seq: int):
    on_device: dict[torch.device, Tensor] = {}

    def hook(module, args, output):
        logits, _own_weights, own_idx = output
        n = int(logits.shape[0])
        if n != b * seq:
            raise ArgumentError(
                f"routed_experts: router {router.name!r} routes {n} tokens but the routing is for [B, L] = "
                f"[{b}, {seq}]"
            )
        forced = on_device.get(logits.device)
        if forced is None:
            forced = on_device.setdefault(logits.device, flat.to(logits.device))
        forced = forced.long()
        experts = torch.where(forced[:, :1] >= 0, forced, own_idx.long())
        return logits, _hf_gate_weights(router, logits, experts), experts.to(own_idx.dtype)

    return hook
