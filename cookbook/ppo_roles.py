"""The roles of ``ppo.py`` and their plumbing: the actor (and reference) and critic modules, loading and FSDP2
sharding them, the reward role (:class:`Scorer`) and the held-out checker, restoring the roles from a run checkpoint
and saving them to one, and the bytes each role holds on a rank.

- :class:`Actor` / :class:`Critic`: ``forward(input_ids [B, L], prompt_lens [B], response_mask [B, T]) -> [B, T]``
  (log-probs / values of the response tokens, aligned with ``RolloutBatch``); :func:`load_actor`,
  :func:`load_reference`, :func:`load_critic`, :func:`shard_role`.
- :class:`Scorer` (``--reward``) and :func:`reward_roles` (it and the ``--eval-reward`` checker).
- :func:`restore_roles` (``--resume``: weights, the engine's version, sharding, both AdamW and their states) and
  :func:`save_roles` (``ckpt.pt``).
- :func:`role_bytes`: weights, gradients and optimizer state per role.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from plumbing import (
    Prompt,
    Recovery,
    Reward,
    RunFiles,
    all_reduce,
    decoder_layers,
    load_hf,
    load_model_state,
    load_optim_state,
    model_state,
    optim_state,
    save_run_checkpoint,
    shard,
)
from torch import Tensor, nn

from rlblocks.kernels import causal_lm_logprobs
from rlblocks.kernels.prefix_share import prefix_shared_hidden_states
from rlblocks.rollout import RolloutBatch


class Actor(nn.Module):
    """Actor (and reference) role: ``forward(input_ids [B, L], prompt_lens [B], response_mask [B, T]) -> logp
    [B, T]``, the log-probs of the response tokens (``causal_lm_logprobs``, aligned with ``RolloutBatch``).

    The HF model lives inside this module so that, under FSDP2 (``fully_shard`` on each decoder layer, then on this
    module), the embeddings, final norm and LM head are unsharded for the duration of ``forward``.
    ``prefix_share``: ``causal_lm_logprobs(..., prefix_share=True)``, each shared prefix forwarded once."""

    def __init__(self, lm: nn.Module, temperature: float = 1.0, prefix_share: bool = False) -> None:
        super().__init__()
        self.lm = lm
        self.temperature = float(temperature)
        self.prefix_share = bool(prefix_share)

    def forward(self, input_ids: Int[Tensor, "B L"], prompt_lens: Int[Tensor, " B"],
                response_mask: Bool[Tensor, "B T"]) -> Float[Tensor, "B T"]:
        return causal_lm_logprobs(self.lm, input_ids, prompt_lens, response_mask, temperature=self.temperature,
                                  prefix_share=self.prefix_share)


class Critic(nn.Module):
    """Critic role: a value model, the decoder of an HF causal LM plus a scalar head.

    ``forward(input_ids [B, L], prompt_lens [B], response_mask [B, T]) -> values [B, T]``: ``V[b, t] =
    head(h[b, P_b + t − 1])``, the value of the state in which response token ``t`` is chosen (the hidden state
    that predicts it, so values line up with ``logp`` and ``RolloutBatch``); 0 where ``response_mask`` is false.
    The head starts at zero (every value 0): the critic first learns the scale of the returns, the decoder starts
    from a pretrained checkpoint (verl: the actor's; DeepSpeed-Chat: the reward model's). ``prefix_share``: the
    hidden states come from one forward over the prefix tree of the rows (``prefix_shared_hidden_states``)."""

    def __init__(self, body: nn.Module, hidden_size: int, prefix_share: bool = False) -> None:
        super().__init__()
        self.body = body
        self.prefix_share = bool(prefix_share)
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: Int[Tensor, "B L"], prompt_lens: Int[Tensor, " B"],
                response_mask: Bool[Tensor, "B T"]) -> Float[Tensor, "B T"]:
        b, seq_len = input_ids.shape
        if self.prefix_share:
            h = prefix_shared_hidden_states(self.body, input_ids, prompt_lens, response_mask)
        else:
            hidden = self.body(input_ids=input_ids, use_cache=False).last_hidden_state  # [B, L, H]
            pos = prompt_lens[:, None] + torch.arange(response_mask.shape[1], device=input_ids.device)[None, :] - 1
            src = pos.clamp(0, seq_len - 1)  # past the row's end only where response_mask is false
            h = hidden.gather(1, src[..., None].expand(b, src.shape[1], hidden.shape[-1]))
        v = self.head(h).squeeze(-1).float()
        return torch.where(response_mask, v, 0.0)


def load_actor(path: str, device: torch.device, temperature: float,
               prefix_share: bool = False) -> tuple[Any, nn.Module]:
    """Tokenizer and actor (an :class:`Actor` around ``AutoModelForCausalLM``) from an HF checkpoint directory."""
    tok, lm = load_hf(path, device)
    return tok, Actor(lm, temperature, prefix_share)


def load_reference(path: str, device: torch.device, temperature: float, prefix_share: bool = False) -> Actor:
    """The frozen reference: an :class:`Actor` of the initial checkpoint, in eval mode, without gradients."""
    return load_actor(path, device, temperature, prefix_share)[1].eval().requires_grad_(False)


def load_critic(path: str, device: torch.device, prefix_share: bool = False) -> Critic:
    """A :class:`Critic` whose decoder is ``AutoModel.from_pretrained(path)`` (the body of a causal LM or of a
    sequence-classification checkpoint; its LM head, which a value model does not use, is not loaded)."""
    from transformers import AutoModel

    body = AutoModel.from_pretrained(path, dtype=torch.float32)
    return Critic(body, body.config.hidden_size, prefix_share).to(device)


def shard_role(module: Actor | Critic, world: int) -> nn.Module:
    """FSDP2 ``fully_shard`` of an :class:`Actor`'s or a :class:`Critic`'s decoder layers, then of the whole role,
    when there is more than one rank."""
    return shard(module, decoder_layers(module.lm if isinstance(module, Actor) else module.body), world)


class Scorer:
    """The reward role: ``score(batch, prompts) -> R [B]`` for ``--reward``.

    ``rm``: ``RewardModel.score_ids`` on the batch's own ``input_ids``/``attention_mask`` (prompt + response, the
    layout the reward model was trained on), standardised ``(r − mean) / std`` with the statistics saved next to
    the checkpoint (``reward_stats.json``) when there are some, so the critic's targets are of order 1.
    Any other ``--reward``: ``plumbing.Reward`` on the decoded responses (a failed call scores 0, counted in
    ``failures``)."""

    def __init__(self, kind: str, tok, device: torch.device, *, reward_model: str = "", timeout: float = 60.0) -> None:
        self.kind = kind
        self.rm, self.verifier, self.mean, self.std = None, None, 0.0, 1.0
        self.failures = 0
        if kind == "rm":
            from rlblocks.reward import RewardModel

            # REAL MODEL: a reward model of the actor's size is a fourth full copy on every rank: shard it (FSDP2 on
            # its layers) or serve it on its own devices; this frozen copy is replicated.
            self.rm = RewardModel.from_pretrained(reward_model, device=device)
            self.rm.model.requires_grad_(False)
            stats = Path(reward_model) / "reward_stats.json"
            if stats.exists():
                s = json.loads(stats.read_text())
                self.mean, self.std = float(s["score_mean"]), max(float(s["score_std"]), 1e-6)
        else:
            self.verifier = Reward(kind, tok, device=device, timeout=timeout)

    def score(self, batch: RolloutBatch, prompts: list[Prompt], outputs: list[list[int]],
              loop: asyncio.AbstractEventLoop, group_size: int) -> tuple[Float[Tensor, " B"], Bool[Tensor, " B"]]:
        """``(R, keep)``: ``keep`` is False for every response of a group whose reward call failed (its retries
        ran out, counted in ``failures``): those rows are not trained (their ``R`` is a 0.0 placeholder)."""
        dev = batch.input_ids.device
        if self.rm is not None:
            raw = self.rm.score_ids(batch.input_ids, batch.attention_mask)
            return ((raw - self.mean) / self.std).to(dev), torch.ones(raw.shape[0], dtype=torch.bool, device=dev)
        vals, keep, failed = loop.run_until_complete(self.verifier.group_scores(prompts, outputs, group_size))
        self.failures += failed
        return (torch.tensor(vals, dtype=torch.float32, device=dev), torch.tensor(keep, dtype=torch.bool,
                                                                                    device=dev))

    def close(self) -> None:
        if self.verifier is not None:
            self.verifier.close()

def reward_roles(cfg: Any, tok, eval_spec: str, rm_path: str, device: torch.device) -> tuple[Scorer, Reward]:
    """The reward role (:class:`Scorer` of ``--reward``; ``rm_path``: the reward model of ``--reward rm``) and the
    held-out checker (``--eval-reward``: exact match on the toy task or ``math`` on a ``--prompts`` file when the
    reward is a learned model, which is no measure of accuracy), also logged on the training samples as
    ``train_accuracy``. The checker is the scorer's own verifier when they are the same reward."""
    scorer = Scorer(cfg.reward, tok, device, reward_model=rm_path, timeout=cfg.reward_timeout)
    if scorer.verifier is not None and eval_spec == cfg.reward:
        return scorer, scorer.verifier
    return scorer, Reward(eval_spec, tok, reward_model=cfg.reward_model, device=device, timeout=cfg.reward_timeout)


