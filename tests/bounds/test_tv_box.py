"""The box supremum bound (``kvcert.bounds.tv_box``): sound against every vertex of the radius box, tight where the
supremum is known, and fail-closed on bad input."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcert.bounds import tv_box, tv_meter

F64 = torch.float64
# the brute force evaluates each vertex's TV in float64 (its own rounding, ~S·2^-53 relative); the bound is rounded up
BRUTE_SLACK = 1e-12


def vertex_sup(p: torch.Tensor, c: torch.Tensor) -> float:
    """``max TV(p, p̃)`` over the ``2^S`` vertices ``ε = ±c`` (where the supremum over the box is attained)."""
    log_p = torch.log(p)
    best = 0.0
    for signs in itertools.product((-1.0, 1.0), repeat=p.shape[-1]):
        exact = torch.softmax(log_p - c * torch.tensor(signs, dtype=F64), -1)
        best = max(best, float(0.5 * (exact - p).abs().sum()))
    return best


@st.composite
def rows(draw: st.DrawFn, max_tokens: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    s = draw(st.integers(1, max_tokens))
    logits = torch.tensor(draw(st.lists(st.floats(-12.0, 12.0), min_size=s, max_size=s)), dtype=F64)
    scale = 10.0 ** draw(st.floats(-4.0, 1.0))
    shape = torch.tensor(draw(st.lists(st.floats(0.0, 1.0), min_size=s, max_size=s)), dtype=F64)
    radius = scale * torch.where(torch.tensor(draw(st.booleans())), torch.ones(s, dtype=F64), shape)
    return torch.softmax(logits, -1), radius


@settings(max_examples=300, deadline=None)
@given(rows(), st.sampled_from([1, 2, 5, 32]), st.integers(0, 2))
def test_bounds_the_supremum_over_every_vertex(row, intervals, exact):
    p, c = row
    bound = float(tv_box(p, c, intervals=intervals, exact=exact, clip=False))
    assert bound >= vertex_sup(p, c) * (1 - BRUTE_SLACK) - BRUTE_SLACK


@settings(max_examples=200, deadline=None)
@given(rows(max_tokens=12), st.integers(0, 2**31 - 1))
def test_bounds_the_true_tv_at_interior_errors(row, seed):
    p, c = row
    gen = torch.Generator().manual_seed(seed)
    eps = c * (2.0 * torch.rand(64, p.shape[-1], generator=gen, dtype=F64) - 1.0)
    tv = 0.5 * (torch.softmax(torch.log(p) - eps, -1) - p).abs().sum(-1)
    assert float(tv.max()) <= float(tv_box(p, c)) * (1 + BRUTE_SLACK) + BRUTE_SLACK


@pytest.mark.parametrize("radius", [1e-3, 0.1, 0.5, 1.0, 2.0])
def test_equal_radii_give_tanh_of_half_the_radius(radius):
    """With many equal tokens the supremum is ``tanh(c/2)`` (raise a share ``1/(e^c + 1)`` of the mass): the bound is
    at least the best vertex and within 5 % of ``tanh(c/2)`` at 64 intervals, where the meter gives about ``c``."""
    s = 2000
    p = torch.full((s,), 1.0 / s, dtype=F64)
    c = torch.full((s,), radius, dtype=F64)
    bound = float(tv_box(p, c, intervals=64))
    k = torch.arange(s + 1, dtype=F64)  # k tokens raised (ε = −c), the rest lowered
    up = k * math.exp(radius) / (k * math.exp(radius) + (s - k) * math.exp(-radius))
    best_vertex = float((up - k / s).max())
    assert best_vertex <= bound <= 1.05 * math.tanh(radius / 2)
    assert bound < 0.6 * float(tv_meter(p, c)) or float(tv_meter(p, c)) == 1.0


def test_the_dominant_token_enters_exactly():
    """Relaxed, a token of mass 0.999 may count as half raised and half lowered (a TV of about c/2); pinned to its
    ends it cannot, and the bound falls to the true supremum's scale."""
    p = torch.tensor([0.999, 0.0005, 0.0005], dtype=F64)
    c = torch.full((3,), 1.0, dtype=F64)
    sup = vertex_sup(p, c)
    relaxed, pinned = float(tv_box(p, c, exact=0)), float(tv_box(p, c, exact=1))
    assert sup <= pinned <= 1.1 * sup
    assert relaxed > 50 * sup


def test_masked_tokens_change_nothing():
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(4, 40, generator=gen, dtype=F64) * 3, -1)
    c = torch.rand(4, 40, generator=gen, dtype=F64)
    padded_p = torch.cat([p, torch.zeros(4, 9, dtype=F64)], -1)
    padded_c = torch.cat([c, 50.0 * torch.rand(4, 9, generator=gen, dtype=F64)], -1)
    torch.testing.assert_close(tv_box(padded_p, padded_c), tv_box(p, c), rtol=1e-12, atol=1e-15)


def test_batch_shapes_broadcast_and_huge_radii_are_trivial():
    gen = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(2, 3, 16, generator=gen, dtype=F64), -1)
    c = 0.1 * torch.rand(16, generator=gen, dtype=F64)
    out = tv_box(p, c)
    assert out.shape == (2, 3)
    torch.testing.assert_close(out[1, 2], tv_box(p[1, 2], c))
    huge = c.clone()
    huge[4] = 400.0
    assert float(tv_box(p[0, 0], huge)) == 1.0
    assert tv_box(p[0, 0], huge, clip=False).item() == math.inf
    assert float(tv_box(p[0, 0], torch.zeros(16, dtype=F64))) < 1e-13  # no error, (almost) no bound


