"""Synchronous, colocated PPO with all four roles (DeepSpeed-Chat's contract): actor, critic, frozen reference, and
a learned reward model or a verifier.

    python cookbook/ppo.py --name ppo-demo                                   # CPU demo (one process)
    torchrun --standalone --nproc_per_node 2 cookbook/ppo.py --name ppo-2    # FSDP2 over 2 ranks, an engine on each
    torchrun --nproc_per_node 8 cookbook/ppo.py --model /ckpt --prompts gsm8k.jsonl --reward math

Roles, each on every rank (the trained ones sharded with FSDP2 ``fully_shard`` when there is more than one rank):

- **actor**: the HF causal LM being trained; log-probs through ``causal_lm_logprobs`` (no ``[B, L, V]`` logits);
- **critic**: a value model, the decoder of an HF causal LM plus a scalar head (``V(s_t)`` per response token), with
  its own AdamW;
- **reference**: a frozen copy of the initial actor; its KL either enters the reward as a k1 penalty per token
  (``--kl-in reward``, DeepSpeed-Chat and verl's ``use_kl_in_reward``) or the actor loss as ``low_var_kl``
  (``--kl-in loss``, verl's ``use_kl_loss``);
- **reward**: a learned reward model (``--reward rm``: ``rlblocks.reward.RewardModel`` on an HF
  sequence-classification checkpoint; on the toy task it is trained by :func:`reward_model_stage` first,
  Bradley–Terry on pairs of completions ranked by the exact-match checker, and cached), or any reward of
  ``plumbing/rewards.py`` (``--reward verifier|math|code|module:function``);
- the rollout engine: a ``TorchEngine`` in this process (colocated, verl's hybrid loop), weights pushed each step.

One step (:func:`main` reads as this list):

1. :func:`rollout`: each rank samples ``K`` responses for each of its ``B / world`` prompts; ``build_batch``.
2. :func:`score`: one scalar ``R`` per response.
3. :func:`make_experience` (no grad, before any update): π_old and π_ref log-probs, values ``V_old``; per-token
   rewards ``r_t = −β·(log π_old − log π_ref)_t`` (``--kl-in reward``; else 0) plus ``R`` at the last token; GAE
   (γ, λ) → advantages and returns; advantages whitened over the whole batch (all ranks).
4. :func:`ppo_update`: ``--ppo-epochs`` × ``--mini-batches`` updates; per mini-batch the actor's clipped loss
   (``ppo_clip_loss``, + β·``low_var_kl`` with ``--kl-in loss``) and the critic's clipped value loss
   (``value_loss``), each aggregated with the mini-batch's global token count and stepped by its own optimiser.
5. :func:`weights_to_engine`: ``full_tensors`` → ``engine.update_weights(version=step)``.

Held-out evaluation (``plumbing/evaluation.py``): ``--eval-k`` samples per held-out prompt on the colocated engine,
pass@k and mean@k of the ``--eval-reward`` (a learned reward model is no measure of accuracy: exact match on the toy
task, ``math`` on a ``--prompts`` file), every ``--eval-every`` steps and before and after RL.

Files: ``runs/<name>/metrics.jsonl`` (one line per step; TensorBoard / W&B with ``--log-to``), ``summary.json``,
``eval/``, ``ckpt.pt``, as the GRPO loops write them (``python cookbook/plot.py runs/<name>``). ``--resume`` (or a
``torchrun --max-restarts`` restart) continues from the last checkpoint (actor, critic, both optimizers, every rank's
RNG states and the prompt sampler's); on CPU the resumed run ends with the weights of an uninterrupted run of the
seed, to the bit. Lines a user changes for a real model or task say ``REAL MODEL:``. The whole pipeline (the
reward-model stage, the roles, one PPO step, main) is this one file, so that it reads top to bottom; what every loop
shares is in ``plumbing/``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import random
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import toy
from jaxtyping import Bool, Float, Int
from plumbing import (
    Progress,
    Prompt,
    Reward,
    RunFiles,
    Task,
    TaskFlags,
    all_reduce,
    broadcast_flag,
    check_at_least,
    check_fits,
    check_max_model_len,
    check_task_flags,
    close_dist,
    decoder_layers,
    eval_metrics,
    eval_reward_spec,
    every,
    heldout,
    heldout_figures,
    load_hf,
    load_model_state,
    load_optim_state,
    load_task,
    make_engine,
    model_state,
    needs_reference,
    opt,
    optim_state,
    parse_flags,
    parse_log_flag,
    prompts_per_rank,
    rank0_first,
    resolve_max_model_len,
    restore_rng,
    resume_run,
    save_policy,
    save_run_checkpoint,
    seed_rank,
    setup_dist,
    shard,
)
from torch import Tensor, nn

from rlblocks.errors import ArgumentError
from rlblocks.kernels import causal_lm_logprobs
from rlblocks.kernels.prefix_share import prefix_shared_hidden_states
from rlblocks.losses import aggregate, gae, kl_estimate, ppo_clip_loss, value_loss
from rlblocks.rollout import GenerationRequest, RolloutBatch, SamplingParams, TorchEngine, build_batch
from rlblocks.sync import full_tensors


@dataclass
class Config(TaskFlags):
    """Synchronous colocated PPO: actor, critic, frozen reference, reward model or verifier (flags from these
    fields; the data, reward, evaluation and --log-to flags every loop shares come from plumbing's TaskFlags)."""

    name: str = opt("ppo", "run name: files go to <runs-dir>/<name>/")
    runs_dir: str = opt("runs", "where run directories (and the cached warm start and reward model) live")
    model: str = opt("", "actor and reference: an HF causal-LM checkpoint; empty: the tiny CPU demo model, "
                         "warm-started and cached")
    critic_model: str = opt("", "the critic's initial decoder (any HF checkpoint of the actor's width); empty: the "
                                "actor's checkpoint, as verl does (DeepSpeed-Chat starts it from the reward model)")
    reward: str = opt("rm", "rm: a learned reward model (--reward-model; on the toy task trained here first); "
                            "verifier: exact match; math: math_reward; code: code_reward; module:function or "
                            "file.py:function: your fn(sample) -> float | RewardResult")
    reward_model: str = opt("", "--reward rm: an HF sequence-classification checkpoint (scores are standardised "
                                "with the mean and std in its reward_stats.json when there is one); empty: trained "
                                "here on the toy task, then cached")
    rm_steps: int = opt(8000, "reward-model stage: Bradley–Terry steps (batches of --rm-batch pairs)")
    rm_batch: int = opt(64, "reward-model stage: pairs per step")
    rm_lr: float = opt(1e-3, "reward-model stage: AdamW learning rate")
    rm_lm_coef: float = opt(1.0, "reward-model stage: weight of the next-token loss on the accepted completions")
    rm_samples: int = opt(4, "reward-model stage: completions sampled from the initial actor per prompt")
    max_model_len: int = opt(0, "prompt + response positions of the engine's KV cache; 0: the model's own positions")
    steps: int = opt(500, "PPO steps (= policy versions); a step count, so the result does not depend on how "
                          "loaded the machine is")
    time_limit: float = opt(0.0, "also stop after this many seconds of RL (0: no limit)")
    prompts_per_step: int = opt(64, "B: prompts per step (global)")
    group_size: int = opt(4, "K: responses sampled per prompt")
    gamma: float = opt(1.0, "GAE discount γ")
    lam: float = opt(0.95, "GAE λ")
    whiten_advantages: bool = opt(True, "whiten the advantages over the whole batch (mean 0, std 1)")
    eps_low: float = opt(0.2, "actor clip offset below 1 (ratio ≥ 1 − eps_low)")
    eps_high: float = opt(0.2, "actor clip offset above 1 (ratio ≤ 1 + eps_high)")
    value_clip: float = opt(0.2, "critic clip: V within V_old ± this (negative: no clipping)")
    ppo_epochs: int = opt(2, "passes over each batch (π_old, V_old fixed before the first)")
    mini_batches: int = opt(2, "optimizer updates per pass, each on a random 1/mini_batches of the batch's samples")
    kl_coef: float = opt(0.3, "β of the KL to the frozen reference (0: no reference model); the learned reward "
                              "model's scores are standardised to std 1, and with β = 0.05 the policy left the "
                              "reference by 0.5 nats per token within 20 steps, towards answers the reward model "
                              "over-scores (held-out accuracy fell); β = 0.3 holds it near 0.2")
    kl_in: str = opt("reward", "reward: −β·k1 per token in the reward (DeepSpeed-Chat, verl); loss: "
                               "+β·low_var_kl in the actor loss (verl's use_kl_loss)", ("reward", "loss"))
    agg: str = opt("token-mean", "loss aggregation mode of both losses (global normalisers)")
    lr: float = opt(2e-4, "actor AdamW learning rate")
    critic_lr: float = opt(1e-3, "critic AdamW learning rate")
    lr_decay: bool = opt(True, "decay both learning rates linearly to 10% over --steps")
    grad_clip: float = opt(1.0, "max grad norm (each model)")
    temperature: float = opt(1.0, "sampling temperature (log-probs use the same)")
    prefix_share: bool = opt(True, "actor, reference and critic forward over the prefix tree of each batch: a "
                             "group's prompt is forwarded once (same outputs and gradients up to float rounding)")
    max_new_tokens: int = opt(6, "response budget")
    eval_every: int = opt(25, "held-out greedy accuracy every N steps, and before and after RL (0: only before "
                              "and after)")
    save_every: int = opt(0, "checkpoint every N steps (0: at the end only)")
    resume: bool = opt(False, "continue from runs/<name>/ckpt.pt (a torchrun restart does so by itself)")
    seed: int = opt(0, "seed")
    quiet: bool = opt(False, "no progress line")


def check_flags(cfg: Config) -> None:
    """Flag combinations that cannot work (raised before anything starts)."""
    check_at_least(cfg, 1, "ppo_epochs", "mini_batches", "steps", "prompts_per_step", "group_size", "max_new_tokens",
                   "rm_steps", "rm_batch", "rm_samples")
    check_at_least(cfg, 0, "eval_every", "save_every")
    for name in ("gamma", "lam"):
        if not 0.0 <= getattr(cfg, name) <= 1.0:
            raise ArgumentError(f"--{name}: expected a value in [0, 1], got {getattr(cfg, name)}")
    if cfg.kl_coef < 0:
        raise ArgumentError(f"--kl-coef: expected >= 0, got {cfg.kl_coef}")
    check_max_model_len(cfg.max_model_len)
    check_task_flags(cfg, rm_built_here=not cfg.prompts)  # the reward-model stage trains one for the toy task


# ================================================================================================ roles
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


# ================================================================================================ stage 1: reward model
@dataclass(frozen=True)
class RewardModelStage:
    """Settings of the toy task's reward-model stage (their hash and the initial actor's name the cache
    directory ``<runs-dir>/reward_model/<key>/``)."""

    steps: int = 8000
    batch: int = 64
    lr: float = 1e-3
    lm_coef: float = 1.0  # weight of the next-token loss on the accepted completions
    cross_frac: float = 0.5  # share of each batch's pairs whose rejected completion answers another prompt
    samples: int = 4
    test_prompts: int = 500  # RL prompts held out of the reward model's training, for its pairwise accuracy
    train_prompts: int = 0  # 0: every SFT and RL prompt but the test ones; n: the first n of them (tests)
    seed: int = 0

    def key(self, policy_path: str) -> str:
        blob = json.dumps({**dataclasses.asdict(self), "policy": os.path.basename(os.path.normpath(policy_path)),
                           "split": [toy.NUM_PAIRS, toy.HELDOUT, toy.SFT_FRAC, toy.SPLIT_SEED]}, sort_keys=True)
        return hashlib.sha1(blob.encode()).hexdigest()[:10]


def preference_pairs(engine: TorchEngine, tok, prompts: list[Prompt], samples: int, rng: random.Random,
                     loop: asyncio.AbstractEventLoop) -> list[tuple[list[int], list[int], list[int]]]:
    """``(prompt_ids, chosen_ids, rejected_ids)`` triples: the initial actor's ``samples`` completions of each
    prompt (temperature 1) and the reference completion (answer + EOS), ranked by the exact-match checker: every
    distinct completion it rejects is paired with one it accepts (the reference's, the only text it accepts).
    A prompt whose samples are all right gets one near miss instead (the answer ± 1 or ± 10), so every prompt
    gives at least one pair."""
    eos = tok.eos_token_id
    base = rng.randrange(1 << 30)  # seeded requests: the same pairs on every run of the stage

    async def sample_all():
        reqs = [GenerationRequest(f"rm-{i}-{k}", list(p.ids), SamplingParams(
                    temperature=1.0, max_new_tokens=6, stop_token_ids=(eos,), seed=base + i * samples + k))
                for i, p in enumerate(prompts) for k in range(samples)]
        return await asyncio.gather(*[engine.generate(r) for r in reqs])

    gens = loop.run_until_complete(sample_all())
    out = []
    for i, p in enumerate(prompts):
        a, b = p.metadata["pair"]
        chosen = [*tok.encode(p.reference, add_special_tokens=False), eos]
        wrong = {tuple(g.output_ids) for g in gens[i * samples:(i + 1) * samples]
                 if toy.reward(tok, a, b, list(g.output_ids)) == 0.0}
        if not wrong:
            c = a + b + rng.choice([k for k in (-10, -1, 1, 10) if a + b + k >= 0])
            wrong = {tuple([*tok.encode(str(c), add_special_tokens=False), eos])}
        out += [(list(p.ids), chosen, list(w)) for w in sorted(wrong)]
    return out


def pair_tensors(chosen: list[list[int]], rejected: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-padded ``input_ids`` and ``attention_mask`` ``[2n, L]``: the n chosen rows, then the n rejected rows."""
    rows = [*chosen, *rejected]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    return ids, mask


def pair_rows(triples, others=None) -> tuple[list[list[int]], list[list[int]]]:
    """Chosen rows ``prompt + chosen`` and rejected rows ``prompt + rejected`` of ``triples``; with ``others``
    (as many triples), the rejected rows are those of ``others`` instead (pairs across prompts)."""
    return [p + c for p, c, _ in triples], [p + r for p, _, r in (others if others is not None else triples)]


@torch.no_grad()
def pairwise_accuracy(rm, triples, pad_id: int, batch: int = 256, others=None) -> float:
    """Fraction of pairs whose chosen completion the reward model scores above the rejected one (with ``others``:
    above the rejected completion of another prompt)."""
    wins = 0
    for s in range(0, len(triples), batch):
        part = triples[s:s + batch]
        r = rm.score_ids(*pair_tensors(*pair_rows(part, others[s:s + batch] if others else None), pad_id))
        wins += int((r[:len(part)] > r[len(part):]).sum())
    return wins / max(len(triples), 1)


def reward_model_stage(stage: RewardModelStage, policy_path: str, cache_root: str, device: torch.device,
                       log=print) -> str:
    """Stage 1 (toy task): train a reward model, return its checkpoint directory (cached; written atomically).

    Model: ``AutoModelForSequenceClassification`` with one label, its backbone initialised from the initial actor
    (as DeepSpeed-Chat and OpenRLHF start their reward models from the SFT model) and a new score head, read at the
    last token by ``rlblocks.reward.RewardModel``. Data: :func:`preference_pairs` on the SFT and RL prompts minus
    ``stage.test_prompts`` RL prompts, which give the held-out pairs for its pairwise accuracy (the evaluation
    pairs of the actor are never used). Half of each batch's pairs set a completion the checker accepts against
    a rejected completion of ANOTHER prompt (still a pair the checker ranks): pairs within one prompt leave each
    prompt's offset free, and PPO's critic would then have to learn those offsets (a within-prompt accuracy of 0.94
    still ranked only 0.80 of correct-vs-wrong samples across prompts here, and PPO did not improve on it).
    Loss: Bradley–Terry ``−log σ(r_chosen − r_rejected)``, mean over a batch,
    plus ``lm_coef`` × the next-token loss of the accepted completions through an auxiliary LM head (the initial
    actor's, dropped afterwards). A pair carries one bit; the next-token loss teaches the backbone the sums the
    score head has to check (4000 steps of pairs within prompts only: 0.83 without it, 0.94 with it; with the
    cross-prompt half as here: 0.886 within prompts and 0.898 across them, 440 s on a loaded 2-core box).
    Saved with ``reward_stats.json``: the held-out and training pairwise accuracies, the mean and std of its scores
    on the training completions (PPO standardises its rewards with them), pair counts and seconds.
    """
    out = Path(cache_root) / stage.key(policy_path)
    if (out / "reward_stats.json").exists():
        return str(out)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from rlblocks.reward import RewardModel

    t0 = time.time()
    rng = random.Random(stage.seed)
    torch.manual_seed(stage.seed)
    tok = AutoTokenizer.from_pretrained(policy_path)
    split = toy.split_pairs()
    test = split["rl"][-stage.test_prompts:]
    train = split["sft"] + split["rl"][:-stage.test_prompts]
    train = train[:stage.train_prompts] if stage.train_prompts else train
    loop = asyncio.new_event_loop()
    engine = TorchEngine.from_pretrained(policy_path, device=device, max_batch_size=1024)
    try:
        train_pairs = preference_pairs(engine, tok, toy.prompts(tok, train), stage.samples, rng, loop)
        test_pairs = preference_pairs(engine, tok, toy.prompts(tok, test), stage.samples, rng, loop)
    finally:
        loop.run_until_complete(engine.aclose())  # close() from the engine's own loop, its step task awaited
        loop.close()
    log(f"reward model: {len(train_pairs)} training pairs, {len(test_pairs)} held-out pairs "
        f"({time.time() - t0:.0f} s sampling)")
    model = AutoModelForSequenceClassification.from_pretrained(policy_path, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tok.pad_token_id
    model.to(device).train()
    # the next-token loss needs an LM head on the backbone: the initial actor's, trained along and then dropped
    lm_head = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32).get_output_embeddings()
    lm_head.to(device).train()
    rm = RewardModel(model, tok)
    params = [*model.parameters(), *lm_head.parameters()]
    optim = torch.optim.AdamW(params, lr=stage.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 - 0.9 * s / stage.steps)
    for step in range(1, stage.steps + 1):
        part = rng.sample(train_pairs, min(stage.batch, len(train_pairs)))
        n = len(part)
        k = round(stage.cross_frac * n)
        chosen, rejected = pair_rows(part)
        rejected[n - k:] = pair_rows(rng.sample(train_pairs, k))[1]  # these rejected rows answer other prompts
        ids, mask = pair_tensors(chosen, rejected, tok.pad_token_id)
        ids, mask = ids.to(device), mask.to(device)
        # the forward RewardModel.score_ids runs (positions from the mask, score at the last valid token), written
        # out so that its hidden states also feed the next-token loss
        hidden = model.model(input_ids=ids, attention_mask=mask,
                             position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).last_hidden_state
        r = model.score(hidden[torch.arange(2 * n, device=device), mask.sum(-1) - 1])[:, 0].float()
        bt = -torch.nn.functional.logsigmoid(r[:n] - r[n:]).mean()  # Bradley–Terry
        labels = torch.full_like(ids[:n], -100)
        for i, (p, c, _) in enumerate(part):
            labels[i, len(p):len(p) + len(c)] = ids[i, len(p):len(p) + len(c)]
        logits = lm_head(hidden[:n, :-1])
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        loss = bt + stage.lm_coef * nll
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        sched.step()
        if step % 500 == 0 or step == stage.steps:
            model.eval()
            probe = test_pairs[:1000]
            acc = pairwise_accuracy(rm, probe, tok.pad_token_id)
            cross = pairwise_accuracy(rm, probe, tok.pad_token_id, others=probe[1:] + probe[:1])
            model.train()
            log(f"reward model: step {step} Bradley–Terry loss {bt.item():.3f} next-token loss {nll.item():.3f} "
                f"held-out pairwise accuracy {acc:.3f} (across prompts {cross:.3f})")
    model.eval()
    with torch.no_grad():
        scores = torch.cat([rm.score_ids(*pair_tensors(*pair_rows(train_pairs[s:s + 512]), tok.pad_token_id))
                            for s in range(0, len(train_pairs), 512)])
    shuffled = rng.sample(test_pairs, len(test_pairs))
    stats = {
        "pairwise_accuracy": pairwise_accuracy(rm, test_pairs, tok.pad_token_id),
        "cross_prompt_accuracy": pairwise_accuracy(rm, test_pairs, tok.pad_token_id, others=shuffled),
        "train_pairwise_accuracy": pairwise_accuracy(rm, train_pairs[:2000], tok.pad_token_id),
        "score_mean": float(scores.mean()), "score_std": float(scores.std()),
        "train_pairs": len(train_pairs), "test_pairs": len(test_pairs), "test_prompts": len(test),
        "seconds": time.time() - t0, "stage": dataclasses.asdict(stage), "policy": policy_path,
    }
    tmp = Path(cache_root) / f".tmp-{out.name}-{os.getpid()}"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "reward_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    try:
        tmp.rename(out)
    except OSError:  # another process finished first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"reward model: held-out pairwise accuracy {stats['pairwise_accuracy']:.3f} ({stats['seconds']:.0f} s)")
    return str(out)


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


# ================================================================================================ one PPO step
def rollout(cfg: Config, engine: TorchEngine, tok, task: Task, rng: random.Random, n_prompts: int,
            step: int, rank: int, loop: asyncio.AbstractEventLoop, device: torch.device):
    """``n_prompts`` prompts × ``K`` samples from the colocated engine. Returns ``(batch, prompts per row,
    output ids per row)``; ``group_ids`` mark the rows of one prompt."""
    sp = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                        stop_token_ids=(tok.eos_token_id,))
    items = [task.draw(rng) for _ in range(n_prompts)]
    reqs = [GenerationRequest(f"s{step}-r{rank}-{i}/{k}", list(p.ids), sp) for i, p in enumerate(items)
            for k in range(cfg.group_size)]

    async def gen():
        return await asyncio.gather(*[engine.generate(r) for r in reqs])

    gens = loop.run_until_complete(gen())
    rows = [p for p in items for _ in range(cfg.group_size)]
    group_ids = [i for i in range(n_prompts) for _ in range(cfg.group_size)]
    batch = build_batch(gens, pad_id=tok.pad_token_id, group_ids=group_ids, device=device)
    return batch, rows, [list(g.output_ids) for g in gens]


def whiten_global(x: Float[Tensor, "B T"], mask: Bool[Tensor, "B T"], eps: float = 1e-8) -> Float[Tensor, "B T"]:
    """``(x − μ)·rsqrt(σ² + eps)`` with μ and the unbiased σ² of the valid entries of the WHOLE batch (the sums are
    all-reduced over the ranks): ``rlblocks.losses.whiten``'s formula, which uses one rank's entries only.
    0 at masked positions."""
    xs = torch.where(mask, x, 0.0)
    s = all_reduce(torch.stack([mask.sum().to(x.dtype), xs.sum(), (xs * xs).sum()]).to(torch.float64))
    n, mean = s[0], s[1] / s[0].clamp(min=1)
    var = (s[2] - n * mean * mean) / (n - 1).clamp(min=1)
    return torch.where(mask, (xs - mean.to(x.dtype)) * torch.rsqrt(var.to(x.dtype) + eps), 0.0)


@dataclass
class Experience:
    """Everything fixed before the first update of a step (no grad): the batch, ``old_logp`` (π_old),
    ``ref_logp`` (π_ref, or None), ``old_values`` (V_old), the per-token ``rewards`` that went into GAE, the
    ``advantages`` (whitened when asked) and the ``returns`` (``A + V_old``, before whitening), all ``[B, T]``;
    ``scores`` ``[B]`` is the reward role's ``R``."""

    batch: RolloutBatch
    old_logp: Float[Tensor, "B T"]
    ref_logp: Float[Tensor, "B T"] | None
    old_values: Float[Tensor, "B T"]
    rewards: Float[Tensor, "B T"]
    advantages: Float[Tensor, "B T"]
    returns: Float[Tensor, "B T"]
    scores: Float[Tensor, " B"]


@torch.no_grad()
def make_experience(cfg: Config, actor: nn.Module, critic: nn.Module, ref: nn.Module | None, batch: RolloutBatch,
                    scores: Float[Tensor, " B"]) -> Experience:
    """π_old, π_ref and V_old on the batch, token rewards, GAE and whitening.

    ``r_t = −β·(log π_old − log π_ref)_t`` on every response token with ``--kl-in reward`` (k1, as DeepSpeed-Chat
    and verl put it in the reward; 0 with ``--kl-in loss``, where the KL goes into the actor loss instead), plus the
    score ``R`` on the row's last response token. ``gae(r, V_old, mask, γ, λ)`` gives ``A`` and ``returns = A +
    V_old``; ``A`` is whitened over the valid tokens of the whole batch."""
    ids, plens, mask = batch.input_ids, batch.prompt_lens, batch.loss_mask
    old_logp = actor(ids, plens, batch.response_mask)
    old_values = critic(ids, plens, batch.response_mask)
    ref_logp = ref(ids, plens, batch.response_mask) if ref is not None else None
    rewards = torch.zeros_like(old_logp)
    if ref_logp is not None and cfg.kl_in == "reward":
        rewards = torch.where(mask, -cfg.kl_coef * kl_estimate(old_logp, ref_logp, kind="k1", mask=mask), 0.0)
    lengths = mask.sum(-1)
    last = (lengths - 1).clamp(min=0)
    # a row without a trained token (none here: every prompt leaves room for one) would add its score nowhere
    rewards = rewards.scatter_add(1, last[:, None], torch.where(lengths > 0, scores, 0.0)[:, None].to(rewards.dtype))
    advantages, returns = gae(rewards, old_values, mask, gamma=cfg.gamma, lam=cfg.lam)
    if cfg.whiten_advantages:
        advantages = whiten_global(advantages, mask)
    return Experience(batch, old_logp, ref_logp, old_values, rewards, advantages, returns, scores)


def global_tokens(mask: Bool[Tensor, "B T"]) -> Tensor:
    """Valid tokens of a mini-batch over all ranks (the aggregation normaliser: the ranks' losses add up)."""
    return all_reduce(mask.sum().to(torch.float64)).to(torch.float32)  # float64: counts stay exact


def ppo_update(cfg: Config, actor: nn.Module, critic: nn.Module, actor_opt: torch.optim.Optimizer,
               critic_opt: torch.optim.Optimizer, exp: Experience, *, grad_scale: float = 1.0,
               step: int = 0) -> dict[str, float]:
    """``--ppo-epochs`` passes, each over ``--mini-batches`` random splits of this rank's samples; per mini-batch
    one actor update and one critic update. Returns the metrics averaged over the updates.

    Actor: ``ppo_clip_loss(logp, old_logp, A, mask, eps_low, eps_high)`` (ratio ``exp(logp − old_logp)``, clip
    offsets from 1), ``+ β·low_var_kl(logp ‖ ref_logp)`` per token with ``--kl-in loss``. Critic: ``value_loss(V,
    V_old, returns, mask, clip=value_clip)`` = ``½·max((V − R)², (clip(V, V_old ± c) − R)²)``. Each is
    ``aggregate``d with the mini-batch's token count over all ranks, scaled by ``grad_scale`` (FSDP averages
    gradients over the ranks), clipped to ``--grad-clip`` and stepped by its own optimiser."""
    b = exp.batch
    mask = b.loss_mask
    shuffle = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    records: list[dict[str, Tensor]] = []
    for _epoch in range(cfg.ppo_epochs):
        order = torch.randperm(mask.shape[0], generator=shuffle).to(mask.device)
        for rows in order.tensor_split(cfg.mini_batches):
            m_mask = mask[rows]
            n_tokens = global_tokens(m_mask)
            args = (b.input_ids[rows], b.prompt_lens[rows], b.response_mask[rows])
            # ---- actor
            logp = actor(*args)
            pg, m = ppo_clip_loss(logp, exp.old_logp[rows], exp.advantages[rows], m_mask, eps_low=cfg.eps_low,
                                  eps_high=cfg.eps_high)
            if exp.ref_logp is not None and cfg.kl_in == "loss":
                kl = kl_estimate(logp, exp.ref_logp[rows], kind="low_var_kl", mask=m_mask)
                pg = pg + cfg.kl_coef * kl
                m["kl_loss"] = torch.where(m_mask, kl, 0.0).sum() / m_mask.sum().clamp(min=1)
            loss = aggregate(pg, m_mask, mode=cfg.agg, num_tokens=n_tokens)
            actor_opt.zero_grad(set_to_none=True)
            (loss * grad_scale).backward()
            m["grad_norm"] = torch.nn.utils.clip_grad_norm_(actor.parameters(), cfg.grad_clip)
            actor_opt.step()
            m["loss"] = loss.detach()
            # ---- critic
            values = critic(*args)
            vl, vm = value_loss(values, exp.old_values[rows], exp.returns[rows], m_mask,
                                clip=cfg.value_clip if cfg.value_clip >= 0 else None)
            vloss = aggregate(vl, m_mask, mode=cfg.agg, num_tokens=n_tokens)
            critic_opt.zero_grad(set_to_none=True)
            (vloss * grad_scale).backward()
            m["critic_grad_norm"] = torch.nn.utils.clip_grad_norm_(critic.parameters(), cfg.grad_clip)
            critic_opt.step()
            m.update(vm)
            m["value_loss"] = vloss.detach()
            records.append({k: v.detach() for k, v in m.items()})
    keys = sorted({k for r in records for k in r})
    out = {k: float(torch.stack([r[k].to(torch.float64).cpu() for r in records if k in r]).mean()) for k in keys}
    out["ppo_updates"] = len(records)
    return out


def weights_to_engine(actor: nn.Module, engine: TorchEngine, version: int, loop: asyncio.AbstractEventLoop) -> float:
    """Gather the actor's full weights (an FSDP collective) and load them into this rank's engine."""
    t0 = time.perf_counter()
    tensors = [(n.removeprefix("lm."), t) for n, t in full_tensors(actor)]
    loop.run_until_complete(engine.update_weights(tensors, version=version))
    return time.perf_counter() - t0


def experience_stats(exp: Experience, checker_scores: Tensor | None) -> dict[str, float]:
    """Batch-wide (all ranks) means: score R, checker accuracy of the training samples, KL k1 to the reference,
    values, returns, the critic's explained variance ``1 − Var(returns − V_old)/Var(returns)``; counts
    (``samples_trained``: rows with a trained token, i.e. not of a group whose reward failed)."""
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


# ================================================================================================ bookkeeping
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


def decay_lrs(cfg: Config, optims: list[tuple[torch.optim.Optimizer, float]], step: int) -> None:
    """Linear decay from each optimiser's base lr to 10% of it over ``--steps`` (with ``--lr-decay``)."""
    frac = max(0.1, 1.0 - 0.9 * min(step / cfg.steps, 1.0)) if cfg.lr_decay else 1.0
    for optim, base in optims:
        for pg in optim.param_groups:
            pg["lr"] = base * frac


def save_roles(files: RunFiles, cfg: Config, actor: nn.Module, critic: nn.Module, actor_opt, critic_opt, step: int,
               world: int, rank: int, rng: random.Random, extra: dict[str, Any]) -> None:
    """``ckpt.pt``, the run checkpoint: actor (``model``, HF names) and critic weights and both optimisers'
    states gathered to full tensors, the step, every rank's RNG states (the prompt sampler's too) and ``extra``
    (counters and the summary's figures so far)."""
    state = {"step": step, "model": {k.removeprefix("lm."): v for k, v in model_state(actor, world).items()},
             "critic": model_state(critic, world), "actor_optim": optim_state(actor, actor_opt, world),
             "critic_optim": optim_state(critic, critic_opt, world), **extra}
    save_run_checkpoint(files, cfg, state, rank=rank, world=world, generators={"data": rng})


# ================================================================================================ main
def main(argv: list[str] | None = None) -> None:
    cfg = parse_flags(Config, argv, check=check_flags)
    rank, world, device = setup_dist()
    n_local = prompts_per_rank(cfg, world)
    rng = random.Random(cfg.seed * 1000 + rank)
    files = RunFiles(cfg.runs_dir, cfg.name, sinks=parse_log_flag(cfg.log_to), config=cfg)
    say = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)

    # ---- checkpoints: the actor's (warm start), the reward model's (stage 1)
    path = cfg.model or rank0_first(rank, lambda: toy.warm_start(os.path.join(cfg.runs_dir, "warmstart"), log=say))
    rm_path, rm_stats = cfg.reward_model, {}
    if cfg.reward == "rm" and not rm_path:
        stage = RewardModelStage(steps=cfg.rm_steps, batch=cfg.rm_batch, lr=cfg.rm_lr, lm_coef=cfg.rm_lm_coef,
                                 samples=cfg.rm_samples,
                                 seed=cfg.seed)
        rm_path = rank0_first(rank, lambda: reward_model_stage(
            stage, path, os.path.join(cfg.runs_dir, "reward_model"), device, log=say))
    if cfg.reward == "rm" and (Path(rm_path) / "reward_stats.json").exists():
        rm_stats = json.loads((Path(rm_path) / "reward_stats.json").read_text())
        say(f"reward model {rm_path}: held-out pairwise accuracy {rm_stats['pairwise_accuracy']:.3f}")
    seed_rank(cfg.seed, rank)  # after the cached stages (they seed and draw when built); the engine's seeds too

    # ---- roles: actor, critic, reference, reward; the engine in this process
    tok, actor = load_actor(path, device, cfg.temperature, cfg.prefix_share)
    max_model_len = resolve_max_model_len(cfg.max_model_len, path)
    eval_spec = eval_reward_spec(cfg)
    task = (load_task(tok, cfg, needs_reference=needs_reference(cfg.reward, eval_spec)) if cfg.prompts
            else toy.task(tok))
    check_fits(task, max_model_len)
    loop = asyncio.new_event_loop()  # the engine binds to the loop that first drives it: always this one
    engine = make_engine("torch", path, device, max_model_len=max_model_len)
    critic = load_critic(cfg.critic_model or path, device, cfg.prefix_share)
    ref = None
    if cfg.kl_coef > 0:
        ref = load_actor(path, device, cfg.temperature, cfg.prefix_share)[1].eval().requires_grad_(False)
    scorer = Scorer(cfg.reward, tok, device, reward_model=rm_path, timeout=cfg.reward_timeout)
    # the held-out metric (--eval-reward; rm: exact match on the toy task, math_reward on a --prompts file), also
    # logged on the training samples as train_accuracy
    checker = scorer.verifier if scorer.verifier is not None and eval_spec == cfg.reward else \
        Reward(eval_spec, tok, reward_model=cfg.reward_model, device=device, timeout=cfg.reward_timeout)
    # ---- fresh run, or resume: both roles' weights (before sharding), the engine at the checkpoint's version
    rec = resume_run(files, cfg, rank=rank, world=world,
                     required=("step", "model", "critic", "actor_optim", "critic_optim", "rng", "config"))
    if rec.state is not None:
        load_model_state(actor.lm, rec.state["model"], what="actor")
        load_model_state(critic, rec.state["critic"], what="critic")
        loop.run_until_complete(engine.update_weights(list(rec.state["model"].items()), version=rec.step))
    actor, critic = shard_role(actor, world), shard_role(critic, world)
    if ref is not None:
        ref = shard_role(ref, world)
    actor_opt = torch.optim.AdamW(actor.parameters(), lr=cfg.lr, weight_decay=0.0)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr, weight_decay=0.0)

    def evaluate(step: int):  # rank 0: the engine holds the current weights, unsharded
        result = loop.run_until_complete(heldout(engine, task.heldout, checker, tok, cfg,
                                                 max_new_tokens=cfg.max_new_tokens, tag=f"eval{step}"))
        files.write_eval(step, result)
        return result

    totals, memory, t_start = Counter(), {}, time.time()
    if rec.state is None:
        eval_before = evaluate(0) if rank == 0 else None
        acc_before = eval_before.mean_at_k if eval_before is not None else 0.0
        heldout_before = heldout_figures(eval_before) if eval_before is not None else None
        last_acc, heldout_after = acc_before, heldout_before
    else:  # both optimizers, the counters and the figures of the run so far
        load_optim_state(actor, actor_opt, rec.state["actor_optim"], world)
        load_optim_state(critic, critic_opt, rec.state["critic_optim"], world)
        totals.update(rec.state["totals"])
        checker.load_state_dict(rec.state["checker"])  # the held-out reward's counters of the run so far
        acc_before, last_acc, heldout_before, heldout_after, memory = (rec.state["summary"][k] for k in (
            "accuracy_before", "accuracy_after", "heldout_before", "heldout_after", "memory_bytes_per_rank"))
        t_start -= rec.state["summary"]["wall_seconds"]
    say(f"held-out accuracy before RL: {acc_before:.3f} ({len(task.heldout)} prompts, {task.heldout_source})")

    def save_checkpoint(steps_done: int) -> None:
        extra = {"totals": dict(totals), "checker": checker.state_dict(),
                 "summary": {"accuracy_before": acc_before, "accuracy_after": last_acc,
                             "heldout_before": heldout_before, "heldout_after": heldout_after,
                             "memory_bytes_per_rank": memory, "wall_seconds": time.time() - t_start}}
        save_roles(files, cfg, actor, critic, actor_opt, critic_opt, steps_done, world, rank, rng, extra)

    steps_done = rec.step
    bar = Progress(cfg.steps, rec.step, enabled=rank == 0 and not cfg.quiet, desc="ppo")
    restore_rng(rec, rank, {"data": rng})  # last before the first step: set-up draws nothing after this
    for step in range(rec.step, cfg.steps):
        t0 = time.perf_counter()
        decay_lrs(cfg, [(actor_opt, cfg.lr), (critic_opt, cfg.critic_lr)], step)
        # ---- 1-2. rollout and reward
        batch, prompts, outputs = rollout(cfg, engine, tok, task, rng, n_local, step, rank, loop, device)
        gen_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        failures_before = scorer.failures
        scores, keep = scorer.score(batch, prompts, outputs, loop, cfg.group_size)
        # a group whose reward failed (retries ran out) is failed whole: its rows are not trained, never scored 0
        batch.loss_mask = batch.loss_mask & keep[:, None]
        checked = scores if checker is scorer.verifier else torch.tensor(  # a failed check counts as wrong here
            loop.run_until_complete(checker.scores(prompts, outputs))[0], device=device)
        reward_s = time.perf_counter() - t1
        # ---- 3-4. experience, then PPO epochs × mini-batches on the actor and the critic
        t2 = time.perf_counter()
        exp = make_experience(cfg, actor, critic, ref, batch, scores)
        m = ppo_update(cfg, actor, critic, actor_opt, critic_opt, exp, grad_scale=float(world), step=step)
        train_s = time.perf_counter() - t2
        if step == 0:  # bytes per role, with the grads and optimiser states of a real update still held
            memory = {"actor": role_bytes(actor, actor_opt), "critic": role_bytes(critic, critic_opt),
                      "reference": role_bytes(ref), "reward_model": role_bytes(scorer.rm.model if scorer.rm else None),
                      "engine": role_bytes(engine.model)}
        # ---- 5. weights into the colocated engine (version = step + 1)
        sync_s = weights_to_engine(actor, engine, step + 1, loop)
        st = experience_stats(exp, checked)
        failed = int(all_reduce(torch.tensor(float(scorer.failures - failures_before), dtype=torch.float64)))
        totals.update({"samples_generated": st["samples"], "samples_trained": st["samples_trained"],
                       "samples_failed_reward": st["samples"] - st["samples_trained"],
                       "tokens_trained": st["tokens"], "reward_failures": failed})
        done = step + 1 >= cfg.steps or (cfg.time_limit > 0 and time.time() - t_start > cfg.time_limit)
        done = broadcast_flag(done, device=device)  # rank 0's clock decides for every rank
        if rank == 0:
            result = evaluate(step + 1) if (every(step + 1, cfg.eval_every) or done) else None
            if result is not None:
                last_acc, heldout_after = result.mean_at_k, heldout_figures(result)
            step_s = time.perf_counter() - t0
            files.log({
                "step": step + 1, "version": step + 1, "reward": st["score"], "reward_failures": failed,
                "train_accuracy": st["train_accuracy"], **eval_metrics(result),
                **{k: v for k, v in st.items() if k not in ("score", "train_accuracy")}, **m,
                "staleness_hist": {"0": st["tokens"]}, "tokens_trained": st["tokens"],
                "tokens_per_s": st["tokens"] / step_s, "step_seconds": step_s, "generate_seconds": gen_s,
                "reward_seconds": reward_s, "train_seconds": train_s, "sync_seconds": sync_s,
                "queue_wait_seconds": 0.0, "lr": actor_opt.param_groups[0]["lr"],
                "samples_generated": totals["samples_generated"], "samples_trained": totals["samples_trained"],
                "samples_failed_reward": totals["samples_failed_reward"], "wall_seconds": time.time() - t_start,
            })
            bar.update({"score": st["score"], "train_acc": st["train_accuracy"], "acc": last_acc,
                        "clipfrac": m["clipfrac"], "vf_mse": m["vf_mse"]})
        steps_done = step + 1
        if every(step + 1, cfg.save_every) or done:
            save_checkpoint(steps_done)
        if done:
            break
    bar.close()
    saved = save_policy(cfg, tok, actor.lm, policy=actor, world=world, rank=rank, base=path, log=say)  # --save-hf
    if rank == 0:
        summary = {
            "accuracy_before": acc_before, "accuracy_after": last_acc, "wall_seconds": time.time() - t_start,
            "cpu_seconds": time.process_time(), "steps": steps_done, "max_staleness": 0, "max_staleness_seen": 0,
            "saved_hf": saved,
            "samples_generated": totals["samples_generated"], "samples_trained": totals["samples_trained"],
            "samples_dropped_stale": 0, "samples_failed_reward": totals["samples_failed_reward"],
            "groups_failed_reward": totals["samples_failed_reward"] // cfg.group_size, "rollout": dict(totals),
            "world_size": world,
            "reward_model": {"path": rm_path, **rm_stats} if cfg.reward == "rm" else None,
            "reward_failures": totals["reward_failures"], "eval_reward": checker.stats(),
            "memory_bytes_per_rank": memory, "config": dataclasses.asdict(cfg), "task": task.source,
            "heldout_prompts": len(task.heldout), "heldout_before": heldout_before,
            "heldout_after": heldout_after, **rec.summary(),
        }
        files.write_summary(summary)
        say(f"held-out accuracy before RL: {acc_before:.3f}  after {steps_done} steps: {last_acc:.3f}  "
            f"({100 * (last_acc - acc_before):+.1f} points, {summary['wall_seconds']:.0f} s)")
    loop.run_until_complete(engine.aclose())  # close() from the engine's own loop, its step task awaited
    scorer.close()
    if checker is not scorer.verifier:
        checker.close()
    loop.close()
    files.close()
    close_dist()


if __name__ == "__main__":
    main()
