"""RoPE pairing conventions and per-band norms over whole rotary pairs.

RoPE rotates each complex pair ``z_j`` by a unit phasor ``e^{i·pos·θ_j}``. A band made of whole
pairs therefore has a position-invariant Euclidean norm (band-unitarity), so a band norm computed
at write time is valid for every later query position.

Pairing conventions (``docs/math.md#rope-pairings``):

* ``rotate_half`` (HF Llama/Qwen2/Gemma): pair ``j`` is ``(x_j, x_{j+D/2})``;
* ``interleaved`` (GPT-J, Meta reference, llama.cpp "normal"): pair ``j`` is ``(x_{2j}, x_{2j+1})``.
"""

from __future__ import annotations

from typing import Literal

import torch

from kvcert.checks import fail_if

Pairing = Literal["rotate_half", "interleaved"]
PAIRINGS: tuple[str, ...] = ("rotate_half", "interleaved")


def check_pairing(pairing: str) -> None:
    """Raise ``ValueError`` unless ``pairing`` is a known RoPE pairing convention."""
    if pairing not in PAIRINGS:
        raise ValueError(f"pairing must be one of {PAIRINGS}, got {pairing!r}")


def pair_components(x: torch.Tensor, pairing: Pairing = "rotate_half") -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``x[..., D]`` into the real and imaginary parts ``(re, im)``, each ``[..., D/2]``.

    Pair ``j`` is ``re[..., j] + i·im[..., j]`` under the given convention.
    """
    check_pairing(pairing)
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"head dimension must be even for RoPE pairing, got D={d}")
    if pairing == "rotate_half":
        return x[..., : d // 2], x[..., d // 2 :]
    return x[..., 0::2], x[..., 1::2]


def pair_sq_moduli(x: torch.Tensor, pairing: Pairing = "rotate_half") -> torch.Tensor:
    """Squared modulus of every rotary pair: ``|z_j|² = re_j² + im_j²``, shape ``[..., D/2]`` (float64)."""
    re, im = pair_components(x.to(torch.float64), pairing)
    return re * re + im * im


def band_norms(delta: torch.Tensor, bands: int = 8, pairing: Pairing = "rotate_half") -> torch.Tensor:
    """Per-band Euclidean norms of ``delta[..., D]`` over contiguous groups of whole RoPE pairs.

    Returns ``rho[..., bands]`` in float64 with ``rho_b = (Σ_{j∈b} |z_j|²)^{1/2}``. Pairs are ordered by
    frequency index ``j`` and split into ``bands`` contiguous groups (``D/2`` must be divisible by
    ``bands``). Invariants: ``Σ_b rho_b² = ‖delta‖²`` and ``rho`` is unchanged by RoPE at any position.
    """
    if bands < 1:
        raise ValueError(f"bands must be >= 1, got {bands}")
    fail_if(~torch.isfinite(delta).all(), lambda: ValueError("delta contains non-finite entries"))
    sq = pair_sq_moduli(delta, pairing)
    npairs = sq.shape[-1]
    if npairs % bands:
        raise ValueError(f"D/2={npairs} rotary pairs cannot be split into {bands} equal bands")
    return sq.unflatten(-1, (bands, npairs // bands)).sum(-1).sqrt()


_F32_INF = torch.tensor(float("inf"), dtype=torch.float32)


def round_up_f32(x: torch.Tensor) -> torch.Tensor:
    """Cast a non-negative float64 witness to float32 rounding *up*, so the stored value is never smaller."""
    y = x.to(torch.float32)
    return torch.where(y.to(torch.float64) < x, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


def norm_up_f32(x: torch.Tensor) -> torch.Tensor:
    """A float32 upper bound on ``‖x‖₂`` over the last dimension (``[..., D] -> [...]``).

    The norm is evaluated in float64 (relative error ``≤ (D/2 + 2)·2^-53``: a D-term sum of squares, then a
    square root), inflated by ``1 + (D + 4)·2^-53``, cast to float32 (nearest) and moved one float32 step up,
    so the stored value is never below the exact norm of ``x`` (float32 or float64 input) and at most two
    float32 ulps above the inflated value. Fewer ops than :func:`round_up_f32` (it runs on every write).
    """
    d = x.shape[-1]
    y = (x.to(torch.float64).norm(dim=-1) * (1.0 + (d + 4) * 2.0**-53)).to(torch.float32)
    return torch.nextafter(y, _F32_INF)
