"""The cheap decode paths keep exactly what the reference selection keeps.

- the middle-slot fast path (protected set = first ``sinks`` + last ``recent`` slots) vs the generic
  protected-mask path, for every policy and for chunked eviction (``select(..., chunk)``);
- lazily mapped query groups: RMM with κ arriving late equals a brute-force demonstrated-utility count, and
  SnapKV's decode window equals a brute-force sum of the last rows by logical position.
"""

from __future__ import annotations

import math

import pytest
import torch
from evict_traces import POLICY_NAMES, make_policies, random_trace

from kvcert.evict import H2O, RMM, EvictionPolicy, SnapKV, StreamingLLM, keep_top, replay
from kvcert.evict.snapkv import pool_scores

F64 = torch.float64


@pytest.fixture(scope="module")
def trace():
    return random_trace(steps=64, layers=2, heads=3, seed=4, spiky=2.0)


@pytest.mark.parametrize("chunk", [1, 3, 9, 11])
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_fast_path_equals_generic_path(trace, name, chunk, monkeypatch):
    budget = 20
    policy = make_policies(trace)[name]
    fast = replay(policy, trace, budget, chunk=chunk)
    monkeypatch.setattr(EvictionPolicy, "_edges_protected", lambda self, state, lo, hi: False)
    generic = replay(make_policies(trace)[name], trace, budget, chunk=chunk)
    assert torch.equal(fast.present, generic.present)
    # budget holds; a chunked eviction brings the layer down to budget − chunk + 1 (StreamingLLM with a
    # window caps budget and chunk at sinks + window)
    windowed = isinstance(policy, StreamingLLM) and policy.window is not None
    cap = min(budget, policy.sinks + policy.window) if windowed else budget
    sizes = fast.present.sum(-1)  # items seen by each read (held + the new one)
    assert int(sizes.max()) <= cap + 1 and fast.max_items <= cap
    assert int(sizes[budget:].min()) == cap - min(chunk, cap) + 2


@pytest.mark.parametrize("first", [0, 1])
@pytest.mark.parametrize("step", [1, 2])
def test_positions_with_gaps_fall_back_to_the_protected_mask(first, step):
    """Logical positions with gaps (or not starting at 0): the protected items are not the first ``sinks``
    and last ``recent`` slots, so select must take the generic path and protect by position."""
    s, budget = 30, 12
    g = torch.Generator().manual_seed(step + first)
    positions = (first + step * torch.arange(s)).expand(1, 2, s)
    attn = torch.softmax(torch.randn(1, 2, 1, s, generator=g, dtype=F64), -1)
    policy = H2O(recent=5, sinks=3)
    policy.observe(0, attn, positions)
    now = int(positions[0, 0, -1])
    protected = (positions < 3) | (positions > now - 5)
    assert torch.equal(policy.select(0, budget), keep_top(attn[:, :, 0], protected, budget))


@pytest.mark.parametrize("chunk", [0, 21])
def test_chunk_outside_budget_fails(trace, chunk):
    with pytest.raises(ValueError, match="chunk"):
        replay(make_policies(trace)["h2o"], trace, 20, chunk=chunk)


def test_chunk_that_leaves_fewer_than_the_protected_items_fails(trace):
    with pytest.raises(ValueError, match="protected"):
        replay(RMM(lag=6), trace, 10, chunk=6)  # keeps 10 − 6 + 1 = 5 < 6 pending


@pytest.mark.parametrize("delay", [1, 3])
@pytest.mark.parametrize("lag", [0, 2])
def test_rmm_with_late_kappa_equals_brute_force_demonstrated_utility(trace, delay, lag):
    """κ of step s arrives ``delay`` steps late, after evictions moved the slots its row was recorded over;
    the policy must still add κ_s · a_{s,p} to the item at logical position p."""
    budget, sinks = 9, 1
    policy = RMM(lag=lag, sinks=sinks)
    kappa = trace.kappa_of("realised")
    layers, heads = trace.attn.shape[1:3]
    du = torch.zeros(layers, heads, trace.steps, dtype=F64)  # by logical position
    held = [torch.empty(1, heads, 0, dtype=torch.long) for _ in range(layers)]
    pending: list[tuple[int, list[torch.Tensor]]] = []
    checked = 0
    for s in range(trace.steps):
        rows = []
        for layer in range(layers):
            held[layer] = torch.cat([held[layer], torch.full((1, heads, 1), s)], -1)
            row = trace.attn[s, layer].gather(-1, held[layer][0])
            row = row / row.sum(-1, keepdim=True)
            rows.append((held[layer][0].clone(), row))
            policy.observe(layer, row[None, :, None, :], held[layer])
        pending.append((s, rows))
        if len(pending) > delay:
            step, recorded = pending.pop(0)
            policy.set_kappa(torch.tensor([[step]]), kappa[step : step + 1][None])
            for layer, (pos, row) in enumerate(recorded):
                du[layer].scatter_add_(-1, pos, kappa[step] * row)
        for layer in range(layers):
            n = held[layer].shape[-1]
            keep = policy.select(layer, budget)
            if keep is None:
                continue
            pos = held[layer]
            protected = (pos < sinks) | (pos > s - lag)
            expected = keep_top(du[layer].gather(-1, pos[0])[None], protected, budget)
            assert torch.equal(keep, expected), (s, layer)
            checked += n - budget
            held[layer] = pos.gather(-1, keep)
            policy.on_evict(layer, keep)
    assert checked > 50 and not math.isnan(float(du.sum()))


@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_snapkv_decode_scores_equal_a_brute_force_window(trace, chunk):
    """SnapKV's decode score is the pooled sum of the last ``window`` served rows over the current slots,
    whatever evictions happened since those rows were recorded (the window is kept by logical position)."""
    budget, window, kernel = 12, 6, 3
    policy = SnapKV(window=window, kernel=kernel)
    layers, heads = trace.attn.shape[1:3]
    held = [torch.empty(1, heads, 0, dtype=torch.long) for _ in range(layers)]
    recent: list[list[torch.Tensor]] = [[] for _ in range(layers)]  # rows by logical position
    evictions = 0
    for s in range(trace.steps):
        for layer in range(layers):
            held[layer] = torch.cat([held[layer], torch.full((1, heads, 1), s)], -1)
            row = trace.attn[s, layer].gather(-1, held[layer][0])
            row = row / row.sum(-1, keepdim=True)
            by_position = torch.zeros(heads, trace.steps, dtype=F64).scatter(-1, held[layer][0], row)
            recent[layer] = [*recent[layer], by_position][-window:]
            policy.observe(layer, row[None, :, None, :], held[layer])
        policy.set_kappa(torch.tensor([[s]]), torch.ones(1, 1, dtype=F64))
        for layer in range(layers):
            keep = policy.select(layer, budget, chunk)
            if keep is None:
                continue
            pos = held[layer]
            total = torch.stack(recent[layer]).sum(0).gather(-1, pos[0])[None]
            scores = pool_scores(total, kernel, "avgpool")
            expected = keep_top(scores, pos > s - window, budget - chunk + 1)
            assert torch.equal(keep, expected), (s, layer)
            evictions += 1
            held[layer] = pos.gather(-1, keep)
            policy.on_evict(layer, keep)
    assert evictions >= 2 * (trace.steps - budget) // chunk
