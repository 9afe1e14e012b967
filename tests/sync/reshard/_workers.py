"""Worker processes for the resharding tests: ``python _workers.py <task> <rank> <world_size> <port>``.

Each task raises (non-zero exit, traceback on stdout) on any mismatch; the launcher in conftest.py turns that into a
test failure.
"""

from __future__ import annotations

import os
import sys
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

ATOL = 1e-5


def tiny_configs():
    """(name, HF config, padded vocab) cases: Llama with GQA 4:2 untied; Qwen2 (q/k/v biases), tied, padded vocab."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
    llama = LlamaConfig(vocab_size=96, head_dim=16, tie_word_embeddings=False, **common)
    qwen2 = Qwen2Config(vocab_size=101, tie_word_embeddings=True, **common)
    return [("llama", llama, 96), ("qwen2", qwen2, 104)]


def build_hf(cfg, seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    if cfg.model_type == "qwen2":  # HF initialises biases to zero; make them count
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
    return model


def build_megatron(cfg, padded_vocab: int, tp: int, seed: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from rlblocks.sync.reshard.megatron import gpt_dims

    dims = gpt_dims(cfg)
    tcfg = TransformerConfig(
        num_layers=dims.num_layers, hidden_size=dims.hidden_size, num_attention_heads=dims.num_heads,
        num_query_groups=dims.num_kv_heads, kv_channels=dims.head_dim, ffn_hidden_size=dims.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=dims.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, use_cpu_initialization=True, params_dtype=torch.float32,
        tensor_model_parallel_size=tp,
    )
    torch.manual_seed(seed)
    model = GPTModel(
        tcfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=padded_vocab,
        max_sequence_length=cfg.max_position_embeddings, position_embedding_type="rope",
        rotary_base=int(cfg.rope_parameters["rope_theta"]), share_embeddings_and_output_weights=dims.tie_embeddings,
        parallel_output=False,
    ).eval()
    return model


def megatron_logits(model, tokens):
    from conftest import causal_mask

    pos = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    with torch.no_grad():
        return model(tokens, pos, causal_mask(tokens.shape[1]))


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


def check_close(what, got, want):
    diff = (got - want).abs().max().item()
    if not diff <= ATOL:
        raise AssertionError(f"{what}: max |logit diff| {diff:.3e} > {ATOL}")
    print(f"{what}: max |logit diff| {diff:.3e}", flush=True)


def task_megatron(rank: int, world: int) -> None:
    """HF -> megatron and megatron -> HF, logits compared with megatron-core GPTModel, TP=2 then TP=1."""
    from conftest import apply_megatron_cpu_patches

    apply_megatron_cpu_patches()
    from megatron.core import parallel_state as ps

    from rlblocks.sync.reshard.megatron import hf_to_megatron, megatron_to_hf, megatron_to_hf_streaming

    tokens = torch.randint(0, 90, (2, 12), generator=torch.Generator().manual_seed(7))
    for tp in (2, 1):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        tp_rank, tp_group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
        for case, cfg, padded in tiny_configs():
            tag = f"{case} tp={tp} rank={rank}"
            vocab = cfg.vocab_size
            # Direction 1: HF weights -> megatron model, compared with the HF model.
            hf = build_hf(cfg, seed=1)
            mg = build_megatron(cfg, padded, tp, seed=2)
            shard = dict(hf_to_megatron(hf.state_dict().items(), cfg, tp_size=tp, tp_rank=tp_rank,
                                        padded_vocab_size=padded))
            res = mg.load_state_dict(shard, strict=False)
            bad_missing = [k for k in res.missing_keys if not k.endswith("._extra_state")]
            if bad_missing or res.unexpected_keys:
                raise AssertionError(f"{tag}: missing {bad_missing}, unexpected {res.unexpected_keys}")
            mg_out = megatron_logits(mg, tokens)
            check_close(f"{tag} hf->megatron", mg_out[..., :vocab], hf_logits(hf, tokens))
            if padded > vocab and not torch.all(mg_out[..., vocab:] == 0):
                raise AssertionError(f"{tag}: padded vocab logits are not zero")

            # Direction 2: a randomly initialised megatron model -> HF model, compared with megatron.
            mg = build_megatron(cfg, padded, tp, seed=3)
            local = mg.state_dict()
            per_rank = [None] * tp
            dist.all_gather_object(per_rank, {k: v for k, v in local.items() if isinstance(v, torch.Tensor)},
                                   group=tp_group)
            full = list(megatron_to_hf(per_rank, cfg))
            streamed = list(megatron_to_hf_streaming(local.items(), cfg, tp_group=tp_group))
            if [n for n, _ in full] != [n for n, _ in streamed]:
                raise AssertionError(f"{tag}: streaming names differ from per_rank names")
            for (n, a), (_, b) in zip(full, streamed):
                if a.dtype != b.dtype or not torch.equal(a, b):
                    raise AssertionError(f"{tag}: streaming tensor {n} differs from per_rank")
            hf2 = build_hf(cfg, seed=4)
            res = hf2.load_state_dict(dict(full), strict=False)
            allowed_missing = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
            if set(res.missing_keys) - allowed_missing or res.unexpected_keys:
                raise AssertionError(f"{tag}: HF missing {res.missing_keys}, unexpected {res.unexpected_keys}")
            if cfg.tie_word_embeddings and hf2.lm_head.weight.data_ptr() != hf2.model.embed_tokens.weight.data_ptr():
                raise AssertionError(f"{tag}: HF model lost its tied embedding")
            check_close(f"{tag} megatron->hf", hf_logits(hf2, tokens), megatron_logits(mg, tokens)[..., :vocab])

            # And back: the HF tensors give this rank's megatron shard again, bit for bit (padding rows aside).
            back = dict(hf_to_megatron(full, cfg, tp_size=tp, tp_rank=tp_rank, padded_vocab_size=padded))
            want = {k: v for k, v in local.items() if isinstance(v, torch.Tensor)}
            if set(back) != set(want):
                raise AssertionError(f"{tag}: round-trip names differ: {sorted(set(back) ^ set(want))}")
            for k, v in want.items():
                if "word_embeddings" in k or "output_layer" in k:
                    rows = max(0, min(v.shape[0], vocab - tp_rank * v.shape[0]))
                    v, b = v[:rows], back[k][:rows]
                else:
                    b = back[k]
                if not torch.equal(v, b):
                    raise AssertionError(f"{tag}: round trip changed {k}")
        if tp == 2:  # ranks that stream different names get a ValueError on both sides, not a hang
            name = "decoder.final_layernorm.weight" if rank == 0 else "decoder.layers.0.input_layernorm.weight"
            try:
                list(megatron_to_hf_streaming([(name, torch.ones(64))], cfg, tp_group=tp_group))
            except ValueError as e:
                assert "different name or shape" in str(e), e
            else:
                raise AssertionError("mismatched streaming names were not refused")
            short = [] if rank == 0 else [("decoder.final_layernorm.weight", torch.ones(64))]
            try:
                list(megatron_to_hf_streaming(short, cfg, tp_group=tp_group))
            except ValueError as e:
                assert "end of" in str(e), e
            else:
                raise AssertionError("streams of different lengths were not refused")
        ps.destroy_model_parallel()


def task_fsdp(rank: int, world: int) -> None:
    """full_tensors of a fully_shard-ed tiny HF Llama equals its unsharded state dict, and streams lazily."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlblocks.sync import full_tensors

    # Odd vocab (67) and FFN (99) sizes: uneven Shard(0) over 2 ranks exercises FSDP2's padding.
    cfg = LlamaConfig(vocab_size=67, hidden_size=64, intermediate_size=99, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    if len(sharded) != len(reference):
        raise AssertionError(f"expected every parameter to be a DTensor, got {len(sharded)} of {len(reference)}")
    local_numel = sum(p.to_local().numel() for p in model.parameters())
    if not local_numel < sum(v.numel() for v in reference.values()):
        raise AssertionError("fully_shard did not shard the parameters")

    got = dict(full_tensors(model, buffers=True))
    if list(got) != list(reference):
        raise AssertionError(f"names differ: {sorted(set(got) ^ set(reference))}")
    for k, v in reference.items():
        if got[k].dtype != v.dtype or not torch.equal(got[k], v) or isinstance(got[k], DTensor):
            raise AssertionError(f"full_tensors[{k!r}] differs from the unsharded state dict")
        if got[k].requires_grad:
            raise AssertionError(f"full_tensors[{k!r}] requires grad")
    del got

    for k, v in full_tensors(model, dtype=torch.bfloat16, cpu_offload=True):
        if v.dtype != torch.bfloat16 or v.device.type != "cpu" or not torch.equal(v, reference[k].to(torch.bfloat16)):
            raise AssertionError(f"full_tensors(dtype=bf16)[{k!r}] is not the bf16 cast of the reference")

    # Laziness: one gather per yielded item, and the generator holds no reference to what it yielded before.
    calls = []
    original = DTensor.full_tensor

    def counting(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls.append(weakref.ref(out))
        return out

    DTensor.full_tensor = counting
    try:
        gen = full_tensors(model)
        for i, (_name, t) in enumerate(gen):
            if len(calls) != i + 1:
                raise AssertionError(f"after {i + 1} items, full_tensor ran {len(calls)} times: not lazy")
            alive = [j for j, ref in enumerate(calls[:-1]) if ref() is not None]
            if alive:
                raise AssertionError(f"item {i}: earlier full tensors {alive} are still alive")
            del t
    finally:
        DTensor.full_tensor = original
    print(f"rank {rank}: {len(reference)} tensors streamed, bit-exact", flush=True)


def main() -> None:
    task, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        {"megatron": task_megatron, "fsdp": task_fsdp}[task](rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
