"""Eviction observability: eviction is a selection operator, so its error is the evicted attention mass.

The served distribution is the full one restricted to the kept set ``K`` and renormalised,
``p̃_i = p_i 1[i ∈ K] / m`` with ``m = Σ_{i ∈ K} p_i > 0``. Then

    TV(p, p̃) = ½ Σ_i |p_i − p̃_i| = 1 − m = Σ_{i ∉ K} p_i        (the evicted mass)

since kept items gain ``p_i (1/m − 1) >= 0`` (total ``1 − m``) and evicted items lose ``p_i`` (total
``1 − m``). In *validate* mode the host tier still holds every item, so the evicted mass of the current
read is measured exactly (tier CERTIFIED: the exact value is its own bound). In *serving* mode the
evicted items are gone; the reading is the mass they held on the last read before eviction, an
EMPIRICAL proxy with no bound claimed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvcert.contracts.tiers import Tier
from kvcert.evict.base import F64


@dataclass(frozen=True)
class EvictionReading:
    """Evicted attention mass per cell (``[..., ]`` = the attention's leading dims) with its tier."""

    mass: Tensor
    tier: Tier
    mode: str  # "validate" or "serving"


def _check(attn: Tensor, keep_mask: Tensor) -> None:
    if attn.shape != keep_mask.shape or keep_mask.dtype != torch.bool:
        raise ValueError(
            f"keep_mask must be bool with attn's shape {tuple(attn.shape)}, got {keep_mask.dtype} "
            f"{tuple(keep_mask.shape)}"
        )
    if not bool((torch.isfinite(attn) & (attn >= 0)).all()):  # one check (one sync on a device)
        raise ValueError("attn must be finite and non-negative")


def evicted_mass(attn: Tensor, keep_mask: Tensor) -> Tensor:
    """``Σ_{i ∉ K} attn_i`` over the last dim, float64."""
    _check(attn, keep_mask)
    return (attn.to(F64) * ~keep_mask).sum(-1)


def served_attention(attn: Tensor, keep_mask: Tensor) -> Tensor:
    """``attn`` restricted to the kept set and renormalised (what a cache holding only ``K`` serves).

    ``ValueError`` if some row keeps zero mass (the served distribution would be undefined).
    """
    _check(attn, keep_mask)
    kept = attn.to(F64) * keep_mask
    total = kept.sum(-1, keepdim=True)
    if (total <= 0).any():
        raise ValueError("keep_mask keeps zero attention mass in some row")
    return kept / total


def selection_tv(attn: Tensor, keep_mask: Tensor) -> Tensor:
    """``TV(attn, served_attention(attn, K)) = ½ Σ |p − p̃|``, computed directly (rows sum to 1)."""
    return 0.5 * (attn.to(F64) - served_attention(attn, keep_mask)).abs().sum(-1)


def validate_reading(full_attn: Tensor, keep_mask: Tensor) -> EvictionReading:
    """Exact evicted mass of the current read from the full attention (host tier holds every item)."""
    return EvictionReading(evicted_mass(full_attn, keep_mask), Tier.CERTIFIED, "validate")


def serving_reading(last_served: Tensor, keep_mask: Tensor) -> EvictionReading:
    """EMPIRICAL reading at eviction time: mass of ``last_served`` (the last read over the items present
    before this eviction) on the items being evicted now (``keep_mask`` False)."""
    return EvictionReading(evicted_mass(last_served, keep_mask), Tier.EMPIRICAL, "serving")
