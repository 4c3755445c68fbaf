"""The query-subspace radius (``kvcert.bounds.subspace_radius``): sound per cell for any basis, exact inside the span,
attained outside it, every term needed, and fail-closed on bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcert.bounds import query_subspace_radius

F64 = torch.float64
REL = 1e-12  # the float64 evaluation of the dot products


def parts(u: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w = UᵀΔ, ‖Δ − Uw‖)`` per token for ``delta[S, D]``."""
    w = delta @ u
    return w, torch.linalg.vector_norm(delta - w @ u.T, dim=-1)


@st.composite
def case(draw: st.DrawFn) -> tuple[torch.Tensor, ...]:
    d = draw(st.integers(1, 12))
    k = draw(st.integers(1, d))
    s = draw(st.integers(1, 6))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    raw = torch.randn(d, k, generator=gen, dtype=F64)
    basis = draw(st.sampled_from(["orthonormal", "any"]))
    u = torch.linalg.qr(raw).Q if basis == "orthonormal" else raw * 10.0 ** draw(st.floats(-2, 2))
    delta = torch.randn(s, d, generator=gen, dtype=F64) * 10.0 ** draw(st.floats(-6, 3))
    w, rho = parts(u, delta)
    noise = torch.randn(s, k, generator=gen, dtype=F64) * 10.0 ** draw(st.floats(-8, 0)) * w.norm()
    w_hat = w + noise
    eta = torch.linalg.vector_norm(noise, dim=-1) * draw(st.floats(1.0, 3.0))
    rho = rho * draw(st.floats(1.0, 3.0))
    # queries: random, inside the span, along the part of a residual outside it, along a residual
    j = draw(st.integers(0, s - 1))
    inside = u @ (u.T @ delta[j])
    pick = draw(st.sampled_from(["random", "inside", "outside", "residual"]))
    q = {
        "random": torch.randn(d, generator=gen, dtype=F64),
        "inside": inside,
        "outside": delta[j] - inside,
        "residual": delta[j],
    }[pick] * 10.0 ** draw(st.floats(-3, 3))
    return q.view(1, d), u, w_hat, eta, rho, delta


@settings(max_examples=400, deadline=None)
@given(case())
def test_radius_bounds_every_logit_error_for_any_basis(c):
    """Per (query, token): ``radius ≥ |q·Δ_t|`` for orthonormal and arbitrary ``U`` and every stored ``ŵ`` within
    ``η`` of ``UᵀΔ``."""
    q, u, w_hat, eta, rho, delta = c
    radius = query_subspace_radius(q, u, w_hat, eta, rho)
    err = (q @ delta.T).abs()
    assert bool((err <= radius * (1 + REL) + 1e-300).all())


def test_exact_inside_the_span():
    """``η = 0``, orthonormal ``U``, a query inside its span: the radius is ``|q·Δ|`` itself."""
    gen = torch.Generator().manual_seed(1)
    u = torch.linalg.qr(torch.randn(16, 5, generator=gen, dtype=F64)).Q
    delta = torch.randn(7, 16, generator=gen, dtype=F64)
    w, rho = parts(u, delta)
    q = (u @ torch.randn(5, generator=gen, dtype=F64)).view(1, 16)
    radius = query_subspace_radius(q, u, w, torch.zeros(7, dtype=F64), rho)
    torch.testing.assert_close(radius, (q @ delta.T).abs(), rtol=1e-9, atol=1e-12)


def test_attained_outside_the_span():
    """A query orthogonal to the span and parallel to ``Δ_⊥``: the radius equals ``|q·Δ| = ‖q‖·‖Δ_⊥‖``, so no smaller
    multiple of the last term is a bound."""
    gen = torch.Generator().manual_seed(2)
    u = torch.linalg.qr(torch.randn(16, 5, generator=gen, dtype=F64)).Q
    delta = torch.randn(1, 16, generator=gen, dtype=F64)
    w, rho = parts(u, delta)
    q = 3.0 * (delta - w @ u.T)
    radius = query_subspace_radius(q, u, w, torch.zeros(1, dtype=F64), rho)
    torch.testing.assert_close(radius, (q @ delta.T).abs(), rtol=1e-9, atol=0.0)


def test_the_leak_term_is_needed_for_a_basis_that_is_not_orthonormal():
    """``U = (½, 0)ᵀ``, ``q = Δ = e_1``: ``q·Δ = 1`` while ``|a·w| + ‖q_⊥‖‖Δ_⊥‖ = ¼ + 9/16 < 1``; the
    ``‖Uᵀq_⊥‖(‖ŵ‖ + η)`` term (3/16) closes the gap exactly."""
    u = torch.tensor([[0.5], [0.0]], dtype=F64)
    e1 = torch.tensor([[1.0, 0.0]], dtype=F64)
    w, rho = parts(u, e1)
    radius = query_subspace_radius(e1, u, w, torch.zeros(1, dtype=F64), rho)
    without_leak = (e1 @ u @ w.T).abs() + torch.linalg.vector_norm(e1 - (e1 @ u) @ u.T) * rho
    assert float(without_leak) == pytest.approx(0.8125)
    assert float(radius) == pytest.approx(1.0)


def test_scale_and_broadcast():
    """The radius scales with ``|scale|``; leading dims broadcast (one basis per head)."""
    gen = torch.Generator().manual_seed(3)
    u = torch.linalg.qr(torch.randn(2, 8, 3, generator=gen, dtype=F64)).Q  # [H, D, k]
    delta = torch.randn(2, 4, 8, generator=gen, dtype=F64)
    w = delta @ u
    rho = torch.linalg.vector_norm(delta - w @ u.transpose(-1, -2), dim=-1)
    q = torch.randn(2, 5, 8, generator=gen, dtype=F64)
    eta = torch.zeros(2, 4, dtype=F64)
    one = query_subspace_radius(q, u, w, eta, rho)
    assert one.shape == (2, 5, 4)
    torch.testing.assert_close(query_subspace_radius(q, u, w, eta, rho, scale=-0.25), 0.25 * one)
    assert bool(((q @ delta.transpose(-1, -2)).abs() <= one * (1 + REL)).all())


def test_unknown_witness_fails_closed():
    """``η = +inf`` gives an infinite radius, also where the query has no component in the span (0·inf)."""
    u = torch.tensor([[1.0], [0.0]], dtype=F64)
    q = torch.tensor([[0.0, 1.0]], dtype=F64)
    radius = query_subspace_radius(q, u, torch.zeros(1, 1, dtype=F64), torch.tensor([float("inf")]), torch.zeros(1))
    assert torch.isinf(radius).all()


@pytest.mark.parametrize(
    "change,message",
    [
        ({"eta": torch.tensor([float("nan")])}, "non-negative"),
        ({"rho": torch.tensor([-1.0])}, "non-negative"),
        ({"q": torch.tensor([[float("nan"), 0.0]])}, "finite"),
        ({"basis": torch.zeros(3, 1)}, "shapes do not fit"),
        ({"w_hat": torch.zeros(1, 2)}, "shapes do not fit"),
        ({"eta": torch.zeros(2)}, "w_hat's shape"),
    ],
)
def test_bad_input_is_refused_by_name(change, message):
    args = {
        "q": torch.ones(1, 2),
        "basis": torch.tensor([[1.0], [0.0]]),
        "w_hat": torch.zeros(1, 1),
        "eta": torch.zeros(1),
        "rho": torch.zeros(1),
    }
    args.update(change)
    with pytest.raises(ValueError, match=message):
        query_subspace_radius(**args)
