"""The calculator tool task through the OpenAI-compatible gateway: an agent written for the ``openai`` client
produces the training data, unchanged (AReaL's online-proxy contract), for a few synchronous GRPO steps.

    python cookbook/agent_gateway.py --steps 8

One process, one event loop: a TorchEngine behind ``rlblocks.rollout.Gateway`` on loopback; ``B·K`` agents per step,
each an ordinary ``openai.AsyncOpenAI`` tool-calling loop (``tools=[calc]``, ``message.tool_calls``, ``tool``
messages, at most 3 turns) that posts its reward (exact match on the toy task; ``--reward`` on the final answer) to
``/v1/sessions/<id>/reward``. ``--prompts`` and ``--tools`` give the agents your prompts and tools. The gateway records
each session's trajectory token for token (the re-sent history is checked against it) and hands it, with the
reward, to a ``StalenessQueue`` (η = 0: synchronous). The trainer takes the step's trajectories, computes the same
GRPO loss as ``agent_async.py`` and loads the new weights into the engine. The held-out evaluation (``--eval-k``
``run_episode`` s per held-out prompt on the same engine, pass@k and mean@k) runs before and after.

Repeatable: every request carries a sampling seed drawn from ``--seed`` (the gateway passes it to the engine), and
the trainer takes the step's trajectories in session order, whatever order the sessions finished in. With
``--batch-invariant`` the engine runs every sequence in its own forward, so a sequence's log-probs do not depend on
which requests shared a step (CPU matrix kernels give a row different last bits at different batch sizes): two runs
of one seed then train bit-identical weights.

Files: ``runs/<name>/metrics.jsonl`` (one line per step; TensorBoard / W&B with ``--log-to``), ``eval/``,
``summary.json`` (with the gateway's counters), ``policy/`` (the trained model and tokenizer).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass

import agent_task as task
import torch
from plumbing import (
    Reward,
    RunFiles,
    TaskFlags,
    check_at_least,
    check_task_flags,
    eval_metrics,
    eval_reward_spec,
    heldout_figures,
    load_hf,
    load_task,
    load_tokenizer,
    load_tools,
    make_engine,
    model_max_len,
    needs_reference,
    opt,
    parse_flags,
    parse_log_flag,
    save_policy,
    seed_rank,
    setup_dist,
)

from rlblocks.errors import ArgumentError
from rlblocks.rollout import Gateway
from rlblocks.sched import StalenessQueue


@dataclass
class Config(TaskFlags):
    """Synchronous GRPO on the calculator tool task, driven by openai-client agents through the gateway (flags are
    generated from these fields; the data, reward, evaluation and --log-to flags every loop shares come from
    plumbing's TaskFlags)."""

    name: str = opt("agent-gateway", "run name: files go to <runs-dir>/<name>/")
    runs_dir: str = opt("runs", "where run directories live")
    model: str = opt("", "HF checkpoint directory whose tokenizer has a chat template; empty: the tiny demo model, "
                         "warm-started and cached (the agent demo's)")
    steps: int = opt(8, "optimizer steps")
    prompts_per_step: int = opt(8, "B: problems per step")
    group_size: int = opt(8, "K: agent sessions per problem")
    lr: float = opt(3e-4, "AdamW learning rate")
    grad_clip: float = opt(1.0, "max grad norm")
    heldout: int = opt(300, "held-out prompts evaluated before and after: the first this many (the toy task has 300)")
    tools: str = opt("", "the agents' tools, module:function,... (a Tool, a function returning one, or a plain "
                         "function); empty: the calculator")
    warmstart_target: float = opt(0.2, "warm start: stop once greedy accuracy on SFT problems reaches this")
    batch_invariant: bool = opt(False, "every sequence in its own engine forward: runs of one seed train "
                                       "bit-identical weights (several times slower)")
    seed: int = opt(0, "seed")


def check_flags(cfg: Config) -> None:
    """Flag values that cannot work (refused before anything starts)."""
    check_at_least(cfg, 1, "steps", "prompts_per_step", "group_size", "heldout")
    check_task_flags(cfg)
    if not cfg.chat:
        raise ArgumentError("--no-chat: the gateway renders every request with the tokenizer's chat template")
    if cfg.tools:
        load_tools(cfg.tools)


async def agent(client, http, base_url: str, session_id: str, prompt, tools, scorer, group: int,
                seed: int) -> tuple[float, int, bool]:
    """An ordinary OpenAI tool-calling agent on ``prompt`` (a ``plumbing.Prompt``) with ``tools``. Returns (reward,
    tool calls, whether the reward call failed); posts the reward (``scorer``, a ``plumbing.Reward``, on the final
    answer) to the gateway, ``info["reward_failed"]`` saying whether its call failed (retries ran out: the 0.0 it
    posts is a placeholder, and the trainer fails the session's group whole)."""
    messages = [dict(m) for m in prompt.messages]
    by_name = {t.name: t for t in tools}
    reward, calls, counts = 0.0, 0, Counter()
    for _ in range(task.MAX_TURNS):
        r = await client.chat.completions.create(
            model="policy", messages=messages, tools=[t.schema() for t in tools], temperature=1.0,
            max_tokens=task.TURN_TOKENS, seed=seed, extra_headers={"X-Session-Id": session_id})
        msg = r.choices[0].message
        if not msg.tool_calls:
            reward = await scorer.score_answer(prompt, msg.content or "", counts)
            break
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            calls += 1
            try:
                result = await by_name[call.function.name](json.loads(call.function.arguments))
            except Exception as e:  # the model sees the error, as from any tool
                result = f"error: {type(e).__name__}: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": result})
    failed = counts["reward_failures"] > 0
    resp = await http.post(f"{base_url}/sessions/{session_id}/reward",
                           json={"reward": reward, "info": {"group": group, "reward_failed": failed}})
    resp.raise_for_status()
    return reward, calls, failed


