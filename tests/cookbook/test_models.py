"""``--model smollm2-135m``: the GGUF file converted once into a cached HF directory, checked against the GGUF model,
and the name accepted by every loop's flags (``cookbook/plumbing/models.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from plumbing import parse_flags
from plumbing.models import MARKER, check_conversion, load_gguf, model_dir

from rlblocks.errors import ArgumentError


@pytest.mark.slow
def test_conversion_equals_the_gguf_model(smollm2_dir):
    figures = json.loads((Path(smollm2_dir) / MARKER).read_text())
    assert figures["max_abs_logit_diff"] <= 1e-4 and figures["eos_token_id"] == figures["pad_token_id"] == 2
    tok, ref = load_gguf("smollm2-135m")  # the reference: transformers reading the GGUF file itself
    again = check_conversion(smollm2_dir, reference=(tok, ref))
    assert again["max_abs_logit_diff"] <= 1e-4
    cfg = json.loads((Path(smollm2_dir) / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["tie_word_embeddings"] and cfg["vocab_size"] == 49152
    assert sum(p.numel() for p in ref.parameters()) == 134_515_008
    with torch.no_grad():  # the check is not vacuous: a changed weight is found
        ref.model.layers[3].mlp.down_proj.weight[0, 0] += 0.5
    with pytest.raises(RuntimeError, match="logits differ"):
        check_conversion(smollm2_dir, reference=(tok, ref))


def test_every_loop_takes_the_name(smollm2_dir):
    import agent_async
    import agent_gateway
    import grpo_async
    import grpo_sync
    import ppo

    for mod in (grpo_sync, grpo_async, ppo, agent_async, agent_gateway):
        cfg = parse_flags(mod.Config, ["--model", "smollm2-135m"])
        assert cfg.model == smollm2_dir, mod.__name__
    assert parse_flags(ppo.Config, ["--model", "smollm2-135m", "--critic-model", "smollm2-135m"]).critic_model \
        == smollm2_dir
    assert parse_flags(grpo_sync.Config, ["--distill-from", "smollm2-135m"]).distill_from == smollm2_dir
    assert parse_flags(grpo_sync.Config, ["--model", "/some/dir"]).model == "/some/dir"  # a path stays a path


def test_a_directory_that_is_not_a_checked_conversion_is_never_overwritten(tmp_path):
    (tmp_path / "smollm2-135m").mkdir()
    (tmp_path / "smollm2-135m" / "config.json").write_text("{}")
    with pytest.raises(ArgumentError, match=MARKER):
        model_dir("smollm2-135m", root=tmp_path)
    assert (tmp_path / "smollm2-135m" / "config.json").read_text() == "{}"
    with pytest.raises(ArgumentError, match="smollm2-135m"):
        model_dir("no-such-model", root=tmp_path)
