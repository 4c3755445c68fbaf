"""Gate-contraction meter against direct computation."""

from __future__ import annotations

import math

import pytest
import torch

from kvcert.bounds.recurrent import HIST_EDGES, gate_contraction, half_life, unrolled_state_error


def _factors(seed: int, t: int = 40, c: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(t, c, generator=g, dtype=torch.float64)
    a[:, 0] = 0.9995  # a near-one channel
    a[:5, 1] = 1.0
    return a


@pytest.mark.parametrize("seed", range(3))
def test_profile_matches_direct_computation(seed):
    a = _factors(seed)
    prof = gate_contraction(a)
    t, c = a.shape
    for j in range(c):
        col = [float(v) for v in a[:, j]]
        s = sum(math.log(max(v, 1e-12)) for v in col)
        mean = sum(col) / t
        assert float(prof.sum_log_a[j]) == pytest.approx(s, rel=1e-12)
        assert float(prof.mean_log_a[j]) == pytest.approx(s / t, rel=1e-12)
        assert float(prof.a_mean[j]) == pytest.approx(mean, rel=1e-12)
        assert float(prof.near_one[j]) == pytest.approx(sum(v >= 0.999 for v in col) / t)
        hl = math.log(2) / (-s / t)
        assert float(prof.half_life_logsum[j]) == pytest.approx(hl, rel=1e-12)
        assert float(prof.half_life_mean[j]) == pytest.approx(math.log(2) / (-math.log(mean)), rel=1e-12)
        # Jensen: E[log a] <= log(mean a); the log-sum half-life is never longer
        assert float(prof.jensen_gap[j]) >= -1e-15
        assert float(prof.half_life_logsum[j]) <= float(prof.half_life_mean[j]) * (1 + 1e-12)
        counts = [sum(HIST_EDGES[b] <= v < HIST_EDGES[b + 1] for v in col) / t for b in range(5)]
        assert prof.hist[j].tolist() == pytest.approx(counts)
    assert torch.allclose(prof.hist.sum(-1), torch.ones(c, dtype=torch.float64))
    assert float(prof.near_one[0]) == 1.0 and float(prof.hist[0, -1]) == 1.0


def test_sum_log_not_mean_decides_contraction():
    # a channel alternating 1.0 and 0.0001 has mean ~0.5 yet contracts much faster than mean suggests;
    # a channel at exactly 1 never contracts
    a = torch.tensor([[1.0, 1.0], [1e-4, 1.0]] * 5, dtype=torch.float64)
    prof = gate_contraction(a)
    assert prof.contracting.tolist() == [True, False]
    assert math.isinf(float(prof.half_life_logsum[1])) and math.isinf(float(prof.half_life_mean[1]))
    assert float(prof.half_life_logsum[0]) < 0.5 * float(prof.half_life_mean[0])


def test_unrolled_bound_equals_recursion():
    g = torch.Generator().manual_seed(4)
    a = torch.rand(30, 5, generator=g, dtype=torch.float64)
    a[7, 2] = 0.0  # a hard reset
    b = torch.rand(30, 5, generator=g, dtype=torch.float64)
    e0 = torch.rand(5, generator=g, dtype=torch.float64)
    e = e0.clone()
    for t in range(30):
        e = a[t] * e + b[t]
    assert torch.allclose(unrolled_state_error(a, b, e0), e, rtol=1e-12)
    # and it dominates an actual linear recurrence error driven by |perturbations| <= b
    s_exact = torch.zeros(5, dtype=torch.float64)
    s_pert = e0.clone()
    for t in range(30):
        s_exact = a[t] * s_exact + 1.0
        s_pert = a[t] * s_pert + 1.0 + b[t] * (2 * torch.rand(5, generator=g, dtype=torch.float64) - 1)
    assert ((s_pert - s_exact).abs() <= unrolled_state_error(a, b, e0) + 1e-12).all()


def test_half_life_edge_cases():
    hl = half_life(torch.tensor([-math.log(2), 0.0, 0.3], dtype=torch.float64))
    assert hl[0] == pytest.approx(1.0) and math.isinf(hl[1]) and math.isinf(hl[2])


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        gate_contraction(torch.tensor([[1.2]]))
    with pytest.raises(ValueError, match="non-finite"):
        gate_contraction(torch.tensor([[float("nan")]]))
    with pytest.raises(ValueError, match="shape"):
        gate_contraction(torch.ones(3))
    with pytest.raises(ValueError, match="b must"):
        unrolled_state_error(torch.ones(3, 2) * 0.5, -torch.ones(3, 2), 0.0)
