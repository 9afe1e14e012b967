"""Per-token log-probs (and entropy) of a Hugging Face causal LM, aligned with ``rlblocks.rollout.RolloutBatch``.

``causal_lm_logprobs(model, input_ids, prompt_lens, response_mask)`` runs the model's decoder body (every layer and
the final norm, not the LM head), takes the hidden state that predicts each response token and calls
``linear_token_logprobs`` with the LM head's weight, so the ``[B, L, V]`` logits are never materialised. The label
shift and the slicing are done here:

- response position ``t`` of row ``b`` is the token at sequence position ``P_b + t`` (``P_b = prompt_lens[b]``),
- it is predicted from the hidden state at sequence position ``P_b + t − 1``,

which is the layout of ``RolloutBatch`` (``input_ids [B, L]`` right-padded, response-aligned ``[B, T]`` tensors), so
``logp`` lines up with ``batch.rollout_logp`` element by element.

Nothing here imports transformers: the model is used through ``get_output_embeddings()`` and its decoder body
(``get_decoder()``, else the ``base_model_prefix`` attribute; a PEFT model is unwrapped with ``get_base_model()``
first, its adapters stay active).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from rlblocks._checks import as_bool_mask, check_ndim, check_tensor, shape_str
from rlblocks.errors import ArgumentError
from rlblocks.kernels._common import check_flags, check_temperature
from rlblocks.kernels._scored_head import scored_head_logprobs


def _decoder_body(model: nn.Module) -> nn.Module:
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        body = get_decoder()
        if body is not None and body is not model:
            return body
    prefix = getattr(model, "base_model_prefix", None)
    body = getattr(model, prefix, None) if isinstance(prefix, str) else None
    if not isinstance(body, nn.Module) or body is model:
        raise ArgumentError(
            f"model: expected an HF causal LM whose decoder body is reachable through get_decoder() or its "
            f"base_model_prefix attribute, got {type(model).__name__}"
        )
    return body


def _head_temperature(model: nn.Module, temperature: float) -> float:
    """The temperature that makes ``hidden @ Wᵀ / T_eff`` equal the model's own ``logits / temperature``.

    Some architectures scale the head's output: Cohere multiplies by ``config.logit_scale`` and Granite divides by
    ``config.logits_scaling``; both fold into the temperature. Soft-capped logits (Gemma 2/3's
    ``final_logit_softcapping``) are not a linear function of the hidden state and are refused."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "final_logit_softcapping", None) is not None:
        raise ArgumentError(
            "model: config.final_logit_softcapping is set (tanh soft-capped logits are not hidden @ Wᵀ); "
            "causal_lm_logprobs supports LM heads whose logits are a linear function of the hidden state"
        )
    scale = getattr(cfg, "logit_scale", None)
    if isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale != 1:
        temperature = temperature / float(scale)
    div = getattr(cfg, "logits_scaling", None)
    if isinstance(div, (int, float)) and not isinstance(div, bool) and div != 1:
        temperature = temperature * float(div)
    return temperature


def _lm_head_weight(head: Any) -> Any:
    """The weight the LM head applies: ``head.weight``, or for a PEFT LoRA layer its base weight plus
    ``scale · B @ A`` (``get_delta_weight``, differentiable in A and B) of every active adapter not merged into it
    (a PEFT layer's ``.weight`` is the base weight alone). LoRA dropout is not applied (the eval-mode head)."""
    base = getattr(head, "base_layer", None)
    if base is None or not callable(getattr(head, "get_delta_weight", None)):
        return getattr(head, "weight", None)
    weight = base.weight
    if getattr(head, "disable_adapters", False):
        return weight
    merged = set(getattr(head, "merged_adapters", ()))
    for name in getattr(head, "active_adapters", ()):
        if name not in getattr(head, "lora_A", {}) or name in merged:
            continue
        if getattr(head, "use_dora", {}).get(name, False):
            raise ArgumentError(f"model: the LM head's adapter {name!r} is DoRA, whose output is not hidden @ Wᵀ of "
                                "one weight; merge it first (merge_and_unload) or adapt the decoder only")
        weight = weight + head.get_delta_weight(name).to(weight.dtype)
    return weight


