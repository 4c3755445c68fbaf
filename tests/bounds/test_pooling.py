"""Pooling contract coefficients and concentration profile against brute force."""

from __future__ import annotations

import math

import pytest
import torch

from kvcert.bounds.pooling import pool_weights, pooled, pooling_profile


@pytest.mark.parametrize("block", [1, 4, 16])
def test_weights_and_coefficients_vs_brute_force(block):
    g = torch.Generator().manual_seed(block)
    gs = 3 * torch.randn(4 * block, 5, generator=g, dtype=torch.float64)
    w = pool_weights(gs, block)
    assert w.shape == (4, 5, block)
    prof = pooling_profile(w)
    for n in range(4):
        for d in range(5):
            col = gs[n * block : (n + 1) * block, d]
            e = [math.exp(float(v)) for v in col]
            ws = [v / sum(e) for v in e]
            assert w[n, d].tolist() == pytest.approx(ws, rel=1e-12)
            assert float(prof.a_l2[n, d]) == pytest.approx(math.sqrt(sum(v * v for v in ws)), rel=1e-12)
            h = -sum(v * math.log(v) for v in ws if v > 0)
            assert float(prof.eff_frac[n, d]) == pytest.approx(math.exp(h) / block, rel=1e-9)
            if block > 1:
                assert float(prof.top1_norm[n, d]) == pytest.approx((max(ws) - 1 / block) / (1 - 1 / block))
                assert float(prof.entropy_n[n, d]) == pytest.approx(h / math.log(block), rel=1e-9)
    assert (prof.a_l2 >= 1 / math.sqrt(block) - 1e-12).all() and (prof.a_l2 <= 1 + 1e-12).all()
    assert (prof.a_linf == 1).all() and prof.floor_violations == 0


@pytest.mark.parametrize("seed", range(3))
def test_both_contract_forms_hold_per_block(seed):
    g = torch.Generator().manual_seed(seed)
    block, d = 8, 6
    w = pool_weights(torch.randn(5 * block, 1, generator=g, dtype=torch.float64), block)[:, 0]  # [5, B]
    x = torch.randn(5, block, d, generator=g, dtype=torch.float64)
    delta = 0.1 * torch.randn(5, block, d, generator=g, dtype=torch.float64)
    dc = (pooled(x + delta, w) - pooled(x, w)).norm(dim=-1)
    tok = delta.norm(dim=-1)
    prof = pooling_profile(w)
    assert (dc <= prof.a_l2 * tok.square().sum(-1).sqrt() + 1e-12).all()
    assert (dc <= prof.a_linf * tok.max(-1).values + 1e-12).all()


def test_extremes_uniform_and_one_hot():
    u = pooling_profile(torch.full((1, 4), 0.25, dtype=torch.float64))
    assert float(u.a_l2) == pytest.approx(0.5) and float(u.top1_norm) == pytest.approx(0.0)
    assert float(u.entropy_n) == pytest.approx(1.0) and float(u.eff_frac) == pytest.approx(1.0)
    o = pooling_profile(torch.tensor([[0.0, 1.0, 0.0, 0.0]], dtype=torch.float64))
    assert float(o.a_l2) == pytest.approx(1.0) and float(o.top1_norm) == pytest.approx(1.0)
    assert float(o.entropy_n) == pytest.approx(0.0, abs=1e-12)
    # l-inf form is tight for a one-hot block
    x = torch.zeros(1, 4, 3, dtype=torch.float64)
    delta = torch.randn(1, 4, 3, dtype=torch.float64)
    w = torch.tensor([[0.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    assert float((pooled(x + delta, w) - pooled(x, w)).norm()) == pytest.approx(float(delta[0, 1].norm()))


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="block"):
        pool_weights(torch.randn(10, 2), 4)
    with pytest.raises(ValueError, match="sum to 1"):
        pooling_profile(torch.full((2, 4), 0.3))
    with pytest.raises(ValueError, match="non-negative"):
        pooling_profile(torch.tensor([[1.5, -0.5]]))
    with pytest.raises(ValueError, match="non-finite"):
        pool_weights(torch.tensor([[float("inf")]]), 1)
