"""The delayed-reuse task: demonstrated utility beats accumulated attention (a test that can fail)."""

from __future__ import annotations

import torch

from kvcert.evict import H2O, RMM, delayed_reuse_trace, gap_closed, replay, served_mass_ceiling


def test_task_is_deterministic_and_valid():
    a, b = delayed_reuse_trace(steps=64, seed=3), delayed_reuse_trace(steps=64, seed=3)
    assert torch.equal(a.attn, b.attn) and torch.equal(a.kappa["realised"], b.kappa["realised"])
    assert not torch.equal(a.attn, delayed_reuse_trace(steps=64, seed=4).attn)


def test_rmm_beats_h2o_on_delayed_reuse():
    trace = delayed_reuse_trace(steps=256, heads=1, seed=0)
    budget, lag = 16, 8
    ceiling = float(served_mass_ceiling(trace.attn, trace.kappa_of("realised"), budget).sum())
    h2o = replay(H2O(recent=lag), trace, budget).total_served
    rmm = replay(RMM(lag=lag), trace, budget).total_served
    assert rmm - h2o >= 3.0
    assert gap_closed(rmm, h2o, ceiling) >= 0.2


def test_lag_shorter_than_the_prime_delay_loses_the_facts():
    """With H = 0 the new item is evictable before its prime is observed: RMM(0) << RMM(prime delay)."""
    trace = delayed_reuse_trace(steps=256, heads=1, seed=0)
    short = replay(RMM(lag=0), trace, 16).total_served
    long = replay(RMM(lag=6), trace, 16).total_served
    assert long - short >= 50.0
