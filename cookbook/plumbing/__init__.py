"""The plumbing every cookbook loop shares, so that a loop file holds its RL and nothing else.

A loop imports it as ``from plumbing import ...``: a script's own folder (``cookbook/``) is the first entry of
``sys.path`` when it runs as a file or under ``torchrun``. Nothing here re-implements an rlblocks block.

- :mod:`.flags`: ``opt``/``parse_flags`` (every field of a loop's ``Config`` dataclass is a flag), flag checks,
  ``every`` (the ``--eval-every``/``--save-every`` rule).
- :mod:`.runs`: ``RunFiles`` (``runs/<name>/``: metrics, summary, checkpoint), ``Progress``, ``mean_metrics``.
- :mod:`.checkpoints`: ``--resume``: ``resume_run`` / ``save_run_checkpoint`` (the run checkpoint, every rank's
  RNG states, the journal of starts and received groups), ``restore_rng``, model and optimizer states (FSDP2 too).
- :mod:`.distributed`: ``setup_dist`` (process group, device, CPU threads), ``seed_rank``, ``prompts_per_rank``,
  ``trainer_groups`` (DP × CP), ``rank0_first``, the weight-sync group, collectives (``all_reduce``,
  ``global_counts``, ``broadcast_flag``, ``gather_cp``).
- :mod:`.policy`: loading an HF checkpoint, ``PolicyLogprobs`` (the policy's per-token log-probs), LoRA adapters
  (``apply_lora``, ``merged_tensors``), FSDP2 sharding.
- :mod:`.models`: named models (``--model smollm2-135m``: a GGUF file converted once into a cached HF directory).
- :mod:`.export`: ``--save-hf`` (the trained policy as an HF directory; LoRA merged or as an adapter).
- :mod:`.engines`: ``make_engine`` (``--engine``), ``--max-model-len``, ``EngineFlags`` (``--engine-dtype``,
  ``--kv-cache-mb``; ``--correction auto``), response budgets.
- :mod:`.batches`: ``group_record`` (what travels from rollout to trainer), ``batch_tensors`` (what a step reads;
  ``trajectory_tensors`` for agent trajectories).
- :mod:`.bounded_async`: the bounded-async protocol of the async loops as one pair: ``RolloutAdmission`` (a rollout
  rank's admission, stale reports, weight commits) and ``TrainerLedger`` (the trainer's queue of groups, stale
  reports, the weight announcement, lost-in-crash accounting and the conservation identity).
- :mod:`.weight_sync`: ``grpo_async.py``'s weight channel (``--sync full|delta|lora``, ``--rollout-dtype fp8``).
- :mod:`.messages`: the typed control messages ``Weights``/``Stale``/``Stop``, ``RolloutEnd``, ``Outbox``/``Inbox``.
- :mod:`.losses`: the policy-loss flags (``--loss``, clip offsets, ``--correction``) and ``policy_loss``.
- :mod:`.data`: ``TaskFlags`` (every loop's data, reward, evaluation and tracking flags), ``--prompts`` files
  (JSONL, Parquet, HF ``datasets`` directories), ``Prompt``/``Task``, ``load_task``.
- :mod:`.rewards`: ``Reward`` (``--reward verifier|math|code|rm|module:function``), ``load_tools`` (``--tools``).
- :mod:`.evaluation`: the held-out evaluation (``rlblocks.reward.evaluate``: pass@k, mean@k, per-prompt files).
- :mod:`.timing`: ``RolloutClock`` / ``TimedEngine`` (where a rollout rank's time goes between weight commits),
  ``RolloutTimes`` (its report), ``rollout_columns`` (the metrics.jsonl columns of a step), ``StepLaps`` (a trainer
  step's parts).
- :mod:`.tracking`: ``MetricsSink`` (``--log-to jsonl,tensorboard,wandb``), the keys every loop logs.

Lines a user changes for a real model or task are marked ``REAL MODEL:`` in place.
"""

