"""``full_tensors`` without a process group: plain tensors, wrapper names, buffers, tied weights, casts, errors.

The sharded (FSDP2, 2-process gloo) case is in test_multiprocess.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from rlblocks.sync.reshard.fsdp import clean_name, full_tensors


class Tiny(nn.Module):
    def __init__(self, tied: bool = False):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        self.head = nn.Linear(4, 10, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.arange(3))
        self.register_buffer("scratch", torch.ones(2), persistent=False)


class CompiledLike(nn.Module):
    """Holds the model as ``_orig_mod``, the attribute ``torch.compile``'s OptimizedModule uses (importing dynamo
    costs ~10 s, so it is imitated here)."""

    def __init__(self, mod: nn.Module):
        super().__init__()
        self._orig_mod = mod


def test_plain_tensors_pass_through_without_copy():
    torch.manual_seed(0)
    model = Tiny()
    got = dict(full_tensors(model))
    assert list(got) == [n for n, _ in model.named_parameters()]
    for name, p in model.named_parameters():
        assert got[name].data_ptr() == p.data_ptr() and not got[name].requires_grad


def test_buffers_are_the_persistent_ones_and_match_state_dict():
    torch.manual_seed(0)
    model = Tiny()
    got = dict(full_tensors(model, buffers=True))
    sd = model.state_dict()
    assert set(got) == set(sd)  # "scratch" is not persistent, so it is left out like in state_dict()
    for k, v in sd.items():
        assert torch.equal(got[k], v)


def test_tied_weights_once_or_under_every_name():
    model = Tiny(tied=True)
    assert "head.weight" not in dict(full_tensors(model))
    every = dict(full_tensors(model, remove_duplicate=False))
    assert every["head.weight"].data_ptr() == every["embed.weight"].data_ptr()
    assert set(every) == {k for k in model.state_dict() if k != "steps"}


def test_wrapper_prefixes_are_removed():
    torch.manual_seed(0)
    inner = Tiny()
    inner.block = checkpoint_wrapper(inner.block)
    compiled = CompiledLike(inner)
    want = {k: v for k, v in Tiny().state_dict().items() if k != "steps"}
    got = dict(full_tensors(compiled))
    assert set(got) == set(want)
    assert clean_name("_orig_mod.model._fsdp_wrapped_module.layers.0._checkpoint_wrapped_module.mlp.w") == (
        "model.layers.0.mlp.w"
    )


def test_dtype_cast_and_cpu_offload_keep_integer_buffers():
    torch.manual_seed(0)
    model = Tiny()
    got = dict(full_tensors(model, buffers=True, dtype=torch.bfloat16, cpu_offload=True))
    assert got["steps"].dtype == torch.int64
    assert torch.equal(got["embed.weight"], model.embed.weight.detach().to(torch.bfloat16))


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"model: expected a torch\.nn\.Module"):
        list(full_tensors({"w": torch.zeros(1)}))
    with pytest.raises(ValueError, match="dtype"):
        list(full_tensors(Tiny(), dtype="bf16"))
