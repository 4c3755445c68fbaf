"""``docs/eviction.md#h2o-reduction``: RMM(κ ≡ 1, H = r) keeps bit-for-bit the same sets as H2O(recent = r)."""

from __future__ import annotations

import pytest
import torch
from evict_traces import random_trace

from kvcert.evict import H2O, RMM, replay


@pytest.mark.parametrize(("budget", "recent"), [(6, 0), (6, 2), (10, 4), (17, 8), (12, 9)])
@pytest.mark.parametrize("sinks", [0, 2])
def test_rmm_uniform_equals_h2o_decode(budget, recent, sinks):
    if sinks + recent >= budget:
        pytest.fail("bad parametrisation")
    trace = random_trace(steps=96, layers=2, heads=3, seed=budget + recent)
    h2o = replay(H2O(recent=recent, sinks=sinks), trace, budget)
    rmm = replay(RMM(lag=recent, kappa="uniform", sinks=sinks), trace, budget, kappa="uniform")
    assert torch.equal(h2o.present, rmm.present)
    # ...and κ matters: with the recorded κ the kept sets differ somewhere (the test can fail)
    weighted = replay(RMM(lag=recent, sinks=sinks), trace, budget, kappa="realised")
    assert not torch.equal(h2o.present, weighted.present)


@pytest.mark.parametrize("lag", [0, 3])
def test_rmm_uniform_equals_h2o_prefill(lag):
    g = torch.Generator().manual_seed(lag)
    q, k = torch.randn(2, 4, 30, 8, generator=g), torch.randn(2, 2, 30, 8, generator=g)
    for ratio in (0.3, 0.5, 0.8):
        a = H2O(recent=lag).prefill_keep(0, k, k, ratio, queries=q)
        b = RMM(lag=lag, kappa="uniform").prefill_keep(0, k, k, ratio, queries=q)
        c = RMM(lag=lag).prefill_keep(0, k, k, ratio, queries=q, kappa=torch.ones(2, 30))
        assert torch.equal(a, b) and torch.equal(a, c)
    with pytest.raises(ValueError, match="kappa"):
        RMM(lag=lag).prefill_keep(0, k, k, 0.5, queries=q)


def test_rmm_buffers_rows_until_kappa_and_checks_positions():
    p = RMM(lag=1)
    attn = torch.tensor([[[[0.7, 0.2, 0.1]]]], dtype=torch.float64)
    p.observe(0, attn, torch.arange(3)[None])
    assert torch.equal(p._state(0).scores, torch.zeros(1, 1, 3, dtype=torch.float64))  # κ not yet known
    with pytest.raises(ValueError, match="step_positions"):
        p.set_kappa(torch.tensor([[1]]), torch.tensor([[0.5]]))
    p.set_kappa(torch.tensor([[2]]), torch.tensor([[0.5]], dtype=torch.float64))
    assert torch.equal(p._state(0).scores, 0.5 * attn[:, :, 0])
    with pytest.raises(ValueError, match="step_positions"):
        p.set_kappa(torch.tensor([[2]]), torch.tensor([[0.5]]))  # nothing pending any more
    # item 0 has DU 0.35, item 1 0.1, item 2 pending (age 0 < lag 1): budget 2 evicts item 1
    assert p.select(0, 2).tolist() == [[[0, 2]]]
