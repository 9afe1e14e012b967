"""Routing replay on megatron-core MoE models, in its own process: ``python _moe_replay_megatron_worker.py <task>``.

megatron-core needs ``torch.distributed`` and the TEST-ONLY CPU patches of tests/sync/reshard/conftest.py (they
change process-wide state), so these checks run in a child process (one gloo rank). Each task raises on any
mismatch (non-zero exit, traceback on stdout) and prints its figures.
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _reshard_conftest():
    """tests/sync/reshard/conftest.py (its TEST-ONLY megatron CPU patches), under a name of its own."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_reshard_conftest", HERE.parent / "sync" / "reshard" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RESHARD = _reshard_conftest()

VOCAB, HIDDEN, EXPERTS, TOP_K, LAYERS = 64, 64, 8, 2, 2


def setup() -> None:
    RESHARD.apply_megatron_cpu_patches()
    # TEST-ONLY: megatron-core 0.16.1 reads ``te_general_gemm`` in the router's gating linear even when
    # Transformer Engine is absent (the name is then undefined); None selects its plain torch.mm path.
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel()


def build(*, seed: int = 0, replay_flag: bool = False, ffn: int = 32, head_dim: int = 32, rope_base: int = 10000,
          eps: float = 1e-5, **router):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=2, num_query_groups=1, kv_channels=head_dim,
        ffn_hidden_size=ffn, normalization="RMSNorm", layernorm_epsilon=eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        use_cpu_initialization=True, params_dtype=torch.float32,
        num_moe_experts=EXPERTS, moe_router_topk=TOP_K, moe_ffn_hidden_size=ffn, moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_enable_routing_replay=replay_flag,
        **router,
    )
    torch.manual_seed(seed)
    model = GPTModel(
        cfg, get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False, normalization="RMSNorm"),
        vocab_size=VOCAB, max_sequence_length=128, position_embedding_type="rope", rotary_base=rope_base,
        share_embeddings_and_output_weights=False,
    ).eval()
    return model


def forward(model, tokens):
    pos = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    return model(tokens, pos, RESHARD.causal_mask(tokens.shape[1])).float()  # [B, L, V]


def token_logp(logits, tokens):
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]


def random_routing(b: int, seq: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(b * seq * LAYERS)]
    return torch.stack(rows).view(b, seq, LAYERS, TOP_K)


def router_grads(model):
    return [m.weight.grad.clone() for n, m in model.named_modules() if n.endswith("mlp.router")]


ROUTER_CASES = {
    "softmax after top-k": {},
    "softmax before top-k": {"moe_router_pre_softmax": True},
    "sigmoid + expert bias, scaled": {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                                      "moe_router_topk_scaling_factor": 2.5},
    "group-limited top-k": {"moe_router_num_groups": 4, "moe_router_group_topk": 2},
}


