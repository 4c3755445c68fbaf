"""Bridges between metrics, as contracts (``docs/contracts.md#bridges``).

A bridge changes the metric an error is measured in. Scalar transfer functions are pure Python
(float in, float out) so that ``kvcert.contracts`` has no tensor dependency.
"""

from __future__ import annotations

import math

from kvcert.contracts.contract import Contract, Premise
from kvcert.contracts.metric import ATTN_DIST_TV, ATTN_LOGIT_LINF, KV_ENTRY_L2, SELECTOR_DIST_TV
from kvcert.contracts.tiers import Tier


def _check_nonneg(value: float, name: str) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0.0:
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    return value


def tv_uniform(eps: float) -> float:
    """Uniform softmax bridge: ``‖s - s'‖_∞ <= ε`` implies ``TV(softmax s, softmax s') <= ½(e^{2ε} - 1)``.

    Unclipped (may exceed 1; ``inf`` when ``e^{2ε}`` overflows). [Lean ``softmax_tv_bridge``]
    """
    eps = _check_nonneg(eps, "eps")
    try:
        return 0.5 * math.expm1(2.0 * eps)
    except OverflowError:
        return math.inf


def tv_tanh(eps: float) -> float:
    """tanh bridge: ``‖s - s'‖_∞ <= ε`` implies ``TV <= tanh ε`` (< 1). [Lean ``softmax_tv_bridge_tanh``]"""
    return math.tanh(_check_nonneg(eps, "eps"))


def score_bridge(scale: float, max_q_norm: float) -> Contract:
    """``kv_entry:l2@write -> attn_logit:linf@consume`` with ``a = scale·max‖q‖₂``, ``b = 0``, certified.

    ``|Δs_t| = scale·|q·Δk_t| <= scale·‖q‖₂·‖Δk_t‖₂`` (Cauchy–Schwarz), so ``‖Δs‖_∞ <= a·max_t ‖Δk_t‖₂``.
    Assumption: ``max_q_norm`` bounds ``‖q‖₂`` for every query the bound is applied to (per read, or
    a supremum over the reads it covers; a *mean* query norm gives a diagnostic reading, not a bound).
    """
    scale = _check_nonneg(scale, "scale")
    max_q_norm = _check_nonneg(max_q_norm, "max_q_norm")
    return Contract(
        name="score_bridge",
        a=scale * max_q_norm,
        b=0.0,
        delta=0.0,
        tier=Tier.CERTIFIED,
        m_in=KV_ENTRY_L2,
        m_out=ATTN_LOGIT_LINF,
        reason="Cauchy-Schwarz |scale·q·Δk| <= scale·‖q‖·‖Δk‖ [WitCert.Calculus.score_bridge]",
    )


def softmax_uniform() -> Contract:
    """``attn_logit:linf -> attn_dist:tv``, exact transfer ``½(e^{2ε} - 1)``, certified as a scalar bound.

    No finite affine relaxation holds for all ε, so ``a = inf``: evaluate it, or chain the affine
    bridge :func:`softmax_affine` when a finite slope is needed.
    """
    return Contract(
        name="softmax_uniform",
        a=math.inf,
        b=0.0,
        delta=0.0,
        tier=Tier.CERTIFIED,
        m_in=ATTN_LOGIT_LINF,
        m_out=ATTN_DIST_TV,
        reason="TV <= ½(e^{2ε}-1) for ‖Δs‖_∞ <= ε [softmax_tv_bridge]",
        transfer=tv_uniform,
    )


def softmax_tanh() -> Contract:
    """``attn_logit:linf -> attn_dist:tv``, exact transfer ``tanh ε``; affine form ``(1, 0)`` since
    ``tanh ε <= ε`` for ``ε >= 0``. Certified."""
    return Contract(
        name="softmax_tanh",
        a=1.0,
        b=0.0,
        delta=0.0,
        tier=Tier.CERTIFIED,
        m_in=ATTN_LOGIT_LINF,
        m_out=ATTN_DIST_TV,
        reason="TV <= tanh ε <= ε for ‖Δs‖_∞ <= ε [softmax_tv_bridge_tanh]",
        transfer=tv_tanh,
    )


def softmax_affine(eps0: float) -> Contract:
    """``attn_logit:linf -> attn_dist:tv`` as the affine contract ``(e^{2ε₀}, 0)``, premise ``ε <= ε₀``.

    For ``0 <= ε <= ε₀``: ``½(e^{2ε} - 1) = ∫₀^ε e^{2t} dt <= e^{2ε₀}·ε``. Partial: it holds only where
    the runtime premise holds; evaluating at ``ε > ε₀`` raises :class:`PremiseViolation`.
    [``softmax_tv_affine``]
    """
    eps0 = _check_nonneg(eps0, "eps0")
    try:
        a = math.exp(2.0 * eps0)
    except OverflowError:
        raise ValueError(f"eps0 too large: e^(2·eps0) overflows for eps0={eps0!r}") from None
    return Contract(
        name="softmax_affine",
        a=a,
        b=0.0,
        delta=0.0,
        tier=Tier.PARTIAL,
        m_in=ATTN_LOGIT_LINF,
        m_out=ATTN_DIST_TV,
        reason=f"½(e^(2ε)-1) <= e^(2ε₀)·ε on the runtime-checked premise ε <= ε₀={eps0:.6g} [softmax_tv_affine]",
        premise=Premise(f"eps <= eps0 = {eps0!r}", lambda e: e <= eps0),
    )


def selector_mass_ratio(
    measured_ratio: float, measured_on: str = "unspecified", applied_to: str = "unspecified"
) -> Contract:
    """``selector_dist:tv -> attn_dist:tv``, ``a = ρ`` (measured mass ratio ``m_attn / m_sel``), EMPIRICAL.

    ρ is a measurement (typically a sample maximum), never a confidence bound; a chain containing
    this stage is empirical. ``measured_on`` / ``applied_to`` record the homogeneity assumption.
    """
    rho = _check_nonneg(measured_ratio, "measured_ratio")
    return Contract(
        name="selector_mass_ratio",
        a=rho,
        b=0.0,
        delta=0.0,
        tier=Tier.EMPIRICAL,
        m_in=SELECTOR_DIST_TV,
        m_out=ATTN_DIST_TV,
        reason=f"measured omitted-mass ratio rho={rho:.6g} (measured on {measured_on}, applied to "
        f"{applied_to}); a sample statistic, not a confidence bound",
    )
