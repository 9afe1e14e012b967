"""The policy: an HF checkpoint (tokenizer and causal LM), its per-token log-prob module, LoRA adapters."""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from rlblocks.errors import ArgumentError
from rlblocks.kernels import causal_lm_logprobs


def load_tokenizer(path: str, *, chat: bool = False, flag: str = "--model"):
    """The tokenizer of the HF checkpoint at ``path`` (local files only). ``chat=True``: it must have a chat
    template (the agent loops render every turn with it); refused with an :class:`ArgumentError` naming ``flag``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if chat and not getattr(tok, "chat_template", None):
        raise ArgumentError(f"{flag}: expected a checkpoint whose tokenizer has a chat template (each turn is "
                            f"rendered with it), got {path!r} (tokenizer_config.json has no chat_template)")
    return tok


def load_hf(path: str, device: torch.device, dtype: torch.dtype = torch.float32):
    """Tokenizer and causal LM from an HF checkpoint directory (local files only)."""
    from transformers import AutoModelForCausalLM

    # REAL MODEL: fp32 suits the tiny CPU demo. On GPUs load bf16 (``dtype=torch.bfloat16``) or keep fp32 master
    # weights and give ``fully_shard`` a ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``.
    tok = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    return tok, model


class PolicyLogprobs(nn.Module):
    """Per-token log-probs of an HF causal LM through the library's ``causal_lm_logprobs`` (the fused
    ``linear_token_logprobs``: no ``[N, V]`` logits).

    ``forward(input_ids [B, L], attention_mask [B, L], labels [B, L-1]) -> logp [B, L-1]`` where ``labels[:, t]``
    is the token at position ``t + 1`` (``input_ids[:, t + 1]``, as :func:`batch_tensors` writes it) or -100
    (ignored: logp 0, no gradient). In ``causal_lm_logprobs``' terms every row's "prompt" is its first token and the
    scored positions are the labelled ones. The LM head lives in this module, so under FSDP2 (``fully_shard`` on the
    decoder layers, then on this module) it is unsharded during ``forward``. ``prefix_share``: the decoder runs
    once over the prefix tree of the rows (``causal_lm_logprobs(..., prefix_share=True)``), so a group's prompt
    is forwarded once; the same log-probs and gradients up to float rounding. With ``cp_group`` (``--cp``) every
    rank of the group passes the same rows and gets the same full ``logp``; each forwards a zigzag shard of the
    positions (``causal_lm_logprobs(..., cp_group=)``), and its gradients cover its own tokens. The two do not
    combine: with ``cp_group`` the rows are not prefix-shared.
    """

    def __init__(self, lm: nn.Module, temperature: float = 1.0, prefix_share: bool = False, cp_group=None) -> None:
        super().__init__()
        self.lm = lm
        self.temperature = float(temperature)
        # a CP group shards positions; prefix-shared rows cannot be sharded, so CP wins
        self.prefix_share = bool(prefix_share) and cp_group is None
        self.cp_group = cp_group

    def forward(
        self, input_ids: Int[Tensor, "B L"], attention_mask: Int[Tensor, "B L"], labels: Int[Tensor, "B Lm1"]
    ) -> Float[Tensor, "B Lm1"]:
        scored = labels != -100
        # the labels only say which positions to score: the tokens scored are input_ids' own (one host sync)
        if not torch.equal(torch.where(scored, labels, 0), torch.where(scored, input_ids[:, 1:], 0)):
            raise ArgumentError("labels: expected input_ids[:, t + 1] or -100 at every position t (the next-token "
                                "layout of batch_tensors), got other tokens")
        first = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
        # REAL MODEL: causal_lm_logprobs finds the decoder body through get_decoder() (Llama/Qwen/Mistral-style HF
        # models, PEFT-wrapped or not); a vision-language or encoder-decoder model needs its own hidden states.
        return causal_lm_logprobs(self.lm, input_ids, first, scored, attention_mask=attention_mask,
                                  temperature=self.temperature, prefix_share=self.prefix_share,
                                  cp_group=self.cp_group)


# REAL MODEL: the projection names of Llama/Qwen-style decoders; other architectures name them differently
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def apply_lora(lm: nn.Module, rank: int) -> nn.Module:
    """LoRA adapters (peft; rank ``rank``, alpha = 2·rank, no dropout) on every linear layer of the decoder
    (:data:`LORA_TARGETS`), the HF modules wrapped in place (``lm`` itself computes with them afterwards, its
    base weights frozen). Returns the ``PeftModel``."""
    from peft import LoraConfig, get_peft_model

    if rank < 1:
        raise ArgumentError(f"--lora-rank: expected an int >= 1, got {rank}")
    return get_peft_model(lm, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(LORA_TARGETS),
                                         lora_dropout=0.0))


def merged_tensors(peft_model: nn.Module) -> list[tuple[str, Tensor]]:
    """The weights of a LoRA-trained model as a rollout engine loads them: HF names, ``W + s·B·A`` merged into every
    adapted layer (``rlblocks.sync.merge_lora``)."""
    from rlblocks.sync import base_state, lora_state, merge_lora

    return list(merge_lora(base_state(peft_model), lora_state(peft_model)))


def decoder_layers(lm: nn.Module) -> nn.ModuleList:
    """The decoder blocks of an HF causal LM or of its decoder body (one FSDP2 unit each)."""
    # REAL MODEL: ``model.layers`` is where Llama/Qwen-style HF models keep their decoder blocks; other
    # architectures name the list differently (e.g. ``transformer.h``).
    body = lm.model if hasattr(lm, "model") else lm
    return body.layers


def shard(module: nn.Module, layers: nn.ModuleList, world: int, mesh=None) -> nn.Module:
    """FSDP2 ``fully_shard`` of each decoder layer, then of the whole module, when there is more than one rank
    (``mesh``: the trainer ranks' device mesh; default: every rank)."""
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(module, mesh=mesh)
    return module
