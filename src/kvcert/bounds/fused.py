"""Fused CPU kernel: served softmax and the cell certificate in one loop over the keys.

The read path needs, per (query head, query) row of float32 logits ``s̃[S]`` (``-inf`` = masked) and Tier-A
radii ``c[S]``: the served distribution ``p̃ = softmax(s̃)`` in float64, the meter
``min(1, eform, two_sided, ptm)`` of :mod:`kvcert.bounds.softmax_tv`, its unclipped value and
``tanh(max_t c_t)`` over the visible tokens. Evaluated as eager tensor ops that is some forty passes over
``[rows, S]``; :func:`softmax_meter` does it with two vectorised ``exp`` ops and two passes per row in numba.

Refinement (``certificates.md`` §2.6: a kernel must be proved to refine the reference before it ships):

* the formulas are those of :func:`kvcert.bounds.softmax_tv.meter_and_unclipped` on
  ``probs64(logits)`` — same clamps (``A ≥ 1``, ``B₋ ≤ 1``), same handling of rows with a supported radius
  above 300 (``ptm`` replaced by the larger ``two_sided``), fully masked rows give 0, a NaN or negative radius
  on a supported token fails closed (unclipped ``+inf``, clipped 1);
* float64 rounding is covered, not ignored: every ``A``, ``B₋`` and gap sum has at most ``S`` terms, each
  term at most three roundings (``exp`` within 1 ulp, one product, one division), so with ``u = 2^-53``
  each sum is within ``γ_{S+4}`` relative of its exact value. Each form gets its own allowance **added**
  before the min: ``4γ_{S+4}(A² + 1)`` for ``eform`` and ``4γ_{S+4}(A/B₋ + A(A − 1/B₋) + 2)`` for ``ptm``
  (``two_sided`` when a radius exceeds 300: ``4γ_{S+4}(A/B₋ + 1)``) — below ``10⁻¹¹`` for ``S ≤ 10⁴`` and
  moderate ``A``, so no cell is visibly loosened — unless every supported radius is 0 (then ``p̃ = p``
  exactly and the true TV is 0);
* ``tests/bounds/test_fused.py`` checks the kernel against the reference on random, masked, huge-radius
  and NaN rows (agreement to ``1e-9``, never below it by more than rounding), and every validate-mode test
  of the certified cache runs through it.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

_U64 = 2.0**-53
_EXP_SAFE = 300.0   # same cut as kvcert.bounds.softmax_tv: above it ptm is replaced by two_sided


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _rows(logits: np.ndarray, p: np.ndarray, c: np.ndarray, ec: np.ndarray, p32: np.ndarray, cert: np.ndarray,
          raw: np.ndarray, tmax: np.ndarray) -> None:  # pragma: no cover - compiled (covered by tests via numba)
    n_rows, s = logits.shape
    gamma = (s + 4) * _U64 / (1.0 - (s + 4) * _U64)
    for r in range(n_rows):
        cvis = 0.0
        mass = 0.0
        a = 0.0
        b = 0.0
        csup = 0.0
        bad = False
        for t in range(s):
            ct = c[r, t]
            if logits[r, t] > -np.inf and ct > cvis:
                cvis = ct
            pt = p[r, t]
            if not pt > 0.0:                    # masked, underflowed, or a NaN row (nothing visible)
                p[r, t] = 0.0
                p32[r, t] = 0.0
                continue
            p32[r, t] = np.float32(pt)
            if not ct >= 0.0:                   # NaN or negative radius: fail closed
                bad = True
                continue
            if ct > csup:
                csup = ct
            e = ec[r, t]
            mass += pt
            a += pt * e
            b += pt / e
        tmax[r] = math.tanh(cvis)
        if bad:
            cert[r] = 1.0
            raw[r] = np.inf
            continue
        if mass == 0.0:                         # no visible token: nothing served, nothing to certify
            cert[r] = 0.0
            raw[r] = 0.0
            continue
        a = max(a / mass, 1.0)
        b = min(b / mass, 1.0)
        eform = 0.5 * (a * a - 1.0)
        two = 0.5 * (a / b - b / a)
        ptm = two
        scale_t = a / b + 1.0                   # magnitude of the terms behind two_sided
        if csup <= _EXP_SAFE:
            k1 = a - 1.0 / b                    # >= 0: A·B₋ >= 1 (Jensen)
            inv_a = 1.0 / a
            gap = 0.0
            for t in range(s):
                pt = p[r, t]
                if pt > 0.0:
                    e = ec[r, t]
                    g = 1.0 - e * k1 - inv_a / e
                    if g > 0.0:
                        gap += pt * g
            ptm = two - 0.5 * gap / mass
            scale_t += a * k1 + 1.0             # Σ p̃ e^{c}·k1 = A·k1 bounds the gap terms
        if csup > 0.0:                          # all supported radii 0: p̃ = p exactly, TV = 0 needs no slack
            eform += 4.0 * gamma * (a * a + 1.0)
            ptm += 4.0 * gamma * scale_t
        m = min(eform, ptm)
        if m < 0.0:
            m = 0.0
        raw[r] = m
        cert[r] = min(m, 1.0)


def softmax_meter(logits: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                  torch.Tensor, torch.Tensor]:
    """``(p̃, p̃ as float32, meter, unclipped meter, tanh(max visible c))`` for float32 ``logits[..., S]``
    (``-inf`` = masked) and radii ``c[..., S]``.

    ``p̃`` is float64 ``[..., S]`` (``softmax`` of the logits, all-zero on fully masked rows); the three cell
    tensors are float64 ``[...]``. The two element-wise exponentials (softmax and ``e^{c}``) run as
    vectorised torch ops (1-ulp ``exp``); the kernel does every reduction in two passes per row. CPU only.
    """
    if logits.shape != c.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and radii {tuple(c.shape)} must have the same shape")
    if logits.device.type != "cpu" or c.device.type != "cpu":
        raise ValueError("softmax_meter runs on CPU tensors; use the eager forms for other devices")
    lead, s = logits.shape[:-1], logits.shape[-1]
    lg = logits.detach().to(torch.float32).reshape(-1, s).contiguous()
    cc = c.detach().to(torch.float64).reshape(-1, s).contiguous()
    p = torch.softmax(lg, dim=-1, dtype=torch.float64)
    ec = torch.exp(cc)
    p32 = torch.empty_like(lg)
    cert, raw, tmax = (torch.empty(lg.shape[0], dtype=torch.float64) for _ in range(3))
    _rows(lg.numpy(), p.numpy(), cc.numpy(), ec.numpy(), p32.numpy(), cert.numpy(), raw.numpy(), tmax.numpy())
    return (p.reshape(*lead, s), p32.reshape(*lead, s), cert.reshape(lead), raw.reshape(lead),
            tmax.reshape(lead))


#: reads with at most this many query rows per KV head use :func:`read_radii`; larger ones (prefill) use BLAS
RADII_MAX_ROWS = 64


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _radii(q: np.ndarray, rho: np.ndarray, khn: np.ndarray, w: np.ndarray, scale: float, gam: float,
           half: bool, c: np.ndarray, qn: np.ndarray, kmax: np.ndarray, phi: np.ndarray,
           wmax: np.ndarray) -> None:  # pragma: no cover - compiled (covered by tests via numba)
    nbatch, nkv, nrows, d = q.shape
    s, nbands = rho.shape[2], rho.shape[3]
    npair = d // 2
    per = npair // nbands
    # every output is a sum / product / square root of at most d + 2·nbands + 8 roundings of non-negative
    # float64 terms (float32 inputs square exactly): computed >= exact·(1 − u)^K, undone by this factor
    infl = 1.0 + 2.0 * (d + 2 * nbands + 12) * _U64
    qb = np.empty((nrows, nbands))
    rate = np.empty(nrows)
    kfs = np.empty(s)
    for bi in range(nbatch):
        for h in range(nkv):
            qmax = 0.0
            for mi in range(nrows):
                tot = 0.0
                for band in range(nbands):
                    acc = 0.0
                    for j in range(band * per, (band + 1) * per):
                        if half:
                            x = np.float64(q[bi, h, mi, j])
                            y = np.float64(q[bi, h, mi, j + npair])
                        else:
                            x = np.float64(q[bi, h, mi, 2 * j])
                            y = np.float64(q[bi, h, mi, 2 * j + 1])
                        acc += x * x + y * y
                    tot += acc
                    qb[mi, band] = math.sqrt(acc)
                norm = math.sqrt(tot)
                qn[bi, h, mi] = norm
                rate[mi] = scale * gam * norm
                if norm > qmax:
                    qmax = norm
            km = 0.0
            wm = 0.0
            for t in range(s):
                wt = np.float64(w[bi, h, t])
                kf = 2.0 * np.float64(khn[bi, h, t]) + wt
                kfs[t] = kf
                if kf > km:
                    km = kf
                if wt > wm:
                    wm = wt
            for mi in range(nrows):
                r = rate[mi]
                for t in range(s):
                    dot = 0.0
                    for band in range(nbands):
                        dot += qb[mi, band] * np.float64(rho[bi, h, t, band])
                    c[bi, h, mi, t] = (scale * dot + r * kfs[t]) * infl
            kmax[bi, h] = km
            wmax[bi, h] = wm
            phi[bi, h] = 2.0 * scale * gam * qmax * km * infl


def read_radii(q: torch.Tensor, rho: torch.Tensor, k_hat_norm: torch.Tensor, witness: torch.Tensor, scale: float,
               gamma: float, pairing: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                    torch.Tensor]:
    """The read path's radii in one pass: ``(c, ‖q‖, max_t(2‖k̂_t‖ + W_t), φ_max, max_t W_t)``.

    For grouped float32 queries ``q[B, Hkv, M, D]`` and the store's float32 write-time witnesses
    ``rho[B, Hkv, S, nb]`` (key-residual band norms over whole RoPE pairs of ``pairing``),
    ``k_hat_norm[B, Hkv, S]`` (``≥ ‖k̂_t‖``) and ``witness[B, Hkv, S]`` (``W_t ≥ ‖k̂_t − k_t‖``)::

        c_t = sc·Σ_b ‖q_b‖·ρ_{t,b} + sc·γ·‖q‖·(2‖k̂_t‖ + W_t)        (Tier A + float32 logit slack φ_t)
        φ_max = 2·sc·γ·max_M ‖q‖·max_t(2‖k̂_t‖ + W_t)

    with ``γ`` the caller's float32 dot-product constant (``γ_{D+1}``). The same quantities as the eager
    read path (band norms rounded up to float32, a float32 matmul inflated by ``1 + (nb + 2)2^-23``), but
    evaluated in float64: squares of float32 entries are exact, every other step is a rounding of a
    non-negative term, so each output is at least ``(1 − u)^K`` times its exact value with
    ``K ≤ D + 2nb + 8``, ``u = 2^-53``; multiplying by ``1 + 2(D + 2nb + 12)u`` makes every ``c_t`` and
    ``φ_max`` an upper bound on the exact expression (products of float32 values cannot underflow in
    float64). ``‖q‖`` and the two maxima are reported as computed (readings). Premise (the caller's): all
    inputs finite, witnesses non-negative, ``D/2`` divisible by ``nb``. Returns float64 ``c[B, Hkv, M, S]``,
    ``‖q‖[B, Hkv, M, 1]`` and ``[B, Hkv, 1]`` maxima. CPU only; one scalar loop, meant for decode-size reads
    (at most :data:`RADII_MAX_ROWS` query rows per KV head).
    """
    b, h, m, d = q.shape
    s, nb = rho.shape[2], rho.shape[3]
    if rho.shape[:2] != (b, h) or k_hat_norm.shape != (b, h, s) or witness.shape != (b, h, s) or (d // 2) % nb:
        raise ValueError(f"read_radii shapes differ: q {tuple(q.shape)}, rho {tuple(rho.shape)}, "
                         f"k_hat_norm {tuple(k_hat_norm.shape)}, witness {tuple(witness.shape)}")
    c = torch.empty(b, h, m, s, dtype=torch.float64)
    qn = torch.empty(b, h, m, 1, dtype=torch.float64)
    kmax, phi, wmax = (torch.empty(b, h, 1, dtype=torch.float64) for _ in range(3))
    _radii(q.detach().numpy(), rho.detach().numpy(), k_hat_norm.detach().numpy(), witness.detach().numpy(),
           float(scale), float(gamma), pairing == "rotate_half", c.numpy(), qn.numpy()[..., 0],
           kmax.numpy()[..., 0], phi.numpy()[..., 0], wmax.numpy()[..., 0])
    return c, qn, kmax, phi, wmax
