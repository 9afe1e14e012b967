"""The calculator tool task through the OpenAI-compatible gateway: an agent written for the ``openai`` client
produces the training data, unchanged (AReaL's online-proxy contract), for a few synchronous GRPO steps.

    python cookbook/agent_gateway.py --steps 8

One process, one event loop: a TorchEngine behind ``rlblocks.rollout.Gateway`` on loopback; ``B·K`` agents per step,
each an ordinary ``openai.AsyncOpenAI`` tool-calling loop (``tools=[calc]``, ``message.tool_calls``, ``tool``
messages, at most 3 turns) that posts its exact-match reward to ``/v1/sessions/<id>/reward``. The gateway records
each session's trajectory token for token (the re-sent history is checked against it) and hands it, with the
reward, to a ``StalenessQueue`` (η = 0: synchronous). The trainer takes the step's trajectories, computes the same
GRPO loss as ``agent_async.py`` and loads the new weights into the engine. Held-out accuracy is measured before and
after with greedy ``run_episode`` on the same engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import agent_task as task

from rlblocks.rollout import Gateway, TorchEngine
from rlblocks.rollout.agent import calculator, calculator_tool
from rlblocks.sched import StalenessQueue


def parse_flags(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    p.add_argument("--name", default="agent-gateway", help="run name: files go to <runs-dir>/<name>/")
    p.add_argument("--runs-dir", default="runs", help="where run directories live")
    p.add_argument("--model", default="", help="checkpoint directory; empty: the cached demo warm start")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps")
    p.add_argument("--prompts-per-step", type=int, default=8, help="B: problems per step")
    p.add_argument("--group-size", type=int, default=8, help="K: agent sessions per problem")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate")
    p.add_argument("--heldout", type=int, default=300, help="held-out problems evaluated before and after")
    p.add_argument("--warmstart-target", type=float, default=0.2, help="warm start stopping accuracy")
    p.add_argument("--seed", type=int, default=0, help="seed")
    return p.parse_args(argv)


async def agent(client, http, base_url: str, session_id: str, a: int, b: int, group: int) -> tuple[float, int]:
    """An ordinary OpenAI tool-calling agent. Returns (reward, tool calls); posts the reward to the gateway."""
    messages = [{"role": "user", "content": f"{a}*{b}"}]
    tools = [calculator_tool("calc").schema()]
    reward, calls = 0.0, 0
    for _ in range(task.MAX_TURNS):
        r = await client.chat.completions.create(
            model="policy", messages=messages, tools=tools, temperature=1.0, max_tokens=task.TURN_TOKENS,
            extra_headers={"X-Session-Id": session_id})
        msg = r.choices[0].message
        if not msg.tool_calls:
            reward = float((msg.content or "").strip() == str(a * b))
            break
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            calls += 1
            try:
                result = calculator(**json.loads(call.function.arguments))
            except Exception as e:  # the model sees the error, as from any tool
                result = f"error: {type(e).__name__}: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": result})
    resp = await http.post(f"{base_url}/sessions/{session_id}/reward",
                           json={"reward": reward, "info": {"group": group}})
    resp.raise_for_status()
    return reward, calls


async def main_async(args: argparse.Namespace) -> dict:
    import httpx
    import openai

    path = args.model or task.warm_start(os.path.join(args.runs_dir, "warmstart-agent"),
                                         task.WarmStart(target_train_accuracy=args.warmstart_target))
    tok, policy = task.load(path)
    _, served = task.load(path)
    policy.train()
    engine = TorchEngine(served.eval(), max_batch_size=4096)
    q = StalenessQueue(max_staleness=0)
    optim = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    heldout = task.split_problems()["heldout"][: args.heldout]
    held_set = set(task.split_problems()["heldout"])
    rng = random.Random(args.seed)
    run_dir = Path(args.runs_dir) / args.name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    acc_before = await task.eval_accuracy(engine, tok, heldout)
    print(f"held-out accuracy before: {acc_before:.3f}", flush=True)
    t0 = time.time()
    async with Gateway(engine, tok, model="policy", queue=q) as gw:
        client = openai.AsyncOpenAI(base_url=gw.url, api_key="unused", max_retries=0, timeout=120)
        async with httpx.AsyncClient(timeout=120) as http:
            for step in range(args.steps):
                ts = time.perf_counter()
                problems = [task.rl_problem(rng, held_set) for _ in range(args.prompts_per_step)]
                results = await asyncio.gather(*[
                    agent(client, http, gw.url, f"s{step}-g{g}-k{k}", a, b, g)
                    for g, (a, b) in enumerate(problems) for k in range(args.group_size)])
                n = args.prompts_per_step * args.group_size
                trajs = q.get_batch(n, current_version=step, timeout=10)
                assert len(trajs) == n, f"expected {n} finished sessions in the queue, got {len(trajs)}"
                for t in trajs:
                    t.group_id = int(t.info["group"])
                gen_s = time.perf_counter() - ts
                optim.zero_grad(set_to_none=True)
                m = task.grpo_backward(policy, trajs, tok.pad_token_id)
                torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
                optim.step()
                await engine.update_weights(list(policy.state_dict().items()), version=step + 1)
                rec = {"step": step + 1, "reward": sum(r for r, _ in results) / n,
                       "tool_calls_per_episode": sum(c for _, c in results) / n, "loss": m["loss"],
                       "tokens_trained": m["tokens_trained"], "generate_seconds": gen_s,
                       "step_seconds": time.perf_counter() - ts,
                       "prefix_mismatches": sum(t.prefix_mismatches for t in trajs)}
                with open(run_dir / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(rec) + "\n")
                print(f"step {step + 1}: reward {rec['reward']:.3f}  tool calls/episode "
                      f"{rec['tool_calls_per_episode']:.2f}  {rec['step_seconds']:.1f} s", flush=True)
            stats = gw.stats()
        await client.close()
    acc_after = await task.eval_accuracy(engine, tok, heldout)
    summary = {"accuracy_before": acc_before, "accuracy_after": acc_after, "steps": args.steps,
               "wall_seconds": time.time() - t0, "gateway": stats, "config": vars(args)}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"held-out accuracy after {args.steps} steps through the gateway: {acc_after:.3f} "
          f"(before {acc_before:.3f}); sessions {stats.get('sessions_finished', 0)}, prefix mismatches "
          f"{stats.get('prefix_mismatches', 0)}; summary: {run_dir / 'summary.json'}", flush=True)
    return summary


def main(argv: list[str] | None = None) -> dict:
    args = parse_flags(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