def restore_roles(cfg: Any, rec: Recovery, actor: Actor, critic: Critic, ref: Actor | None, engine, world: int,
                  loop: asyncio.AbstractEventLoop) -> tuple[nn.Module, nn.Module, nn.Module | None,
                                                            torch.optim.Optimizer, torch.optim.Optimizer]:
    """The trained roles, fresh or resumed from ``rec`` (``plumbing.resume_run``): the actor's and critic's weights
    (loaded before sharding) and the engine at the checkpoint's version; then every role sharded
    (:func:`shard_role`), the actor's and critic's AdamW (``--lr``, ``--critic-lr``, no weight decay) and, resumed,
    their states. Returns ``(actor, critic, ref, actor_opt, critic_opt)``."""
    if rec.state is not None:
        load_model_state(actor.lm, rec.state["model"], what="actor")
        load_model_state(critic, rec.state["critic"], what="critic")
        loop.run_until_complete(engine.update_weights(list(rec.state["model"].items()), version=rec.step))
    actor, critic = shard_role(actor, world), shard_role(critic, world)
    if ref is not None:
        ref = shard_role(ref, world)
    actor_opt = torch.optim.AdamW(actor.parameters(), lr=cfg.lr, weight_decay=0.0)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr, weight_decay=0.0)
    if rec.state is not None:
        load_optim_state(actor, actor_opt, rec.state["actor_optim"], world)
        load_optim_state(critic, critic_opt, rec.state["critic_optim"], world)
    return actor, critic, ref, actor_opt, critic_opt


