"""The page-spectral p-weighted form of ``benchmarks/page_spectral_form.py`` (``docs/math.md#page-spectral-form``):
never below the exact TV, cell by cell, with and without a light atom, on random and adversarial residuals; the
one-sided sums never below the sums they bound; the bands are ``band_norms``'s."""

import pytest
import torch
from benchmark_scripts import load_benchmark

from kvcert.bounds import band_norms, tier_a_radius, true_tv

psf = load_benchmark("page_spectral_form")
F64 = torch.float64


def _read(seed: int, s: int, d: int, aligned: bool, peaked: bool):
    """One KV head read by 3 queries: exact keys, a residual (``aligned``: every residual along the first query, the
    direction where Cauchy–Schwarz is tight), the served and exact attention and the radii."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(3, d, generator=gen, dtype=F64) * (4.0 if peaked else 1.0)
    k = torch.randn(s, d, generator=gen, dtype=F64)
    scale = torch.rand(s, 1, generator=gen, dtype=F64) * 0.6
    if aligned:
        signs = torch.randint(0, 2, (s, 1), generator=gen).to(F64) * 2 - 1
        residual = signs * scale * q[0] / q[0].norm()
    else:
        residual = torch.randn(s, d, generator=gen, dtype=F64) * scale / d**0.5
    sc = d**-0.5
    p = torch.softmax(sc * q @ (k + residual).T, -1)
    exact = torch.softmax(sc * q @ k.T, -1)
    c = tier_a_radius(q, band_norms(residual, 8).unsqueeze(0), sc)
    return q, residual, sc, p, exact, c


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("peaked", [False, True])
@pytest.mark.parametrize(("page", "bands"), [(1, 1), (4, 1), (16, 8), (64, 2)])
def test_the_form_is_never_below_the_exact_tv(seed, aligned, peaked, page, bands):
    q, residual, sc, p, exact, c = _read(seed, 80, 32, aligned, peaked)
    tv = true_tv(exact, p)
    gen = torch.Generator().manual_seed(100 + seed)
    light = torch.rand(80, generator=gen) < 0.7
    for lit in (None, light, torch.ones(80, dtype=torch.bool)):
        masked = residual if lit is None else residual.masked_fill(~lit[:, None], 0.0)
        e = sc * band_norms(q, bands) @ psf.page_spectra(masked, page, bands).T
        form = psf.spectral_form(p, c, e, page, lit)
        assert bool((form >= tv - 1e-12).all()), (lit is None, (tv - form).max())
        assert bool((form <= 1.0).all())
        if lit is None:  # Cauchy–Schwarz per page: the first-order term is never below the exact one
            exact_linear = (p * sc * (q @ residual.T).abs()).sum(-1)
            assert bool((psf.page_weight(p, e, page) >= exact_linear - 1e-12).all())


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("up", [True, False])
def test_each_sided_sum_bounds_every_error_its_constraints_allow(seed, up):
    """Errors drawn at the constraints' edges (every token at its radius, or the page's norm on one token), weights
    from flat to a single token: the bound is never below the sum it bounds."""
    gen = torch.Generator().manual_seed(seed)
    s, page = 48, 16
    a = torch.rand(s, generator=gen, dtype=F64) ** (1 + 8 * seed % 5)
    a /= a.sum()
    c = torch.rand(s, generator=gen, dtype=F64) * 3
    x = (torch.rand(s, generator=gen, dtype=F64) * 2 - 1) * c
    if seed % 3 == 0:
        x = c * (1 if up else -1)  # every token at its radius, on the side the sum counts
    e = x.view(-1, page).norm(dim=-1) * (1 + torch.rand(s // page, generator=gen, dtype=F64))
    got = psf.sided_sum(a, c, e, page, up)
    want = (a * (torch.expm1(x) if up else -torch.expm1(x)).clamp(min=0)).sum()
    assert float(got) >= float(want) - 1e-12


def test_a_single_token_page_is_the_per_token_sum_or_less():
    gen = torch.Generator().manual_seed(0)
    a, c = torch.rand(2, 10, generator=gen, dtype=F64)
    e = torch.full((10,), 100.0, dtype=F64)  # a page norm that says nothing: the per-token term is kept
    assert torch.allclose(psf.sided_sum(a, c, e, 1, True), (a * torch.expm1(c)).sum())
    assert torch.allclose(psf.sided_sum(a, c, e, 1, False), (a * c.clamp(max=1.0)).sum())


@pytest.mark.parametrize("bands", [1, 2, 8])
def test_band_columns_are_the_bands_of_band_norms(bands):
    x = torch.randn(5, 32, dtype=F64)
    cols = psf.band_columns(32, bands)
    assert torch.allclose(torch.stack([x[:, i].norm(dim=-1) for i in cols], -1), band_norms(x, bands))
    with pytest.raises(ValueError, match="cannot be split"):
        psf.band_columns(32, 3)


def test_the_figure_draws_every_codec(tmp_path):
    one = torch.linspace(0, 1, 50, dtype=F64)
    rows = {name: (one, one > 0.5) for name in ("exact TV", "box", "best page form", "best of box and forms")}
    path = tmp_path / "f.png"
    psf.plot({"int4": rows, "dither-int5": rows}, path, "t")
    assert path.stat().st_size > 10_000
