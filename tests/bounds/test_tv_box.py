"""The box supremum bound (``kvcert.bounds.tv_box``): sound against every vertex of the radius box, tight where the
supremum is known, and fail-closed on bad input."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from benchmark_scripts import load_benchmark
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcert import StorageConfig
from kvcert.bounds import true_tv, tv_box, tv_meter
from kvcert.bounds.tv_box import box_rows
from kvcert.kernels import numba_box
from kvcert.quant import bytes_per_token_head, get
from kvcert.report.tables import fmt

#: the two evaluations of the prepared rows: tensor operations (any device) and the compiled CPU kernel
ROWS = pytest.mark.parametrize("rows", [box_rows, numba_box.box_rows], ids=["tensor", "compiled"])

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
def cell(draw: st.DrawFn, max_tokens: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    s = draw(st.integers(1, max_tokens))
    logits = torch.tensor(draw(st.lists(st.floats(-12.0, 12.0), min_size=s, max_size=s)), dtype=F64)
    scale = 10.0 ** draw(st.floats(-4.0, 1.0))
    shape = torch.tensor(draw(st.lists(st.floats(0.0, 1.0), min_size=s, max_size=s)), dtype=F64)
    radius = scale * torch.where(torch.tensor(draw(st.booleans())), torch.ones(s, dtype=F64), shape)
    return torch.softmax(logits, -1), radius


@ROWS
@settings(max_examples=300, deadline=None)
@given(cell(), st.sampled_from([1, 2, 5, 32]), st.integers(0, 2), st.sampled_from([0, 0, 1, 8]))
def test_bounds_the_supremum_over_every_vertex(rows, row, intervals, exact, classes):
    p, c = row
    bound = float(tv_box(p, c, intervals=intervals, exact=exact, clip=False, rows=rows, classes=classes))
    assert bound >= vertex_sup(p, c) * (1 - BRUTE_SLACK) - BRUTE_SLACK


@ROWS
@settings(max_examples=200, deadline=None)
@given(cell(max_tokens=12), st.integers(0, 2**31 - 1))
def test_bounds_the_true_tv_at_interior_errors(rows, row, seed):
    p, c = row
    gen = torch.Generator().manual_seed(seed)
    eps = c * (2.0 * torch.rand(64, p.shape[-1], generator=gen, dtype=F64) - 1.0)
    tv = 0.5 * (torch.softmax(torch.log(p) - eps, -1) - p).abs().sum(-1)
    assert float(tv.max()) <= float(tv_box(p, c, rows=rows)) * (1 + BRUTE_SLACK) + BRUTE_SLACK


@ROWS
@pytest.mark.parametrize("radius", [1e-3, 0.1, 0.5, 1.0, 2.0])
def test_equal_radii_give_tanh_of_half_the_radius(rows, radius):
    """With many equal tokens the supremum is ``tanh(c/2)`` (raise a share ``1/(e^c + 1)`` of the mass): the bound is
    at least the best vertex and within 5 % of ``tanh(c/2)`` at 64 intervals, where the meter gives about ``c``."""
    s = 2000
    p = torch.full((s,), 1.0 / s, dtype=F64)
    c = torch.full((s,), radius, dtype=F64)
    bound = float(tv_box(p, c, intervals=64, rows=rows))
    k = torch.arange(s + 1, dtype=F64)  # k tokens raised (ε = −c), the rest lowered
    up = k * math.exp(radius) / (k * math.exp(radius) + (s - k) * math.exp(-radius))
    best_vertex = float((up - k / s).max())
    assert best_vertex <= bound <= 1.05 * math.tanh(radius / 2)
    assert bound < 0.6 * float(tv_meter(p, c)) or float(tv_meter(p, c)) == 1.0


@ROWS
def test_the_dominant_token_enters_exactly(rows):
    """Relaxed, a token of mass 0.999 may count as half raised and half lowered (a TV of about c/2); pinned to its
    ends it cannot, and the bound falls to the true supremum's scale."""
    p = torch.tensor([0.999, 0.0005, 0.0005], dtype=F64)
    c = torch.full((3,), 1.0, dtype=F64)
    sup = vertex_sup(p, c)
    relaxed, pinned = float(tv_box(p, c, exact=0, rows=rows)), float(tv_box(p, c, exact=1, rows=rows))
    assert sup <= pinned <= 1.1 * sup
    assert relaxed > 50 * sup


