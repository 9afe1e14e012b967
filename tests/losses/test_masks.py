"""OPSM, top-entropy mask, overlong penalty, zero-variance groups."""

import pytest
import torch

from rlblocks.losses import off_policy_sequence_mask, overlong_penalty, top_entropy_mask, zero_variance_groups


def test_opsm_reference():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    old = torch.zeros(4, 4, dtype=torch.float64)
    # per-sequence mean(old - logp): row0 0.5 (drifted), row1 0.05, row2 0.5, row3 empty
    logp = torch.tensor([[-0.5, -0.5, -0.5, 9], [-0.05] * 4, [-1.0, 0.0, 5, 5], [0] * 4], dtype=torch.float64)
    adv = torch.tensor([-1.0, -1.0, 1.0, -1.0])
    keep, metrics = off_policy_sequence_mask(torch.where(mask, logp, torch.nan), old, mask, advantages=adv, delta=0.1)
    want = mask.clone()
    want[0] = False  # A<0 and drifted
    assert keep.tolist() == want.tolist()  # row1: not drifted; row2: A>0
    # 9 valid tokens, 3 dropped; 3 non-empty sequences, 1 with a dropped token
    assert metrics["masked_frac"].item() == 3 / 9 and metrics["seq_masked_frac"].item() == 1 / 3
    tok_adv = torch.tensor([[1.0, -1.0, 1.0, 1.0]] * 4)
    keep_tok, metrics_tok = off_policy_sequence_mask(logp, old, mask, advantages=tok_adv, delta=0.1)
    want_tok = mask.clone()
    want_tok[0, 1] = want_tok[2, 1] = False  # per-token sign of A, sequence-level drift
    assert keep_tok.tolist() == want_tok.tolist()
    assert metrics_tok["masked_frac"].item() == 2 / 9 and metrics_tok["seq_masked_frac"].item() == 2 / 3


@pytest.mark.parametrize("q", [0.0, 0.25, 0.8, 0.9, 1.0])
def test_top_entropy_mask_matches_torch_quantile(q):
    g = torch.Generator().manual_seed(0)
    ent = torch.rand(4, 9, generator=g)
    mask = torch.rand(4, 9, generator=g) > 0.3
    thr = torch.quantile(ent[mask], q)
    want = mask & (ent >= thr)
    got = top_entropy_mask(torch.where(mask, ent, torch.nan), mask, quantile=q)
    assert got.tolist() == want.tolist()
    assert not top_entropy_mask(ent, torch.zeros_like(mask), quantile=q).any()


def test_overlong_penalty_dapo():
    lengths = torch.tensor([10, 12, 13, 15, 16, 30])
    got = overlong_penalty(lengths, max_len=16, buffer=4, penalty=1.0)
    # 0 up to 12; linear -(L-12)/4 inside the buffer; -1 at and beyond 16
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.75, -1.0, -1.0]))
    torch.testing.assert_close(overlong_penalty(lengths, max_len=16, buffer=4, penalty=0.5), got * 0.5)


def test_zero_variance_groups():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.5, 2.0])
    ids = torch.tensor([3, 3, 8, 8, -1, -1, -1, 100])
    assert zero_variance_groups(r, ids).tolist() == [True, True, False, False, True, True, True, True]
