"""On-policy distillation for the cookbook loops: the student samples, a frozen teacher scores those samples, and
the student moves toward the teacher on its own trajectories (Thinking Machines' "On-Policy Distillation";
tinker-cookbook's ``distillation/train_on_policy.py``; Agarwal et al.'s GKD with on-policy data).

    python cookbook/grpo_sync.py --distill-from runs/demo/ckpt.pt                      # sampled reverse KL
    python cookbook/grpo_sync.py --distill-from runs/demo/ckpt.pt --distill-mode dense # full-vocabulary KL

Read top to bottom, the named steps are:

1. :func:`load_teacher`: the teacher checkpoint (an HF directory, or a cookbook run's ``ckpt.pt`` loaded into the
   student's architecture), frozen.
2. :func:`hidden_states` and :func:`teacher_logprobs`: the teacher's log-probs of the tokens the student sampled,
   through the fused ``linear_token_logprobs`` (no ``[B, L, V]`` logits).
3. :func:`distill_step`: one update of the student. ``--distill-mode sampled``: the per-token advantage
   ``A_t = log π_teacher(y_t) − log π_student(y_t)`` (``distill_advantages``; the negative single-sample
   reverse-KL estimate, optionally discounted over the future tokens), optionally plus ``w ×`` the task's GRPO
   advantage, fed to the policy loss. ``--distill-mode dense``: the exact per-token reverse KL
   ``KL(π_student ‖ π_teacher) = Σ_v π_s(v) (log π_s(v) − log π_t(v))`` over the whole vocabulary
   (``linear_vocab_kl``, from hidden states), optionally plus ``w ×`` the GRPO policy loss.

Both directions are the reverse KL (mode seeking, evaluated on the student's own samples), so the student is pushed
off the tokens the teacher finds unlikely rather than made to cover everything the teacher might say. The teacher is
scored at the student's sampling temperature, so both sides of ``A_t`` are log-probs of the same tempered
distributions. The engine's log-probs (``rollout_logp``) stand for π_student in ``A_t``, as tinker-cookbook uses
the sampler's; the first update's ratio is then π_θ/π_rollout ≈ 1.

Teacher log-probs come from an HF model here. An engine could supply them as prompt log-probs (score
``prompt + response`` as a prompt); the rollout engines' ``Generation`` does not carry prompt log-probs, so this
module does not take that path.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from grpo import run_updates
from jaxtyping import Float
from plumbing import load_hf, mean_metrics, policy_loss
from torch import Tensor, nn

from rlblocks.checkpoint import MAGIC, load_checkpoint
from rlblocks.errors import ArgumentError, CheckpointError
from rlblocks.kernels import linear_token_logprobs, linear_vocab_kl
from rlblocks.losses import distill_advantages, grpo_advantages

MODES = ("sampled", "dense")


# ================================================================================================ flags
def check_distill_flags(cfg: Any) -> None:
    """Refuse distillation flags that would be ignored, and loop flags a distillation step does not apply.

    ``--distill-mode``/``--distill-reward-weight``/``--distill-discount`` need ``--distill-from``; the discount
    belongs to the sampled advantage only; with a teacher, ``--correction`` and ``--kl-coef`` (the GRPO step's
    train/rollout correction and reference penalty) are not applied, so they are refused rather than dropped.
    """
    if cfg.distill_mode not in MODES:
        raise ArgumentError(f"--distill-mode: expected one of {MODES}, got {cfg.distill_mode!r}")
    if not cfg.distill_from:
        for flag, value, default in (("--distill-mode", cfg.distill_mode, "sampled"),
                                     ("--distill-reward-weight", cfg.distill_reward_weight, 0.0),
                                     ("--distill-discount", cfg.distill_discount, 0.0)):  # fmt: skip
            if value != default:
                raise ArgumentError(f"{flag}: only applies with --distill-from PATH (a teacher), got {flag} {value}")
        return
    if not 0.0 <= cfg.distill_discount <= 1.0:
        raise ArgumentError(f"--distill-discount: expected a value in [0, 1], got {cfg.distill_discount}")
    if cfg.distill_discount and cfg.distill_mode != "sampled":
        raise ArgumentError("--distill-discount: discounts the sampled reverse-KL advantage, got --distill-mode "
                            f"{cfg.distill_mode}")
    if cfg.distill_reward_weight < 0:
        raise ArgumentError(f"--distill-reward-weight: expected a value >= 0, got {cfg.distill_reward_weight}")
    if cfg.correction != "none":
        raise ArgumentError(f"--correction: not applied by the distillation step, got --correction {cfg.correction} "
                            "with --distill-from")
    if cfg.kl_coef:
        raise ArgumentError(f"--kl-coef: the distillation step has no reference penalty (the teacher plays that "
                            f"part), got --kl-coef {cfg.kl_coef} with --distill-from")


# ================================================================================================ the teacher
def load_teacher(path: str, student_path: str, device: torch.device, *, world: int = 1,
                 mode: str = "sampled") -> nn.Module:
    """The frozen teacher LM (eval mode, no grad) from ``path``:

    - an HF checkpoint directory (``config.json`` inside): loaded as is; its vocabulary must be the student's;
    - a cookbook run directory or its ``ckpt.pt`` (the run checkpoint every loop saves, ``{"model": state_dict, ...}``;
      a plain ``torch.save`` file of that shape, or of the state dict itself, too):
      the weights are loaded, strictly, into a copy of the student's architecture read from ``student_path``.

    ``mode="dense"`` computes the KL from the student's whole LM head on this rank, so it needs ``world == 1``
    (under FSDP2 the head is sharded outside the policy's forward). Raises :class:`ArgumentError` naming
    ``--distill-from`` for a missing file, mismatched weights or a different vocabulary.
    """
    p = path
    if os.path.isdir(p) and not os.path.exists(os.path.join(p, "config.json")):
        p = os.path.join(p, "ckpt.pt")
    if not os.path.exists(p):
        raise ArgumentError(f"--distill-from: expected an HF checkpoint directory, a run directory with ckpt.pt or "
                            f"a ckpt.pt file, got {path!r} (not found)")
    if mode == "dense" and world > 1:
        raise ArgumentError(f"--distill-mode dense: needs the whole student LM head on one rank, got a world of "
                            f"{world}; use --distill-mode sampled under torchrun")
    _, student = load_hf(student_path, torch.device("cpu"))
    if os.path.isdir(p):
        teacher = load_hf(p, torch.device("cpu"))[1]
    else:
        state = read_teacher_file(p)
        weights = state.get("model") if isinstance(state, dict) and "model" in state else state
        teacher = student
        missing, unexpected = teacher.load_state_dict(weights, strict=False)
        if missing or unexpected:
            raise ArgumentError(f"--distill-from: {p} does not fit the student's architecture ({student_path}): "
                                f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    v_t = teacher.get_output_embeddings().weight.shape[0]
    v_s = student.get_output_embeddings().weight.shape[0]
    if v_t != v_s:
        raise ArgumentError(f"--distill-from: the teacher's vocabulary has {v_t} entries, the student's {v_s}; "
                            "on-policy distillation scores the student's token ids with the teacher")
    return teacher.to(device).eval().requires_grad_(False)


def read_teacher_file(path: str) -> dict:
    """A teacher file: a cookbook run checkpoint (``rlblocks.checkpoint``, checked) or a plain ``torch.save`` state
    dict (loaded with ``weights_only=True``). A damaged run checkpoint is refused, naming ``--distill-from``."""
    with open(path, "rb") as f:
        ours = f.read(len(MAGIC)) == MAGIC
    if not ours:
        return torch.load(path, map_location="cpu", weights_only=True)
    try:
        return load_checkpoint(path, required=("model",))
    except CheckpointError as e:
        raise ArgumentError(f"--distill-from: {e}") from e


def hidden_states(lm: nn.Module, bt: dict[str, Tensor]) -> tuple[Float[Tensor, "B Lm1 H"], Float[Tensor, "V H"]]:
    """The hidden states that predict each next token, ``h[:, t]`` predicting ``input_ids[:, t + 1]``
    (``[B, L-1, H]``, after the final norm), and the LM head's weight ``[V, H]`` (logits = ``h @ Wᵀ``)."""
    # REAL MODEL: ``lm.model`` is the decoder body of Llama/Qwen/Mistral-style HF models (``causal_lm_logprobs``,
    # used by ``PolicyLogprobs``, finds it through ``get_decoder()``; do the same for other architectures).
    hidden = lm.model(input_ids=bt["input_ids"], attention_mask=bt["attention_mask"]).last_hidden_state[:, :-1]
    return hidden, lm.get_output_embeddings().weight


@torch.no_grad()
def teacher_logprobs(teacher: nn.Module, bt: dict[str, Tensor], temperature: float = 1.0) -> Float[Tensor, "B Lm1"]:
    """``log softmax(h_teacher @ W_teacherᵀ / temperature)[label]`` at each labelled position of ``bt`` (the
    student's sampled response tokens), 0 elsewhere; fp32, through ``linear_token_logprobs``."""
    hidden, weight = hidden_states(teacher, bt)
    return linear_token_logprobs(hidden, weight, bt["labels"], temperature=temperature)


# ================================================================================================ the update
def distill_step(cfg: Any, policy: nn.Module, optim: torch.optim.Optimizer, bt: dict[str, Tensor],
                 teacher: nn.Module, *, group=None, grad_scale: float = 1.0, step: int = 0) -> dict[str, float]:
    """One distillation update of the student ``policy`` (a ``PolicyLogprobs``) on this rank's share of a batch:
    ``grpo_step``'s numbered steps with the teacher in place of the GRPO advantage.

    1. **Teacher** log-probs of the sampled tokens (and, in dense mode, its hidden states), once, without grad.
    2. **π_old** for the policy loss's ratios, computed once when there is more than one update (as in
       ``grpo_step``); the dense KL alone has none.
    3. **Epochs × mini-batches** (``grpo.run_updates``: ``aggregate`` with the mini-batch's global token and
       sequence counts, backward scaled by ``grad_scale``, grad-norm clip, optimizer step), with the per-token loss
       ``sampled``: ``A_t = teacher_logp_t − rollout_logp_t`` (``distill_advantages``, discount
       ``cfg.distill_discount``) ``+ w · A^GRPO_i`` (``w = cfg.distill_reward_weight``), into ``policy_loss``;
       ``dense``: per token ``KL(π_θ ‖ π_teacher)`` over the vocabulary (``linear_vocab_kl(kind="reverse")``)
       ``+ w ·`` the policy loss with the GRPO advantages.
    4. **Metrics**: ``distill_kl_k1`` (mean over sampled tokens of ``rollout_logp − teacher_logp``, the
       single-sample estimate of the reverse KL, measured before the update), ``distill_kl_dense`` (dense mode: the
       exact per-token reverse KL of the first update), the policy loss's own, ``loss``, ``grad_norm``.
    """
    mask, rollout_logp, labels = bt["mask"], bt["rollout_logp"], bt["labels"]
    temperature = cfg.temperature
    w = cfg.distill_reward_weight
    dense = cfg.distill_mode == "dense"
    n_updates = cfg.ppo_epochs * cfg.mini_batches
    work = dict(bt)
    # 1. the teacher, 2. π_old
    with torch.no_grad():
        if dense:
            t_hidden, t_weight = hidden_states(teacher, bt)
            t_weight = t_weight.detach()  # a Parameter keeps requires_grad under no_grad; the teacher is a constant
            t_logp = linear_token_logprobs(t_hidden, t_weight, labels, temperature=temperature)
            work["t_hidden"] = t_hidden
        else:
            t_logp = teacher_logprobs(teacher, bt, temperature)
        if n_updates > 1 and (not dense or w):
            work["old_logp"] = policy(bt["input_ids"], bt["attention_mask"], labels)
    n_all = mask.sum().clamp(min=1)
    kl_k1 = torch.where(mask, rollout_logp - t_logp, 0.0).sum() / n_all
    if w:
        work["task_adv"] = grpo_advantages(bt["rewards"], bt["group_ids"])  # [B], one per sample
    if not dense:
        adv = distill_advantages(rollout_logp, t_logp, mask, discount=cfg.distill_discount or None)
        work["adv"] = adv + w * work["task_adv"][:, None] if w else adv

    # 3. the per-token loss of each mini-batch
    def token_loss(mb: dict[str, Tensor]) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        mb_mask, mb_rollout = mb["mask"], mb["rollout_logp"]
        if not dense:
            logp = policy(mb["input_ids"], mb["attention_mask"], mb["labels"])
            old = mb.get("old_logp", logp.detach())
            per_tok, m = policy_loss(cfg, logp, old, mb["adv"], mb_mask, rollout_logp=mb_rollout)
            return per_tok, mb_mask, m
        hidden, weight = hidden_states(policy.lm, mb)
        per_tok = linear_vocab_kl(hidden, weight, mb["t_hidden"], t_weight, kind="reverse", temperature=temperature,
                                  mask=mb_mask)
        m = {"distill_kl_dense": per_tok.sum() / mb_mask.sum().clamp(min=1)}
        if w:
            logp = linear_token_logprobs(hidden, weight, mb["labels"], temperature=temperature)
            old = mb.get("old_logp", logp.detach())
            pg, pm = policy_loss(cfg, logp, old, mb["task_adv"], mb_mask, rollout_logp=mb_rollout)
            per_tok = per_tok + w * pg
            m.update(pm)
        return per_tok, mb_mask, m

    per_update = run_updates(cfg, policy, optim, work, token_loss, group=group, grad_scale=grad_scale, step=step)
    # 4. metrics
    metrics = mean_metrics(per_update)
    if dense:  # the KL before this step's first update, comparable from step to step
        metrics["distill_kl_dense"] = float(per_update[0]["distill_kl_dense"])
    metrics["distill_kl_k1"] = float(kl_k1)
    metrics["ppo_updates"] = n_updates
    return metrics
