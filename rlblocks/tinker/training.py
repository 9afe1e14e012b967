"""The training side of one served base model: a frozen HF causal LM carrying one peft LoRA adapter per training
client, with its own AdamW.

- **LoRA** (peft): rank ``r`` from the request, ``lora_alpha = 32`` (scale ``32 / r``, so the best learning rate
  barely moves with the rank), no dropout, A Kaiming-uniform and B zero (the adapter starts as the identity), drawn
  under ``LoraConfig.seed`` in a forked RNG. ``train_attn`` targets the linear layers of the attention blocks,
  ``train_mlp`` those of the MLP blocks, ``train_unembed`` the LM head. Every adapter shares the base weights; the
  active one is chosen per request (peft ``set_adapter``), so requests of different training clients on one base
  run one after the other.
- **Log-probs**: the decoder body (every layer and the final norm, LoRA layers active) gives ``h [B, L, H]``;
  ``rlblocks.kernels.linear_token_logprobs(h, W, target_tokens)`` gives ``log softmax(h·Wᵀ)[target]`` in fp32
  without the ``[B, L, V]`` logits, with ``W`` the LM head — merged with its adapter (``rlblocks.sync.merge_lora``,
  differentiable in A and B) when the head is trained. Targets are arbitrary ids per position (Tinker's
  ``target_tokens``), ``[N, K]`` targets score K candidates per position.
- **Prefix sharing** (``prefix_share=True``, the default): the datums of a micro-batch go into one prefix trie of
  their token ids (``rlblocks.kernels.prefix_share``): a prompt that a group's samples share is forwarded once, and
  the LM head runs once per distinct (trie position, target token) pair; every datum's log-probs and the gradient
  are those of one forward per datum, up to the order of floating-point sums. Datums without a common prefix run
  one per row as before; ``[N, K]`` targets always do.
- **Batching**: datums are right-padded into micro-batches of at most ``max_batch_tokens`` padded tokens; the loss
  is a sum (see :mod:`rlblocks.tinker.losses`), so per-micro-batch backward passes add up to the request's gradient,
  and gradients of every ``forward_backward`` add up until ``optim_step``.
- **optim_step**: ``torch.optim.AdamW`` (Tinker's optimizer "is identical to torch.optim.AdamW") with the request's
  ``learning_rate``, ``beta1``, ``beta2``, ``eps``, ``weight_decay``; ``grad_clip_norm > 0`` clips the global norm
  of the adapter's gradients first. Gradients are then cleared. Accumulated gradients holding NaN or ±inf (or whose
  global norm overflows) are refused: the step raises ``RequestError`` naming the request and the first such
  tensor, discards those gradients, and leaves the adapter, its Adam moments and its step count as they were.

Not thread-safe: the service calls one host from one worker at a time.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from rlblocks.errors import ArgumentError, RequestError
from rlblocks.kernels import linear_token_logprobs
from rlblocks.kernels.prefix_share import prefix_shared_rows
from rlblocks.sync import lora_state, merge_lora
from rlblocks.tinker.losses import tinker_loss
from rlblocks.tinker.wire import OutputRun, WireDatum

LORA_ALPHA = 32
PEFT_PREFIX = "base_model.model."
_ATTN_PARTS = {"self_attn", "attn", "attention", "self_attention", "cross_attn"}
_MLP_PARTS = {"mlp", "feed_forward", "ffn", "experts", "shared_expert"}


@dataclass
class LoraSpec:
    """The LoRA of one training client, as ``tinker.types.LoraConfig`` states it."""

    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "seed": self.seed, "train_mlp": self.train_mlp, "train_attn": self.train_attn,
                "train_unembed": self.train_unembed}


@dataclass
class _Adapter:
    name: str  # the peft adapter name
    spec: LoraSpec
    params: dict[str, nn.Parameter]  # lora_state key -> parameter, sorted by key
    optimizer: torch.optim.AdamW
    steps: int = 0
    pending: bool = False  # gradients accumulated since the last optim_step
    extra: dict[str, Any] = field(default_factory=dict)


def check_model_config(model: nn.Module, name: str) -> None:
    """Refuse architectures whose logits are not ``hidden @ W_headᵀ`` (the log-prob kernels' contract)."""
    cfg = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        v = getattr(cfg, attr, None)
        if v is not None and not (attr != "final_logit_softcapping" and v == 1):
            raise ArgumentError(f"--model {name}: config.{attr}={v!r}: the served models' logits must be "
                                "hidden @ W_headᵀ (no soft-capping or logit scaling)")
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise ArgumentError(f"--model {name}: expected a bias-free linear LM head, got {type(head).__name__}")


def linear_groups(model: nn.Module) -> dict[str, list[str]]:
    """Full names of the model's linear layers by what ``LoraConfig`` can train: ``attn`` (attention blocks),
    ``mlp`` (MLP / expert blocks) and ``unembed`` (the LM head). Read from the plain model, before any adapter
    wraps its layers."""
    head = model.get_output_embeddings()
    groups: dict[str, list[str]] = {"attn": [], "mlp": [], "unembed": []}
    for name, mod in model.named_modules():
        if mod is head:
            groups["unembed"].append(name)
        elif isinstance(mod, nn.Linear):
            parts = set(name.split("."))
            if parts & _ATTN_PARTS:
                groups["attn"].append(name)
            elif parts & _MLP_PARTS:
                groups["mlp"].append(name)
    return groups


def lora_targets(groups: dict[str, list[str]], spec: LoraSpec) -> list[str]:
    """The module names ``spec`` trains (see :func:`linear_groups`)."""
    names = ((groups["attn"] if spec.train_attn else []) + (groups["mlp"] if spec.train_mlp else []) +
             (groups["unembed"] if spec.train_unembed else []))
    if not names:
        raise RequestError("lora_config: selects no linear layer of this model to train")
    return names


class TrainingHost:
    """One base model and every training client's adapter on it (see the module docstring).

    Args:
        name: the served model name.
        path: the HF checkpoint directory.
        device: where the model runs.
        dtype: the base weights' dtype (adapters are float32).
        max_batch_tokens: padded tokens per micro-batch.
        prefix_share: forward the prefixes that datums share once (module docstring).
    """

    def __init__(self, name: str, path: str, *, device: torch.device, dtype: torch.dtype,
                 max_batch_tokens: int = 16384, prefix_share: bool = True) -> None:
        from transformers import AutoModelForCausalLM

        self.name, self.path, self.device = name, path, device
        base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        base.requires_grad_(False).eval()
        check_model_config(base, name)
        self.vocab_size = int(base.get_output_embeddings().weight.shape[0])
        self.max_len = int(getattr(base.config, "max_position_embeddings", 0) or 1 << 30)
        self.arch = type(base).__name__
        self._groups = linear_groups(base)
        self.max_batch_tokens = int(max_batch_tokens)
        self.prefix_share = bool(prefix_share)
        self._base = base
        self._peft: Any = None
        self._adapters: dict[str, _Adapter] = {}
        self._count = 0

    # ------------------------------------------------------------------ adapters
    def has(self, model_id: str) -> bool:
        return model_id in self._adapters

    def spec(self, model_id: str) -> LoraSpec:
        return self._adapters[model_id].spec

    def create(self, model_id: str, spec: LoraSpec) -> None:
        """Add a fresh adapter (B = 0) and its optimizer for ``model_id``."""
        from peft import LoraConfig, get_peft_model

        if model_id in self._adapters:
            raise RequestError(f"model_id: {model_id!r} already exists", status=409)
        targets = lora_targets(self._groups, spec)
        cfg = LoraConfig(r=spec.rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=targets, bias="none")
        name = f"a{self._count}"
        self._count += 1
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), warnings.catch_warnings():
            # a tied LM head (SmolLM2, Qwen2.5, Llama-3.2) with an adapter: peft warns that the tying is not carried
            # into the adapter. That is intended: the adapter changes the head only (the forward merges it into a
            # separate head weight, the sampler unties its copy), the input embedding stays the base one.
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*", category=UserWarning)
            if spec.seed is not None:
                torch.manual_seed(spec.seed)
            if self._peft is None:
                self._peft = get_peft_model(self._base, cfg, adapter_name=name)
                self._peft.eval()
            else:
                self._peft.add_adapter(name, cfg)
        params = self._adapter_params(name)
        opt = torch.optim.AdamW(list(params.values()), lr=0.0, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        self._adapters[model_id] = _Adapter(name, spec, params, opt)

    def _adapter_params(self, name: str) -> dict[str, nn.Parameter]:
        tag = f".{name}."
        out = {}
        for pname, p in self._peft.named_parameters():
            if tag in pname and ".lora_" in pname:
                out[pname.replace(tag, ".")] = p
        return dict(sorted(out.items()))

    def _activate(self, model_id: str) -> _Adapter:
        ad = self._adapters.get(model_id)
        if ad is None:
            raise RequestError(f"model_id: unknown model {model_id!r}", status=404)
        self._peft.set_adapter(ad.name)
        for p in ad.params.values():
            p.requires_grad_(True)
        return ad

    # ------------------------------------------------------------------ forward / backward
    def _head_weight(self, ad: _Adapter) -> Tensor:
        base = self._peft.get_base_model()
        head = base.get_output_embeddings()
        if not ad.spec.train_unembed:
            return head.weight
        head_name = next(n for n, m in base.named_modules() if m is head)
        a = head.lora_A[ad.name].weight
        b = head.lora_B[ad.name].weight
        pre = f"{PEFT_PREFIX}{head_name}"
        state = {"tensors": {f"{pre}.lora_A.weight": a, f"{pre}.lora_B.weight": b},
                 "config": {"lora_alpha": LORA_ALPHA, "use_rslora": False}}
        (_, w), = merge_lora([(f"{head_name}.weight", head.base_layer.weight)], state)
        return w

    def forward_backward(self, model_id: str, data: Sequence[WireDatum], loss_fn: str, config: dict[str, float],
                         forward_only: bool) -> tuple[list[OutputRun], dict[str, float]]:
        """The datums' ``target_logprobs`` (float32, in datum order, one :class:`~rlblocks.tinker.wire.OutputRun`
        per micro-batch, field ``"logprobs"``) and ``{"loss:sum": Σ loss}``; adds the gradient of the sum to the
        adapter's accumulated gradients unless ``forward_only``."""
        ad = self._activate(model_id)
        outputs: list[OutputRun] = []
        total = 0.0
        body = self._peft.get_base_model().get_decoder()
        for idx in self._micro_batches(data):
            with torch.set_grad_enabled(not forward_only):
                w = self._head_weight(ad)
                ids, targets, inputs, mask = self._pad([data[i] for i in idx])
                if self.prefix_share and targets.dim() == 2 and len(idx) > 1:
                    logp = self._shared_logprobs(body, w, ids, targets, mask)
                else:
                    hidden = body(input_ids=ids, use_cache=False).last_hidden_state
                    if targets.dim() == 3:
                        k = targets.shape[-1]
                        h = hidden.unsqueeze(2).expand(*hidden.shape[:2], k, hidden.shape[-1])
                        logp = linear_token_logprobs(h.to(w.dtype), w, targets,
                                                     mask=mask[..., None].expand_as(targets))
                    else:
                        logp = linear_token_logprobs(hidden.to(w.dtype), w, targets, mask=mask)
                loss, _ = tinker_loss(loss_fn, config, logp, inputs, mask)
                if not forward_only:
                    loss.backward()
            total += float(loss.detach())
            # the real positions in row-major order are the datums' positions end to end (idx is consecutive)
            lengths = mask.sum(1).cpu().numpy()
            outputs.append(OutputRun(lengths, {"logprobs": logp.detach()[mask].float().cpu().numpy()}))
        if not forward_only:
            ad.pending = True
        return outputs, {"loss:sum": total}

    def _shared_logprobs(self, body: nn.Module, w: Tensor, ids: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
        """``log softmax(h_t · wᵀ)[targets[b, t]]`` at every real position ``(b, t)`` (0 at padding) from one
        prefix-shared forward of the rows ``ids`` (right-padded, ``mask`` true on the real positions).

        The rows enter the trie whole (a prompt length of 1 and every position scored: position ``t`` is read from
        the hidden state at ``t``), and the head runs on each distinct ``(flat row, target)`` pair once; a
        position's log-prob is gathered from its pair, so the gradient of a shared pair is the sum over the
        positions that use it, as with one forward per datum."""
        b = ids.shape[0]
        # one more column: the trie scores position P + t = 1 + t, which must lie inside the rows
        padded = torch.nn.functional.pad(ids, (0, 1))
        ones = torch.ones(b, dtype=torch.long, device=ids.device)
        flat, index = prefix_shared_rows(body, padded, ones, mask, max_tokens=max(self.max_batch_tokens, ids.shape[1]))
        key = index[mask] * self.vocab_size + targets[mask]
        pairs, where = torch.unique(key, return_inverse=True)
        rows = torch.div(pairs, self.vocab_size, rounding_mode="floor")
        logp = linear_token_logprobs(flat.index_select(0, rows).to(w.dtype), w, pairs % self.vocab_size)
        return logp.new_zeros(mask.shape).masked_scatter(mask, logp[where])

    def _micro_batches(self, data: Sequence[WireDatum]) -> list[list[int]]:
        groups: list[list[int]] = []
        cur: list[int] = []
        width, key = 0, None
        for i, d in enumerate(data):
            k = tuple(d.inputs["target_tokens"].shape[1:])
            n = len(d.tokens)
            if cur and (k != key or (len(cur) + 1) * max(width, n) > self.max_batch_tokens):
                groups.append(cur)
                cur, width = [], 0
            cur.append(i)
            width, key = max(width, n), k
        if cur:
            groups.append(cur)
        return groups

    def _pad(self, rows: Sequence[WireDatum]) -> tuple[Tensor, Tensor, dict[str, Tensor], Tensor]:
        b = len(rows)
        lens = [len(r.tokens) for r in rows]
        width = max(lens)
        ids = np.zeros((b, width), dtype=np.int64)
        mask = np.arange(width)[None, :] < np.asarray(lens)[:, None]
        for i, r in enumerate(rows):
            ids[i, : lens[i]] = np.asarray(r.tokens)
        inputs: dict[str, Tensor] = {}
        for name in rows[0].inputs:
            cols = [np.asarray(r.inputs[name]) for r in rows]
            out = np.zeros((b, width, *cols[0].shape[1:]), dtype=cols[0].dtype)
            for i, c in enumerate(cols):
                out[i, : c.shape[0]] = c
            inputs[name] = torch.from_numpy(out).to(self.device)
        targets = inputs.pop("target_tokens").long()
        return torch.from_numpy(ids).to(self.device), targets, inputs, torch.from_numpy(mask).to(self.device)

    # ------------------------------------------------------------------ optimizer
    def optim_step(self, model_id: str, adam: dict[str, float], *, where: str = "optim_step") -> dict[str, float]:
        """One AdamW step on the accumulated gradients (see the module docstring); returns ``grad_norm`` (before
        clipping; 0 when no gradient was accumulated, in which case the weights do not move). Non-finite gradients
        raise ``RequestError`` (``where`` names the request) and change nothing but discarding them."""
        ad = self._activate(model_id)
        params = list(ad.params.values())
        grads = [p.grad for p in params if p.grad is not None]
        norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        if not math.isfinite(norm):
            bad = [(n, p.grad) for n, p in ad.params.items()
                   if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
            ad.optimizer.zero_grad(set_to_none=True)
            ad.pending = False
            what = (f"{len(bad)} of {len(grads)} gradient tensors hold NaN or inf (first: {bad[0][0]}, "
                    f"{int((~torch.isfinite(bad[0][1])).sum())} values)" if bad else
                    f"the gradients' global norm overflows float32 ({norm})")
            raise RequestError(f"{where}: refused: {what}. The accumulated gradients were discarded; the adapter, "
                               f"its Adam moments and its step count ({ad.steps}) are unchanged. Check the "
                               "forward_backward inputs since the last step (advantages, weights, logprobs) for "
                               "values too large to train on")
        if grads and adam["grad_clip_norm"] > 0:
            torch.nn.utils.clip_grads_with_norm_(params, adam["grad_clip_norm"], torch.tensor(norm))
        for g in ad.optimizer.param_groups:
            g.update(lr=adam["learning_rate"], betas=(adam["beta1"], adam["beta2"]), eps=adam["eps"],
                     weight_decay=adam["weight_decay"])
        ad.optimizer.step()
        ad.optimizer.zero_grad(set_to_none=True)
        if grads:
            ad.steps += 1
        ad.pending = False
        return {"grad_norm": norm}

    # ------------------------------------------------------------------ state
    def adapter_state(self, model_id: str) -> dict[str, Any]:
        """A copy of the adapter as ``rlblocks.sync.lora_state`` lays it out (CPU tensors, peft key names)."""
        ad = self._adapters[model_id]
        state = lora_state(self._peft, ad.name)
        state["tensors"] = {k: v.detach().to("cpu", copy=True) for k, v in state["tensors"].items()}
        state["config"]["base_model_name_or_path"] = self.path
        return state

    def optimizer_state(self, model_id: str) -> dict[str, Tensor]:
        """AdamW's moments and step counts, keyed ``<param>::exp_avg`` / ``::exp_avg_sq`` / ``::step``."""
        ad = self._adapters[model_id]
        out: dict[str, Tensor] = {}
        for name, p in ad.params.items():
            st = ad.optimizer.state.get(p)
            if not st:
                continue
            for k in ("exp_avg", "exp_avg_sq", "step"):
                out[f"{name}::{k}"] = st[k].detach().to("cpu", copy=True)
        return out

    def load_state(self, model_id: str, tensors: dict[str, Tensor], optimizer: dict[str, Tensor] | None) -> None:
        """Overwrite the adapter with ``tensors`` (``adapter_state`` names) and, if given, AdamW's state (else a
        fresh optimizer). Refuses names or shapes that do not match the adapter."""
        ad = self._adapters[model_id]
        missing = sorted(set(ad.params) - set(tensors))
        extra = sorted(set(tensors) - set(ad.params))
        if missing or extra:
            raise RequestError(f"path: the checkpoint's adapter does not match this model (missing {missing[:3]}, "
                               f"unexpected {extra[:3]})")
        with torch.no_grad():
            for name, p in ad.params.items():
                t = tensors[name]
                if t.shape != p.shape:
                    raise RequestError(f"path: tensor {name!r} has shape {list(t.shape)}, expected {list(p.shape)}")
                p.copy_(t.to(p.device, p.dtype))
                p.grad = None
        params = list(ad.params.values())
        ad.optimizer = torch.optim.AdamW(params, lr=0.0, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        ad.pending = False
        if optimizer:
            state = {}
            for i, name in enumerate(ad.params):
                if f"{name}::step" in optimizer:
                    state[i] = {k: optimizer[f"{name}::{k}"] for k in ("step", "exp_avg", "exp_avg_sq")}
            groups = [{**ad.optimizer.param_groups[0], "params": list(range(len(params)))}]
            ad.optimizer.load_state_dict({"state": state, "param_groups": groups})


def check_adam(params: dict[str, Any]) -> dict[str, float]:
    """``AdamParams`` fields as floats; raises ``RequestError`` naming the field for a value out of range."""
    out = {}
    inf = math.inf
    for k, lo, hi in (("learning_rate", 0.0, inf), ("beta1", 0.0, 1.0), ("beta2", 0.0, 1.0), ("eps", 0.0, inf),
                      ("weight_decay", 0.0, inf), ("grad_clip_norm", 0.0, inf)):
        v = float(params[k])
        if not (math.isfinite(v) and lo <= v and (v < hi or hi == math.inf)):
            rng = f"[{lo}, {hi})" if hi != math.inf else f">= {lo} and finite"
            raise RequestError(f"optim_params.{k}: expected a value {rng}, got {params[k]!r}")
        out[k] = v
    return out