@ROWS
def test_masked_tokens_change_nothing(rows):
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(4, 40, generator=gen, dtype=F64) * 3, -1)
    c = torch.rand(4, 40, generator=gen, dtype=F64)
    padded_p = torch.cat([p, torch.zeros(4, 9, dtype=F64)], -1)
    padded_c = torch.cat([c, 50.0 * torch.rand(4, 9, generator=gen, dtype=F64)], -1)
    torch.testing.assert_close(tv_box(padded_p, padded_c, rows=rows), tv_box(p, c, rows=rows), rtol=1e-12, atol=1e-15)


@ROWS
def test_batch_shapes_broadcast_and_huge_radii_are_trivial(rows):
    gen = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(2, 3, 16, generator=gen, dtype=F64), -1)
    c = 0.1 * torch.rand(16, generator=gen, dtype=F64)
    out = tv_box(p, c, rows=rows)
    assert out.shape == (2, 3)
    torch.testing.assert_close(out[1, 2], tv_box(p[1, 2], c, rows=rows))
    huge = c.clone()
    huge[4] = 400.0
    assert float(tv_box(p[0, 0], huge, rows=rows)) == 1.0
    assert tv_box(p[0, 0], huge, clip=False, rows=rows).item() == math.inf
    masked_huge = huge.clone()
    p_masked = p[0, 0].clone()
    p_masked[4] = 0.0  # a huge radius on a masked token is ignored
    p_masked /= p_masked.sum()
    assert tv_box(p_masked, masked_huge, clip=False, rows=rows).item() < 1.0
    assert float(tv_box(p[0, 0], torch.zeros(16, dtype=F64), rows=rows)) < 1e-13  # no error, (almost) no bound
    near = torch.full((16,), 299.0, dtype=F64)  # radii under 300 whose class ends (320) are above it
    assert tv_box(p[0, 0], near, clip=False, rows=rows, exact=0).item() < math.inf
    assert tv_box(p[0, 0], near, clip=False, rows=rows, exact=0, classes=8).item() == math.inf