def task_exact() -> None:
    """Own routing replays bit for bit; forced routing matches megatron-core's own RouterReplay (logits and
    router gradients), for each score function; the recorder inside a replay sees the forced experts."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from rlblocks.rollout.moe_replay import RoutingRecorder, replay_routing, routing_spec

    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    for case, router in ROUTER_CASES.items():
        model = build(**router)
        spec = routing_spec(model)
        assert (spec.backend, spec.num_layers, spec.top_k, spec.num_experts) == ("megatron", LAYERS, TOP_K, EXPERTS)
        assert spec.decoder_layers == (0, 1) and spec.names[0] == "decoder.layers.0.mlp.router", spec
        rec = RoutingRecorder(model)
        with torch.no_grad(), rec:
            ref = forward(model, tokens)
        own = rec.take().view(2, 9, LAYERS, TOP_K)
        with torch.no_grad(), replay_routing(model, own):
            assert torch.equal(forward(model, tokens), ref), case

        forced = random_routing(2, 9, seed=1)
        with replay_routing(model, forced), rec:
            ours = forward(model, tokens)
            token_logp(ours, tokens).sum().backward()
        assert torch.equal(rec.take().view(2, 9, LAYERS, TOP_K).long(), forced), case
        ours_grads = router_grads(model)

        RouterReplay.clear_global_router_replay_instances()
        theirs_model = build(replay_flag=True, **router)
        theirs_model.load_state_dict(model.state_dict())
        # megatron's RouterReplay takes one [L * B, top_k] tensor per layer, in its routers' token order
        RouterReplay.set_replay_data([forced[:, :, i].transpose(0, 1).reshape(-1, TOP_K) for i in range(LAYERS)])
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            theirs = forward(theirs_model, tokens)
            token_logp(theirs, tokens).sum().backward()
        finally:
            RouterReplay.clear_global_router_replay_action()
            RouterReplay.clear_global_router_replay_instances()
        assert torch.equal(ours, theirs), f"{case}: max |diff| {(ours - theirs).abs().max():.3e}"
        for g_ours, g_theirs in zip(ours_grads, router_grads(theirs_model)):
            assert bool((g_ours != 0).any()), case
            torch.testing.assert_close(g_ours, g_theirs, atol=1e-6, rtol=1e-5)
        print(f"{case}: own routing bitwise, forced routing == megatron RouterReplay "
              f"(forced vs own logits differ by {(ours - ref).abs().max():.3f})", flush=True)

    # megatron's own RouterReplay slot is restored after our context
    RouterReplay.clear_global_router_replay_instances()
    flagged = build(replay_flag=True)
    saved = [m.router_replay for n, m in flagged.named_modules() if n.endswith("mlp.router")]
    with replay_routing(flagged, own):
        pass
    assert [m.router_replay for n, m in flagged.named_modules() if n.endswith("mlp.router")] == saved
    RouterReplay.clear_global_router_replay_instances()


def task_errors() -> None:
    from rlblocks.errors import ArgumentError
    from rlblocks.rollout.moe_replay import replay_routing

    model = build()
    tokens = torch.randint(0, VOCAB, (2, 9))
    forced = random_routing(2, 8, seed=2)  # one position short
    try:
        with torch.no_grad(), replay_routing(model, forced):
            forward(model, tokens)
    except ArgumentError as exc:
        assert "routed_experts" in str(exc) and "[2, 8]" in str(exc), exc
    else:
        raise AssertionError("a token-count mismatch was not refused")
    try:
        with replay_routing(model, forced), replay_routing(model, forced):
            pass
    except ArgumentError as exc:
        assert "do not nest" in str(exc), exc
    else:
        raise AssertionError("nested replays were not refused")
    print("errors: token mismatch and nesting refused", flush=True)


def _mismatch(model, run, engine_logp, routed, mask=None):
    """(max |dlogp|, mean |dlogp|, flipped routes) of ``run()``'s logits against ``engine_logp``, without and
    with replay of ``routed``; ``run`` returns logits whose position ``j`` predicts token ``j + 1``."""
    from contextlib import nullcontext

    from rlblocks.rollout.moe_replay import RoutingRecorder, replay_routing, route_flip_fraction

    out = {}
    for replay in (False, True):
        rec = RoutingRecorder(model)
        ctx = replay_routing(model, routed) if replay else nullcontext()
        with torch.no_grad(), ctx, rec:
            logits, tokens = run()
        lp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
        d = (lp - engine_logp).abs()
        if mask is not None:
            d = d[mask]
        used = rec.take().view(*routed.shape)
        out[replay] = (float(d.max()), float(d.mean()), float(route_flip_fraction(routed, used)))
    return out


def _report(name, out):
    w, r = out[False], out[True]
    print(f"[R3 {name}] without replay: max|dlogp| {w[0]:.4f} mean {w[1]:.5f} flipped routes {w[2]:.2%}; "
          f"with replay: max {r[0]:.4f} mean {r[1]:.5f} flipped {r[2]:.2%}", flush=True)
    assert w[2] > 0.002, f"{name}: the perturbation flipped no route"
    assert r[2] == 0.0, f"{name}: replay left flipped routes"
    assert r[0] < w[0] / 4 and r[1] < w[1] / 2, f"{name}: replay did not bring the log-probs back"


def _near_tied(model, expert_scale: float = 3.0):
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("mlp.router.weight"):
                p.normal_(0, 0.1)
            elif ".mlp.experts." in n:
                p.mul_(expert_scale)
    return model


def task_perturbation() -> None:
    """megatron engine-side forward (fp32) records; the trainer's weights moved by a small update."""
    from rlblocks.rollout.moe_replay import RoutingRecorder

    tokens = torch.randint(0, VOCAB, (8, 30), generator=torch.Generator().manual_seed(3))
    engine = _near_tied(build(seed=4))
    rec = RoutingRecorder(engine)
    with torch.no_grad(), rec:
        engine_logp = token_logp(forward(engine, tokens), tokens)
    routed = rec.take().view(8, 30, LAYERS, TOP_K)
    trainer = build(seed=4)  # megatron models do not deepcopy (they hold process groups): copy the weights
    trainer.load_state_dict(engine.state_dict())
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-3 * p.abs().mean())
    _report("megatron weight_update",
            _mismatch(trainer, lambda: (forward(trainer, tokens)[:, :-1], tokens), engine_logp, routed))


