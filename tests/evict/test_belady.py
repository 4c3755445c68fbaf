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


@pytest.mark.parametrize("variant", ["next_use", "future_mass"])
def test_a_trace_of_the_answer_steps_scores_like_the_whole_trace(variant):
    """Belady over rows ``first..T−1`` only (``first``) gives the whole trace's scores at every step it can
    see (``now >= first − 1``), so the prefill selection of an ``S``-token prompt needs only the answer rows."""
    trace = random_trace(steps=12, layers=2, heads=3, seed=5)
    k = trace.kappa_of("realised")
    whole = Belady(trace.attn, k, variant=variant, threshold=0.05)
    first = 7
    part = Belady(trace.attn[first:], k[first:], variant=variant, threshold=0.05, first=first)
    positions = torch.arange(12).expand(1, 3, 12)
    for now in range(first - 1, 12):
        for layer in range(2):
            got = part._lookup(layer, positions[..., : now + 1], torch.tensor([now]))
            want = whole._lookup(layer, positions[..., : now + 1], torch.tensor([now]))
            assert torch.equal(got, want), (now, layer)
    keys = torch.randn(1, 3, first, 4, dtype=torch.float64)
    for ratio in (0.25, 0.5, 0.75):
        assert torch.equal(part.prefill_keep(0, keys, keys, ratio), whole.prefill_keep(0, keys, keys, ratio))
    with pytest.raises(ValueError, match="outside the recorded trace"):
        part._lookup(0, positions[..., :5], torch.tensor([first - 2]))
    with pytest.raises(ValueError, match="first"):
        Belady(trace.attn[first:], k[first:], first=first + 1)