@pytest.mark.parametrize(
    ("p", "c", "kwargs", "match"),
    [
        (torch.tensor([0.5, 0.5]), torch.tensor([0.1, -0.1]), {}, "radius"),
        (torch.tensor([0.5, 0.5]), torch.tensor([0.1, math.nan]), {}, "radius"),
        (torch.tensor([0.5, math.inf]), torch.tensor([0.1, 0.1]), {}, "p_served"),
        (torch.tensor([0.5, 0.2]), torch.tensor([0.1, 0.1]), {}, "sum to 1"),
        (torch.tensor([0.5, 0.5]), torch.tensor([0.1, 0.1]), {"intervals": 0}, "intervals"),
        (torch.tensor([0.5, 0.5]), torch.tensor([0.1, 0.1]), {"exact": 9}, "exact"),
        (torch.tensor([0.5, 0.5]), torch.tensor([0.1, 0.1]), {"classes": 3}, "classes"),
        (torch.tensor([0.5, 0.5]), torch.tensor([0.1, 0.1]), {"classes": 128}, "classes"),
    ],
)
def test_bad_input_is_refused(p, c, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tv_box(p, c, **kwargs)


def _tightness_benchmark():  # noqa: ANN202 - the script's module
    return load_benchmark("tv_box_tightness")


@settings(max_examples=300, deadline=None)
@given(cell(max_tokens=12), st.integers(0, 2**31 - 1))
def test_p_weighted_form_bounds_the_tv_for_every_error(pc, seed):
    """``TV(p, softmax(log p + ε)) ≤ ½(Σ_t p_t|e^{ε_t} − 1| + |Σ_t p_t(e^{ε_t} − 1)|)``
    (docs/math.md#p-weighted-form), for errors of every size, per cell."""
    p, c = pc
    gen = torch.Generator().manual_seed(seed)
    eps = c * (2 * torch.rand(p.shape, generator=gen, dtype=F64) - 1) * 4
    served = torch.softmax(torch.log(p) + eps, -1)
    tv = float(0.5 * (served - p).abs().sum())
    assert tv <= float(_tightness_benchmark().p_weighted_form(p, eps)) + BRUTE_SLACK


@pytest.mark.parametrize("a", [0.1, 0.5, 0.9])
def test_p_weighted_form_is_attained(a):
    """Equality where one token's logit drops out (``p = (a, 1 − a)``, ``ε = (0, −50)``): the form is the TV
    ``1 − a``, so no smaller multiple of it is a bound."""
    p, eps = torch.tensor([a, 1 - a], dtype=F64), torch.tensor([0.0, -50.0], dtype=F64)
    tv = float(0.5 * (torch.softmax(torch.log(p) + eps, -1) - p).abs().sum())
    assert float(_tightness_benchmark().p_weighted_form(p, eps)) == pytest.approx(tv, rel=1e-12)
    assert tv == pytest.approx(1 - a, rel=1e-12)


def test_tightness_benchmark_cells_table_and_figure(tmp_path):
    """``benchmarks/tv_box_tightness.py`` on random post-RoPE queries and keys: every cell's exact TV is within
    ``min(meter, box)`` and within the p-weighted form, the box is never above the meter, and the tables and figure
    are written."""
    bench = _tightness_benchmark()
    gen = torch.Generator().manual_seed(11)
    qs = [torch.randn(4, 96, 64, generator=gen, dtype=F64) for _ in range(2)]
    ks = [torch.randn(2, 96, 64, generator=gen, dtype=F64) * 2 for _ in range(2)]
    seen = bench.Captured(qs, ks, 0.125, [None, None])
    r = bench.cells("int4", seen, nq=3, intervals=8)
    assert r["tv"].shape == r["box"].shape == (2 * 4 * 3,)
    assert bool((r["tv"] <= r["box"]).all()) and bool((r["box"] <= r["meter"]).all())
    windowed = bench.cells("int4", bench.Captured(qs, ks, 0.125, [None, 40]), nq=3, intervals=8)  # layer 1: 40 tokens
    assert bool((windowed["tv"] <= windowed["box"]).all())
    assert torch.equal(windowed["tv"][:12], r["tv"][:12]) and not torch.equal(windowed["tv"][12:], r["tv"][12:])
    assert bool((r["box"] < r["meter"]).any()) and bool((r["spent"] > 0).all())
    # a codec that needs a dither key, with the partially certified min(Tier A, Tier B) box beside
    dithered = bench.cells("dither-int6", seen, nq=3, intervals=8, delta_loc=1e-7)
    assert bool((dithered["tv"] <= dithered["box"]).all()) and bool((dithered["tv"] > 0).all())
    assert bool((dithered["tv"] <= dithered["partial"]).all()) and bool((dithered["partial"] <= dithered["box"]).all())
    assert dithered["kv_partial"].shape == dithered["kv_box"].shape == (2 * 2 * 3,)  # layers x KV heads x steps
    assert "partial" not in r  # Tier B only with delta_loc, and only for a dithered codec
    gates = bench.gate_table({"int4": r, "dither-int6": dithered}, 1e-7, "random")
    assert gates.rows[0][3:] == ("–",) * 4 and gates.rows[1][-1] == "0"
    assert float(r["gap"].max()) < 1e-8  # the compiled evaluation is the same bound
    assert bool((r["tv"] <= r["pweighted"]).all()) and bool((dithered["tv"] <= dithered["pweighted"]).all())
    # a KV-head read passes the exact-TV ceiling iff each of its query heads' exact TV is <= τ (cells: layer, head,
    # then the G = 2 query heads of that KV head, then the steps)
    per_cell = (r["tv"] <= bench.TAU).view(2, 2, 2, 3).all(2).flatten()
    assert torch.equal(r["kv_exact"], per_cell) and bool((r["kv_exact"] >= r["kv_box"]).all())
    ceiling = bench.ceiling_table({"int4": r}, "random")
    assert ceiling.rows[0][-1] == "0" and len(ceiling.rows[0]) == len(ceiling.columns)
    bench.plot_ceiling(
        {"int4": r, "dither-int6": dithered}, {"int4": 36.0, "dither-int6": 52.0}, tmp_path / "ceiling.png", "random"
    )
    assert (tmp_path / "ceiling.png").stat().st_size > 0
    table = bench.table({"int4": r}, 8)
    assert len(table.rows) == 1 and table.rows[0][2] == "0" and len(table.rows[0]) == len(table.columns)
    bench.plot({"int4": r, "dither-int6": dithered}, tmp_path / "box.png")
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


def test_the_compiled_rows_equal_the_tensor_rows():
    """``kvcert.kernels.numba_box.box_rows`` against :func:`box_rows` on adversarial cells of every length, every
    ``exact`` and both grids a gate uses: the same bound up to summation order (the same λ, the same grid)."""
    from bounds_adversarial import make_cells

    gen = torch.Generator().manual_seed(21)
    for s, n in ((1, 50), (2, 500), (7, 500), (64, 200), (1024, 20)):
        cells = make_cells(n, s, gen) if s > 1 else None
        p = torch.ones(n, 1, dtype=F64) if cells is None else cells.p_served
        c = torch.rand(n, s, generator=gen, dtype=F64) if cells is None else cells.radius
        for intervals, exact, classes in ((4, 1, 0), (16, 1, 0), (16, 0, 0), (8, 3, 0), (4, 1, 8), (16, 2, 1)):
            # merged classes carry the rounding allowance of a sum of sums (γ_{2S+16}, not γ_{S+8}), which dominates
            # only in rows far above 1 (radii near 300: e^c ~ 1e130 against a TV of at most 1); compared clipped
            kw = {"intervals": intervals, "exact": exact, "clip": classes > 0, "classes": classes}
            fast = tv_box(p, c, rows=numba_box.box_rows, **kw)
            slow = tv_box(p, c, **kw)  # the tensor rows evaluate every token at its class end, one by one
            torch.testing.assert_close(fast, slow, rtol=1e-8, atol=1e-12)


@settings(max_examples=300, deadline=None)
@given(st.floats(0.0, 400.0) | st.floats(0.0, 1e-300) | st.floats(1e-320, 1e-5), st.sampled_from([1, 2, 8, 64]))
def test_round_radii_raises_each_radius_less_than_one_class(c, classes):
    """A class end is at least the radius, less than ``1 + 1/K`` times it (above the ``2^-1000`` floor), exact and
    idempotent; the compiled kernel's class end of a radius is the same number."""
    from kvcert.bounds.tv_box import round_radii

    x = torch.tensor([c], dtype=F64)
    end = round_radii(x, classes)
    assert float(end) >= c
    if c == 0.0:
        assert float(end) == 0.0
    else:
        assert float(end) < (1 + 1 / classes) * max(c, 2.0**-1000)
        assert float(end) == numba_box._class_end(c, classes)[1]
    assert torch.equal(round_radii(end, classes), end)


def test_radius_classes_loosen_the_bound_by_less_than_a_class():
    """On real-sized cells the coarse pass's classes (8 per octave) give a bound within the bound of the radii raised
    by a whole class (``1 + 1/8``) where that is informative, and never below the exact radii's: the looseness the
    classes cost is bounded."""
    from bounds_adversarial import make_cells

    gen = torch.Generator().manual_seed(4)
    cells = make_cells(300, 512, gen)
    p, c = cells.p_served, cells.radius.clamp(max=10.0)
    exact_radii = tv_box(p, c, intervals=16, clip=False, rows=numba_box.box_rows)
    classed = tv_box(p, c, intervals=16, clip=False, rows=numba_box.box_rows, classes=8)
    raised = tv_box(p, c * (1 + 1 / 8), intervals=16, clip=False, rows=numba_box.box_rows)
    informative = raised < 1.0  # the bound is not exactly monotone in the radii where it exceeds 1 (allowances)
    assert bool((classed >= exact_radii - 1e-12).all())
    assert bool((classed <= raised + 1e-12)[informative].all()) and int(informative.sum()) > 200
    assert bool((classed > exact_radii).any())


def _light_atom_case(p: torch.Tensor, c: torch.Tensor, seed: int) -> tuple[torch.Tensor, ...]:
    """Exact logits ``log p``, served logits off by ``ε ∈ [−c, c]``, both softmaxes, and a random light set."""
    gen = torch.Generator().manual_seed(seed)
    exact_logit = torch.log(p)
    served_logit = exact_logit + c * (2 * torch.rand(p.shape, generator=gen, dtype=F64) - 1)
    light = torch.rand(p.shape, generator=gen) < 0.6
    return torch.softmax(served_logit, -1), p, served_logit, exact_logit, light


@settings(max_examples=300, deadline=None)
@given(cell(max_tokens=12), st.integers(0, 2**31 - 1))
def test_light_atom_form_bounds_the_tv(pc, seed):
    """``TV(p, p̃) ≤ tv_box(P̃, (c_H, |ε_L|)) + M̃_L·TV(π, π̃)`` (docs/math.md#light-atom) per cell, for any light set,
    whenever the radii bound the heavy tokens' logit errors (the light tokens' errors may be of any size)."""
    p, c = pc
    served, exact, served_logit, exact_logit, light = _light_atom_case(p, c, seed)
    served_logit = torch.where(light, exact_logit + 40 * (served_logit - exact_logit), served_logit)  # light: any size
    served = torch.softmax(served_logit, -1)
    form = _tightness_benchmark().light_atom_form(served, exact, served_logit, exact_logit, c, light)
    assert float(true_tv(exact, served)) <= float(form) + BRUTE_SLACK


def test_light_atom_form_is_the_tv_when_every_token_is_light_and_the_box_when_none_is():
    """Every token light: one atom, no coarse error, so the form is the exact TV. No token light: the box itself."""
    bench = _tightness_benchmark()
    gen = torch.Generator().manual_seed(5)
    p = torch.softmax(3 * torch.randn(4, 50, generator=gen, dtype=F64), -1)
    c = 0.5 * torch.rand(4, 50, generator=gen, dtype=F64)
    served, exact, served_logit, exact_logit, _ = _light_atom_case(p, c, 6)
    every = torch.ones(50, dtype=torch.bool)
    form = bench.light_atom_form(served, exact, served_logit, exact_logit, c, every)
    torch.testing.assert_close(form, true_tv(exact, served), rtol=1e-12, atol=1e-15)
    none = bench.light_atom_form(served, exact, served_logit, exact_logit, c, ~every)
    torch.testing.assert_close(none, tv_box(served, c, rows=numba_box.box_rows), rtol=1e-12, atol=1e-15)


def test_heavy_tokens_come_from_the_prefill_alone():
    """The heavy tier holds ``round(frac·S)`` tokens: the sinks, everything from the observation window on, and the
    prefix tokens the window's queries attend to most; the reads' own queries never change it; too small a share is
    refused by name."""
    bench = _tightness_benchmark()
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 200, 16, generator=gen, dtype=F64), torch.randn(200, 16, generator=gen, dtype=F64)
    mean = q[:, 160:192].mean((0, 1))
    k[37] = 60 * mean / mean.square().sum()  # a key the observation window's queries attend to
    tiers = bench.Tiers("int8", 0.3, window=32, sinks=4)
    heavy = bench.heavy_tokens(q, k, 0.25, None, 8, tiers)
    assert int(heavy.sum()) == 60 and bool(heavy[:4].all()) and bool(heavy[160:].all()) and bool(heavy[37])
    moved = q.clone()
    moved[:, 192:] = torch.randn(2, 8, 16, generator=gen, dtype=F64)  # the reads' queries
    assert torch.equal(bench.heavy_tokens(moved, k, 0.25, None, 8, tiers), heavy)
    windowed = bench.heavy_tokens(q, k, 0.25, 20, 8, tiers)  # a sliding window of 20: k[37] is out of every view
    assert not bool(windowed[37]) and int(windowed.sum()) == 60
    with pytest.raises(ValueError, match="heavy fraction 0.1 of 200 tokens is below the 44 tokens"):
        bench.heavy_tokens(q, k, 0.25, None, 8, bench.Tiers("int8", 0.1))


