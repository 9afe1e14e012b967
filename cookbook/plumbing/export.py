"""The trained policy as an HF directory: ``--save-hf DIR`` (every loop), ``--save-lora merged|adapter``.

At the end of a run (rank 0) the policy is written with ``save_pretrained`` (``config.json``, safetensors weights,
the tokenizer with its chat template), so ``AutoModelForCausalLM.from_pretrained(DIR)`` and vLLM load it, and any
loop takes it as ``--model DIR``. A LoRA-trained policy is written merged (``W + s·B·A`` in every adapted layer: a
plain HF model of the base architecture; default) or, with ``--save-lora adapter``, as the PEFT adapter alone
(``adapter_config.json`` + ``adapter_model.safetensors``, its ``base_model_name_or_path`` the base checkpoint;
``PeftModel.from_pretrained(base, DIR)``, or vLLM's ``LoRARequest``), with the tokenizer beside it.

Under FSDP2 (several trainer ranks) the full weights are gathered (a collective of every rank) and loaded into an
unsharded copy of the base model on rank 0 first. The directory is written into a temporary sibling and renamed into
place (``rlblocks.checkpoint.replace_dir``), so a killed run never leaves half of one; an existing directory is
replaced.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from rlblocks.checkpoint import replace_dir
from rlblocks.errors import ArgumentError

from .flags import opt

LORA_FORMS = ("merged", "adapter")


@dataclass
class ExportFlags:
    """The export flags every loop shares (a loop's ``Config`` inherits them through ``TaskFlags``)."""

    save_hf: str = opt("", "write the trained policy here at the end as an HF directory (save_pretrained: weights, "
                           "config, tokenizer; transformers and vLLM load it, every loop takes it as --model); "
                           "empty: none")
    save_lora: str = opt("merged", "--save-hf of a LoRA-trained policy: merged (W + s·B·A, a plain HF model) or "
                                   "adapter (the PEFT adapter, loaded over the base checkpoint)", LORA_FORMS)


def check_export_flags(cfg: Any) -> None:
    """``--save-hf`` must not name a file (a directory, replaced when it exists)."""
    if cfg.save_hf and Path(cfg.save_hf).is_file():
        raise ArgumentError(f"--save-hf: expected a directory to write the policy into, got the file {cfg.save_hf!r}")


def is_peft(model: nn.Module) -> bool:
    """Whether ``model`` is a PEFT model (LoRA adapters over a base model)."""
    return hasattr(model, "peft_config") and hasattr(model, "merge_and_unload")


def save_hf(out: str | os.PathLike, model: nn.Module, tok: Any, *, lora: str = "merged") -> str:
    """Write ``model`` (an unsharded HF causal LM, or a PEFT model over one) and ``tok`` into the HF directory
    ``out`` (see the module docstring; ``lora``: ``merged`` or ``adapter``, for a PEFT model). Returns ``out``."""
    if lora not in LORA_FORMS:
        raise ArgumentError(f"--save-lora: expected one of {'|'.join(LORA_FORMS)}, got {lora!r}")
    out = Path(out)
    with replace_dir(out) as tmp:
        if is_peft(model) and lora == "merged":
            copy.deepcopy(model).merge_and_unload().save_pretrained(tmp)  # the live model keeps its adapters
        else:
            model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return str(out)


def save_policy(cfg: Any, tok: Any, lm: nn.Module, *, peft_model: nn.Module | None = None,
                policy: nn.Module | None = None, world: int = 1, rank: int = 0, base: str = "",
                log=print) -> str | None:
    """``--save-hf``: the loop's trained policy into ``cfg.save_hf`` (nothing when it is empty). ``lm``: the HF
    model (inside ``policy``, a ``PolicyLogprobs``, when sharded); ``peft_model``: its PEFT wrapper when trained
    with LoRA; with ``world > 1`` every rank must call this (the weights are gathered from ``policy``) and rank 0
    writes an unsharded copy of ``base`` loaded with them. Returns the directory on the rank that wrote it."""
    if not cfg.save_hf:
        return None
    if world > 1:
        from .checkpoints import model_state
        from .policy import load_hf

        state = model_state(policy, world)  # a collective: every rank
        if rank != 0:
            return None
        import torch

        model = load_hf(base, torch.device("cpu"))[1]
        model.load_state_dict({k.removeprefix("lm."): v for k, v in state.items()})
    else:
        model = peft_model if peft_model is not None else lm
    out = save_hf(cfg.save_hf, model, tok, lora=cfg.save_lora)
    form = f", LoRA {cfg.save_lora}" if is_peft(model) else ""
    log(f"policy saved as an HF directory: {out}{form}")
    return out
