"""From generations to training tensors: the batch layout that rlblocks.losses and rlblocks.kernels take directly.

Layout (every tensor right-padded):

- ``input_ids [B, L]``: prompt then response of each row; ``attention_mask [B, L]`` is True on real tokens.
- ``prompt_lens [B]``: the prompt length ``P_b`` of each row.
- Response-aligned tensors ``[B, T]`` (``T`` = longest response): position ``t`` of row ``b`` is the token at
  sequence position ``P_b + t``, predicted from position ``P_b + t − 1``.

  - ``response_ids``: the response tokens (``pad_id`` beyond the row's length);
  - ``response_mask``: True on the row's response tokens;
  - ``loss_mask``: the positions to train on, a subset of ``response_mask`` (a generation's own ``loss_mask``,
    e.g. ``resumable_generate(..., mask_stale=True)``, and, in multi-turn trajectories, model tokens only);
  - ``rollout_logp``: the engine's processed log-probs (the behaviour policy; 0 where there is no model token);
  - ``versions``: the weight version of each model token (−1 where there is none);
  - ``turn_ids``: the turn index of each token for multi-turn trajectories (``None`` for single-turn batches).

- Per row: ``group_ids [B]`` (rows of one prompt share an id) and ``rewards [B]`` when given.
- ``routed_experts [B, L, layers, top_k]`` (MoE routing replay, when the generations carry records): aligned with
  ``input_ids``, ``-1`` where there is no record; pass it to ``rlblocks.rollout.moe_replay.replay_routing``.

With a causal LM, ``rlblocks.kernels.causal_lm_logprobs(model, batch.input_ids, batch.prompt_lens,
batch.response_mask)`` gives the ``[B, T]`` trainer log-probs aligned with ``rollout_logp``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from rlblocks._checks import check_int, check_int_list, check_real_list
from rlblocks.errors import ArgumentError

from .moe_replay import pad_routing
from .types import Generation, check_outputs

__all__ = ["RolloutBatch", "build_batch"]


@dataclass
class RolloutBatch:
    """Right-padded training tensors for a list of generations or trajectories (layout in the module docstring)."""

    input_ids: Int[Tensor, "B L"]
    attention_mask: Bool[Tensor, "B L"]
    prompt_lens: Int[Tensor, " B"]
    response_ids: Int[Tensor, "B T"]
    response_mask: Bool[Tensor, "B T"]
    loss_mask: Bool[Tensor, "B T"]
    rollout_logp: Float[Tensor, "B T"]
    versions: Int[Tensor, "B T"]
    group_ids: Int[Tensor, " B"] | None = None
    rewards: Float[Tensor, " B"] | None = None
    turn_ids: Int[Tensor, "B T"] | None = None
    routed_experts: Int[Tensor, "B L layers top_k"] | None = None

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> Int[Tensor, ""]:
        """Number of trained tokens (``loss_mask.sum()``) as a 0-dim int64 tensor (no host sync)."""
        return self.loss_mask.sum()

    def to(self, device: torch.device | str) -> RolloutBatch:
        """A copy with every tensor on ``device``."""
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), Tensor)
            },
        )


def per_row(name: str, value: object, n: int, *, kind: str, unit: str = "generation") -> list | None:
    """``value`` (a sequence or a 1-D tensor) as ``n`` checked values, one per ``unit``; ``None`` passes through.

    ``kind="int"``: genuine integers (a float group id would be truncated into another group, a bool read as 0/1);
    ``kind="real"``: real numbers (``None`` for a failed reward, a string or a bool is refused; NaN passes and
    propagates, as NaN in valid data must).
    """
    if value is None:
        return None
    if isinstance(value, Tensor):
        if value.dim() != 1:
            raise ArgumentError(f"{name}: expected a 1-D tensor of {n} values (one per {unit}), got shape "
                                f"{list(value.shape)}")
        if kind == "int" and (value.is_floating_point() or value.dtype == torch.bool):
            raise ArgumentError(f"{name}: expected an integer tensor, got dtype {value.dtype}")
        value = value.tolist()
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise ArgumentError(f"{name}: expected a sequence of {n} values (one per {unit}), got {type(value).__name__}")
    if len(value) != n:
        raise ArgumentError(f"{name}: expected {n} values (one per {unit}), got {len(value)}")
    return check_int_list(name, value) if kind == "int" else check_real_list(name, value)


def own_loss_mask(name: str, generation: Generation) -> list[bool] | None:
    """A generation's own per-token ``loss_mask`` (e.g. ``ResumableResult``'s), checked to have one entry per
    output token; ``None`` when it carries none. A mask of another length used to be ignored silently, which
    trained on every token, masked ones included."""
    own = getattr(generation, "loss_mask", None)
    if own is None:
        return None
    if len(own) != len(generation.output_ids):
        raise ArgumentError(f"{name}.loss_mask: expected one entry per output token ({len(generation.output_ids)}), "
                            f"got {len(own)}")
    return [bool(x) for x in own]


def padded_rows(rows: Sequence[tuple[Sequence[int], int, Sequence[bool] | None, Sequence[float], Sequence[int]]],
                pad_id: int) -> dict[str, Tensor]:
    """The right-padded tensors of :class:`RolloutBatch` from rows ``(token ids, prompt length, loss mask of the
    response or None for all true, response log-probs, response versions)``, one row each: ``input_ids``,
    ``attention_mask``, ``prompt_lens``, ``response_ids``, ``response_mask``, ``loss_mask``, ``rollout_logp``
    (fp32, 0 on padding) and ``versions`` (-1 on padding); ``T`` is at least 1. The one padding rule of
    :func:`build_batch` and of the trajectories' ``to_tensors``."""
    b = len(rows)
    l_max = max(len(ids) for ids, *_ in rows)
    t_max = max(max(len(ids) - p for ids, p, *_ in rows), 1)
    input_ids = torch.full((b, l_max), pad_id, dtype=torch.long)
    attention = torch.zeros((b, l_max), dtype=torch.bool)
    response_ids = torch.full((b, t_max), pad_id, dtype=torch.long)
    response_mask = torch.zeros((b, t_max), dtype=torch.bool)
    loss_mask = torch.zeros((b, t_max), dtype=torch.bool)
    rollout_logp = torch.zeros((b, t_max), dtype=torch.float32)
    versions = torch.full((b, t_max), -1, dtype=torch.long)
    for r, (ids, p, own, logps, vers) in enumerate(rows):
        n = len(ids)
        input_ids[r, :n] = torch.tensor(list(ids), dtype=torch.long)
        attention[r, :n] = True
        k = n - p
        if k == 0:
            continue
        response_ids[r, :k] = torch.tensor(list(ids[p:]), dtype=torch.long)
        response_mask[r, :k] = True
        loss_mask[r, :k] = True if own is None else torch.tensor(list(own), dtype=torch.bool)
        rollout_logp[r, :k] = torch.tensor(list(logps), dtype=torch.float32)
        versions[r, :k] = torch.tensor(list(vers), dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention,
            "prompt_lens": torch.tensor([p for _, p, *_ in rows], dtype=torch.long), "response_ids": response_ids,
            "response_mask": response_mask, "loss_mask": loss_mask, "rollout_logp": rollout_logp,
            "versions": versions}


