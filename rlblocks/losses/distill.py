"""On-policy distillation: the teacher's per-token reverse KL to the student, used as the advantage.

Sample from the student, score the samples with the teacher (its log-probs of the same tokens), and train the
student with a policy-gradient loss whose per-token advantage is ``teacher_logp − student_logp``, the negative
of the per-token reverse-KL estimate ``log π_student − log π_teacher``: minimising KL(π_student‖π_teacher)
along the student's own trajectories (tinker-cookbook's ``distillation/train_on_policy.py``; Thinking Machines'
"On-Policy Distillation").
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Shaped
from torch import Tensor

from rlblocks._checks import check_real, check_token_pair
from rlblocks.losses._common import compute_dtype, safe

__all__ = ["distill_advantages"]


def distill_advantages(
    student_logp: Float[Tensor, "B T"],
    teacher_logp: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    *,
    discount: float | None = None,
) -> Float[Tensor, "B T"]:
    """Per-token distillation advantage ``A_t = teacher_logp_t − student_logp_t`` (detached), 0 at masked positions.

    Sign: positive where the teacher likes the sampled token more than the student does, so a policy-gradient
    loss (``pg_loss``, ``ppo_clip_loss``, ...) with these advantages lowers the reverse KL
    ``Σ_t (log π_student − log π_teacher)``. This is tinker-cookbook's ``incorporate_kl_penalty`` with
    ``kl_penalty_coef = 1`` (scale the result yourself for another coefficient, or add it to task advantages).
    ``student_logp`` is the student's log-probs of its sampled tokens: the engine's ``rollout_logp`` (as
    tinker-cookbook, which uses the sampler's log-probs) or the trainer's ``old_logp``.

    ``discount=γ`` (in [0, 1]) replaces each advantage by its discounted future sum
    ``A'_t = Σ_{k ≥ t} γ^{k−t}·A_k`` along the row, as tinker-cookbook's ``kl_discount_factor`` (its
    ``discounted_future_sum_vectorized``): a token is then credited with the divergence it causes later on.
    As there, every position is one discount step and masked positions contribute 0 (unlike
    ``discounted_returns``, which skips masked positions; the two agree on right-padded single-turn rows).
    ``None`` (or 0) means no discounting.

    Numerics: float32 (float64 for float64 inputs); masked positions may hold NaN/inf and are never read; a NaN
    at a valid token propagates (with a discount, to the earlier tokens of its row too). The discounted sum is a
    reverse loop over the T columns (static, no host sync; compiles with fullgraph but unrolls T steps).
    """
    m = check_token_pair("student_logp", student_logp, "teacher_logp", teacher_logp, mask)
    gamma = None if discount is None else check_real("discount", discount, ge=0.0, le=1.0)
    dt = compute_dtype(student_logp)
    adv = (safe(teacher_logp, m, dt) - safe(student_logp, m, dt)).detach()
    if not gamma:
        return adv
    b, t_len = adv.shape
    running = torch.zeros(b, dtype=dt, device=adv.device)
    zero = torch.zeros((), dtype=dt, device=adv.device)
    outs = []
    for t in range(t_len - 1, -1, -1):
        running = adv[:, t] + gamma * running
        outs.append(torch.where(m[:, t], running, zero))
    return torch.stack(outs[::-1], dim=1) if t_len > 0 else adv
