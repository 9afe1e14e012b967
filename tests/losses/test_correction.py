"""Rollout mismatch correction and metrics against float64 loop references."""

import math

import pytest
import torch

from rlblocks.losses import mismatch_metrics, rollout_correction

MASK = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)


def logps(seed=0, spread=0.8):
    g = torch.Generator().manual_seed(seed)
    roll = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 3
    train = roll + (torch.rand(3, 5, generator=g, dtype=torch.float64) * 2 - 1) * spread
    return train, roll


def ref_rho(train, roll, m, level):
    out = [[0.0] * 5 for _ in range(3)]
    for i in range(3):
        lr = [train[i][j] - roll[i][j] for j in range(5) if m[i][j]]
        for j in range(5):
            if level == "token":
                x = train[i][j] - roll[i][j]
            elif level == "sequence":
                x = sum(lr)
            else:
                x = sum(lr) / max(len(lr), 1)
            out[i][j] = math.exp(min(max(x, -20), 20))
    return out


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize(
    ("mode", "upper", "lower"),
    [("truncate", 1.2, None), ("truncate", 1.2, 0.9), ("mask", 1.3, 0.7), ("mask", 1.3, None), ("truncate", None, 0)],
)
def test_rollout_correction_matches_reference(level, mode, upper, lower):
    train, roll = logps(1)
    m = MASK.tolist()
    rho = ref_rho(train.tolist(), roll.tolist(), m, level)
    hi = math.inf if upper is None else upper
    w_ref = [[0.0] * 5 for _ in range(3)]
    keep_ref = [[False] * 5 for _ in range(3)]
    for i in range(3):
        for j in range(5):
            if not m[i][j]:
                continue
            r = rho[i][j]
            if mode == "truncate":
                w = min(r, hi)
                if lower is not None:
                    w = max(w, lower)
                w_ref[i][j], keep_ref[i][j] = w, True
            elif (0.0 if lower is None else lower) <= r <= hi:
                w_ref[i][j], keep_ref[i][j] = r, True
    tr = train.clone().requires_grad_(True)
    w, keep, met = rollout_correction(
        torch.where(MASK, tr, torch.nan), roll, MASK, level=level, mode=mode, upper=upper, lower=lower
    )
    torch.testing.assert_close(w, torch.tensor(w_ref, dtype=torch.float64))
    assert keep.tolist() == keep_ref
    assert not w.requires_grad
    assert all(torch.isfinite(v) and v.dim() == 0 for v in met.values())
    kept = [w_ref[i][j] for i in range(3) for j in range(5) if keep_ref[i][j]]
    assert met["weight_mean"].item() == pytest.approx(sum(kept) / max(len(kept), 1))


def test_sequence_level_log_sum_is_clamped():
    roll = torch.zeros(1, 30, dtype=torch.float64)
    train = torch.ones(1, 30, dtype=torch.float64)  # Σ log ρ = 30 -> clamped to 20
    w, _, _ = rollout_correction(train, roll, torch.ones(1, 30, dtype=torch.bool), level="sequence", upper=None)
    torch.testing.assert_close(w, torch.full((1, 30), math.exp(20.0), dtype=torch.float64))


def test_mismatch_metrics_match_reference():
    train, roll = logps(2)
    m = MASK.tolist()
    valid = [(i, j) for i in range(3) for j in range(5) if m[i][j]]
    lg = {ij: roll[ij].item() - train[ij].item() for ij in valid}
    rho = {ij: math.exp(-lg[ij]) for ij in valid}
    n = len(valid)
    e_rho = sum(rho.values()) / n
    e_rho2 = sum(r * r for r in rho.values()) / n
    seqs = [i for i in range(3) if any(m[i])]
    rho_seq = [math.exp(sum(-lg[(i, j)] for j in range(5) if m[i][j])) for i in seqs]
    want = {
        "kl_k1": sum(lg.values()) / n,
        "kl_k3": sum(math.exp(-x) - 1 + x for x in lg.values()) / n,
        "ppl_train": math.exp(-sum(train[ij].item() for ij in valid) / n),
        "ppl_rollout": math.exp(-sum(roll[ij].item() for ij in valid) / n),
        "chi2_token": e_rho2 - 1,
        "chi2_seq": sum(r * r for r in rho_seq) / len(rho_seq) - 1,
        "ess": 1 / (sum((r / e_rho) ** 2 for r in rho.values()) / n),
    }
    pt = [math.exp(train[ij].item()) for ij in valid]
    pr = [math.exp(roll[ij].item()) for ij in valid]
    mt, mr = sum(pt) / n, sum(pr) / n
    cov = sum((a - mt) * (b - mr) for a, b in zip(pt, pr))
    want["prob_corr"] = cov / math.sqrt(sum((a - mt) ** 2 for a in pt) * sum((b - mr) ** 2 for b in pr))
    want["ratio_in_band_frac"] = sum(0.9 <= r <= 1.1 for r in rho.values()) / n
    got = mismatch_metrics(torch.where(MASK, train, torch.inf), torch.where(MASK, roll, torch.nan), MASK)
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].item() == pytest.approx(v, rel=1e-9), k
    assert 0 < got["ess"].item() <= 1