@pytest.mark.parametrize(
    ("p", "c", "kwargs", "match"),
    [
        (torch.tensor([0.5, 0.5]), torch.tensor([0.1, -0.1]), {}, "radius"),
        (torch.tensor([0.5, 0.5]), torch.tensor([0.1, math.nan]), {}, "radius"),
        (torch.tensor([0.5, math.inf]), torch.tensor([0.1, 0.1]), {}, "p_served"),
        (torch.tensor([0.5, 0.2]), torch.tensor([0.1, 0.1]), {}, "sum to 1"),
        (torch.tensor([0.5, 0.5]), torch.tensor([0.1, 0.1]), {"intervals": 0}, "intervals"),
        (torch.tensor([0.5, 0.5]), torch.tensor([0.1, 0.1]), {"exact": 9}, "exact"),
    ],
)
def test_bad_input_is_refused(p, c, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tv_box(p, c, **kwargs)


def test_tightness_benchmark_cells_table_and_figure(tmp_path):
    """``benchmarks/tv_box_tightness.py`` on random post-RoPE queries and keys: every cell's exact TV is within
    ``min(meter, box)``, the box is never above the meter, and the table and figure are written."""
    import importlib.util
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "tv_box_tightness.py"
    spec = importlib.util.spec_from_file_location("tv_box_tightness", script)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    gen = torch.Generator().manual_seed(11)
    qs = [torch.randn(4, 96, 64, generator=gen, dtype=F64) for _ in range(2)]
    ks = [torch.randn(2, 96, 64, generator=gen, dtype=F64) * 2 for _ in range(2)]
    r = bench.cells("int4", qs, ks, 0.125, nq=3, intervals=8)
    assert r["tv"].shape == r["box"].shape == (2 * 4 * 3,)
    assert bool((r["tv"] <= r["box"]).all()) and bool((r["box"] <= r["meter"]).all())
    windowed = bench.cells("int4", qs, ks, 0.125, nq=3, intervals=8, windows=[None, 40])  # layer 1 reads 40 tokens
    assert bool((windowed["tv"] <= windowed["box"]).all())
    assert torch.equal(windowed["tv"][:12], r["tv"][:12]) and not torch.equal(windowed["tv"][12:], r["tv"][12:])
    assert bool((r["box"] < r["meter"]).any()) and bool((r["spent"] > 0).all())
    table = bench.table({"int4": r}, 8)
    assert len(table.rows) == 1 and table.rows[0][2] == "0"
    bench.plot({"int4": r}, tmp_path / "box.png")
    assert (tmp_path / "box.png").stat().st_size > 0


def test_box_refined_under_a_threshold_refines_only_the_rows_above_it():
    """``box_refined`` with a gate's threshold: never above the certificate it refines, the coarse grid kept where
    it already certifies (no lower than the full grid's value there), the full grid's value wherever the coarse one
    is above the threshold, and masked rows keep their certificate."""
    from kvcert.bounds.tv_box import box_refined

    gen = torch.Generator().manual_seed(9)
    p = torch.softmax(torch.randn(64, 200, generator=gen, dtype=F64) * 2, -1)
    c = 0.3 * torch.rand(64, 200, generator=gen, dtype=F64)
    p[3] = 0.0  # a fully masked row
    cert = torch.rand(64, generator=gen, dtype=F64)
    tau = 0.12
    full, gated = box_refined(p, c, cert), box_refined(p, c, cert, tau)
    assert torch.all(gated <= cert) and torch.all(full <= cert)
    assert gated[3] == cert[3] and full[3] == cert[3]
    below = gated <= tau
    assert bool(below.any()) and bool((~below).any())
    assert torch.all(full[below] <= gated[below])
    torch.testing.assert_close(gated[~below], full[~below], rtol=0, atol=0)


def test_the_compiled_chooser_picks_the_sorted_choosers_lambda():
    """``kvcert.kernels.numba_box.choose_lambda`` (weighted quickselect) against :func:`sorted_lambda` on adversarial
    cells of every length: the same λ up to ties, so the same bound (the choice bears on tightness only)."""
    from bounds_adversarial import make_cells

    from kvcert.bounds.tv_box import sorted_lambda
    from kvcert.kernels.numba_box import choose_lambda

    gen = torch.Generator().manual_seed(21)
    for s, rows in ((1, 50), (2, 500), (7, 500), (64, 200), (1024, 20)):
        cells = make_cells(rows, s, gen) if s > 1 else None
        p = torch.ones(rows, 1, dtype=F64) if cells is None else cells.p_served
        c = torch.rand(rows, s, generator=gen, dtype=F64) if cells is None else cells.radius
        fast = tv_box(p, c, choose=choose_lambda, clip=False)
        torch.testing.assert_close(fast, tv_box(p, c, clip=False), rtol=1e-12, atol=1e-13)
        h, l = torch.exp(c.clamp(max=50.0)), torch.exp(-c.clamp(max=50.0))  # tv_box zeroes rows above 300
        mid = 1.0 + 0.5 * (torch.rand(rows, 5, generator=gen, dtype=F64) - 0.5)
        b_sum = (p * l).sum(-1)
        lam_fast, lam_sorted = choose_lambda(p, h, l, mid, b_sum), sorted_lambda(p, h, l, mid, b_sum)
        assert bool(((lam_fast >= 0) & (lam_fast <= 1)).all())
        torch.testing.assert_close(lam_fast, lam_sorted, rtol=1e-9, atol=1e-12)
