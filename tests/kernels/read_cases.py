"""Shared cases of the read-path kernel tests: random store allocations and radii in exact arithmetic."""

from __future__ import annotations

from decimal import Decimal, getcontext

import torch

from kvcert.bounds import pair_components
from kvcert.kernels.inputs import DecodeInputs


def exact_radii(
    q: torch.Tensor, rho: torch.Tensor, khn: torch.Tensor, w: torch.Tensor, sc: float, gam: float, pairing: str
) -> list[list[list[list[Decimal]]]]:
    """``c`` of :func:`logits_radii` in 50-digit decimal arithmetic from the float32 inputs (the exact value up
    to 10^-45 relative)."""
    getcontext().prec = 50
    b, h, m, d = q.shape
    nb = rho.shape[-1]
    re, im = pair_components(q, pairing)
    per = (d // 2) // nb
    dsc, dgam = Decimal(sc), Decimal(gam)
    out = []
    for bi in range(b):
        heads = []
        for hi in range(h):
            rows = []
            for mi in range(m):
                sq = [
                    Decimal(float(re[bi, hi, mi, j])) ** 2 + Decimal(float(im[bi, hi, mi, j])) ** 2
                    for j in range(d // 2)
                ]
                qb = [sum(sq[k * per : (k + 1) * per], Decimal(0)).sqrt() for k in range(nb)]
                qn = sum(sq, Decimal(0)).sqrt()
                rows.append(
                    [
                        dsc * sum((qb[k] * Decimal(float(rho[bi, hi, t, k])) for k in range(nb)), Decimal(0))
                        + dsc * dgam * qn * (2 * Decimal(float(khn[bi, hi, t])) + Decimal(float(w[bi, hi, t])))
                        for t in range(rho.shape[2])
                    ]
                )
            heads.append(rows)
        out.append(heads)
    return out


def random_store(b: int, h: int, s: int, d: int, nb: int, gen: torch.Generator, cap: int | None = None):
    """Random float32 keys and key witnesses, each a ``[B, H, cap, ...]`` allocation of which ``s`` are live."""
    cap = s if cap is None else cap
    keys = torch.randn(b, h, cap, d, generator=gen) * 2
    rho = torch.rand(b, h, cap, nb, generator=gen) * 0.1
    khn = keys.norm(dim=-1) * (1 + 1e-6)
    w = torch.rand(b, h, cap, generator=gen) * 0.1
    return keys, rho, khn, w


def decode_inputs(
    tensors: tuple[torch.Tensor, ...],
    *,
    scale: float,
    gamma: float,
    rotate_half: bool,
    mask: torch.Tensor | None = None,
    nq: int = 1,
    n_tokens: int | None = None,
    k_from: int | None = None,
    v_from: int | None = None,
    arrays: bool = False,
) -> DecodeInputs:
    """:class:`DecodeInputs` of ``tensors = (q, k_served, k_band, k_hat_norm, k_wit, v_served, v_res, v_dist,
    v_hat_norm)`` (``arrays``: as numpy arrays, for the numba read); every token checked at write by default."""
    n = tensors[1].shape[2] if n_tokens is None else n_tokens
    conv = (lambda x: x.numpy()) if arrays else (lambda x: x)
    return DecodeInputs(
        *(conv(x) for x in tensors),
        n_tokens=n,
        scale=scale,
        gamma=gamma,
        rotate_half=rotate_half,
        mask=None if mask is None else conv(mask),
        nq=nq,
        k_from=n if k_from is None else k_from,
        v_from=n if v_from is None else v_from,
    )