def test_mismatch_metrics_identical_and_empty():
    train, _ = logps(3)
    got = mismatch_metrics(train, train, MASK)
    for k in ("kl_k1", "kl_k3", "chi2_token", "chi2_seq"):
        assert got[k].item() == pytest.approx(0.0, abs=1e-12)
    assert got["ess"].item() == pytest.approx(1.0)
    assert got["ratio_in_band_frac"].item() == 1.0 and got["prob_corr"].item() == pytest.approx(1.0)
    empty = mismatch_metrics(train, train + 1, torch.zeros(3, 5, dtype=torch.bool))
    assert math.isnan(empty.pop("prob_corr").item())  # undefined without two valid tokens
    assert {k: v.item() for k, v in empty.items()} == {
        "kl_k1": 0.0, "kl_k3": 0.0, "ppl_train": 1.0, "ppl_rollout": 1.0, "chi2_token": 0.0, "chi2_seq": 0.0,
        "ess": 1.0, "ratio_in_band_frac": 0.0,
    }
    const = mismatch_metrics(torch.zeros(1, 3), torch.full((1, 3), -1.0), torch.ones(1, 3, dtype=torch.bool))
    assert math.isnan(const["prob_corr"].item())  # both sides constant: no correlation to report


def test_mismatch_metrics_band_and_per_version_breakdown():
    g = torch.Generator().manual_seed(8)
    m = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    roll = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 2
    old = roll + (torch.rand(3, 5, generator=g, dtype=torch.float64) * 2 - 1) * 0.2
    versions = torch.tensor([[7, 7, 6, 6, -1], [5, 5, 8, -1, -1], [7, 6, 5, 4, 7]])
    got = mismatch_metrics(old, roll, m, band=(0.95, 1.05), versions=versions, current_version=7, max_staleness=2)
    valid = [(i, j) for i in range(3) for j in range(5) if m[i, j]]
    rho = {ij: math.exp(old[ij].item() - roll[ij].item()) for ij in valid}
    n = len(valid)
    assert got["ratio_in_band_frac"].item() == pytest.approx(sum(0.95 <= r <= 1.05 for r in rho.values()) / n)
    total = 0.0
    for s in range(3):
        sel = [ij for ij in valid if versions[ij].item() >= 0 and 7 - versions[ij].item() == s]
        assert sel, s
        assert got[f"staleness{s}_token_frac"].item() == pytest.approx(len(sel) / n)
        k3 = sum(r - 1 - math.log(r) for ij, r in rho.items() if ij in sel) / len(sel)
        assert got[f"staleness{s}_kl_k3"].item() == pytest.approx(k3, rel=1e-9)
        band = sum(0.95 <= rho[ij] <= 1.05 for ij in sel) / len(sel)
        assert got[f"staleness{s}_ratio_in_band_frac"].item() == pytest.approx(band)
        total += got[f"staleness{s}_token_frac"].item()
    # version 8 (ahead of the trainer) and version 4 (older than η = 2) are counted, not dropped
    assert got["staleness_other_token_frac"].item() == pytest.approx(2 / n)
    assert total + got["staleness_other_token_frac"].item() == pytest.approx(1.0)
    as_tensor = mismatch_metrics(old, roll, m, band=(0.95, 1.05), versions=versions,
                                 current_version=torch.tensor(7), max_staleness=2)
    for k in got:
        torch.testing.assert_close(as_tensor[k], got[k])


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        ({"versions": torch.zeros(3, 5)}, "^versions: expected an integer"),
        ({"versions": torch.zeros(3, 4, dtype=torch.long), "current_version": 1, "max_staleness": 1}, r"^versions: "),
        ({"versions": torch.zeros(3, 5, dtype=torch.long), "max_staleness": 1}, "^current_version: required"),
        ({"versions": torch.zeros(3, 5, dtype=torch.long), "current_version": 1.5, "max_staleness": 1},
         "^current_version: "),
        ({"versions": torch.zeros(3, 5, dtype=torch.long), "current_version": 1}, "^max_staleness: "),
        ({"versions": torch.zeros(3, 5, dtype=torch.long), "current_version": 1, "max_staleness": torch.tensor(1)},
         "^max_staleness: "),
        ({"band": (1.1, 0.9)}, r"^band\[1\]: "),
        ({"band": 0.9}, "^band: "),
    ],
)
def test_mismatch_metrics_argument_checks(kw, pattern):
    train, roll = logps(9)
    with pytest.raises(ValueError, match=pattern):
        mismatch_metrics(train, roll, MASK, **kw)


def test_bf16_inputs():
    train, roll = logps(4)
    w, _, _ = rollout_correction(train.bfloat16(), roll.bfloat16(), MASK)
    assert w.dtype == torch.float32
    met = mismatch_metrics(train.bfloat16(), roll.bfloat16(), MASK)
    assert all(v.dtype == torch.float32 for v in met.values())