from .batches import batch_tensors, group_record, trajectory_tensors
from .bounded_async import RolloutAdmission, TrainerLedger
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
from .data import (
    DataFlags,
    Prompt,
    Task,
    TaskFlags,
    check_fits,
    check_task_flags,
    encode_prompt,
    load_task,
)
from .distributed import (
    TrainerGroups,
    all_reduce,
    broadcast_flag,
    close_dist,
    gather_cp,
    global_counts,
    join_sync_group,
    pick_port,
    prompts_per_rank,
    rank0_first,
    seed_rank,
    setup_dist,
    trainer_groups,
)
from .engines import (
    EngineFlags,
    check_engine_flags,
    check_max_model_len,
    length_budget,
    make_engine,
    model_max_len,
    resolve_engine_dtype,
    resolve_max_model_len,
    until_eos,
)
from .evaluation import eval_metrics, heldout, heldout_figures, on_model
from .export import ExportFlags, save_hf, save_policy
from .flags import check_at_least, every, opt, parse_flags
from .losses import CORRECTION_CAP, POLICY_LOSSES, check_loss_flags, loss_defaults, policy_loss
from .messages import Inbox, Outbox, RolloutEnd, Stale, Stop, Weights, recv_control, send_control
from .policy import PolicyLogprobs, apply_lora, decoder_layers, load_hf, load_tokenizer, merged_tensors, shard
from .rewards import Reward, RewardFlags, eval_reward_spec, load_tools, needs_reference
from .runs import Progress, RunFiles, mean_metrics
from .timing import RolloutClock, RolloutTimes, StepLaps, TimedEngine, rollout_columns
from .tracking import COMMON_KEYS, LogFlags, MetricsSink, parse_log_flag

__all__ = [
    "COMMON_KEYS",
    "CORRECTION_CAP",
    "FREE_FLAGS",
    "POLICY_LOSSES",
    "DataFlags",
    "EngineFlags",
    "ExportFlags",
    "Inbox",
    "Journal",
    "LogFlags",
    "MetricsSink",
    "Outbox",
    "PolicyLogprobs",
    "Progress",
    "Prompt",
    "Recovery",
    "Reward",
    "RewardFlags",
    "RolloutAdmission",
    "RolloutClock",
    "RolloutEnd",
    "RolloutTimes",
    "RunFiles",
    "Stale",
    "StepLaps",
    "Stop",
    "Task",
    "TaskFlags",
    "TimedEngine",
    "TrainerGroups",
    "TrainerLedger",
    "Weights",
    "all_reduce",
    "apply_lora",
    "batch_tensors",
    "broadcast_flag",
    "check_at_least",
    "check_engine_flags",
    "check_fits",
    "check_loss_flags",
    "check_max_model_len",
    "check_task_flags",
    "close_dist",
    "decoder_layers",
    "encode_prompt",
    "eval_metrics",
    "eval_reward_spec",
    "every",
    "gather_cp",
    "global_counts",
    "group_record",
    "heldout",
    "heldout_figures",
    "join_sync_group",
    "length_budget",
    "load_hf",
    "load_model_state",
    "load_optim_state",
    "load_task",
    "load_tokenizer",
    "load_tools",
    "loss_defaults",
    "make_engine",
    "mean_metrics",
    "merged_tensors",
    "model_max_len",
    "model_state",
    "needs_reference",
    "on_model",
    "opt",
    "optim_state",
    "parse_flags",
    "parse_log_flag",
    "pick_port",
    "policy_loss",
    "prompts_per_rank",
    "rank0_first",
    "recv_control",
    "resolve_engine_dtype",
    "resolve_max_model_len",
    "restart_count",
    "restore_rng",
    "resume_run",
    "rollout_columns",
    "save_hf",
    "save_policy",
    "save_run_checkpoint",
    "seed_rank",
    "send_control",
    "setup_dist",
    "shard",
    "trainer_groups",
    "trajectory_tensors",
    "until_eos",
]