async def run(cfg: Config, path: str) -> dict:
    """The whole run on one event loop (the engine's and the gateway's), from the checkpoint at ``path``."""
    import httpx
    import openai

    # ---- set-up: policy, engine, queue, optimiser, run files
    tok = load_tokenizer(path, chat=True)  # a tokenizer without a chat template is refused, naming --model
    cpu = torch.device("cpu")
    policy = load_hf(path, cpu)[1]
    policy.train()
    engine = make_engine("torch", path, cpu, max_model_len=model_max_len(path), max_batch_size=4096,
                         batch_invariant=cfg.batch_invariant)
    q = StalenessQueue(max_staleness=0)
    optim = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)
    # ---- the prompts (the toy problems, or --prompts), the tools, the rewards (training, held-out)
    loop_task = (load_task(tok, cfg, needs_reference=needs_reference(cfg.reward, eval_reward_spec(cfg)),
                           encode_ids=False) if cfg.prompts else task.task())
    tools = load_tools(cfg.tools) if cfg.tools else task.default_tools()
    heldout = loop_task.heldout[: cfg.heldout]
    scorer = Reward(cfg.reward, tok, reward_model=cfg.reward_model, timeout=cfg.reward_timeout)
    eval_reward = Reward(eval_reward_spec(cfg), tok, reward_model=cfg.reward_model, timeout=cfg.reward_timeout)
    rng = random.Random(cfg.seed)
    files = RunFiles(cfg.runs_dir, cfg.name, sinks=parse_log_flag(cfg.log_to), config=cfg)
    files.fresh()

    async def evaluate(step: int):
        result = await task.eval_episodes(engine, tok, heldout, tools=tools, reward=eval_reward, k=cfg.eval_k,
                                          temperature=cfg.eval_temperature, seed=cfg.seed)
        files.write_eval(step, result)
        return result

    eval_before = await evaluate(0)
    acc_before = eval_before.mean_at_k
    print(f"held-out accuracy before: {acc_before:.3f}", flush=True)
    t0 = time.time()
    n = cfg.prompts_per_step * cfg.group_size
    totals = Counter()  # samples generated / trained / failed with their group for the reward, groups failed
    async with Gateway(engine, tok, model="policy", queue=q) as gw:
        client = openai.AsyncOpenAI(base_url=gw.url, api_key="unused", max_retries=0, timeout=120)
        async with httpx.AsyncClient(timeout=120) as http:
            for step in range(cfg.steps):
                # ---- 1. B·K agent sessions through the gateway, each with its own sampling seed
                ts = time.perf_counter()
                problems = [loop_task.draw(rng) for _ in range(cfg.prompts_per_step)]
                seeds = [rng.getrandbits(62) for _ in range(n)]
                failures_before = scorer.failures
                results = await asyncio.gather(*[
                    agent(client, http, gw.url, f"s{step}-g{g}-k{k}", p, tools, scorer, g,
                          seeds[g * cfg.group_size + k])
                    for g, p in enumerate(problems) for k in range(cfg.group_size)])
                # ---- 2. the step's trajectories, in session order (not the order they finished in)
                trajs = q.get_batch(n, current_version=step, timeout=10)
                if len(trajs) != n:
                    raise RuntimeError(f"expected {n} finished sessions in the queue, got {len(trajs)}")
                trajs.sort(key=lambda t: t.session_id)
                for t in trajs:
                    t.group_id = int(t.info["group"])
                # a group with a failed reward call is failed whole: none of its sessions is trained (a baseline
                # without it, or with its placeholder 0, would be biased)
                failed_groups = {int(t.info["group"]) for t in trajs if t.info.get("reward_failed")}
                train = [t for t in trajs if t.group_id not in failed_groups]
                totals["groups_failed_reward"] += len(failed_groups)
                totals["samples_failed_reward"] += len(trajs) - len(train)
                totals["samples_generated"] += len(trajs)
                totals["samples_trained"] += len(train)
                gen_s = time.perf_counter() - ts
                # ---- 3. GRPO over the trajectories, then the new weights into the engine
                optim.zero_grad(set_to_none=True)
                if train:
                    m = task.grpo_backward(policy, train, tok.pad_token_id)
                    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip)
                    optim.step()
                else:  # every group failed: nothing to train this step (the weights stay, the version advances)
                    m, grad_norm = {"loss": 0.0, "tokens_trained": 0.0}, 0.0
                t_sync = time.perf_counter()
                await engine.update_weights(list(policy.state_dict().items()), version=step + 1)
                sync_s = time.perf_counter() - t_sync
                last = step + 1 == cfg.steps
                result = await evaluate(step + 1) if last else None
                step_s = time.perf_counter() - ts
                scored = [r for r, _, failed in results if not failed]
                rec = {"step": step + 1, "version": step + 1, "reward": sum(scored) / max(len(scored), 1),
                       "reward_failures": scorer.failures - failures_before, **eval_metrics(result),
                       "samples_failed_reward": totals["samples_failed_reward"],
                       "tool_calls_per_episode": sum(c for _, c, _ in results) / n, "loss": m["loss"],
                       "grad_norm": float(grad_norm), "lr": optim.param_groups[0]["lr"],
                       "tokens_trained": m["tokens_trained"], "tokens_per_s": m["tokens_trained"] / step_s,
                       "samples_generated": totals["samples_generated"],
                       "samples_trained": totals["samples_trained"],
                       "staleness_hist": {"0": int(m["tokens_trained"])}, "generate_seconds": gen_s,
                       "train_seconds": t_sync - ts - gen_s, "sync_seconds": sync_s, "queue_wait_seconds": 0.0,
                       "step_seconds": step_s, "wall_seconds": time.time() - t0,
                       "prefix_mismatches": sum(t.prefix_mismatches for t in trajs)}
                files.log(rec)
                print(f"step {step + 1}: reward {rec['reward']:.3f}  tool calls/episode "
                      f"{rec['tool_calls_per_episode']:.2f}  {rec['step_seconds']:.1f} s", flush=True)
            stats = gw.stats()
        await client.close()
    eval_after = result if result is not None else await evaluate(cfg.steps)
    acc_after = eval_after.mean_at_k
    await engine.aclose()
    summary = {"accuracy_before": acc_before, "accuracy_after": acc_after, "steps": cfg.steps,
               "wall_seconds": time.time() - t0, **{k: totals[k] for k in (
                   "samples_generated", "samples_trained", "samples_failed_reward", "groups_failed_reward")},
               "reward_failures": scorer.stats()["failures"], "gateway": stats, "config": dataclasses.asdict(cfg),
               "task": loop_task.source, "heldout_prompts": len(heldout),
               "heldout_before": heldout_figures(eval_before), "heldout_after": heldout_figures(eval_after),
               "reward": scorer.stats(), "eval_reward": eval_reward.stats()}
    files.write_summary(summary)
    files.close()
    scorer.close()
    eval_reward.close()
    policy.save_pretrained(files.dir / "policy")  # the trained policy, loadable with from_pretrained
    tok.save_pretrained(files.dir / "policy")
    save_policy(cfg, tok, policy)  # --save-hf: the same, where the user asks
    print(f"held-out accuracy after {cfg.steps} steps through the gateway: {acc_after:.3f} "
          f"(before {acc_before:.3f}); sessions {stats.get('sessions_finished', 0)}, prefix mismatches "
          f"{stats.get('prefix_mismatches', 0)}; summary: {files.summary}", flush=True)
    return summary


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_flags(Config, argv, check=check_flags)
    setup_dist(threads=1, cpu=True)  # one process, one thread: the tiny model gains nothing from more
    # the warm start (cached) evaluates with its own event loops, so it runs before this run's loop starts
    path = cfg.model or task.warm_start(os.path.join(cfg.runs_dir, "warmstart-agent"),
                                        task.WarmStart(target_train_accuracy=cfg.warmstart_target),
                                        log=lambda s: print(s, flush=True))
    load_tokenizer(path, chat=True)  # refused before anything starts
    seed_rank(cfg.seed, 0)  # after the warm start, which seeds and draws on its own when it is not cached yet
    return asyncio.run(run(cfg, path))


if __name__ == "__main__":
    main()
