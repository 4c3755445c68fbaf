"""E-process factors for the drift sentinel (``docs/math.md#e-process-factor``), pure float64 math.

For an authorised write entry with realised witness ``W`` (a function of independent bounded coordinates
whose one-coordinate changes are bounded by ``Δ_c``), pre-draw mean term ``m ≥ E[W]`` and
``C = Σ_c Δ_c²``, the factor is::

    g = exp(λ (W − m) − λ² C / 8),    λ = 4κ / √C.

McDiarmid's MGF bound gives ``E[exp(λ(W − E W))] ≤ exp(λ² C / 8)``, and ``m ≥ E W`` then gives
``E[g] ≤ 1``: the running product ``M_t = Π g`` is a non-negative supermartingale and Ville's inequality
gives ``P(∃t: M_t ≥ 1/δ_e) ≤ δ_e``. The alarm therefore fires when ``log M_t ≥ ln(1/δ_e)``.
"""

from __future__ import annotations

import math

import numpy as np

KAPPA = 0.5
"""Pre-registered tilt: ``λ = 4κ/√C``."""


def _check_positive_finite(name: str, x: np.ndarray) -> None:
    if not np.all(np.isfinite(x)) or np.any(x <= 0):
        raise ValueError(f"{name} must be finite and > 0")


def eprocess_lambda(c: np.ndarray | float, kappa: float = KAPPA) -> np.ndarray:
    """Tilt ``λ = 4κ/√C`` per entry (float64); ``C = Σ_c Δ_c² > 0``."""
    if not (math.isfinite(kappa) and kappa > 0):
        raise ValueError(f"kappa must be finite and > 0, got {kappa}")
    c64 = np.asarray(c, dtype=np.float64)
    _check_positive_finite("c", c64)
    return 4.0 * kappa / np.sqrt(c64)


def eprocess_log_factor(
    w: np.ndarray | float, m: np.ndarray | float, c: np.ndarray | float, kappa: float = KAPPA
) -> np.ndarray:
    """``log g = λ(W − m) − λ²C/8`` per entry (float64), with ``λ = 4κ/√C``.

    Contract: if ``W`` has bounded differences ``Δ_c`` with ``Σ Δ_c² = C`` and ``E W ≤ m`` then
    ``E[exp(log g)] ≤ 1``. ``W`` and ``m`` must be finite.
    """
    w64 = np.asarray(w, dtype=np.float64)
    m64 = np.asarray(m, dtype=np.float64)
    if not (np.all(np.isfinite(w64)) and np.all(np.isfinite(m64))):
        raise ValueError("w and m must be finite")
    c64 = np.asarray(c, dtype=np.float64)
    lam = eprocess_lambda(c64, kappa)
    return lam * (w64 - m64) - lam * lam * c64 / 8.0


def alarm_threshold(delta_e: float) -> float:
    """``ln(1/δ_e)``: Ville's level; crossing it has probability ≤ ``δ_e`` under the null."""
    if not (math.isfinite(delta_e) and 0.0 < delta_e < 1.0):
        raise ValueError(f"delta_e must lie in (0, 1), got {delta_e}")
    return math.log(1.0 / delta_e)
