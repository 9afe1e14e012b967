"""The shared weight-update rule (rlblocks.rollout.engines._weights) on its own: finite-value check (fast path and its
overflow fallback), layouts of tied modules, and the message shape every engine uses."""

import math

import pytest
import torch

from rlblocks.errors import ArgumentError, WeightUpdateError
from rlblocks.rollout.engines._weights import WeightLayout, check_tensors, check_update_version


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_every_non_finite_value_is_refused(dtype, bad):
    t = torch.zeros(1000, dtype=dtype)
    t[637] = bad
    with pytest.raises(WeightUpdateError, match=r"'w': 1 of 1000 values are not finite"):
        check_tensors([("w", t)], engine="E")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_weights_are_checked_too(dtype):
    # torch has no isfinite for float8: the slow path reads the values as float32
    t = torch.zeros(1000, dtype=dtype)
    assert check_tensors([("w", t)], engine="E")[0][0] == "w"
    t[637] = math.nan
    with pytest.raises(WeightUpdateError, match=r"'w': 1 of 1000 values are not finite"):
        check_tensors([("w", t)], engine="E")


def test_finite_values_whose_sum_overflows_are_accepted():
    t = torch.full((64,), torch.finfo(torch.float32).max)
    assert not torch.isfinite(t.sum())  # the fast path's sum overflows: the exact check decides
    assert check_tensors([("w", t)], engine="E")[0][0] == "w"
    h = torch.full((64,), torch.finfo(torch.float16).max, dtype=torch.float16)
    assert not torch.isfinite(h.sum())  # in fp16 it would overflow; the fast path accumulates in fp32
    assert check_tensors([("h", h)], engine="E")[0][0] == "h"


def test_layout_of_a_tied_module_and_buffers():
    emb = torch.nn.Embedding(5, 3)
    head = torch.nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    model.register_buffer("scale", torch.ones(2))
    model.register_buffer("freq", torch.ones(4), persistent=False)
    layout = WeightLayout.from_module(model)
    assert layout.aliases == {"head.weight": "emb.weight"} and layout.required == ["emb.weight"]
    assert "freq" in layout.specs and "freq" not in WeightLayout.from_module(model, non_persistent_buffers=False).specs
    w = torch.randn(5, 3)
    assert layout.validate([("head.weight", w)], engine="E") == [("emb.weight", w)]  # an alias covers the tensor
    with pytest.raises(WeightUpdateError, match=r"^E.update_weights refused: .*nothing was loaded \(weights and"):
        layout.validate([("scale", torch.ones(2))], engine="E")  # a buffer alone is partial


def test_version_rule():
    assert check_update_version("E", 3, 3, allow_rollback=False) == 3  # equal: a re-load
    with pytest.raises(WeightUpdateError, match="older"):
        check_update_version("E", 2, 3, allow_rollback=False)
    assert check_update_version("E", 2, 3, allow_rollback=True) == 2
    for bad in (True, 2.0, "2", None):
        with pytest.raises(ArgumentError, match="version"):
            check_update_version("E", bad, 3, allow_rollback=False)
