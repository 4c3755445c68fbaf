"""dither_witness_moments: E W <= m and the bounded-difference constant, checked by Monte Carlo / brute force."""

from __future__ import annotations

import math

import torch

from kvcert.bounds import band_norms
from kvcert.bounds.radii import dither_witness_moments


def test_mean_bound_and_bounded_differences_hold():
    g = torch.Generator().manual_seed(0)
    steps = torch.rand(5, 2, generator=g, dtype=torch.float64) + 0.05  # 5 tokens, D = 64, groups of 32
    m, c = dither_witness_moments(steps, 32, bands=8)
    s_chan = steps.repeat_interleave(32, -1)
    r = (torch.rand(20000, 5, 64, generator=g, dtype=torch.float64) - 0.5) * s_chan
    w = band_norms(r, 8).sum(-1)  # [N, 5]
    assert torch.all(w.mean(0) <= m)  # E W <= m (Jensen)
    assert torch.all(w.mean(0) >= 0.8 * m)  # and not vacuous
    # changing one coordinate moves W by at most s_c: check the extreme swap per channel
    for ch in (0, 17, 40, 63):
        r2 = r[:100].clone()
        r2[..., ch] = -r2[..., ch].sign() * s_chan[..., ch] / 2
        dw = (band_norms(r2, 8).sum(-1) - w[:100]).abs()
        assert torch.all(dw <= s_chan[:, ch] + 1e-12)
    assert torch.allclose(c, s_chan.square().sum(-1))


def test_bypassed_channels_drop_out():
    steps = torch.ones(1, 2, dtype=torch.float64)
    mask = torch.ones(64, dtype=torch.float64)
    mask[:8] = 0
    m, c = dither_witness_moments(steps, 32, channel_mask=mask)
    assert math.isclose(float(c), 56.0)
    m_full, _ = dither_witness_moments(steps, 32)
    assert float(m) < float(m_full)
