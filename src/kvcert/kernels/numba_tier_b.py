"""Fused CPU kernel of the Tier-B side meter (numba): dither radii plus logit slack, then the meter.

The eager Tier-B meter of a read (``kvcert.attention.certified._tier_b``) is

``u_t = sqrt(2·σ²_t·ln(2S/δ_loc)) + rate·kfac_t``, ``σ²_t = (sc²/12)·Σ_g s_{t,g}²‖q_g‖²``,
``rate = sc·γ_{D+1}·‖q‖``, ``kfac_t = 2‖k̂_t‖ + W_t``, and the meter ``served_meter(p̃, u)``

(:func:`kvcert.bounds.tier_b_sigma2`, :func:`kvcert.bounds.tier_b_radius`, the read path's float32 logit slack,
:func:`kvcert.bounds.softmax_tv.served_meter`): some thirty float64 tensor ops per layer. :func:`tier_b_meter`
computes the radii in one compiled pass over the store's allocations, ``e^{u}`` as numpy's vectorised ``exp``
and the meter with the read path's row kernel (:func:`kvcert.kernels.numba_read.softmax_meter`'s, with its
rounding allowance).

Rounding (``docs/math.md#tier-b-kernel``): every radius is a sum and product of non-negative float64 terms with
at most ``n = group_size + G + 8`` roundings on its longest chain (``G = D/group_size``; the squares of float32
values are exact in float64), so the computed value before inflation is at least ``(1 − γ_n)`` times its exact
value, and the eager value (the same formula, at most ``n`` roundings) at most ``(1 + γ_n)`` times it. The kernel
multiplies by ``1 + 3γ_n``, which makes each radius at least the exact one and at least the eager one. The meter
is then the read path's fused meter on those radii: never below the exact meter formula at them, which bounds the
TV on the event ``|ε_t| ≤ u_t`` (larger radii only weaken the event's conclusion, never its validity).
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from kvcert.kernels.numba_read import meter_rows

__all__ = ["tier_b_inflation", "tier_b_meter"]

_U64 = 2.0**-53


def tier_b_inflation(group_size: int, groups: int) -> float:
    """``1 + 3γ_n`` with ``n = group_size + groups + 8``, ``γ_n = n·u/(1 − n·u)``, ``u = 2^-53``: the factor that
    lifts a computed Tier-B radius above both its exact value and the eager evaluation's."""
    n = group_size + groups + 8
    return 1.0 + 3.0 * (n * _U64 / (1.0 - n * _U64))


@numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "contract"})
def _tier_b_radii(
    q: np.ndarray,
    steps: np.ndarray,
    k_hat_norm: np.ndarray,
    k_wit: np.ndarray,
    qn: np.ndarray,
    s: int,
    group_size: int,
    sig_scale: float,
    log_term: float,
    rate_scale: float,
    infl: float,
    u: np.ndarray,
) -> bool:  # pragma: no cover - compiled (tested via numba)
    """``u[b, h, r, t] = (sqrt(2·sig_scale·Σ_g steps[t, g]²·‖q_g‖²·log_term) + rate_scale·qn[r]·(2·k_hat_norm[t] +
    k_wit[t]))·infl`` for ``t < s`` (float64 from float32 store fields, any summation order; every term is
    non-negative, so each sum is within ``γ`` of its terms' exact sum). False (nothing certified here) when a query
    entry, step or radius is not finite or a step or radius is negative."""
    nb, nh, m, d = q.shape
    ng = d // group_size
    qg2 = np.empty(ng)
    acc = np.empty(s)  # Σ_g steps[t, g]²·‖q_g‖² per token, the groups added in order (token loops innermost: SIMD)
    for bi in range(nb):
        for h in range(nh):
            for r in range(m):
                for g in range(ng):
                    sq = 0.0
                    for j in range(g * group_size, (g + 1) * group_size):
                        x = np.float64(q[bi, h, r, j])
                        sq += x * x
                    qg2[g] = sq
                rate = rate_scale * qn[bi, h, r]
                bad = not (np.isfinite(rate) and rate >= 0.0)
                acc[:] = 0.0
                for g in range(ng):
                    qq = qg2[g]
                    for t in range(s):
                        st = np.float64(steps[bi, h, t, g])
                        bad |= not st >= 0.0
                        acc[t] += st * st * qq
                for t in range(s):
                    kf = 2.0 * np.float64(k_hat_norm[bi, h, t]) + np.float64(k_wit[bi, h, t])
                    ut = (math.sqrt(2.0 * (acc[t] * sig_scale) * log_term) + rate * kf) * infl
                    bad |= not (ut >= 0.0 and ut < np.inf)
                    u[bi, h, r, t] = ut
                if bad:
                    return False
    return True


def tier_b_meter(
    q: np.ndarray,
    steps: np.ndarray,
    k_hat_norm: np.ndarray,
    k_wit: np.ndarray,
    qn: np.ndarray,
    p: np.ndarray,
    s: int,
    *,
    scale: float,
    gamma: float,
    group_size: int,
    delta_loc: float,
) -> torch.Tensor | None:
    """The Tier-B meter ``[B, Hkv, M]`` (float64, clipped at 1; 0 on rows with no visible token) of the served
    distribution ``p[B, Hkv, M, S]`` (float64) under the dither radii of grouped float32 queries
    ``q[B, Hkv, M, D]`` (C-contiguous; channel mask already applied) plus the float32 logit slack, never below the
    eager form's value (module docstring). Store fields are numpy views of whole float32 allocations of which
    the first ``s`` tokens are read: ``steps[B, Hkv, ≥s, D/group_size]``, ``k_hat_norm`` / ``k_wit``
    ``[B, Hkv, ≥s]``; ``qn[B, Hkv, M]`` is ``‖q‖₂`` (float64) and ``gamma`` the float32 constant ``γ_{D+1}``.
    ``None`` when an input is not finite or a step or radius negative (the caller takes the eager form, which raises its
    error). CPU only; ``s ≥ 1``."""
    b, h, m, d = q.shape
    if s < 1 or d % group_size or p.shape != (b, h, m, s):
        raise ValueError(f"tier_b_meter: p {p.shape} must be [{b}, {h}, {m}, s >= 1], D={d} a multiple of {group_size}")
    if not (0.0 < delta_loc <= 1.0):
        raise ValueError(f"delta_loc must lie in (0, 1], got {delta_loc}")
    u = np.empty((b, h, m, s))
    infl = tier_b_inflation(group_size, d // group_size)
    log_term = math.log(2.0 * s / delta_loc)
    ok = _tier_b_radii(
        q, steps, k_hat_norm, k_wit, qn, s, group_size, scale * scale / 12.0, log_term, scale * gamma, infl, u
    )
    if not ok:
        return None
    return torch.from_numpy(meter_rows(p.reshape(-1, s), u.reshape(-1, s)).reshape(b, h, m))
