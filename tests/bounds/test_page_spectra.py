"""The page-spectral witness (``docs/math.md#page-spectral-witness``): the rigorous spectral-norm bound, the page
spectra of the principal-basis sketch, and the per-page bound ``basis_page_bound`` — per matrix, per page and per
cell, for random and adversarial queries (along the top singular vector of a page's residuals, where the page step
is tight)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcert.bounds import pages as pg
from kvcert.bounds.spectral import spectral_norm_up

F64 = torch.float64


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 20), st.integers(1, 70), st.integers(-250, 250), st.integers(0, 3), st.integers(0, 2**31 - 1))
def test_spectral_bound_dominates_and_is_within_its_stated_factor(m, n, exp10, kind, seed):
    """``‖X‖₂ ≤ σ̄ ≤ k^{1/2^{K+2}}·‖X‖₂`` (``k = min(m, n)``, ``K = 5``; up to the reference SVD's own rounding) for
    Gaussian, rank-one, orthogonal-column (flat spectrum: the factor is attained) and one-dominant-column matrices
    from 1e-250 to 1e250."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, m, n, generator=gen, dtype=F64)
    if kind == 1:
        x = torch.randn(4, m, 1, generator=gen, dtype=F64) @ torch.randn(4, 1, n, generator=gen, dtype=F64)
    elif kind == 2:
        big, small = max(m, n), min(m, n)
        qmat = torch.linalg.qr(torch.randn(4, big, small, generator=gen, dtype=F64)).Q
        x = qmat if m >= n else qmat.transpose(-1, -2)
    elif kind == 3:
        x[..., 0] *= 1e6
    x = x * 10.0**exp10
    sigma = spectral_norm_up(x)
    ref = torch.linalg.matrix_norm(x, ord=2)
    assert bool((sigma >= ref * (1 - 1e-12)).all()), (sigma / ref).min()
    factor = min(m, n) ** (1 / 2**7)
    # the final log/exp's relative 2^-30 inflation and the product allowances aside (as the flat-spectrum test below);
    # 1e-9 alone was exceeded by 1.05e-9 on an orthogonal 20 × 39 matrix at 1e71
    assert bool((sigma <= ref * factor * (1 + 3e-9)).all()), (sigma / ref).max()


def test_spectral_bound_of_zero_and_bad_input():
    assert torch.equal(spectral_norm_up(torch.zeros(3, 4, 5)), torch.zeros(3, dtype=F64))
    with pytest.raises(ValueError, match="NaN or inf"):
        spectral_norm_up(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="squarings"):
        spectral_norm_up(torch.ones(2, 2), squarings=0)
    with pytest.raises(ValueError, match=r"\[\.\.\., m, n\]"):
        spectral_norm_up(torch.ones(3))


def test_flat_spectrum_attains_the_stated_factor_for_every_squaring_count():
    """On an orthogonal ``16 × 16`` matrix (``‖X‖₂ = 1``, flat spectrum) the bound is exactly ``16^{1/2^{K+2}}`` for
    ``K`` squarings: any slip in the tracked exponents or the final root shows here."""
    qmat = torch.linalg.qr(torch.randn(16, 16, dtype=F64, generator=torch.Generator().manual_seed(0))).Q
    for k in (1, 2, 3, 5, 7):
        got = float(spectral_norm_up(qmat[None] * 3.0, squarings=k)[0]) / 3.0
        assert got == pytest.approx(16 ** (1 / 2 ** (k + 2)), rel=3e-9), k  # the final 2^-30 inflation aside


def _residuals(keys: torch.Tensor, sk: pg.BasisSketch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 head coefficient errors ``Aᵀk − â`` ``[..., N, r]``, tail residuals ``k − AAᵀk − B·b̂`` ``[..., N, D]``
    and ``‖Aᵀk‖`` ``[..., N]`` from the stored sketch."""
    a, b, k = sk.basis.to(F64), sk.tail.to(F64), keys.to(F64)
    coef = k @ a
    ahat = sk.codes.to(F64) * sk.scale.to(F64).unsqueeze(-1)
    tail = k - coef @ a.transpose(-1, -2) - sk.tail_coefficients() @ b.transpose(-1, -2)
    return coef - ahat, tail, coef.norm(dim=-1)


def _pages(x: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[..., N, m]`` -> ``[..., P, page_size, m]`` (zero-padded)."""
    n = x.shape[-2]
    pages = -(-n // page_size)
    return torch.nn.functional.pad(x, (0, 0, 0, pages * page_size - n)).reshape(*x.shape[:-2], pages, page_size, -1)


def _page_truth(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sc: float, gamma: float, ps: int):
    """``log Σ_{t∈P visible} e^{s_t}`` with ``s_t = sc·⟨q, k_t⟩ + 3·sc·γ·‖q‖‖k_t‖`` in float64 ``[..., M, P]``
    (``-inf`` for a page without a visible token)."""
    q64, k64 = q.to(F64), keys.to(F64)
    s = (
        sc * q64 @ k64.transpose(-1, -2)
        + 3 * sc * gamma * q64.norm(dim=-1, keepdim=True) * k64.norm(dim=-1)[..., None, :]
    )
    s = torch.where(visible, s, float("-inf"))
    pages = -(-s.shape[-1] // ps)
    s = torch.nn.functional.pad(s, (0, pages * ps - s.shape[-1]), value=float("-inf"))
    return torch.logsumexp(s.reshape(*s.shape[:-1], pages, ps), -1)


def _adversarial_queries(keys, sk, ps, gen, mag):
    """Random queries, and queries along the top singular vector of each of the first pages' tail residuals and
    head errors (mapped through ``A``), where the page-spectral Cauchy–Schwarz step is an equality."""
    g, h, _ = _residuals(keys, sk)
    q = torch.randn(*keys.shape[:-2], 3, keys.shape[-1], generator=gen, dtype=F64) * mag
    tops = [torch.linalg.svd(_pages(h, ps)[..., 0, :, :].transpose(-1, -2), full_matrices=False).U[..., 0]]
    head = _pages(g, ps)[..., 0, :, :] @ sk.basis.to(F64).transpose(-1, -2)
    tops.append(torch.linalg.svd(head.transpose(-1, -2), full_matrices=False).U[..., 0])
    return torch.cat([q, *(t.unsqueeze(-2) * mag * 3 for t in tops)], -2).float()


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 40),
    st.integers(2, 24),
    st.integers(1, 10),
    st.integers(1, 9),
    st.integers(-3, 3),
    st.integers(0, 2**31 - 1),
    st.booleans(),
)
def test_page_spectra_and_page_bound_hold_for_any_query_in_every_page(n_tok, d, rank, page_size, exp10, seed, aware):
    """Per page: the stored spectra dominate the spectral norms of the exact residual matrices (head plus the
    ``δ``-term, tail); per (query, page): ``seen·e^{ū} ≥ Σ_{t∈P visible} e^{s_t}`` for random, adversarial and
    zero queries under random masks, and ``ū`` never above the pooled per-token bound. ``aware``: the sketch in the
    query-aware basis of a Gram of queries with a dominant direction of their own (``docs/math.md#query-aware-basis``;
    the bound is the same for any basis)."""
    gen = torch.Generator().manual_seed(seed)
    mag = 10.0**exp10
    keys = (torch.randn(2, n_tok, d, generator=gen, dtype=F64) * mag).float()
    if seed % 2:  # structured keys: one dominant direction, so residuals of a page correlate
        keys = keys + (30 * mag * torch.randn(2, 1, d, generator=gen)).float()
    gram = None
    if aware:
        seen_q = torch.randn(2, 12, d, generator=gen, dtype=F64) + 5 * torch.randn(2, 1, d, generator=gen, dtype=F64)
        gram = seen_q.transpose(-1, -2) @ seen_q
    sk = pg.basis_sketch(keys, rank, page_size=page_size, query_gram=gram)
    g, h, coef_n = _residuals(keys, sk)
    a = sk.basis.to(F64)
    delta = (torch.eye(a.shape[-1], dtype=F64) - a.transpose(-1, -2) @ a).flatten(-2).norm(dim=-1)
    spec_g = torch.linalg.matrix_norm(_pages(g, page_size), ord=2)
    cross = _pages(coef_n.unsqueeze(-1), page_size)[..., 0].norm(dim=-1) * delta.unsqueeze(-1)
    assert bool((sk.coef_spec.to(F64) >= (spec_g + cross) * (1 - 1e-12)).all())
    assert bool((sk.perp_spec.to(F64) >= torch.linalg.matrix_norm(_pages(h, page_size), ord=2) * (1 - 1e-12)).all())
    q = _adversarial_queries(keys, sk, page_size, gen, mag)
    q = torch.cat([q, torch.zeros_like(q[..., :1, :])], -2)
    visible = torch.rand(*q.shape[:-1], n_tok, generator=gen) < 0.8
    sc, gamma = 1 / math.sqrt(d), 1e-6
    u, seen = pg.basis_page_bound(q, sk, visible, sc, gamma)
    truth = _page_truth(q, keys, visible, sc, gamma, page_size)
    on = seen.bool()
    assert torch.equal(on, truth > float("-inf"))
    assert bool((u[on] >= truth[on]).all()), float((truth - u)[on].max())
    pooled, _ = pg.pool_pages(pg.basis_logit_bound(q, sk, sc, gamma), visible, page_size)
    assert bool((u <= pooled).all())


def test_page_bound_is_tighter_than_pooling_when_attention_spreads_over_a_page():
    """Keys whose tail residuals are near orthogonal within each page and a query that spreads its attention over
    the page: the page-spectral bound lies strictly below the pooled per-token bound (its point of using the
    page's spectral norm instead of each token's Cauchy–Schwarz), and stays above the truth."""
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(1, 64, 64, generator=gen)
    sk = pg.basis_sketch(keys, 8, page_size=16)
    q = torch.randn(1, 4, 64, generator=gen) * 0.5
    visible = torch.ones(1, 4, 64, dtype=torch.bool)
    u, _ = pg.basis_page_bound(q, sk, visible, 0.125, 1e-7)
    pooled, _ = pg.pool_pages(pg.basis_logit_bound(q, sk, 0.125, 1e-7), visible, 16)
    truth = _page_truth(q, keys, visible, 0.125, 1e-7, 16)
    assert bool((u >= truth).all()) and bool((u < pooled - 0.05).all()), pooled - u


def test_zeroed_page_spectra_are_caught():
    """Planted bug: page spectra replaced by 0 (the residuals forgotten) make the page bound fail for a query along
    one token's tail residual (its logit above the sketch's point; one-token pages, so no other token hides it);
    the real sketch holds there."""
    gen = torch.Generator().manual_seed(2)
    keys = torch.randn(1, 32, 16, generator=gen) * torch.linspace(0.5, 3.0, 16)
    sk = pg.basis_sketch(keys, 4, page_size=1)
    _, h, _ = _residuals(keys, sk)
    q = (h[..., 3:4, :] / h[..., 3:4, :].norm(dim=-1, keepdim=True) * 200.0).float()  # along token 3's residual
    visible = torch.ones(1, 1, 32, dtype=torch.bool)
    truth = _page_truth(q, keys, visible, 0.25, 0.0, 1)
    broken = dataclasses.replace(sk, coef_spec=torch.zeros_like(sk.coef_spec), perp_spec=torch.zeros_like(sk.perp_spec))
    real, _ = pg.basis_page_bound(q, sk, visible, 0.25, 0.0)
    assert bool((real >= truth).all())
    bad, _ = pg.basis_page_bound(q, broken, visible, 0.25, 0.0)
    assert bool((bad[..., 3] < truth[..., 3]).all())


def test_page_spectra_bytes_and_refusals():
    keys = torch.randn(2, 3, 40, 64)
    plain, spec = pg.basis_sketch(keys, 16), pg.basis_sketch(keys, 16, page_size=16)
    assert spec.coef_spec is not None and spec.perp_spec is not None
    assert spec.coef_spec.shape == spec.perp_spec.shape == (2, 3, 3) and spec.coef_spec.dtype == torch.float32
    assert spec.nbytes == plain.nbytes + 2 * 3 * 3 * 2 * 4  # two float32 per page and (row, KV head)
    assert plain.page_size == 0 and plain.coef_spec is None
    q = torch.randn(2, 3, 1, 64)
    with pytest.raises(ValueError, match="page spectra"):
        pg.basis_page_bound(q, plain, torch.ones(2, 3, 1, 40, dtype=torch.bool), 0.125, 0.0)
    with pytest.raises(ValueError, match="visible must match"):
        pg.basis_page_bound(q, spec, torch.ones(2, 3, 1, 39, dtype=torch.bool), 0.125, 0.0)
    with pytest.raises(ValueError, match="page_size"):
        pg.basis_sketch(keys, 16, page_size=-1)
