"""The LM head of the decoders that :class:`~rlblocks.rollout.engines.TorchEngine` loads itself, computed in
vocabulary slices on a CPU.

A decode step multiplies ``[M, H]`` hidden states (one row per sequence) by the ``[V, H]`` head weight. At a real
vocabulary the weight (V = 49,152 × H = 576 in fp32: 113 MB) is far larger than the caches, and one BLAS call over
all of it ran at about 2/3 of the speed of the same product taken 2048 weight rows at a time, each slice written
into its columns of one output (a 2-core AVX2 CPU, M = 64: 43-47 ms against 31-33 ms per step). Every logit is the
same ``H``-long dot product either way, so the logits are bit-identical (tested); only the order in which the
vocabulary is visited changes.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

SLICE = 2048
"""Head weight rows per product (one fp32 slice of H = 576 is 4.7 MB)."""


def sliced_head_forward(self: nn.Linear, x: Float[Tensor, "*lead H"]) -> Float[Tensor, "*lead V"]:
    """``x @ self.weight.T (+ self.bias)``, the weight taken :data:`SLICE` rows at a time, each product written
    into its columns of one ``[*lead, V]`` output. A head of at most one slice, or a single row of ``x``, is one
    ``F.linear`` call (at one row the product reads the whole weight once either way), and so is a call that
    autograd records (``out=`` products are not differentiable)."""
    weight, bias = self.weight, self.bias
    v = weight.shape[0]
    rows = x.numel() // max(x.shape[-1], 1)
    if v <= SLICE or rows <= 1 or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    out = flat.new_empty(rows, v)
    for s in range(0, v, SLICE):
        part = out[:, s : s + SLICE]
        if bias is None:
            torch.mm(flat, weight[s : s + SLICE].t(), out=part)
        else:
            torch.addmm(bias[s : s + SLICE], flat, weight[s : s + SLICE].t(), out=part)
    return out.view(*x.shape[:-1], v)


def use_sliced_head(model: nn.Module) -> bool:
    """Compute ``model``'s output embedding (an ``nn.Linear`` on a CPU) with :func:`sliced_head_forward`: the
    instance's ``forward`` is replaced, its parameters and ``state_dict`` are not (weight updates and tied
    embeddings see the same tensors). A head on another device, of another type (a LoRA-wrapped one), or already
    switched is left as it is. Returns whether it switched."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if type(head) is not nn.Linear or head.weight.device.type != "cpu" or "forward" in vars(head):
        return False
    head.forward = types.MethodType(sliced_head_forward, head)
    return True
