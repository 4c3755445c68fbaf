"""TV(full, kept-renormalised) equals the evicted mass, per cell; tiers are labelled."""

from __future__ import annotations

import pytest
import torch

from kvcert.contracts.tiers import Tier
from kvcert.evict import evicted_mass, selection_tv, served_attention, serving_reading, validate_reading


@pytest.mark.parametrize("scale", [0.1, 3.0, 12.0])
def test_tv_equals_evicted_mass_per_cell(scale):
    g = torch.Generator().manual_seed(int(scale * 10))
    attn = torch.softmax(scale * torch.randn(64, 4, 200, generator=g, dtype=torch.float64), -1)
    keep = torch.rand(64, 4, 200, generator=g) < torch.rand(64, 4, 1, generator=g)
    keep[..., 0] = True
    tv, mass = selection_tv(attn, keep), evicted_mass(attn, keep)
    assert tv.shape == (64, 4)
    assert ((tv - mass).abs() <= 1e-12).all()
    served = served_attention(attn, keep)
    assert torch.allclose(served.sum(-1), torch.ones(64, 4, dtype=torch.float64), atol=1e-12, rtol=0)
    assert (served[~keep] == 0).all()


def test_identity_would_catch_a_wrong_renormalisation():
    attn = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    keep = torch.tensor([True, False, True])
    unnormalised = attn * keep
    assert abs(0.5 * float((attn - unnormalised).abs().sum()) - float(evicted_mass(attn, keep))) > 0.1
    assert abs(float(selection_tv(attn, keep)) - 0.3) < 1e-15


def test_reading_tiers_and_errors():
    attn = torch.tensor([[0.6, 0.4]], dtype=torch.float64)
    keep = torch.tensor([[True, False]])
    assert validate_reading(attn, keep).tier is Tier.CERTIFIED
    r = serving_reading(attn, keep)
    assert r.tier is Tier.EMPIRICAL and r.mode == "serving" and float(r.mass[0]) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="keep_mask"):
        evicted_mass(attn, keep.float())
    with pytest.raises(ValueError, match="zero attention mass"):
        served_attention(torch.tensor([[0.0, 1.0]], dtype=torch.float64), keep)
