"""The query-subspace radius (``docs/math.md#query-subspace-witness``): a logit-error bound that is exact inside a
subspace where a head's queries concentrate and pays Cauchy–Schwarz only outside it.

For a key residual ``Δ ∈ ℝ^D``, **any** matrix ``U ∈ ℝ^{D×k}`` (meant to have orthonormal columns), ``w = UᵀΔ``,
``Δ_⊥ = Δ − Uw``, and a query ``q`` split as ``q = Ua + q_⊥`` for **any** ``a ∈ ℝ^k`` (``q_⊥ := q − Ua``; the read
takes ``a = Uᵀq``):

    q·Δ = a·w + (Uᵀq_⊥)·w + q_⊥·Δ_⊥                       (an identity)

so for a stored ``ŵ`` with ``‖ŵ − w‖ ≤ η`` and ``‖Δ_⊥‖ ≤ ρ`` (triangle and Cauchy–Schwarz inequalities):

    |q·Δ| ≤ |a·ŵ| + ‖a‖·η + ‖Uᵀq_⊥‖·(‖ŵ‖ + η) + ‖q_⊥‖·ρ.

Sound for every query, every ``U`` and every ``a``; orthonormal columns and ``a = Uᵀq`` only make it tight
(``Uᵀq_⊥ = 0``: the third term vanishes). With ``η = 0`` it is exact for queries inside the span of ``U``; for a
query orthogonal to that span and parallel to ``Δ_⊥`` it equals ``‖q‖·ρ``, which is ``|q·Δ|`` when ``ρ = ‖Δ_⊥‖``
(no smaller multiple of the last term is a bound). Evaluated in float64; the read-time rounding of the products is
the float64 evaluation's (relative ``~D·2^-53``), as for the Tier-A radius.
"""

from __future__ import annotations

import torch

from kvcert.checks import fail_if

F64 = torch.float64


def _check(q: torch.Tensor, basis: torch.Tensor, w_hat: torch.Tensor, eta: torch.Tensor, rho: torch.Tensor) -> None:
    if basis.dim() < 2 or q.shape[-1] != basis.shape[-2] or w_hat.shape[-1] != basis.shape[-1]:
        raise ValueError(
            f"shapes do not fit: q {tuple(q.shape)} [..., Q, D], basis {tuple(basis.shape)} [..., D, k], "
            f"w_hat {tuple(w_hat.shape)} [..., S, k]"
        )
    if eta.shape != w_hat.shape[:-1] or rho.shape != w_hat.shape[:-1]:
        raise ValueError(
            f"eta {tuple(eta.shape)} and rho {tuple(rho.shape)} must be w_hat's shape without k: "
            f"{tuple(w_hat.shape[:-1])}"
        )
    fail_if(
        ~(torch.isfinite(q).all() & torch.isfinite(basis).all() & torch.isfinite(w_hat).all()),
        lambda: ValueError("q, basis and w_hat must be finite"),
    )
    # +inf radii are allowed (they fail closed: the read cannot certify); NaN and negative ones are not
    fail_if(
        (torch.isnan(eta) | (eta < 0) | torch.isnan(rho) | (rho < 0)).any(),
        lambda: ValueError("eta and rho must be non-negative (NaN given or a negative entry)"),
    )


def query_subspace_radius(
    q: torch.Tensor,
    basis: torch.Tensor,
    w_hat: torch.Tensor,
    eta: torch.Tensor,
    rho: torch.Tensor,
    scale: float = 1.0,
) -> torch.Tensor:
    """Per (query, token) radius ``c ≥ |scale·q·Δ_t|`` (module docstring), float64 ``[..., Q, S]``.

    ``q[..., Q, D]`` queries; ``basis[..., D, k]`` the matrix ``U``; ``w_hat[..., S, k]`` the stored projections,
    ``eta[..., S] ≥ ‖ŵ_t − UᵀΔ_t‖`` and ``rho[..., S] ≥ ‖Δ_t − UUᵀΔ_t‖`` (leading dims broadcast). Raises
    ``ValueError`` on shapes that do not fit, non-finite ``q``/``basis``/``w_hat``, or NaN/negative ``eta``/``rho``.
    """
    _check(q, basis, w_hat, eta, rho)
    q, u, w, eta, rho = (t.to(F64) for t in (q, basis, w_hat, eta, rho))
    a = q @ u  # [..., Q, k]
    q_perp = q - a @ u.transpose(-1, -2)
    leak = torch.linalg.vector_norm(q_perp @ u, dim=-1)  # ‖Uᵀq_⊥‖: 0 for orthonormal U, up to rounding
    w_norm = torch.linalg.vector_norm(w, dim=-1)
    inside = (a @ w.transpose(-1, -2)).abs()
    radius = (
        inside
        + torch.linalg.vector_norm(a, dim=-1).unsqueeze(-1) * eta.unsqueeze(-2)
        + leak.unsqueeze(-1) * (w_norm + eta).unsqueeze(-2)
        + torch.linalg.vector_norm(q_perp, dim=-1).unsqueeze(-1) * rho.unsqueeze(-2)
    )
    # 0·inf (an unknown η or ρ where the query has no component) is NaN: fail closed to +inf
    return abs(scale) * torch.where(torch.isnan(radius), torch.inf, radius)
