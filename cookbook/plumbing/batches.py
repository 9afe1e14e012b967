"""What travels from rollout to trainer: a finished prompt group as a plain record, and the batch tensors a
trainer step reads (next-token layout), from group records or from agent trajectories."""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Bool
from torch import Tensor

from rlblocks.rollout import Generation, RolloutBatch, build_batch


def group_record(uid: str, prompt: Any, prompt_ids: list[int], gens: list, rewards: list[float],
                 rank: int) -> dict:
    """A finished prompt group as a plain, picklable dict (what travels from rollout to trainer and into the
    queue's checkpoint). ``version`` is the OLDEST token version of the group (the staleness key). ``prompt`` says
    which prompt the group answered (the toy task's ``(a, b)``, a ``--prompts`` row's text), for inspection only:
    nothing in the trainer reads it."""
    samples = [
        {
            "output_ids": list(g.output_ids),
            "output_logprobs": list(g.output_logprobs),
            "output_versions": list(g.output_versions),
            "finish_reason": g.finish_reason,
            "reward": float(r),
        }
        for g, r in zip(gens, rewards)
    ]
    versions = [v for s in samples for v in s["output_versions"]]
    return {
        "uid": uid,
        "prompt": prompt,
        "prompt_ids": list(prompt_ids),
        "samples": samples,
        "version": min(versions) if versions else 0,
        "rank": rank,
    }


def batch_tensors(groups: list[dict], pad_id: int, device: torch.device) -> dict[str, Tensor]:
    """Right-padded tensors for a list of group records, built by ``rlblocks.rollout.build_batch`` (one row per
    sample, every output token trained except those of a group marked ``"reward_failed"`` (its reward failed, see
    ``Reward.group_scores``: its rows stay in the batch, ``mask`` all False), group ``i`` of the list is group id
    ``i``), in the next-token layout the loops' log-prob module uses.

    Returns ``input_ids``/``attention_mask`` ``[B, L]`` (``L >= 2``), and over the ``L-1`` next-token positions:
    ``labels`` (response tokens, else -100), ``mask`` (bool), ``rollout_logp`` (engine logprobs, 0 elsewhere),
    ``versions`` (token versions, -1 elsewhere); per sequence: ``rewards``, ``group_ids`` (index of the group),
    ``trained`` (bool: False for the rows of a failed group).
    Response token ``t`` of row ``b`` (``RolloutBatch``' ``[B, T]`` layout) sits at next-token position
    ``prompt_lens[b] − 1 + t``.
    """
    gens, gids, rewards, trained = [], [], [], []
    for gi, g in enumerate(groups):
        for k, s in enumerate(g["samples"]):
            gens.append(Generation(f"{g['uid']}/{k}", list(g["prompt_ids"]), list(s["output_ids"]),
                                   list(s["output_logprobs"]), list(s["output_versions"]), s["finish_reason"]))
            gids.append(gi)
            rewards.append(s["reward"])
            trained.append(not g.get("reward_failed", False))
    rb = build_batch(gens, pad_id=pad_id, group_ids=gids, rewards=rewards)
    out = next_token_tensors(rb, rb.loss_mask, pad_id)
    rows = torch.tensor(trained, dtype=torch.bool)
    out.update(mask=out["mask"] & rows[:, None], trained=rows, rewards=rb.rewards, group_ids=rb.group_ids)
    return {k: v.to(device) for k, v in out.items()}


def trajectory_tensors(trajectories: list, pad_id: int, device: torch.device | None = None) -> dict[str, Tensor]:
    """The :func:`batch_tensors` layout of agent trajectories (``rlblocks.rollout.agents.to_tensors``: one row per
    segment, prompt then every turn after it), in which only the model's own tokens are trained: ``labels`` and
    ``mask`` cover the ``loss_mask`` tokens, so tool results and chat markers are neither scored nor trained.

    Per row also: ``advantages`` (``grpo_advantages`` over the trajectories, one per trajectory with its
    ``reward`` and ``group_id``, broadcast to the rows of its segments, so a branched episode does not count twice
    in its group), ``old_logp`` (the engine's log-probs: the behaviour policy is π_old of the PPO ratio),
    ``rewards`` and ``group_ids`` (the row's trajectory's).
    """
    from rlblocks.losses import grpo_advantages
    from rlblocks.rollout.agents import to_tensors, trajectory_rows

    rb = to_tensors(trajectories, pad_id=pad_id)
    rewards = torch.tensor([float(t.reward) for t in trajectories], dtype=torch.float32)
    groups = torch.tensor([int(t.group_id) for t in trajectories], dtype=torch.long)
    of_row = trajectory_rows(trajectories)
    out = next_token_tensors(rb, rb.loss_mask, pad_id)
    out.update(advantages=grpo_advantages(rewards, groups)[of_row], old_logp=out["rollout_logp"],
               rewards=rewards[of_row], group_ids=groups[of_row])
    return out if device is None else {k: v.to(device) for k, v in out.items()}


def next_token_tensors(rb: RolloutBatch, scored: Bool[Tensor, "B T"], pad_id: int) -> dict[str, Tensor]:
    """A ``RolloutBatch``' tensors in the next-token layout: ``input_ids``/``attention_mask`` ``[B, L]``
    (``L >= 2``), and over the ``L-1`` positions ``labels`` (the ``scored`` response tokens, else -100), ``mask``
    (``labels != -100``), ``rollout_logp`` (0 elsewhere), ``versions`` (-1 elsewhere). Response token ``t`` of row
    ``b`` sits at position ``prompt_lens[b] − 1 + t``."""
    b, width = rb.input_ids.shape
    extra = max(0, 2 - width)  # at least one next-token position, even for one-token prompts with no output
    input_ids = torch.nn.functional.pad(rb.input_ids, (0, extra), value=pad_id)
    attention = torch.nn.functional.pad(rb.attention_mask, (0, extra)).long()
    width += extra
    # next-token position of each response token; padding slots go to a sink column (index width − 1), dropped
    t = torch.arange(rb.response_ids.shape[1])
    pos = torch.where(rb.response_mask, rb.prompt_lens[:, None] - 1 + t, width - 1)

    def to_positions(x: Tensor, fill, keep: Tensor = rb.response_mask) -> Tensor:
        out = torch.full((b, width), fill, dtype=x.dtype)
        return out.scatter_(1, pos, torch.where(keep, x, fill))[:, :-1]

    labels = to_positions(rb.response_ids, -100, rb.response_mask & scored)
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "labels": labels,
        "mask": labels != -100,
        "rollout_logp": to_positions(rb.rollout_logp, 0.0),
        "versions": to_positions(rb.versions, -1),
    }
