"""Two gloo processes per test (started by the test): megatron-core logits at TP=1/2 and FSDP2 full tensors.

The work runs in tests/sync/reshard/_workers.py; a failing rank fails the test with its traceback.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


@pytest.mark.slow
def test_megatron_logits_match_hf_both_directions(run_workers):
    """For Llama (GQA, untied) and Qwen2 (q/k/v biases, tied, vocab 101 padded to 104), at TP=2 then TP=1:

    * HF weights -> ``hf_to_megatron`` -> megatron-core ``GPTModel``: logits equal the HF model's (fp32, atol 1e-5);
    * a random ``GPTModel`` -> ``megatron_to_hf`` -> HF model: logits equal megatron's; the streaming variant inside
      the live TP group yields the same names and bit-identical tensors as the per-rank variant; converting back
      gives each rank's shard bit for bit;
    * ranks streaming different names both get a ValueError.
    """
    pytest.importorskip("megatron.core")
    run_workers("megatron", world_size=2)


def test_fsdp2_full_tensors_equal_unsharded_state(run_workers):
    """``full_tensors`` of a ``fully_shard``-ed tiny Llama (uneven shards) equals the unsharded state dict bit for
    bit, casts with ``dtype``, and gathers lazily (one full tensor alive at a time)."""
    run_workers("fsdp", world_size=2)