def save_roles(files: RunFiles, cfg: Any, actor: nn.Module, critic: nn.Module, actor_opt, critic_opt, step: int,
               world: int, rank: int, rng: random.Random, extra: dict[str, Any]) -> None:
    """``ckpt.pt``, the run checkpoint: actor (``model``, HF names) and critic weights and both optimisers'
    states gathered to full tensors, the step, every rank's RNG states (the prompt sampler's too) and ``extra``
    (counters and the summary's figures so far)."""
    state = {"step": step, "model": {k.removeprefix("lm."): v for k, v in model_state(actor, world).items()},
             "critic": model_state(critic, world), "actor_optim": optim_state(actor, actor_opt, world),
             "critic_optim": optim_state(critic, critic_opt, world), **extra}
    save_run_checkpoint(files, cfg, state, rank=rank, world=world, generators={"data": rng})


def tensor_bytes(tensors) -> int:
    """Bytes held by ``tensors`` on this rank (the local shard of a DTensor)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def role_bytes(module: nn.Module | None, optim: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """``weights``, ``grads`` and ``optimizer`` state bytes of one role on this rank (grads: as held after an
    update, before the next ``zero_grad``)."""
    if module is None:
        return {"weights": 0, "grads": 0, "optimizer": 0}
    params = list(module.parameters())
    opt_state = [v for s in (optim.state.values() if optim is not None else []) for v in s.values()
                 if isinstance(v, Tensor)]
    return {"weights": tensor_bytes(params), "grads": tensor_bytes(p.grad for p in params),
            "optimizer": tensor_bytes(opt_state)}


def memory_bytes(actor: nn.Module, actor_opt: torch.optim.Optimizer, critic: nn.Module,
                 critic_opt: torch.optim.Optimizer, ref: nn.Module | None, scorer: Scorer, engine) -> dict[str, dict]:
    """:func:`role_bytes` of every role on this rank, and of the engine's model (``memory_bytes_per_rank``)."""
    return {"actor": role_bytes(actor, actor_opt), "critic": role_bytes(critic, critic_opt),
            "reference": role_bytes(ref), "reward_model": role_bytes(scorer.rm.model if scorer.rm else None),
            "engine": role_bytes(engine.model)}


def experience_stats(exp, checker_scores: Tensor | None) -> dict[str, float]:
    """The metrics of a step's ``ppo.Experience``, batch-wide (all ranks) means: score R, checker accuracy of the
    training samples, KL k1 to the reference, values, returns, the critic's explained variance
    ``1 − Var(returns − V_old)/Var(returns)``; counts (``samples_trained``: rows with a trained token, i.e. not of a
    group whose reward failed)."""
    m = exp.batch.loss_mask
    z = torch.zeros((), device=m.device)
    kl = torch.where(m, exp.old_logp - exp.ref_logp, 0.0).sum() if exp.ref_logp is not None else z
    ret, val = torch.where(m, exp.returns, 0.0), torch.where(m, exp.old_values, 0.0)
    err = ret - val
    cs = checker_scores if checker_scores is not None else torch.zeros_like(exp.scores)
    s = all_reduce(torch.stack([
        torch.tensor(float(exp.scores.numel()), device=m.device), exp.scores.sum(), cs.sum(), m.sum().float(), kl,
        val.sum(), ret.sum(), (ret * ret).sum(), err.sum(), (err * err).sum(), m.any(-1).sum().float(),
    ]).to(torch.float64)).tolist()
    n, tokens = s[0], max(s[3], 1.0)
    var_ret = s[7] / tokens - (s[6] / tokens) ** 2
    var_err = s[9] / tokens - (s[8] / tokens) ** 2
    return {"samples": int(n), "samples_trained": int(s[10]), "tokens": int(s[3]), "score": s[1] / n,
            "train_accuracy": s[2] / n if checker_scores is not None else None,
            "kl_ref_k1": s[4] / tokens, "value_mean": s[5] / tokens, "return_mean": s[6] / tokens,
            "explained_variance": 1.0 - var_err / var_ret if var_ret > 0 else 0.0}