def build_batch(
    generations: Sequence[Generation],
    *,
    pad_id: int,
    group_ids: Sequence[int] | Tensor | None = None,
    rewards: Sequence[float] | Tensor | None = None,
    stop_token_ids: Sequence[int] | None = None,
    vocab_size: int | None = None,
    device: torch.device | str | None = None,
) -> RolloutBatch:
    """Right-padded tensors for ``generations`` (any :class:`~rlblocks.rollout.types.Generation`, including the
    :class:`~rlblocks.rollout.resume.ResumableResult` of ``resumable_generate``).

    - ``response_mask`` covers each generation's output tokens. With ``stop_token_ids``, it ends at (and includes)
      the first stop token: tokens an engine produced after it are padding and are not trained on (the engines in
      rlblocks stop there, so this only matters for outputs of other origins).
    - ``loss_mask`` is ``response_mask`` and, where the generation carries one (``ResumableResult.loss_mask``),
      its own per-token mask.
    - ``rollout_logp`` is float32 (the engines' fp32 values, exactly); ``versions`` int64.
    - ``group_ids`` (one int per generation; default: all 0) and ``rewards`` (float32) are per row.

    - ``vocab_size`` (the model's vocabulary, when the caller knows it): every token id and ``pad_id`` must be
      below it; an id beyond the embedding would fail (or, on some devices, read memory) inside the model.

    Raises :class:`~rlblocks.errors.ArgumentError` for an empty list, a non-``Generation`` entry, a ``pad_id``
    that is not an int >= 0, per-row lists of the wrong length or type (a float or bool group id, a ``None``
    reward), stop ids that are not ints, a generation's own ``loss_mask`` of another length than its output, or
    a value no engine produces (checked again here, as lists may change after a ``Generation`` is built): a token
    id that is not an int ``>= 0`` (or ``>= vocab_size``), a log-prob that is NaN or above 0 (beyond ``1e-3`` of
    rounding), a version that is not an int ``>= 0``; the message names ``generations[i]``, the field and the
    element. Nothing is dropped: every generation is one row.
    """
    if not isinstance(generations, Sequence) or len(generations) == 0:
        raise ArgumentError(f"generations: expected a non-empty sequence of Generation, got {generations!r:.80}")
    for i, g in enumerate(generations):
        if not isinstance(g, Generation):
            raise ArgumentError(f"generations[{i}]: expected a Generation, got {type(g).__name__}")
    if vocab_size is not None:
        vocab_size = check_int("vocab_size", vocab_size, minimum=1)
    in_vocab = "" if vocab_size is None else f" and < vocab_size ({vocab_size})"
    pad_id = check_int("pad_id", pad_id, minimum=0, maximum=None if vocab_size is None else vocab_size - 1,
                       what=f"an int token id >= 0{in_vocab}")
    for i, g in enumerate(generations):
        check_outputs(g, name=f"generations[{i}].", vocab_size=vocab_size)
    n = len(generations)
    gids = per_row("group_ids", group_ids, n, kind="int")
    rews = per_row("rewards", rewards, n, kind="real")
    stops = None if stop_token_ids is None else set(check_int_list("stop_token_ids", stop_token_ids, minimum=0))
    masks = [own_loss_mask(f"generations[{i}]", g) for i, g in enumerate(generations)]

    lengths = []
    for g in generations:
        k = len(g.output_ids)
        if stops:
            for j, t in enumerate(g.output_ids):
                if t in stops:
                    k = j + 1
                    break
        lengths.append(k)
    fields = padded_rows([(list(g.prompt_ids) + list(g.output_ids[:k]), len(g.prompt_ids),
                           None if own is None else own[:k], g.output_logprobs[:k], g.output_versions[:k])
                          for g, k, own in zip(generations, lengths, masks)], pad_id)
    l_max = fields["input_ids"].shape[1]

    records = [getattr(g, "routed_experts", None) for g in generations]
    routed = None
    if any(r is not None for r in records):  # positions beyond a row's kept tokens are not in the batch
        kept = [None if r is None else r[: len(g.prompt_ids) + k] for r, g, k in zip(records, generations, lengths)]
        routed = pad_routing(kept, seq_len=l_max)
    batch = RolloutBatch(
        **fields,
        group_ids=torch.tensor(gids if gids is not None else [0] * n, dtype=torch.long),
        rewards=None if rews is None else torch.tensor(rews, dtype=torch.float32),
        routed_experts=routed,
    )
    return batch if device is None else batch.to(device)
