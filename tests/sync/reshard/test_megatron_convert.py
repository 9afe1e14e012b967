"""HF <-> megatron-core layout conversion, in process: round trips, an explicit per-row layout reference, errors."""

from __future__ import annotations

import pytest
import torch

from rlblocks.sync.reshard.megatron import gpt_dims, hf_to_megatron, megatron_to_hf

LLAMA = dict(model_type="llama", vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
             num_attention_heads=8, num_key_value_heads=2, head_dim=4, tie_word_embeddings=False)
QWEN2 = dict(LLAMA, model_type="qwen2", head_dim=None, vocab_size=51, tie_word_embeddings=True)  # head_dim 16/8 = 2
LLAMA_BIASES = dict(LLAMA, attention_bias=True, mlp_bias=True, num_key_value_heads=4)


def random_hf_state(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """A full HF state dict whose shapes are written out here, independently of the library."""
    g = torch.Generator().manual_seed(seed)
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["head_dim"] or h // nq
    attn_bias = cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False)

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    sd = {"model.embed_tokens.weight": rnd(v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd |= {p + "input_layernorm.weight": rnd(h), p + "post_attention_layernorm.weight": rnd(h),
               p + "self_attn.q_proj.weight": rnd(nq * d, h), p + "self_attn.k_proj.weight": rnd(nkv * d, h),
               p + "self_attn.v_proj.weight": rnd(nkv * d, h), p + "self_attn.o_proj.weight": rnd(h, nq * d),
               p + "mlp.gate_proj.weight": rnd(f, h), p + "mlp.up_proj.weight": rnd(f, h),
               p + "mlp.down_proj.weight": rnd(h, f)}
        if attn_bias:
            sd |= {p + "self_attn.q_proj.bias": rnd(nq * d), p + "self_attn.k_proj.bias": rnd(nkv * d),
                   p + "self_attn.v_proj.bias": rnd(nkv * d)}
        if cfg.get("attention_bias", False) and cfg["model_type"] == "llama":
            sd[p + "self_attn.o_proj.bias"] = rnd(h)
        if cfg.get("mlp_bias", False):
            sd |= {p + "mlp.gate_proj.bias": rnd(f), p + "mlp.up_proj.bias": rnd(f), p + "mlp.down_proj.bias": rnd(h)}
    sd["model.norm.weight"] = rnd(h)
    if not cfg["tie_word_embeddings"]:
        sd["lm_head.weight"] = rnd(v, h)
    return sd


def to_megatron(sd, cfg, tp, pp_size=1, pp_rank=0, **kw):
    return [dict(hf_to_megatron(sd.items(), cfg, tp_size=tp, tp_rank=r, pp_size=pp_size, pp_rank=pp_rank, **kw))
            for r in range(tp)]


def assert_same(got: dict, want: dict):
    assert list(got) == list(got)  # names unique by construction of a dict
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.mark.parametrize("cfg", [LLAMA, QWEN2, LLAMA_BIASES], ids=["llama_gqa", "qwen2_bias_tied", "llama_all_bias"])
@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_bit_exact(cfg, tp):
    sd = random_hf_state(cfg)
    padded = cfg["vocab_size"] + (-cfg["vocab_size"]) % (4 * tp)
    per_rank = to_megatron(sd, cfg, tp, padded_vocab_size=padded)
    for shard in per_rank:  # the padded rows are zeros
        rows = shard["embedding.word_embeddings.weight"].shape[0]
        assert rows == padded // tp
    back = dict(megatron_to_hf(per_rank, cfg))
    assert_same(back, sd)


@pytest.mark.parametrize("cfg", [LLAMA, QWEN2], ids=["llama", "qwen2_tied"])
def test_round_trip_pipeline_stages(cfg):
    """3 layers over 2 stages as [1, 2]: stage 1's local layer j is HF layer 1 + j."""
    sd = random_hf_state(cfg, seed=1)
    tp, pp_layers = 2, [1, 2]
    back = {}
    for stage in (0, 1):
        per_rank = to_megatron(sd, cfg, tp, pp_size=2, pp_rank=stage, pp_layers=pp_layers, padded_vocab_size=52)
        names = set(per_rank[0])
        assert ("embedding.word_embeddings.weight" in names) == (stage == 0)
        assert ("decoder.final_layernorm.weight" in names) == (stage == 1)
        assert "output_layer.weight" in names if stage == 1 else "output_layer.weight" not in names
        assert {n.split(".")[2] for n in names if n.startswith("decoder.layers.")} == {"0", "1"} if stage else {"0"}
        if stage == 1:
            assert torch.equal(per_rank[1]["decoder.layers.0.input_layernorm.weight"],
                               sd["model.layers.1.input_layernorm.weight"])
        stage_out = list(megatron_to_hf(per_rank, cfg, pp_size=2, pp_rank=stage, pp_layers=pp_layers))
        assert not set(dict(stage_out)) & set(back)
        back |= dict(stage_out)
    if cfg["tie_word_embeddings"]:
        # The last stage's copy of the tied embedding comes back as lm_head.weight.
        assert torch.equal(back.pop("lm_head.weight"), sd["model.embed_tokens.weight"])
    assert_same(back, sd)


def test_layout_against_explicit_rows():
    """Per-rank megatron tensors equal a row-by-row construction of the documented layout (TP=2, GQA 4:1)."""
    cfg, tp = LLAMA, 2
    sd = random_hf_state(cfg, seed=2)
    nq, nkv, d, f, v = 8, 2, 4, 24, 50
    qpg = nq // nkv
    padded = 52
    per_rank = to_megatron(sd, cfg, tp, padded_vocab_size=padded)
    q, k, vv = (sd[f"model.layers.1.self_attn.{x}_proj.weight"] for x in "qkv")
    for r, shard in enumerate(per_rank):
        rows = []
        for grp in range(r * nkv // tp, (r + 1) * nkv // tp):
            for head in range(grp * qpg, (grp + 1) * qpg):
                rows += [q[head * d + i] for i in range(d)]
            rows += [k[grp * d + i] for i in range(d)]
            rows += [vv[grp * d + i] for i in range(d)]
        assert torch.equal(shard["decoder.layers.1.self_attention.linear_qkv.weight"], torch.stack(rows))
        gate, up = sd["model.layers.1.mlp.gate_proj.weight"], sd["model.layers.1.mlp.up_proj.weight"]
        per = f // tp
        fc1 = torch.stack([gate[r * per + i] for i in range(per)] + [up[r * per + i] for i in range(per)])
        assert torch.equal(shard["decoder.layers.1.mlp.linear_fc1.weight"], fc1)
        o = sd["model.layers.1.self_attn.o_proj.weight"]
        cols = nq * d // tp
        assert torch.equal(shard["decoder.layers.1.self_attention.linear_proj.weight"], o[:, r * cols:(r + 1) * cols])
        down = sd["model.layers.1.mlp.down_proj.weight"]
        assert torch.equal(shard["decoder.layers.1.mlp.linear_fc2.weight"], down[:, r * per:(r + 1) * per])
        emb = torch.cat([sd["model.embed_tokens.weight"], torch.zeros(padded - v, 16)])
        assert torch.equal(shard["embedding.word_embeddings.weight"], emb[r * 26:(r + 1) * 26])
        head = torch.cat([sd["lm_head.weight"], torch.zeros(padded - v, 16)])
        assert torch.equal(shard["output_layer.weight"], head[r * 26:(r + 1) * 26])


def test_te_spec_names_and_extra_state():
    cfg = LLAMA
    sd = random_hf_state(cfg, seed=3)
    per_rank = to_megatron(sd, cfg, 2, spec="te")
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in per_rank[0]
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in per_rank[0]
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in per_rank[0])
    for shard in per_rank:  # megatron state dicts carry _extra_state entries: skipped
        shard["decoder.layers.0.mlp.linear_fc1._extra_state"] = None
    assert_same(dict(megatron_to_hf(per_rank, cfg)), sd)


def test_transformers_config_object():
    transformers = pytest.importorskip("transformers")
    obj = transformers.Qwen2Config(**{k: v for k, v in QWEN2.items() if k not in ("model_type", "head_dim")})
    assert gpt_dims(obj) == gpt_dims(QWEN2)
    sd = random_hf_state(QWEN2, seed=4)
    assert_same(dict(megatron_to_hf(to_megatron(sd, obj, 2, padded_vocab_size=52), obj)), sd)


def test_streams_one_layer_at_a_time():
    """Layer-ordered input: a layer's output is yielded before the next layer's first input is read."""
    sd = random_hf_state(LLAMA, seed=5)
    read = []

    def source():
        for k, v in sd.items():
            read.append(k)
            yield k, v

    for name, _ in hf_to_megatron(source(), LLAMA, tp_size=2, tp_rank=1):
        if name.startswith("decoder.layers.0."):
            assert not any(k.startswith("model.layers.1.") for k in read), name


# ------------------------------------------------------------------------------------------------- errors


def test_hf_to_megatron_errors():
    sd = random_hf_state(LLAMA)

    def run(items, cfg=LLAMA, **kw):
        return list(hf_to_megatron(items, cfg, **kw))

    with pytest.raises(ValueError, match=r"unknown HF tensor name .model\.rotary_emb\.inv_freq."):
        run([*sd.items(), ("model.rotary_emb.inv_freq", torch.zeros(2))])
    with pytest.raises(ValueError, match="unknown HF tensor"):
        run([*sd.items(), ("model.layers.7.input_layernorm.weight", torch.zeros(16))])
    bad = dict(sd, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(9, 16)})
    with pytest.raises(ValueError, match=r"k_proj.weight: expected shape \[8, 16\], got \[9, 16\]"):
        run(bad.items())
    short = {k: v for k, v in sd.items() if k != "model.layers.2.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing 1 tensor.*up_proj"):
        run(short.items())
    # A stage that does not hold layer 2 does not need it.
    run(short.items(), pp_size=3, pp_rank=0)
    with pytest.raises(ValueError, match="duplicate"):
        run([*sd.items(), ("model.norm.weight", sd["model.norm.weight"])])
    with pytest.raises(ValueError, match="padded_vocab_size"):
        run(sd.items(), tp_size=2, padded_vocab_size=51)
    with pytest.raises(ValueError, match="tp_size: num_key_value_heads"):
        run(sd.items(), tp_size=4)
    with pytest.raises(ValueError, match="pp_size: 3 layers"):
        run(sd.items(), pp_size=2)
    with pytest.raises(ValueError, match="pp_layers"):
        run(sd.items(), pp_size=2, pp_layers=[1, 1])
    with pytest.raises(ValueError, match="model_type"):
        run(sd.items(), cfg=dict(LLAMA, model_type="gpt2"))
    with pytest.raises(ValueError, match="spec"):
        run(sd.items(), spec="apex")
    tied = random_hf_state(QWEN2)
    with pytest.raises(ValueError, match="differs"):
        run([*tied.items(), ("lm_head.weight", torch.zeros(51, 16))], cfg=QWEN2)
    # With tied embeddings an identical lm_head is accepted (and not needed).
    run([*tied.items(), ("lm_head.weight", tied["model.embed_tokens.weight"].clone())], cfg=QWEN2)


def test_megatron_to_hf_errors():
    sd = random_hf_state(LLAMA)
    per_rank = to_megatron(sd, LLAMA, 2)

    def run(pr, **kw):
        return list(megatron_to_hf(pr, LLAMA, **kw))

    with pytest.raises(ValueError, match="names differ"):
        run([per_rank[0], {k: v for k, v in per_rank[1].items() if "fc2" not in k}])
    with pytest.raises(ValueError, match="unknown megatron-core tensor name"):
        run([dict(s, **{"decoder.layers.0.mlp.router.weight": torch.zeros(1)}) for s in per_rank])
    with pytest.raises(ValueError, match="missing 1 megatron tensor"):
        run([{k: v for k, v in s.items() if k != "decoder.final_layernorm.weight"} for s in per_rank])
    with pytest.raises(ValueError, match="layer index 3"):
        run([dict(s, **{"decoder.layers.3.input_layernorm.weight": torch.zeros(16)}) for s in per_rank])
    with pytest.raises(ValueError, match="does not belong on this pipeline stage"):
        run(per_rank, pp_size=3, pp_rank=1)
    bad = dict(per_rank[1], **{"decoder.layers.0.input_layernorm.weight": torch.zeros(16)})
    with pytest.raises(ValueError, match=r"per_rank\[1\].*replicated tensor differs"):
        run([per_rank[0], bad])
    bad = dict(per_rank[1], **{"decoder.layers.0.mlp.linear_fc2.weight": torch.zeros(16, 13)})
    with pytest.raises(ValueError, match=r"per_rank\[1\].*linear_fc2.weight.*expected shape \[16, 12\]"):
        run([per_rank[0], bad])
    with pytest.raises(ValueError, match="per_rank: expected a non-empty sequence"):
        run([])
    with pytest.raises(ValueError, match="per_rank: expected a non-empty sequence"):
        run(per_rank[0])
