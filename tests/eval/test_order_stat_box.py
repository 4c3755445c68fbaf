"""``benchmarks/order_stat_box.py``'s per-cell columns on synthetic dithered reads: the uniform box and the order-stat
bound are never above the union box and hold the exact TV where the draw keeps to the tail bounds; the oracle columns
are ordered by their radii; invisible tokens carry nothing; and the table counts a violation when there is one."""

import torch
from benchmark_scripts import load_benchmark

from kvcert.bounds import tier_b_radius_uniform

osb = load_benchmark("order_stat_box")
F64 = torch.float64


def _read(seed: int, g: int = 2, nq: int = 3, s: int = 300, sigma_scale: float = 0.05):
    """Exact logits, per-token proxies, and served logits whose errors are a uniform-sum draw of that variance (a
    dithered residual seen through a fixed query), with a Tier-A radius that always holds."""
    gen = torch.Generator().manual_seed(seed)
    exact = torch.randn(g, nq, s, generator=gen, dtype=F64) * 3
    sigma2 = (torch.rand(1, 1, s, generator=gen, dtype=F64) * 0.9 + 0.1) * sigma_scale**2
    parts = torch.rand(g, nq, s, 12, generator=gen, dtype=F64) - 0.5  # 12 uniforms: variance 1
    err = parts.sum(-1) * sigma2.sqrt()
    tier_a = 6.0 * sigma2.sqrt() * 12**0.5 / 2  # |Σ of 12 uniforms on [−½, ½]| ≤ 6
    visible = torch.ones(g, nq, s, dtype=torch.bool)
    visible[:, 0, s - 40 :] = False
    # the same law as 12 channels of weight σ_t/2 (query 1, step σ_t, one group), at the benchmark's δ_loc/2
    uniform = tier_b_radius_uniform(torch.ones(12, dtype=F64), sigma2.view(s, 1).sqrt(), 1.0, s, 0.5e-7, 12)
    return exact + err, exact, visible, tier_a, sigma2, uniform.view(1, 1, s)


def test_order_stat_is_below_the_union_box_and_holds_the_exact_tv():
    for seed in range(6):
        served, exact, visible, tier_a, sigma2, uniform = _read(seed, sigma_scale=0.02 + 0.05 * seed)
        v = osb.cell_bounds(served, exact, visible, tier_a, sigma2, uniform, 1e-7)
        assert set(v) == set(osb.COLUMNS)
        assert (v["order-stat"] <= v["union box"]).all() and (v["uniform box"] <= v["union box"]).all()
        assert (v["exact"] <= v["order-stat"]).all() and (v["exact"] <= v["uniform box"]).all()
        assert (v["2σ"] <= v["3σ"] + 1e-15).all()


def test_invisible_tokens_carry_nothing():
    served, exact, visible, tier_a, sigma2, uniform = _read(1)
    v = osb.cell_bounds(served, exact, visible, tier_a, sigma2, uniform, 1e-7)
    garbled = served.masked_fill(~visible, 1e6)  # an invisible token's logit must not reach any column
    w = osb.cell_bounds(garbled, exact, visible, tier_a, sigma2, uniform, 1e-7)
    for column in osb.COLUMNS:
        assert torch.allclose(v[column], w[column], rtol=0, atol=1e-12)


def test_the_table_counts_violations():
    row = osb.Row({c: [torch.full((2, 3), 0.1, dtype=F64)] for c in osb.COLUMNS})
    assert row.violations() == 0
    assert row.passed("exact") == (1.0, 1.0)
    row.cells["exact"] = [torch.tensor([[0.1, 0.3, 0.1], [0.1, 0.1, 0.1]], dtype=F64)]
    assert row.violations() == 1
    assert row.passed("exact") == (5 / 6, 2 / 3)
    assert osb.table({"x": row}).rows[0][-1] == "1"
