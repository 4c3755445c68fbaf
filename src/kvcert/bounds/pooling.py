"""Block-pooling contract (Lemma P1) and concentration profile (``docs/memory-meters.md#pooling``).

A pooled entry is ``c = Σ_j w_j x_j`` over a block of ``B`` tokens with ``w ≥ 0``, ``Σ_j w_j = 1``; token
errors
``Δ_j`` give ``Δc = Σ_j w_j Δ_j``. Two sound contracts (report both):

* ℓ2 form: ``‖Δc‖ ≤ ‖w‖₂·(Σ_j ‖Δ_j‖²)^{1/2}`` (Cauchy–Schwarz), coefficient ``a = ‖w‖₂ ∈ [1/√B, 1]``;
* ℓ∞ form: ``‖Δc‖ ≤ max_j ‖Δ_j‖`` (convexity) [Lean ``pool_linf``], coefficient ``a = 1``, no assumption.

The concentration profile (``top1_norm``, normalised entropy, effective fraction) is **empirical**. Floors
that
hold for any valid ``w`` — ``max_j w_j ≥ 1/B`` and ``‖w‖₂ ≥ 1/√B`` — are self-checks; a violation is a bug.

Weights are ``w[..., B]`` (block axis last); with per-channel gating pass ``[..., D, B]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FLOOR_TOL = 1e-4


def pool_weights(gate_scores: torch.Tensor, block: int) -> torch.Tensor:
    """Softmax gate weights per block and channel: ``gate_scores[n, D]`` -> ``w[n/block, D, block]``
    (float64)."""
    if gate_scores.dim() != 2:
        raise ValueError(f"gate_scores must have shape [n, D], got {tuple(gate_scores.shape)}")
    n, d = gate_scores.shape
    if block < 1 or n % block:
        raise ValueError(f"block={block} must be >= 1 and divide the token count n={n}")
    if not torch.isfinite(gate_scores).all():
        raise ValueError("gate_scores contains non-finite entries")
    x = gate_scores.to(torch.float64).reshape(n // block, block, d).transpose(1, 2)
    return torch.softmax(x, dim=-1)


def _check_weights(w: torch.Tensor) -> torch.Tensor:
    x = w.to(torch.float64)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"w must have a non-empty block axis last, got {tuple(w.shape)}")
    if not torch.isfinite(x).all() or (x < 0).any():
        raise ValueError("pooling weights w must be finite and non-negative")
    if ((x.sum(-1) - 1.0).abs() > 1e-9).any():
        raise ValueError("pooling weights w must sum to 1 over the block axis")
    return x


def pooled(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``c = Σ_j w_j x_j``: ``x[..., B, D]`` tokens of each block, ``w[..., B]`` -> ``c[..., D]``
    (float64)."""
    ww = _check_weights(w)
    return torch.einsum("...j,...jd->...d", ww, x.to(torch.float64))


@dataclass(frozen=True)
class PoolingProfile:
    """Per-block contract coefficients and concentration profile (float64 ``[...]``).

    ``a_l2 = ‖w‖₂`` (ℓ2 contract coefficient, certified), ``a_linf = 1`` (ℓ∞ form, certified),
    ``top1_norm = (max w − 1/B)/(1 − 1/B)``, ``entropy_n = H/log B``, ``eff_frac = e^H/B`` (empirical),
    ``floor_mask`` marks blocks with ``max w < 1/B − 1e−4`` or ``‖w‖₂ < 1/√B − 1e−4``, ``floor_violations`` counts
    them (must be 0).
    """

    block: int
    a_l2: torch.Tensor
    a_linf: torch.Tensor
    top1_norm: torch.Tensor
    entropy_n: torch.Tensor
    eff_frac: torch.Tensor
    floor_mask: torch.Tensor
    floor_violations: int


def pooling_profile(w: torch.Tensor) -> PoolingProfile:
    """Contract coefficients and concentration profile of pooling weights ``w[..., B]`` (see
    ``PoolingProfile``)."""
    x = _check_weights(w)
    b = x.shape[-1]
    top1 = x.max(-1).values
    a_l2 = x.square().sum(-1).sqrt()
    ent = -(x * x.clamp_min(1e-300).log()).sum(-1)
    if b > 1:
        top1_norm = (top1 - 1.0 / b) / (1.0 - 1.0 / b)
        entropy_n = ent / math.log(b)
    else:
        top1_norm = torch.ones_like(top1)
        entropy_n = torch.zeros_like(top1)
    viol = (top1 < 1.0 / b - FLOOR_TOL) | (a_l2 < 1.0 / math.sqrt(b) - FLOOR_TOL)
    return PoolingProfile(
        block=b,
        a_l2=a_l2,
        a_linf=torch.ones_like(a_l2),
        top1_norm=top1_norm,
        entropy_n=entropy_n,
        eff_frac=ent.exp() / b,
        floor_mask=viol,
        floor_violations=int(viol.sum()),
    )
