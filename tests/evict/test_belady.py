"""The clairvoyant ceiling bounds every policy per cell; Belady's scores mean what they say."""

from __future__ import annotations

import pytest
import torch
from evict_traces import POLICY_NAMES, make_policies, random_trace

from kvcert.evict import Belady, replay, served_mass_ceiling


@pytest.mark.parametrize("budget", [4, 9])
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_ceiling_bounds_every_policy_per_cell(name, budget):
    trace = random_trace(steps=36, layers=2, heads=2, seed=7, spiky=4.0)
    ceiling = served_mass_ceiling(trace.attn, trace.kappa_of("realised"), budget)
    res = replay(make_policies(trace)[name], trace, budget)
    assert (res.served_mass <= ceiling + 1e-12).all()


def test_ceiling_is_attained_by_a_clairvoyant_recall():
    """Tightness: each cell of the ceiling equals κ · (diag + top-C earlier mass), by brute force."""
    trace = random_trace(steps=10, layers=1, heads=1, seed=2)
    k = trace.kappa_of("realised")
    ceiling = served_mass_ceiling(trace.attn, k, 3)
    for s in range(10):
        row = trace.attn[s, 0, 0]
        best = row[s] + row[:s].sort(descending=True).values[:3].sum()
        assert torch.isclose(ceiling[s, 0, 0], k[s] * best, rtol=0, atol=1e-15)


def test_belady_next_use_evicts_farthest():
    # 5 positions; uses (κ·a >= 0.1): item 0 at step 4, item 1 never, item 2 at step 3
    steps = 5
    attn = torch.zeros(steps, 1, 1, steps, dtype=torch.float64)
    for s in range(steps):
        attn[s, 0, 0, s] = 1.0
    attn[3, 0, 0, [2, 3]] = torch.tensor([0.5, 0.5], dtype=torch.float64)
    attn[4, 0, 0, [0, 4]] = torch.tensor([0.5, 0.5], dtype=torch.float64)
    kappa = torch.ones(steps, dtype=torch.float64)
    p = Belady(attn, kappa, threshold=0.1)
    p.observe(0, torch.full((1, 1, 1, 3), 1 / 3, dtype=torch.float64), torch.arange(3)[None])
    assert p.select(0, 2).tolist() == [[[0, 2]]]  # item 1 is never used again
    assert p.select(0, 1).tolist() == [[[2]]]  # item 2 (step 3) is sooner than item 0 (step 4)
    m = Belady(attn, kappa, variant="future_mass")
    m.observe(0, torch.full((1, 1, 1, 3), 1 / 3, dtype=torch.float64), torch.arange(3)[None])
    assert m.select(0, 1).tolist() == [[[0]]]  # tie 0.5 vs 0.5: the lower physical index wins
    assert torch.equal(m._scores(0, m._state(0)), torch.tensor([[[0.5, 0.0, 0.5]]], dtype=torch.float64))
    with pytest.raises(ValueError, match="variant"):
        Belady(attn, kappa, variant="lru")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kappa"):
        Belady(attn, kappa[:3])