def causal_lm_logprobs(
    model: nn.Module,
    input_ids: Int[Tensor, "B L"],
    prompt_lens: Int[Tensor, " B"],
    response_mask: Bool[Tensor, "B T"],
    *,
    attention_mask: Bool[Tensor, "B L"] | None = None,
    temperature: float = 1.0,
    top_k: int | Int[Tensor, "B T"] | None = None,
    top_p: float | Float[Tensor, "B T"] | None = None,
    return_entropy: bool = False,
    return_outside: bool = False,
    backend: str | None = None,
    validate: bool = True,
    model_kwargs: Mapping[str, Any] | None = None,
    prefix_share: bool = False,
    prefix_max_tokens: int | None = None,
    prefix_attention: str | None = None,
    cp_group: Any = None,
    **unknown: Any,
) -> Float[Tensor, "B T"] | tuple[Tensor, ...]:
    """Trainer log-probs ``logp [B, T]`` (and entropy) of the response tokens of an HF causal LM.

    Formula: with ``h = decoder(input_ids)`` (``[B, L, H]``, after the final norm) and ``W`` the LM head,
    ``logp[b, t] = log softmax(h[b, P_b + t − 1] @ Wᵀ / temperature)[input_ids[b, P_b + t]]`` and
    ``entropy[b, t]`` the entropy of that softmax (natural log), computed by ``linear_token_logprobs`` in fp32
    without materialising the logits. Positions where ``response_mask`` is false give 0 and no gradient.
    Differentiable w.r.t. every parameter of the model (decoder and LM head). With ``top_k`` / ``top_p`` (the
    engine's sampling parameters) the softmax is the one the engine sampled from, renormalised over its top-k /
    top-p kept set (sampling-mask replay, as ``rlblocks.rollout.Generation.output_logprobs`` reports it); a
    token outside the trainer's kept set gets ``−inf`` and is flagged by ``return_outside`` (see
    ``linear_token_logprobs``).

    Args:
        model: an HF causal LM (``LlamaForCausalLM``-like, or a PEFT model around one). Its LM head must be a
            bias-free linear layer (``get_output_embeddings()``); tied embeddings are fine; a LoRA adapter on the
            head counts (its active, unmerged adapters are added to the base weight).
        input_ids: ``[B, L]`` prompt then response of each row, right-padded (``RolloutBatch.input_ids``).
        prompt_lens: ``[B]`` prompt length of each row (>= 1: the first response token is predicted from the
            last prompt token).
        response_mask: ``[B, T]`` true on the response tokens to score (``RolloutBatch.response_mask`` or
            ``loss_mask``); every true position needs ``prompt_lens[b] + t < L``.
        attention_mask: optional ``[B, L]`` mask passed to the model (right padding needs none: a causal model's
            positions before the padding do not see it).
        temperature: > 0, the sampling temperature (logits are divided by it, as the engines do).
        top_k: the engine's top-k (``None`` / ``<= 0``: off), an int or a ``[B, T]`` integer tensor.
        top_p: the engine's top-p in ``(0, 1]`` (``None`` / 1: off), a float or a ``[B, T]`` floating tensor.
        return_entropy: also return the per-token entropy.
        return_outside: also return the bool ``[B, T]`` of response tokens outside the kept set (last).
        backend: ``linear_token_logprobs``'s backend (``None`` = Triton on CUDA, chunked torch elsewhere).
        validate: check the positions against ``L`` (one host sync; skipped under ``torch.compile``).
        model_kwargs: extra keyword arguments for the decoder body, as a dict (e.g. ``{"position_ids": pos}`` for
            packed rows). They go in their own dict because an HF model takes ``**kwargs`` and ignores names it
            does not know: a misspelt option (``topp=0.9``) passed through would be dropped without a word. So
            any other keyword of this function raises ``ArgumentError`` listing the valid ones, and
            ``model_kwargs`` may not set ``input_ids``, ``attention_mask`` or ``use_cache`` (set here).
        prefix_share: run the decoder once over the prefix trie of the rows (``rlblocks.kernels.prefix_share``):
            rows that share a prefix (a group's prompt, an episode's history) forward it once. The same outputs
            and gradients, up to the order of floating-point sums, and never more tokens forwarded than without.
            Needs an ``sdpa``, ``eager`` or ``flex_attention`` model; ``model_kwargs`` may then hold no tensor
            (a tensor there follows the ``[B, L]`` rows, which the model no longer sees).
        prefix_max_tokens: with ``prefix_share``, the most tokens in one packed row (``None``: the largest set of
            rows sharing a prefix, none repeated).
        prefix_attention: with ``prefix_share``, ``"segments"`` (CPU), ``"flex"`` (CUDA) or ``"dense"``;
            ``None`` picks by device (``rlblocks.kernels.prefix_share``).
        cp_group: a ``torch.distributed`` process group for context parallelism (gloo or NCCL). Every rank of the
            group calls with the same full batch and gets the same full ``[B, T]`` outputs; each forwards only its
            zigzag shard of the positions, with ring attention across the group (``rlblocks.kernels.
            context_parallel``). Each rank's parameter gradients cover its own tokens: their sum over the group is
            the unsharded gradient. Needs right padding (``attention_mask`` checked) and plain causal attention.

    Raises ``ArgumentError`` (a ``ValueError``) naming the argument for wrong shapes or dtypes, a prompt length
    < 1, a response position past ``L``, an LM head with a bias, soft-capped logits, or an unknown keyword.
    """
    if unknown:
        name = sorted(unknown)[0]
        close = difflib.get_close_matches(name, _KEYWORDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ArgumentError(
            f"{name}: not an argument of causal_lm_logprobs{hint}; expected one of {', '.join(_KEYWORDS)}; "
            f"pass keyword arguments for the model in model_kwargs={{...}}"
        )
    if model_kwargs is None:
        model_kwargs = {}
    elif not isinstance(model_kwargs, Mapping) or not all(isinstance(k, str) for k in model_kwargs):
        raise ArgumentError(f"model_kwargs: expected a dict of keyword arguments for the model or None, got "
                            f"{type(model_kwargs).__name__}")
    taken = sorted(set(model_kwargs) & {"input_ids", "attention_mask", "use_cache"})
    if taken:
        raise ArgumentError(f"model_kwargs: {taken[0]!r} is set by causal_lm_logprobs itself (pass input_ids and "
                            f"attention_mask as its own arguments), got it in model_kwargs")
    check_ndim("input_ids", input_ids, 2, "[B, L]")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ArgumentError(f"input_ids: expected an integer tensor, got dtype {input_ids.dtype}")
    b, seq_len = input_ids.shape
    check_tensor("prompt_lens", prompt_lens)
    if prompt_lens.dtype.is_floating_point or prompt_lens.dtype == torch.bool or prompt_lens.shape != (b,):
        raise ArgumentError(f"prompt_lens: expected an integer tensor of shape [{b}], got {prompt_lens.dtype} "
                            f"{shape_str(prompt_lens)}")
    check_ndim("response_mask", response_mask, 2, "[B, T]")
    if response_mask.shape[0] != b:
        raise ArgumentError(f"response_mask: expected shape [{b}, T] (B of input_ids), got {shape_str(response_mask)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ArgumentError(f"attention_mask: expected the shape of input_ids {shape_str(input_ids)}, "
                            f"got {shape_str(attention_mask)}")
    temperature = check_temperature(temperature)
    check_flags(return_entropy=return_entropy, return_outside=return_outside, validate=validate,
                prefix_share=prefix_share)
    if callable(getattr(model, "get_base_model", None)):  # PEFT: the wrapped transformers model, adapters active
        model = model.get_base_model()
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    weight = _lm_head_weight(head)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ArgumentError(f"model: expected get_output_embeddings() to return a linear LM head, got {head!r:.80}")
    if getattr(head, "bias", None) is not None:
        raise ArgumentError("model: the LM head has a bias; causal_lm_logprobs supports bias-free heads only")
    temp_eff = _head_temperature(model, temperature)

    device = input_ids.device
    t_len = response_mask.shape[1]
    keep = as_bool_mask(response_mask, response_mask, name="response_mask", like_name="response_mask").to(device)
    starts = prompt_lens.to(device=device, dtype=torch.long)
    pos = starts.unsqueeze(1) + torch.arange(t_len, device=device).unsqueeze(0)  # sequence position of each token
    if validate and not torch.compiler.is_compiling():
        if bool((starts < 1).any()):
            raise ArgumentError(f"prompt_lens: expected values >= 1 (a response token is predicted from the "
                                f"previous position), got {int(starts.min())}")
        bad = keep & (pos >= seq_len)
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            raise ArgumentError(
                f"response_mask: row {row} marks a response token at sequence position {int(pos[bad][0])}, past "
                f"input_ids' length L={seq_len} (prompt_lens[{row}]={int(starts[row])})"
            )
    body = _decoder_body(model)
    if prefix_share and cp_group is not None:
        # a prefix tree's packed rows have no zigzag sharding: the two layouts of the positions do not compose
        raise ArgumentError("prefix_share=True with cp_group: expected one of them (prefix-shared rows are not "
                            "sharded across a context-parallel group), got both")
    if prefix_share:
        from rlblocks.kernels.prefix_share import prefix_shared_logprobs

        return prefix_shared_logprobs(
            body, weight, input_ids, starts, keep, attention_mask=attention_mask, model_kwargs=model_kwargs,
            max_tokens=prefix_max_tokens, attention=prefix_attention, temperature=temp_eff, top_k=top_k,
            top_p=top_p, return_entropy=return_entropy, return_outside=return_outside, backend=backend)
    if cp_group is not None:
        from rlblocks.kernels.context_parallel import cp_causal_lm_logprobs

        return cp_causal_lm_logprobs(model, body, weight, input_ids, starts, keep, group=cp_group,
                                     attention_mask=attention_mask, temperature=temp_eff, top_k=top_k, top_p=top_p,
                                     return_entropy=return_entropy, return_outside=return_outside, backend=backend,
                                     validate=validate, model_kwargs=model_kwargs)  # fmt: skip
    out = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **dict(model_kwargs))
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    if hidden.dim() != 3 or hidden.shape[:2] != (b, seq_len):
        raise ArgumentError(f"model: expected the decoder body to return hidden states [{b}, {seq_len}, H], "
                            f"got {shape_str(hidden)}")
    # The head runs on the scored positions only (scored_head_logprobs): position pos − 1 of row b predicts the
    # token at pos; clamped gathers, since positions outside the sequence belong to masked-out slots.
    keep = keep & (pos < seq_len)
    rows = torch.arange(b, device=device).unsqueeze(1) * seq_len + (pos - 1).clamp(0, seq_len - 1)
    index = torch.where(keep, rows, -1)
    labels = input_ids.gather(1, pos.clamp(0, seq_len - 1))
    return scored_head_logprobs(hidden.reshape(b * seq_len, -1), index, weight, labels, temperature=temp_eff,
                                top_k=top_k, top_p=top_p, return_entropy=return_entropy,
                                return_outside=return_outside, backend=backend)


_KEYWORDS = ("attention_mask", "temperature", "top_k", "top_p", "return_entropy", "return_outside", "backend",
             "validate", "model_kwargs", "prefix_share", "prefix_max_tokens", "prefix_attention", "cp_group")
"""The keyword arguments of ``causal_lm_logprobs`` (listed in its error for an unknown one)."""
