"""The torch path of the eviction policies (what a CUDA cache runs) keeps exactly what the numpy / numba path keeps.

A policy's state lives on the device of the attention it observes; on CPU the per-step bookkeeping runs in numpy /
numba over views of the state's tensors, elsewhere as torch operations on the device (``evict/base.py``, "Devices").
``HOST_KERNELS = False`` forces the torch operations on CPU, so without a GPU the tests below show that both paths
give the same kept sets, bit-identical scores and positions, the same prefill selections, and the same fail-closed
errors; ``tests/attention/test_host_syncs.py`` shows that the torch path leaves nothing on the host.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from evict_traces import POLICY_NAMES, make_policies, random_trace
from test_policy_matrix import test_bad_inputs_fail_closed as _bad_inputs_fail_closed
from test_policy_matrix import test_batch_rows_are_independent as _batch_rows_are_independent
from test_policy_matrix import (
    test_first_read_after_an_eviction_checks_every_held_slot as _first_read_after_an_eviction,
)
from test_policy_matrix import test_keep_top_fast_path_matches_stable_sort as _keep_top_fast_path

from kvcert.evict import H2O, RMM, SnapKV, StreamingLLM, base, replay
from kvcert.evict.snapkv import _subtract_by_position, _subtract_by_position_torch, pool_scores

F64 = torch.float64


@pytest.fixture
def device_path(monkeypatch):
    """Run the policies' torch operations (the path of a non-CPU state) on CPU."""
    monkeypatch.setattr(base, "HOST_KERNELS", False)


@pytest.fixture(scope="module")
def trace():
    return random_trace(steps=56, layers=2, heads=3, seed=11, spiky=2.0)


def _run(name, trace, budget, chunk, host, monkeypatch):
    monkeypatch.setattr(base, "HOST_KERNELS", host)
    policy = make_policies(trace)[name]
    result = replay(policy, trace, budget, chunk=chunk)
    states = {layer: (s.scores.clone(), s.positions.clone(), s.now.clone()) for layer, s in policy._layers.items()}
    return result, states


@pytest.mark.parametrize("chunk", [1, 3, 11])
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_torch_path_keeps_the_same_items_with_bit_identical_scores(trace, name, chunk, monkeypatch):
    host, host_states = _run(name, trace, 18, chunk, True, monkeypatch)
    dev, dev_states = _run(name, trace, 18, chunk, False, monkeypatch)
    assert torch.equal(host.present, dev.present)
    assert torch.equal(host.served_mass, dev.served_mass)
    for layer, (scores, positions, now) in host_states.items():
        d_scores, d_positions, d_now = dev_states[layer]
        assert torch.equal(scores, d_scores) and torch.equal(positions, d_positions) and torch.equal(now, d_now)


@pytest.mark.parametrize("ratio", [0.25, 0.6])
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_torch_path_prefill_keeps_the_same_items(trace, name, ratio, monkeypatch):
    g = torch.Generator().manual_seed(3)
    s = 40
    keys = torch.randn(1, 3, s, 8, generator=g)
    queries = torch.randn(1, 6, s, 8, generator=g)
    kappa = torch.rand(1, s, generator=g, dtype=F64)
    kept = []
    for host in (True, False):
        monkeypatch.setattr(base, "HOST_KERNELS", host)
        policy = make_policies(random_trace(steps=s, layers=1, heads=3, seed=2))[name]
        kept.append(policy.prefill_keep(0, keys, keys, ratio, queries=queries, kappa=kappa))
    assert torch.equal(kept[0], kept[1])


def test_torch_path_fails_closed_on_the_same_inputs(device_path):
    _bad_inputs_fail_closed()


def test_torch_path_checks_every_held_slot_after_an_eviction(device_path):
    _first_read_after_an_eviction()


@pytest.mark.parametrize("n_evict", [1, 2, 5, 8, 9, 20])
def test_torch_path_keep_top_matches_stable_sort(device_path, n_evict):
    _keep_top_fast_path(n_evict)


@pytest.mark.parametrize(
    "make",
    [lambda: StreamingLLM(sinks=1), lambda: H2O(recent=2), lambda: SnapKV(window=2, kernel=3), lambda: RMM(lag=2)],
)
def test_torch_path_batch_rows_are_independent(device_path, make):
    _batch_rows_are_independent(make())


@pytest.mark.parametrize("k", [1, 2, 5, 8])
def test_lowest_and_complement_agree_on_ties(k, monkeypatch):
    """Integer keys (heavy ties): the higher index goes first among equal keys on both paths."""
    g = torch.Generator().manual_seed(k)
    key = torch.randint(0, 3, (2, 3, 30), generator=g).to(F64)
    key[0, 0, :5] = math.inf
    out = []
    for host in (True, False):
        monkeypatch.setattr(base, "HOST_KERNELS", host)
        low = base._lowest(key, k)
        out.append((low, base._complement(low, 30), base._keep_highest(key, 30 - k)))
    for a, b in zip(*out, strict=True):
        assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b)


@pytest.mark.parametrize("s", [1, 2, 3, 7, 40])
@pytest.mark.parametrize("kernel", [1, 3, 5, 7])
def test_pooling_agrees_bit_for_bit(kernel, s, monkeypatch):
    x = torch.rand(2, 3, s, generator=torch.Generator().manual_seed(s), dtype=F64)
    for pooling in ("avgpool", "maxpool"):
        monkeypatch.setattr(base, "HOST_KERNELS", True)
        host = pool_scores(x, kernel, pooling)
        monkeypatch.setattr(base, "HOST_KERNELS", False)
        assert torch.equal(host, pool_scores(x, kernel, pooling))


def test_subtract_by_position_agrees_with_the_merge_walk():
    g = torch.Generator().manual_seed(5)
    held = torch.stack([torch.randperm(60, generator=g)[:25].sort().values for _ in range(6)]).view(2, 3, 25)
    old = torch.stack([torch.randperm(60, generator=g)[:20].sort().values for _ in range(6)]).view(2, 3, 20)
    row = torch.rand(2, 3, 20, generator=g, dtype=F64)
    scores = torch.rand(2, 3, 32, generator=g, dtype=F64)
    positions = torch.cat([held, torch.full((2, 3, 7), 99)], -1)  # capacity beyond n = 25
    want = scores.clone()
    _subtract_by_position(want.numpy(), positions.numpy(), 25, old.numpy(), row.numpy())
    got = scores.clone()
    _subtract_by_position_torch(got, positions, 25, old, row)
    assert torch.equal(got, want)
    assert not np.array_equal(want.numpy(), scores.numpy())  # something matched