def test_tightness_benchmark_token_tiers(tmp_path):
    """``cells`` with token tiers on random queries and keys: the heavy tokens take the wider code (so its box is
    never above the narrow code's alone on these cells' median), every cell's exact TV is within the light-atom form
    and the boxes, and the tier table has one row per tier row with measured bytes."""
    bench = _tightness_benchmark()
    gen = torch.Generator().manual_seed(13)
    qs = [torch.randn(4, 128, 64, generator=gen, dtype=F64) for _ in range(2)]
    ks = [torch.randn(2, 128, 64, generator=gen, dtype=F64) * 2 for _ in range(2)]
    seen = bench.Captured(qs, ks, 0.125, [None, 80])
    tiers = bench.Tiers("dither-int8", 0.5)
    narrow = bench.cells("dither-int4", seen, nq=3, intervals=8, delta_loc=1e-7)
    tiered = bench.cells("dither-int4", seen, nq=3, intervals=8, delta_loc=1e-7, tiers=tiers)
    assert float(tiered["box"].median()) < float(narrow["box"].median())
    for key in ("box", "partial", "light_form"):
        assert bool((tiered["tv"] <= tiered[key]).all()), key
    assert tiered["kv_light"].shape == tiered["kv_box"].shape == (2 * 2 * 3,)
    assert bool((tiered["light"] >= 0).all()) and bool((tiered["light"] < 1).all()) and "light" not in narrow
    assert bool((tiered["light_sigma"] > 0).all())
    rows = {"narrow": ("dither-int4", None), "tiered": ("dither-int4", tiers)}
    table = bench.tier_table({"narrow": narrow, "tiered": tiered}, rows, ("int2", "int4"), 64, "random")
    assert len(table.rows) == 1 and len(table.rows[0]) == len(table.columns)
    codes = 0.5 * (bytes_per_token_head(get("dither-int4"), 64) + bytes_per_token_head(get("dither-int8"), 64))
    keys = codes + StorageConfig(seed=0).store(0).cell_layout(64, 64).witness_bytes
    assert bench.key_bytes("dither-int4", tiers, 64) == keys and table.rows[0][1] == fmt(keys)
    bench.plot_ceiling({"tiered": tiered}, {"tiered": keys}, tmp_path / "tiers.png", "random")
    assert (tmp_path / "tiers.png").stat().st_size > 0
