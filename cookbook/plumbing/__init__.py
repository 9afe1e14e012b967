"""The plumbing every cookbook loop shares, so that a loop file holds its RL and nothing else.

A loop imports it as ``from plumbing import ...``: a script's own folder (``cookbook/``) is the first entry of
``sys.path`` when it runs as a file or under ``torchrun``. Nothing here re-implements an rlblocks block.

- :mod:`.flags`: ``opt``/``parse_flags`` (every field of a loop's ``Config`` dataclass is a flag), flag checks,
  ``every`` (the ``--eval-every``/``--save-every`` rule).
- :mod:`.runs`: ``RunFiles`` (``runs/<name>/``: metrics, summary, checkpoint), ``Progress``, ``mean_metrics``.
- :mod:`.checkpoints`: ``--resume``: ``resume_run`` / ``save_run_checkpoint`` (the run checkpoint, every rank's
  RNG states, the journal of starts and received groups), ``restore_rng``, model and optimizer states (FSDP2 too).
- :mod:`.distributed`: ``setup_dist`` (process group, device, CPU threads), ``seed_rank``, ``prompts_per_rank``,
  ``rank0_first``, the weight-sync group, collectives (``all_reduce``, ``global_counts``, ``broadcast_flag``).
- :mod:`.policy`: loading an HF checkpoint, ``PolicyLogprobs`` (the policy's per-token log-probs), FSDP2 sharding.
- :mod:`.engines`: ``make_engine`` (``--engine``), ``--max-model-len``, response budgets.
- :mod:`.batches`: ``group_record`` (what travels from rollout to trainer), ``batch_tensors`` (what a step reads).
- :mod:`.messages`: the typed control messages ``Weights``/``Stale``/``Stop``, ``RolloutEnd``, ``Outbox``/``Inbox``.
- :mod:`.losses`: the policy-loss flags (``--loss``, clip offsets, ``--correction``) and ``policy_loss``.

Lines a user changes for a real model or task are marked ``REAL MODEL:`` in place.
"""

from .batches import batch_tensors, group_record
from .checkpoints import (
    FREE_FLAGS,
    Journal,
    Recovery,
    load_model_state,
    load_optim_state,
    model_state,
    optim_state,
    restart_count,
    restore_rng,
    resume_run,
    save_run_checkpoint,
)
from .distributed import (
    all_reduce,
    broadcast_flag,
    close_dist,
    global_counts,
    join_sync_group,
    pick_port,
    prompts_per_rank,
    rank0_first,
    seed_rank,
    setup_dist,
)
from .engines import check_max_model_len, length_budget, make_engine, model_max_len, resolve_max_model_len, until_eos
from .flags import check_at_least, every, opt, parse_flags
from .losses import CORRECTION_CAP, POLICY_LOSSES, check_loss_flags, loss_defaults, policy_loss
from .messages import Inbox, Outbox, RolloutEnd, Stale, Stop, Weights, recv_control, send_control
from .policy import PolicyLogprobs, decoder_layers, load_hf, load_tokenizer, shard
from .runs import Progress, RunFiles, mean_metrics

__all__ = [
    "CORRECTION_CAP",
    "FREE_FLAGS",
    "POLICY_LOSSES",
    "Inbox",
    "Journal",
    "Outbox",
    "PolicyLogprobs",
    "Progress",
    "Recovery",
    "RolloutEnd",
    "RunFiles",
    "Stale",
    "Stop",
    "Weights",
    "all_reduce",
    "batch_tensors",
    "broadcast_flag",
    "check_at_least",
    "check_loss_flags",
    "check_max_model_len",
    "close_dist",
    "decoder_layers",
    "every",
    "global_counts",
    "group_record",
    "join_sync_group",
    "length_budget",
    "load_hf",
    "load_model_state",
    "load_optim_state",
    "load_tokenizer",
    "loss_defaults",
    "make_engine",
    "mean_metrics",
    "model_max_len",
    "model_state",
    "opt",
    "optim_state",
    "parse_flags",
    "pick_port",
    "policy_loss",
    "prompts_per_rank",
    "rank0_first",
    "recv_control",
    "resolve_max_model_len",
    "restart_count",
    "restore_rng",
    "resume_run",
    "save_run_checkpoint",
    "seed_rank",
    "send_control",
    "setup_dist",
    "shard",
    "until_eos",
]