def mixtral_to_megatron(hf, mg) -> None:
    """Load an HF Mixtral's weights into a megatron-core MoE GPTModel (attention and norms through rlblocks'
    Llama converter; router and experts by name: HF ``gate_up_proj[e]`` is ``[gate; up]`` like megatron's fc1)."""
    from rlblocks.sync.reshard.megatron import hf_to_megatron

    cfg = hf.config
    sd = hf.state_dict()
    llama_cfg = {"model_type": "llama", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
                 "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
                 "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
                 "head_dim": cfg.head_dim, "tie_word_embeddings": False}
    f = cfg.intermediate_size
    items = []
    for name, t in sd.items():
        if ".mlp." in name:
            continue
        items.append((name, t))
    for i in range(cfg.num_hidden_layers):  # placeholders for the dense MLP slots of the Llama layout
        gate_up = sd[f"model.layers.{i}.mlp.experts.gate_up_proj"][0]
        items += [(f"model.layers.{i}.mlp.gate_proj.weight", gate_up[:f]),
                  (f"model.layers.{i}.mlp.up_proj.weight", gate_up[f:]),
                  (f"model.layers.{i}.mlp.down_proj.weight", sd[f"model.layers.{i}.mlp.experts.down_proj"][0])]
    out = {k: v for k, v in hf_to_megatron(items, llama_cfg) if ".mlp.linear_fc" not in k}
    for i in range(cfg.num_hidden_layers):
        out[f"decoder.layers.{i}.mlp.router.weight"] = sd[f"model.layers.{i}.mlp.gate.weight"]
        for e in range(cfg.num_local_experts):
            pre = f"decoder.layers.{i}.mlp.experts.local_experts.{e}"
            out[f"{pre}.linear_fc1.weight"] = sd[f"model.layers.{i}.mlp.experts.gate_up_proj"][e]
            out[f"{pre}.linear_fc2.weight"] = sd[f"model.layers.{i}.mlp.experts.down_proj"][e]
    missing, unexpected = mg.load_state_dict(out, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)


def task_hf_engine_megatron_trainer() -> None:
    """The realistic R3 split: an HF Mixtral engine (TorchEngine, bf16) samples and records; a megatron-core
    trainer (fp32, the same bf16-rounded weights) scores the samples with and without the engine's routing."""
    import asyncio

    from _moe_replay_models import tiny_moe

    from rlblocks.rollout import GenerationRequest, SamplingParams, build_batch
    from rlblocks.rollout.engines import TorchEngine
    from rlblocks.rollout.moe_replay import RoutingRecorder, pad_routing

    hf = tiny_moe("mixtral", layers=LAYERS, gate_std=0.1, expert_scale=3.0, sharpen=1.0)
    mg = build(ffn=hf.config.intermediate_size, head_dim=hf.config.head_dim,
               rope_base=int(hf.config.rope_parameters["rope_theta"]), eps=hf.config.rms_norm_eps)
    mixtral_to_megatron(hf, mg)
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        diff = (forward(mg, tokens) - hf(tokens).logits).abs().max()
    assert diff < 1e-4, f"HF Mixtral vs megatron-core logits differ by {diff:.3e}"
    print(f"HF Mixtral -> megatron-core MoE: max |logit diff| {diff:.2e} (fp32)", flush=True)

    engine_model = copy.deepcopy(hf).to(torch.bfloat16)
    mixtral_to_megatron(copy.deepcopy(engine_model).float(), mg)  # the trainer holds the same rounded weights
    engine = TorchEngine(engine_model)
    recorder = RoutingRecorder(engine_model)
    gens, records = [], []

    async def run():
        g = torch.Generator().manual_seed(7)
        for i in range(8):
            prompt = torch.randint(4, VOCAB, (6,), generator=g).tolist()
            with recorder:
                gens.append(await engine.generate(GenerationRequest(f"r{i}", prompt,
                                                                    SamplingParams(max_new_tokens=24, seed=i))))
            records.append(recorder.take())

    asyncio.run(run())
    batch = build_batch(gens, pad_id=0)
    tokens = batch.input_ids
    assert tokens.shape == (8, 30) and bool(batch.response_mask.all()), "expected 8 rows of 6 + 24 tokens"
    routed = pad_routing(records, seq_len=30)[:, :29]  # the last token is never fed: score positions 0..28
    engine_logp = torch.zeros(8, 29)
    engine_logp[:, 5:] = batch.rollout_logp  # position j predicts token j + 1; the responses start at 6
    response_part = torch.zeros(8, 29, dtype=torch.bool)
    response_part[:, 5:] = True
    out = _mismatch(mg, lambda: (forward(mg, tokens[:, :-1]), tokens), engine_logp, routed, response_part)
    _report("HF Mixtral bf16 engine -> megatron fp32 trainer", out)


def main() -> None:
    torch.set_num_threads(1)
    setup()
    tasks = {"exact": task_exact, "errors": task_errors, "perturbation": task_perturbation,
             "hf_engine_megatron_trainer": task_hf_engine_megatron_trainer}
    try:
        for name in sys.argv[1:] or list(tasks):
            tasks[name]()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
