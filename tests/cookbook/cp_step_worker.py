"""Run by test_context_parallel.py: 2 gloo processes train one ``grpo_step`` with ``--cp 2``'s set-up (FSDP2 over
both ranks, ``PolicyLogprobs(cp_group=)``, normalisers over the data-parallel group, ``grad_scale`` = world) and
compare the updated weights with one process running the same step unsharded.

Usage: python cp_step_worker.py <init_file>. Exits non-zero with the failing check printed.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COOKBOOK = Path(__file__).resolve().parents[2] / "cookbook"
WORLD = 2


def _records():
    g = torch.Generator().manual_seed(2)
    out = []
    for gi in range(2):
        prompt = torch.randint(4, 60, (3 + gi,), generator=g).tolist()
        samples = []
        for k in range(4):
            n = int(torch.randint(2, 10, (1,), generator=g))
            samples.append({"output_ids": torch.randint(4, 60, (n,), generator=g).tolist(),
                            "output_logprobs": (-2 * torch.rand(n, generator=g)).tolist(),
                            "output_versions": [0] * n, "finish_reason": "stop", "reward": float((k + gi) % 2)})
        out.append({"uid": f"g{gi}", "pair": (0, 0), "prompt_ids": prompt, "samples": samples, "version": 0,
                    "rank": 0})
    return out


def _worker(rank, init_file):
    sys.path.insert(0, str(COOKBOOK))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        import transformers
        from grpo import grpo_step
        from plumbing import PolicyLogprobs, batch_tensors, decoder_layers, shard, trainer_groups

        from rlblocks.sync import full_tensors

        solo = [dist.new_group([r]) for r in range(WORLD)][rank]  # the reference's own one-rank group
        tg = trainer_groups(range(WORLD), WORLD, rank)  # DP 1 × CP 2
        if tg.cp_size != 2 or tg.dp_size != 1 or tg.cp_rank != rank:
            raise AssertionError(f"trainer_groups: {tg}")
        cfg_llama = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                             max_position_embeddings=64)
        torch.manual_seed(0)
        base = transformers.LlamaForCausalLM(cfg_llama).eval()
        torch.manual_seed(1)
        ref_lm = transformers.LlamaForCausalLM(cfg_llama).eval().requires_grad_(False)
        bt = batch_tensors(_records(), 0, torch.device("cpu"))
        for case in (dict(loss="ppo", agg="token-mean", kl_coef=0.0),
                     dict(loss="gspo", agg="seq-mean-token-mean", kl_coef=0.2)):
            cfg = SimpleNamespace(eps_low=None, eps_high=None, rollout_weight_cap=None, correction="tis",
                                  correction_cap=2.0, ppo_epochs=2, mini_batches=2, grad_clip=1e9, seed=3, **case)
            # the reference: one process, no sharding
            one = PolicyLogprobs(copy.deepcopy(base))
            ref_one = PolicyLogprobs(copy.deepcopy(ref_lm)) if cfg.kl_coef else None
            m1 = grpo_step(cfg, one, torch.optim.SGD(one.parameters(), lr=0.5), bt, ref_policy=ref_one, group=solo,
                           step=5)
            # --cp 2: FSDP2 over both ranks, each forwarding its zigzag shard
            lm = copy.deepcopy(base)
            pol = shard(PolicyLogprobs(lm, cp_group=tg.cp), decoder_layers(lm), WORLD)
            ref_cp = PolicyLogprobs(copy.deepcopy(ref_lm), cp_group=tg.cp) if cfg.kl_coef else None
            m2 = grpo_step(cfg, pol, torch.optim.SGD(pol.parameters(), lr=0.5), bt, ref_policy=ref_cp, group=tg.dp,
                           grad_scale=float(WORLD), step=5)
            tag = f"[rank{rank} {case['loss']} {case['agg']}]"
            if not abs(float(m1["grad_norm"])) > 0:
                raise AssertionError(f"{tag} the reference step has no gradient (the check would be empty)")
            for key in ("loss", "grad_norm"):
                if abs(float(m1[key]) - float(m2[key])) > 1e-5 * max(1.0, abs(float(m1[key]))):
                    raise AssertionError(f"{tag} {key}: {m2[key]} vs one process {m1[key]}")
            want = {n: p.detach() for n, p in one.named_parameters()}
            for name, t in full_tensors(pol):
                err = (t - want[name]).abs().max().item()
                if err > 1e-5:
                    raise AssertionError(f"{tag} {name}: max abs error {err:.3g} after the step")
                if name == "lm.lm_head.weight" and torch.equal(t, base.lm_head.weight):
                    raise AssertionError(f"{tag} the step did not change {name}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(_worker, args=(sys.argv[1],), nprocs=WORLD, join=True)
    print("cp grpo_step OK")
