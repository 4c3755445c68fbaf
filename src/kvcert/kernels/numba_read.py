"""Fused CPU kernels of the certified read path (numba): logits + radii, softmax + meter + output.

The read path needs, per (query head, query) row over the ``S`` stored tokens: served float32 logits
``s̃[S]`` (``-inf`` = masked), Tier-A radii ``c[S]`` with the float32 logit slack, the served distribution
``p̃ = softmax(s̃)`` in float64, the meter ``min(1, eform, two_sided, ptm)`` of
:mod:`kvcert.bounds.softmax_tv`, its unclipped value, ``tanh(max_t c_t)`` over the visible tokens, the output
``p̃·v̂`` and the output bound's per-read terms. Evaluated as eager tensor ops that is some fifty small ops
per layer; for decode-size reads :func:`logits_radii` and :func:`meter_output` do it in two kernel calls
around two vectorised numpy ``exp`` calls (the softmax and ``e^{c}``, :func:`_softmax_exp`) and one batched
float32 BLAS product (the output), reading the cache's token-major allocations in place.
:func:`decode_read` runs the same two steps on numpy arrays without their input checks or tensor
conversions (the certified cache's read path). :func:`softmax_meter` is the meter alone, for reads of any
size; :func:`meter_rows` the meter of a given distribution (for the Tier-B side meter,
:mod:`kvcert.kernels.numba_tier_b`).

Refinement (``docs/read-path.md#kernel-refinement``: a kernel must refine the reference before it ships):

* the meter formulas are those of :func:`kvcert.bounds.softmax_tv.meter_and_unclipped` on
  ``probs64(logits)`` — same clamps (``A ≥ 1``, ``B₋ ≤ 1``), same handling of rows with a supported radius
  above 300 (``ptm`` replaced by the larger ``two_sided``), fully masked rows give 0, a NaN or negative radius
  on a supported token fails closed (unclipped ``+inf``, clipped 1);
* float64 rounding is covered, not ignored: every ``A``, ``B₋`` and gap sum has at most ``S`` terms, added
  in any order (the kernels let the compiler reassociate them into vector lanes), each term at most five
  roundings (``exp`` within 1 ulp, a reciprocal, products and the gap's two
  subtractions), so with ``u = 2^-53`` each sum is within ``γ_{S+6}`` relative of its exact value (of its
  terms' magnitudes, for the gap). Each form gets its own allowance **added** before the min:
  ``4γ_{S+6}(A² + 1)`` for ``eform`` and ``4γ_{S+6}(A/B₋ + A(A − 1/B₋) + 2)`` for ``ptm`` (``two_sided``
  when a radius exceeds 300: ``4γ_{S+6}(A/B₋ + 1)``) — below ``10⁻¹¹`` for ``S ≤ 10⁴`` and moderate ``A``,
  so no cell is visibly loosened — unless every supported radius is 0 (then ``p̃ = p`` exactly and the
  true TV is 0);
* radii, logits and output carry their own stated roundings (see each function);
* ``tests/kernels/test_numba_read.py`` checks the kernels against the reference on random, masked, huge-radius
  and NaN rows (agreement to ``1e-9``, never below it by more than rounding), the radii against 50-digit
  decimal arithmetic, the logits and the output against their float32 rounding bounds, and every
  validate-mode test of the certified cache runs through them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numba
import numpy as np
import torch

from kvcert.kernels.inputs import DecodeInputs

_U64 = 2.0**-53
_U32 = 2.0**-24
_EXP_SAFE = 300.0  # same cut as kvcert.bounds.softmax_tv: above it ptm is replaced by two_sided


@numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "contract"})
def _row_sums(
    lg: np.ndarray, p: np.ndarray, c: np.ndarray, cbits: np.ndarray, ec: np.ndarray, p32: np.ndarray, r: int
) -> tuple[float, float, float, int, int, int]:  # pragma: no cover - compiled (tested via numba)
    """One pass over row ``r``: ``(Σ p̃, Σ p̃e^{c}, Σ p̃e^{-c}, #bad, bits of max visible c, bits of max supported
    c)``, the sums over the tokens with ``p̃_t > 0`` and ``c_t ≥ 0``; zeroes ``p[r]`` where it is not > 0,
    writes ``p32[r] = float32(p[r])`` and counts the supported tokens whose radius is NaN or negative.

    Branch-free selects and any summation order (``reassoc``), so the loop vectorises; each sum is still within
    ``γ_S`` of its exact value (any order of an ``S``-term sum). The maxima run over ``cbits`` (``c`` viewed as
    int64): for non-negative floats the bit patterns order as the values, so an integer maximum of the selected
    ``c_t ≥ 0`` (NaN and negative radii ignored, floor 0) is exact and vectorises too."""
    mass = 0.0
    a = 0.0
    b = 0.0
    nbad = 0
    vis_bits = 0
    sup_bits = 0
    for t in range(p.shape[1]):
        pt = p[r, t]
        pos = pt > 0.0
        pz = pt if pos else 0.0
        p[r, t] = pz
        p32[r, t] = np.float32(pz)
        ct = c[r, t]
        okc = ct >= 0.0
        use = pos and okc
        nbad += 1 if pos and not okc else 0
        bits = cbits[r, t]
        vb = bits if okc and lg[r, t] > -np.inf else 0
        sb = bits if use else 0
        vis_bits = max(vis_bits, vb)
        sup_bits = max(sup_bits, sb)
        e = ec[r, t]
        mass += pz if use else 0.0
        a += pz * e if use else 0.0
        b += pz / e if use else 0.0
    return mass, a, b, nbad, vis_bits, sup_bits


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _float_of_bits(bits: int) -> float:  # pragma: no cover - compiled (covered by tests via numba)
    """The float64 whose IEEE bit pattern is ``bits``."""
    x = np.empty(1, np.int64)
    x[0] = bits
    return x.view(np.float64)[0]


@numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "contract"})
def _row_gap(
    p: np.ndarray, ec: np.ndarray, k1: float, inv_a: float, r: int
) -> float:  # pragma: no cover - compiled (covered by tests via numba)
    """``Σ_t p̃_t·max(0, 1 − e^{c_t}·k1 − e^{-c_t}/A)`` over ``p̃_t > 0`` (branch-free, any summation order)."""
    gap = 0.0
    for t in range(p.shape[1]):
        pt = p[r, t]
        e = ec[r, t]
        g = 1.0 - e * k1 - inv_a / e
        gap += pt * g if pt > 0.0 and g > 0.0 else 0.0
    return gap


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _meter_row(
    lg: np.ndarray, p: np.ndarray, c: np.ndarray, ec: np.ndarray, p32: np.ndarray, r: int
) -> tuple[float, float, float]:  # pragma: no cover - compiled (covered by tests via numba)
    """``(meter, unclipped meter, tanh(max visible c))`` of row ``r``; zeroes ``p[r]`` where it is not > 0
    and writes ``p32[r] = float32(p[r])``."""
    s = lg.shape[1]
    gamma = (s + 6) * _U64 / (1.0 - (s + 6) * _U64)
    mass, a, b, nbad, vis_bits, sup_bits = _row_sums(lg, p, c, c.view(np.int64), ec, p32, r)
    cvis, csup = _float_of_bits(vis_bits), _float_of_bits(sup_bits)
    tmax = math.tanh(cvis)
    if nbad:  # a NaN or negative radius on a supported token: fail closed
        return 1.0, np.inf, tmax
    if mass == 0.0:  # no visible token: nothing served, nothing to certify
        return 0.0, 0.0, tmax
    a = max(a / mass, 1.0)
    b = min(b / mass, 1.0)
    eform = 0.5 * (a * a - 1.0)
    two = 0.5 * (a / b - b / a)
    ptm = two
    scale_t = a / b + 1.0  # magnitude of the terms behind two_sided
    if csup <= _EXP_SAFE:
        k1 = a - 1.0 / b  # >= 0: A·B₋ >= 1 (Jensen)
        ptm = two - 0.5 * _row_gap(p, ec, k1, 1.0 / a, r) / mass
        scale_t += a * k1 + 1.0  # Σ p̃ e^{c}·k1 = A·k1 bounds the gap terms
    if csup > 0.0:  # all supported radii 0: p̃ = p exactly, TV = 0 needs no slack
        eform += 4.0 * gamma * (a * a + 1.0)
        ptm += 4.0 * gamma * scale_t
    m = max(min(eform, ptm), 0.0)
    return min(m, 1.0), m, tmax


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _rows(
    logits: np.ndarray,
    p: np.ndarray,
    c: np.ndarray,
    ec: np.ndarray,
    p32: np.ndarray,
    cert: np.ndarray,
    raw: np.ndarray,
    tmax: np.ndarray,
) -> None:  # pragma: no cover - compiled (covered by tests via numba)
    for r in range(logits.shape[0]):
        cert[r], raw[r], tmax[r] = _meter_row(logits, p, c, ec, p32, r)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _shift_rows(lg: np.ndarray, z: np.ndarray) -> None:  # pragma: no cover - compiled (covered by tests via numba)
    """``z[r, t] = float64(lg[r, t]) − max_t lg[r, t]`` in float64 (one rounding; ``−inf`` stays ``−inf``; a row
    with no finite logit becomes NaN, as torch's softmax gives)."""
    s = lg.shape[1]
    for r in range(lg.shape[0]):
        m0 = m1 = m2 = m3 = -np.inf  # four running maxima (exact in any order), so compares overlap
        t = 0
        while t + 4 <= s:
            x0, x1, x2, x3 = lg[r, t], lg[r, t + 1], lg[r, t + 2], lg[r, t + 3]
            m0 = x0 if x0 > m0 else m0
            m1 = x1 if x1 > m1 else m1
            m2 = x2 if x2 > m2 else m2
            m3 = x3 if x3 > m3 else m3
            t += 4
        for u in range(t, s):
            m0 = lg[r, u] if lg[r, u] > m0 else m0
        m64 = np.float64(max(max(m0, m1), max(m2, m3)))
        for t in range(lg.shape[1]):
            z[r, t] = np.float64(lg[r, t]) - m64


@numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"})
def _normalise_rows(e: np.ndarray) -> None:  # pragma: no cover - compiled (covered by tests via numba)
    """``e[r] /= Σ_t e[r, t]`` in place (the sum in any order)."""
    for r in range(e.shape[0]):
        tot = 0.0
        for t in range(e.shape[1]):
            tot += e[r, t]
        for t in range(e.shape[1]):
            e[r, t] = e[r, t] / tot


def _softmax_exp(lg: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(softmax(lg) in float64, e^{c})`` for float32 ``lg[R, S]`` and float64 ``c[R, S]``: the row shift and
    the normalisation in numba, both exponentials as numpy's vectorised float64 ``exp`` (tested by numpy to
    1 ulp, the accuracy the meter's rounding allowance assumes, as for torch's)."""
    p = np.empty(lg.shape)
    _shift_rows(lg, p)
    np.exp(p, out=p)
    _normalise_rows(p)
    with np.errstate(over="ignore"):  # e^{c} = inf for huge radii: the meter's overflow-safe forms take it
        return p, np.exp(c)


def softmax_meter(
    logits: torch.Tensor, c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(p̃, p̃ as float32, meter, unclipped meter, tanh(max visible c))`` for float32 ``logits[..., S]``
    (``-inf`` = masked) and radii ``c[..., S]``.

    ``p̃`` is float64 ``[..., S]`` (``softmax`` of the logits, all-zero on fully masked rows); the three cell
    tensors are float64 ``[...]``. The two element-wise exponentials (softmax and ``e^{c}``) run as
    vectorised numpy ``exp`` (1 ulp); the kernel does every reduction in two passes per row. CPU only.
    """
    if logits.shape != c.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and radii {tuple(c.shape)} must have the same shape")
    if logits.device.type != "cpu" or c.device.type != "cpu":
        raise ValueError("softmax_meter runs on CPU tensors; use the eager forms for other devices")
    lead, s = logits.shape[:-1], logits.shape[-1]
    lg = logits.detach().to(torch.float32).reshape(-1, s).contiguous().numpy()
    cc = c.detach().to(torch.float64).reshape(-1, s).contiguous().numpy()
    p, ec = _softmax_exp(lg, cc)
    p32 = np.empty(lg.shape, dtype=np.float32)
    cells = np.empty((3, lg.shape[0]))  # cert, raw, tmax
    _rows(lg, p, cc, ec, p32, cells[0], cells[1], cells[2])
    t = torch.from_numpy
    return (
        t(p).reshape(*lead, s),
        t(p32).reshape(*lead, s),
        t(cells[0]).reshape(lead),
        t(cells[1]).reshape(lead),
        t(cells[2]).reshape(lead),
    )


def meter_rows(p: np.ndarray, c: np.ndarray) -> np.ndarray:
    """The clipped meter ``[R]`` of given served distributions ``p[R, S]`` (float64, C-contiguous) under radii
    ``c[R, S]`` (float64): :func:`softmax_meter`'s row kernel (same formulas, rounding allowance, clamps and
    fail-closed rules; rows with no positive entry give 0) without the softmax. ``p`` is not written.

    The row kernel zeroes entries that are not > 0 in place, so it gets a copy; visibility is read from ``p``
    itself, not the copy (an array it writes as it reads would keep its loop from vectorising; the clipped meter
    does not depend on visibility, only ``tanh(max visible c)``, which is not returned)."""
    pp = p.copy()
    with np.errstate(over="ignore"):  # e^{c} = inf for huge radii: the meter's overflow-safe forms take it
        ec = np.exp(c)
    p32 = np.empty(p.shape, dtype=np.float32)
    cells = np.empty((3, p.shape[0]))  # cert, raw, tmax
    _rows(p, pp, c, ec, p32, cells[0], cells[1], cells[2])
    return cells[0]


#: reads with at most this many query rows per KV head use the decode kernels; larger ones (prefill) use BLAS
DECODE_MAX_ROWS = 64

#: rows of the per-cell block ``[7, B, Hkv, M]`` the decode kernels fill (see :class:`DecodeArrays`)
CELL_ROWS = ("cert", "raw", "tanh", "value_term", "key_term", "slack", "bound")
_CERT, _RAW, _TANH, _VTERM, _KEY, _SLACK, _BOUND = range(7)
#: rows of the per-KV-head block ``[5, B, Hkv]``
HEAD_ROWS = ("key_norm_max", "phi_max", "witness_max", "spread", "vmax")
_KEY_NORM_MAX, _PHI_MAX, _WITNESS_MAX, _SPREAD, _VMAX = range(5)


class LogitsRadii(NamedTuple):
    """What :func:`logits_radii` returns (float64 unless stated)."""

    logits: torch.Tensor  # [B, Hkv, M, S] float32 served logits, -inf where masked
    c: torch.Tensor  # [B, Hkv, M, S] Tier-A radius + float32 logit slack per token
    qn: torch.Tensor  # [B, Hkv, M, 1] ‖q‖₂ of the float32 query
    key_norm_max: torch.Tensor  # [B, Hkv, 1] max_t (2‖k̂_t‖ + W_t)
    phi_max: torch.Tensor  # [B, Hkv, 1] φ_max = 2·sc·γ·max_M ‖q‖·key_norm_max (inflated)
    witness_max: torch.Tensor  # [B, Hkv, 1] max_t W_t


class MeterOutput(NamedTuple):
    """What :func:`meter_output` returns (float64 unless stated)."""

    p: torch.Tensor  # [B, Hkv, M, S] served distribution softmax(logits)
    p32: torch.Tensor  # [B, Hkv, M, S] float32 copy of p (what the output is computed from)
    cert: torch.Tensor  # [B, Hkv, M] meter, clipped at 1
    raw: torch.Tensor  # [B, Hkv, M] unclipped meter
    tanh: torch.Tensor  # [B, Hkv, M] tanh(max visible c)
    out: torch.Tensor  # [B, Hkv, M, Dv] float32 served output p32·v̂
    value_term: torch.Tensor  # [B, Hkv, M] Σ_t p_t‖Δv_t‖ (rounded up)
    spread: torch.Tensor  # [B, Hkv, 1] max over visible t of ‖v̂_t − centre‖ + ‖Δv_t‖ (rounded up)
    vmax: torch.Tensor  # [B, Hkv, 1] max over visible t of ‖v̂_t‖ + ‖Δv_t‖ (rounded up)
    bound: torch.Tensor  # [B, Hkv, M] output bound key_term + value_term + slack of the unrepaired read
    key_term: torch.Tensor  # [B, Hkv, M] 2·min(meter, 1)·spread
    slack: torch.Tensor  # [B, Hkv, M] (2(S + Dv)u₃₂(1 + 10⁻⁶) + 2·tanh(φ_max))·vmax


@numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "contract"})
def _dot_rows(qs: np.ndarray, k: np.ndarray, s: int, lg: np.ndarray) -> None:  # pragma: no cover - compiled
    """``lg[i, t] = Σ_j qs[i, j]·k[t, j]`` for ``t < s`` in float32, any summation order (so it vectorises; two
    tokens per iteration, so their reductions overlap): each is within ``γ_D·Σ_j |qs_ij·k_tj|`` of the exact
    dot product, with or without fused multiply-adds."""
    m, d = qs.shape
    t = 0
    while t + 2 <= s:
        for i in range(m):
            a0 = np.float32(0.0)
            a1 = np.float32(0.0)
            for j in range(d):
                a0 += qs[i, j] * k[t, j]
                a1 += qs[i, j] * k[t + 1, j]
            lg[i, t] = a0
            lg[i, t + 1] = a1
        t += 2
    for u in range(t, s):
        for i in range(m):
            acc = np.float32(0.0)
            for j in range(d):
                acc += qs[i, j] * k[u, j]
            lg[i, u] = acc


@numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "contract"})
def _radius_rows(
    qb: np.ndarray,
    rho: np.ndarray,
    s: int,
    scale: float,
    rate: np.ndarray,
    kf: np.ndarray,
    infl: float,
    out: np.ndarray,
) -> None:  # pragma: no cover - compiled
    """``out[i, t] = (scale·Σ_b qb[i, b]·ρ[t, b] + rate[i]·kf[t])·infl`` for ``t < s`` in float64 from float32
    ``ρ``, any summation order: every operand is non-negative, so the computed value is at least
    ``(1 − u)^(nb + 4)`` times the exact one (``nb`` products and additions, two products and an addition,
    fused or not)."""
    m, nb = qb.shape
    for t in range(s):
        kt = kf[t]
        for i in range(m):
            acc = 0.0
            for b in range(nb):
                acc += qb[i, b] * np.float64(rho[t, b])
            out[i, t] = (scale * acc + rate[i] * kt) * infl


@numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "contract"})
def _weighted_sum(p: np.ndarray, x: np.ndarray, s: int) -> float:  # pragma: no cover - compiled
    """``Σ_{t<s} p[t]·float64(x[t])`` in float64, any summation order (vectorises): for non-negative terms
    within ``γ_s`` relative of the exact sum."""
    acc = 0.0
    for t in range(s):
        acc += p[t] * np.float64(x[t])
    return acc


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _visible(mask: np.ndarray, full: bool, bi: int, h: int, nq: int, mi: int, t: int) -> bool:  # pragma: no cover
    """Row ``mi`` of KV head ``h`` (query ``mi % nq``) sees token ``t``; ``mi < 0``: any query does."""
    if full:
        return True
    hm = h if mask.shape[1] > 1 else 0
    if mi >= 0:
        return mask[bi, hm, mi % nq, t]
    for qi in range(nq):
        if mask[bi, hm, qi, t]:
            return True
    return False


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _query_rows(
    q: np.ndarray,
    nbands: int,
    half: bool,
    scale: float,
    gam: float,
    qs: np.ndarray,
    qb: np.ndarray,
    qn: np.ndarray,
    rate: np.ndarray,
) -> float:  # pragma: no cover - compiled (covered by tests via numba)
    """For one KV head's query rows ``q[M, D]``: band norms ``qb[M, nb]``, ``qn[M] = ‖q‖₂``, the slack rate
    ``rate[M] = sc·γ·‖q‖`` and the scaled float32 query ``qs = fl32(sc·q)`` (one rounding of the product);
    returns ``max_M ‖q‖``, or ``-1`` when a norm is not finite."""
    nrows, d = q.shape
    npair = d // 2
    per = npair // nbands
    qmax = 0.0
    for mi in range(nrows):
        tot = 0.0
        for band in range(nbands):
            acc = 0.0
            for j in range(band * per, (band + 1) * per):
                jx, jy = (j, j + npair) if half else (2 * j, 2 * j + 1)
                x = np.float64(q[mi, jx])
                y = np.float64(q[mi, jy])
                acc += x * x + y * y
            tot += acc
            qb[mi, band] = math.sqrt(acc)
        norm = math.sqrt(tot)
        if not np.isfinite(norm):
            return -1.0
        qn[mi] = norm
        rate[mi] = scale * gam * norm
        qmax = max(qmax, norm)
        for j in range(d):
            qs[mi, j] = np.float32(np.float64(q[mi, j]) * scale)
    return qmax


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _logits_radii(
    q: np.ndarray,
    k_served: np.ndarray,
    k_band: np.ndarray,
    k_hat_norm: np.ndarray,
    k_wit: np.ndarray,
    s: int,
    mask: np.ndarray,
    full: bool,
    nq: int,
    scale: float,
    gamma: float,
    half: bool,
    k_from: int,
    lg: np.ndarray,
    c: np.ndarray,
    qn: np.ndarray,
    heads: np.ndarray,
) -> bool:  # pragma: no cover - compiled (covered by tests via numba)
    nbatch, nkv, nrows, d = q.shape
    nbands = k_band.shape[3]
    # every radius is a sum / product / square root of at most d + 2·nbands + 8 roundings of non-negative
    # float64 terms (float32 inputs square exactly): computed >= exact·(1 − u)^K, undone by this factor
    infl = 1.0 + 2.0 * (d + 2 * nbands + 12) * _U64
    qs = np.empty((nrows, d), np.float32)
    qb = np.empty((nrows, nbands))
    rate = np.empty(nrows)
    kf = np.empty(s)  # 2‖k̂_t‖ + W_t
    for bi in range(nbatch):
        for h in range(nkv):
            qmax = _query_rows(q[bi, h], nbands, half, scale, gamma, qs, qb, qn[bi, h], rate)
            if qmax < 0.0:
                return False
            for t in range(k_from, s):  # pending keys were not checked at write
                for j in range(d):
                    if not np.isfinite(k_served[bi, h, t, j]):
                        return False
            _dot_rows(qs, k_served[bi, h], s, lg[bi, h])
            km = 0.0
            wm = 0.0
            for t in range(s):
                wt = np.float64(k_wit[bi, h, t])
                kf[t] = 2.0 * np.float64(k_hat_norm[bi, h, t]) + wt
                km = max(km, kf[t])
                wm = max(wm, wt)
            _radius_rows(qb, k_band[bi, h], s, scale, rate, kf, infl, c[bi, h])
            if not full:
                for mi in range(nrows):
                    for t in range(s):
                        if not _visible(mask, full, bi, h, nq, mi, t):
                            lg[bi, h, mi, t] = -np.inf
            heads[_KEY_NORM_MAX, bi, h] = km
            heads[_WITNESS_MAX, bi, h] = wm
            heads[_PHI_MAX, bi, h] = 2.0 * scale * gamma * qmax * km * infl
    return True


_NO_MASK = np.ones((1, 1, 1, 1), dtype=np.bool_)  # placeholder the kernels never read (``full``)


def _mask_arg(mask: torch.Tensor | None, b: int, h: int, nq: int, s: int) -> tuple[np.ndarray, bool]:
    if mask is None:
        return _NO_MASK, True
    if mask.dim() != 4 or mask.shape[0] != b or mask.shape[1] not in (1, h) or mask.shape[2] != nq or mask.shape[3] < s:
        raise ValueError(f"mask {tuple(mask.shape)} must be [B={b}, 1 or Hkv={h}, Q={nq}, >= S={s}] booleans")
    return mask.to(torch.bool).numpy(), False


def _prefix(name: str, x: torch.Tensor | np.ndarray, lead: tuple[int, ...], s: int) -> np.ndarray:
    """A C-contiguous float32 token-major allocation holding at least ``s`` tokens, as numpy (the kernels read
    the first ``s``); a cache's growable buffers are passed whole (``GrowBuffer.array``), so no copy is made."""
    a = x if isinstance(x, np.ndarray) else x.detach().numpy()
    if (
        a.shape[:2] != lead[:2]
        or a.shape[2] < s
        or a.shape[3:] != lead[3:]
        or a.dtype != np.float32
        or not a.flags.c_contiguous
    ):
        raise ValueError(
            f"{name} {tuple(a.shape)} {a.dtype} must be a contiguous float32 "
            f"[{lead[0]}, {lead[1]}, >= {s}{''.join(f', {n}' for n in lead[3:])}] allocation"
        )
    return a


def logits_radii(
    q: torch.Tensor,
    k_served: torch.Tensor,
    k_band: torch.Tensor,
    k_hat_norm: torch.Tensor,
    k_wit: torch.Tensor,
    s: int,
    scale: float,
    gamma: float,
    pairing: str,
    *,
    mask: torch.Tensor | None = None,
    nq: int = 1,
    pending_from: int = 0,
) -> LogitsRadii | None:
    """Served logits and the read path's radii in one pass over the stored tokens (decode-size reads).

    For grouped float32 queries ``q[B, Hkv, M, D]`` (row ``i`` is query ``i mod nq``) and the first ``s``
    tokens of the store's float32 allocations — served keys ``k_served[B, Hkv, ≥s, D]``, key-residual band norms
    ``k_band[B, Hkv, ≥s, nb]`` over whole RoPE pairs of ``pairing``, ``k_hat_norm`` (``≥ ‖k̂_t‖``) and
    ``k_wit`` (``W_t ≥ ‖k̂_t − k_t‖``), each ``[B, Hkv, ≥s]``::

        s̃_t = fl32(Σ_j fl32(sc·q_j)·k̂_tj)                            (−inf where ``mask`` hides t)
        c_t = sc·Σ_b ‖q_b‖·ρ_{t,b} + sc·γ·‖q‖·(2‖k̂_t‖ + W_t)         (Tier A + float32 logit slack φ_t)
        φ_max = 2·sc·γ·max_M ‖q‖·max_t(2‖k̂_t‖ + W_t)

    with ``γ`` the caller's float32 dot-product constant (``γ_{D+1}``). Soundness of the premise
    ``|s̃_t − s_t| ≤ c_t``: the logit is one rounding of the scaled query and a float32 dot product in any
    order, within ``γ_{D+1}·sc·Σ|q_j k̂_tj| ≤ sc·γ·‖q‖‖k̂_t‖`` of ``sc·q·k̂_t``, and the exact key's product
    is covered by the Tier-A term plus ``sc·γ·‖q‖(‖k̂_t‖ + W_t)``. The radii are evaluated in float64:
    squares of float32 entries are exact, every other step is a rounding of a non-negative term, so each is
    at least ``(1 − u)^K`` times its exact value with ``K ≤ D + 2nb + 8``, ``u = 2^-53``; multiplying by
    ``1 + 2(D + 2nb + 12)u`` makes every ``c_t`` and ``φ_max`` an upper bound on the exact expression.
    ``‖q‖`` and the two maxima are reported as computed (readings). ``mask[B, 1|Hkv, nq, ≥S]`` (True =
    visible; ``None``: every token). Premise (the caller's): stored witnesses finite and non-negative,
    ``D/2`` divisible by ``nb``, keys before ``pending_from`` checked finite at write time. Returns ``None``
    when the query or a pending key is not finite (the caller fails closed on its exact path). CPU only.
    """
    b, h, m, d = q.shape
    nb = k_band.shape[-1]
    if (d // 2) % nb or q.dtype != torch.float32 or m % nq:
        raise ValueError(
            f"logits_radii: q {tuple(q.shape)} {q.dtype} must be float32 with D/2 divisible by "
            f"{nb} bands and M divisible by nq={nq}"
        )
    kk = _prefix("k_served", k_served, (b, h, s, d), s)
    rr = _prefix("k_band", k_band, (b, h, s, nb), s)
    kn = _prefix("k_hat_norm", k_hat_norm, (b, h, s), s)
    ww = _prefix("k_wit", k_wit, (b, h, s), s)
    mk, full = _mask_arg(mask, b, h, nq, s)
    r = _logits_radii_arrays(
        KeyArrays(
            q=q.detach().contiguous().numpy(),
            k_served=kk,
            k_band=rr,
            k_hat_norm=kn,
            k_wit=ww,
            s=s,
            mask=mk,
            full=full,
            nq=nq,
            scale=float(scale),
            gamma=float(gamma),
            half=pairing == "rotate_half",
            k_from=pending_from,
        )
    )
    if r is None:
        return None
    lg, c, qn, heads = r
    t = torch.from_numpy
    return LogitsRadii(
        t(lg),
        t(c),
        t(qn[..., None]),
        t(heads[_KEY_NORM_MAX, ..., None]),
        t(heads[_PHI_MAX, ..., None]),
        t(heads[_WITNESS_MAX, ..., None]),
    )


class KeyArrays(NamedTuple):
    """The key side of one decode read as :func:`_logits_radii` takes it, in its parameter order (numpy arrays,
    whole allocations of which the first ``s`` tokens are read; ``full``: ``mask`` is the all-visible
    placeholder). Built by name at both callers, unpacked only at the boundary of the compiled code."""

    q: np.ndarray
    k_served: np.ndarray
    k_band: np.ndarray
    k_hat_norm: np.ndarray
    k_wit: np.ndarray
    s: int
    mask: np.ndarray
    full: bool
    nq: int
    scale: float
    gamma: float
    half: bool
    k_from: int


def _logits_radii_arrays(a: KeyArrays) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """:func:`logits_radii` on checked numpy inputs: ``(logits, c, ‖q‖ [B, Hkv, M], heads [5, B, Hkv])`` with
    the ``key_norm_max``, ``phi_max`` and ``witness_max`` rows of ``heads`` filled (:data:`HEAD_ROWS`), or ``None``."""
    b, h, m, _ = a.q.shape
    lg = np.empty((b, h, m, a.s), dtype=np.float32)
    c = np.empty((b, h, m, a.s))
    qn = np.empty((b, h, m))
    heads = np.empty((len(HEAD_ROWS), b, h))
    ok = _logits_radii(*a, lg, c, qn, heads)
    return (lg, c, qn, heads) if ok else None


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _meter_output(
    lg: np.ndarray,
    p: np.ndarray,
    c: np.ndarray,
    ec: np.ndarray,
    v_served: np.ndarray,
    v_res: np.ndarray,
    v_dist: np.ndarray,
    v_hat_norm: np.ndarray,
    s: int,
    mask: np.ndarray,
    full: bool,
    nq: int,
    v_from: int,
    p32: np.ndarray,
    cells: np.ndarray,
    heads: np.ndarray,
) -> bool:  # pragma: no cover - compiled (covered by tests via numba)
    nbatch, nkv, nrows = cells.shape[1:]
    dv = v_served.shape[3]
    up2 = 1.0 + 4.0 * _U64  # one float64 addition of two non-negative float32 values
    upv = 1.0 + 2.0 * (s + 2) * _U64  # an S-term float64 sum of non-negative products
    rel0 = 2.0 * (s + dv) * _U32 * (1 + 1e-6)  # float32 softmax and p̃·v̂ evaluation, relative to vmax
    for bi in range(nbatch):
        for h in range(nkv):
            for t in range(v_from, s):  # pending values were not checked at write
                for j in range(dv):
                    if not np.isfinite(v_served[bi, h, t, j]):
                        return False
            sp = 0.0
            vm = 0.0
            for t in range(s):
                if _visible(mask, full, bi, h, nq, -1, t):
                    res_t = np.float64(v_res[bi, h, t])
                    sp = max(sp, np.float64(v_dist[bi, h, t]) + res_t)
                    vm = max(vm, np.float64(v_hat_norm[bi, h, t]) + res_t)
            spread = sp * up2
            vmax = vm * up2
            heads[_SPREAD, bi, h] = spread
            heads[_VMAX, bi, h] = vmax
            sl = (rel0 + 2.0 * math.tanh(heads[_PHI_MAX, bi, h])) * vmax
            for r in range(nrows):
                cert, raw, tmax = _meter_row(lg[bi, h], p[bi, h], c[bi, h], ec[bi, h], p32[bi, h], r)
                vterm = _weighted_sum(p[bi, h, r], v_res[bi, h], s) * upv
                key_term = 2.0 * min(cert, 1.0) * spread
                cells[_CERT, bi, h, r] = cert
                cells[_RAW, bi, h, r] = raw
                cells[_TANH, bi, h, r] = tmax
                cells[_VTERM, bi, h, r] = vterm
                cells[_KEY, bi, h, r] = key_term
                cells[_SLACK, bi, h, r] = sl
                cells[_BOUND, bi, h, r] = key_term + vterm + sl
    return True


def meter_output(
    lr: LogitsRadii,
    v_served: torch.Tensor,
    v_res: torch.Tensor,
    v_dist: torch.Tensor,
    v_hat_norm: torch.Tensor,
    s: int,
    *,
    mask: torch.Tensor | None = None,
    nq: int = 1,
    pending_from: int = 0,
) -> MeterOutput | None:
    """Served softmax, certificate, output and the output bound's per-read terms in one pass per row.

    From :func:`logits_radii`'s float32 logits and radii: ``p̃ = softmax(s̃)`` in float64 and ``e^{c}``
    (:func:`_softmax_exp`), then per row the meter, its unclipped value and ``tanh(max visible c)`` exactly as
    :func:`softmax_meter` (same rounding allowance, clamps and fail-closed rules), the float32 output ``Σ_t
    fl32(p̃_t)·v̂_t`` (a batched float32 BLAS product after the kernel; any order: within ``γ_S·max_t‖v̂_t‖`` of the
    exact sum in norm, which the read path's evaluation slack covers), the value term ``Σ_t p̃_t‖Δv_t‖`` and, per KV
    head, ``spread = max_t (‖v̂_t − c‖ + ‖Δv_t‖)`` and ``vmax = max_t (‖v̂_t‖ + ‖Δv_t‖)`` over tokens visible to any
    row; float64 sums of non-negative terms are multiplied by ``1 + 2(S + 2)u`` (maxima by ``1 + 4u``) so each is at
    least its exact value. The output bound of the unrepaired read per cell (``kvcert.attention.certified``'s
    two-term bound with the store's fixed centre: ``key_term + value_term + slack``, ``key_term = 2·min(meter,
    1)·spread``, ``slack = (2(S + Dv)u₃₂(1 + 10⁻⁶) + 2·tanh(φ_max))·vmax`` with ``φ_max = lr.phi_max``) is formed here
    too, in the same float64 operations as the eager form. Inputs: the first ``s`` tokens of the float32 allocations
    ``v_served[B, Hkv, ≥s, Dv]`` and the per-token witnesses ``v_res`` (``‖Δv_t‖``), ``v_dist`` (``‖v̂_t − c‖``),
    ``v_hat_norm`` (``‖v̂_t‖``), each ``[B, Hkv, ≥s]``. Returns ``None`` when a value at or after ``pending_from``
    is not finite (the caller fails closed). CPU only.
    """
    b, h, m, _ = lr.logits.shape
    dv = v_served.shape[-1]
    vv = _prefix("v_served", v_served, (b, h, s, dv), s)
    vr = _prefix("v_res", v_res, (b, h, s), s)
    vd = _prefix("v_dist", v_dist, (b, h, s), s)
    vn = _prefix("v_hat_norm", v_hat_norm, (b, h, s), s)
    mk, full = _mask_arg(mask, b, h, nq, s)
    heads = np.empty((len(HEAD_ROWS), b, h))
    heads[_PHI_MAX] = lr.phi_max.numpy()[..., 0]
    r = _meter_output_arrays(lr.logits.numpy(), lr.c.numpy(), heads, vv, vr, vd, vn, s, mk, full, nq, pending_from)
    if r is None:
        return None
    p, p32, cells, out = r
    t = torch.from_numpy
    return MeterOutput(
        t(p),
        t(p32),
        t(cells[_CERT]),
        t(cells[_RAW]),
        t(cells[_TANH]),
        t(out),
        t(cells[_VTERM]),
        t(heads[_SPREAD, ..., None]),
        t(heads[_VMAX, ..., None]),
        t(cells[_BOUND]),
        t(cells[_KEY]),
        t(cells[_SLACK]),
    )


def _meter_output_arrays(
    lg: np.ndarray,
    c: np.ndarray,
    heads: np.ndarray,
    v_served: np.ndarray,
    v_res: np.ndarray,
    v_dist: np.ndarray,
    v_hat_norm: np.ndarray,
    s: int,
    mask: np.ndarray,
    full: bool,
    nq: int,
    v_from: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """:func:`meter_output` on checked numpy inputs (``heads[phi_max]`` filled): ``(p̃, p̃ float32, cells [7, B,
    Hkv, M] (:data:`CELL_ROWS`), output [B, Hkv, M, Dv])`` with the ``spread`` and ``vmax`` rows of ``heads``
    filled, or ``None``."""
    b, h, m, _ = lg.shape
    p, ec = _softmax_exp(lg.reshape(-1, s), c.reshape(-1, s))
    p, ec = p.reshape(b, h, m, s), ec.reshape(b, h, m, s)
    p32 = np.empty((b, h, m, s), dtype=np.float32)
    cells = np.empty((len(CELL_ROWS), b, h, m))
    if not _meter_output(
        lg, p, c, ec, v_served, v_res, v_dist, v_hat_norm, s, mask, full, nq, v_from, p32, cells, heads
    ):
        return None
    out = np.matmul(p32, v_served[:, :, :s])  # float32 BLAS: an S-term sum per entry, in some order
    return p, p32, cells, out


class DecodeArrays(NamedTuple):
    """numpy results of :func:`decode_read` (float64 unless stated)."""

    p: np.ndarray  # [B, Hkv, M, S] served distribution
    c: np.ndarray  # [B, Hkv, M, S] radii incl. the float32 logit slack
    qn: np.ndarray  # [B, Hkv, M] ‖q‖₂
    cells: np.ndarray  # [7, B, Hkv, M] rows CELL_ROWS
    heads: np.ndarray  # [5, B, Hkv] rows HEAD_ROWS
    out: np.ndarray  # [B, Hkv, M, Dv] float32 served output


def decode_read(inputs: DecodeInputs[np.ndarray]) -> DecodeArrays | None:
    """:func:`logits_radii` then :func:`meter_output` on numpy arrays, without their input checks or tensor
    conversions: for the certified cache's read path, whose allocations are float32, C-contiguous and shaped
    ``[B, Hkv, capacity ≥ n_tokens, ...]`` by construction (``kvcert.cache.buffer.GrowBuffer``), with a float32
    C-contiguous query ``inputs.q[B, Hkv, M, D]`` and ``inputs.mask`` a ``[B, 1|Hkv, nq, ≥ n_tokens]`` boolean
    array or ``None`` (every token visible). Same kernels, same guarantees; ``None`` when a query or pending entry
    is not finite. The fields are unpacked here, at the boundary of the compiled code."""
    x = inputs
    s = x.n_tokens
    mk, full = (_NO_MASK, True) if x.mask is None else (x.mask, False)
    r = _logits_radii_arrays(
        KeyArrays(
            q=x.q,
            k_served=x.k_served,
            k_band=x.k_band,
            k_hat_norm=x.k_hat_norm,
            k_wit=x.k_wit,
            s=s,
            mask=mk,
            full=full,
            nq=x.nq,
            scale=x.scale,
            gamma=x.gamma,
            half=x.rotate_half,
            k_from=x.k_from,
        )
    )
    if r is None:
        return None
    _, c, qn, heads = r
    mo = _meter_output_arrays(r[0], c, heads, x.v_served, x.v_res, x.v_dist, x.v_hat_norm, s, mk, full, x.nq, x.v_from)
    if mo is None:
        return None
    p, _, cells, out = mo
    return DecodeArrays(p, c, qn, cells, heads, out)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _all_set(mask: np.ndarray) -> bool:  # pragma: no cover - compiled (covered by tests via numba)
    for x in mask.flat:
        if not x:
            return False
    return True


def all_visible(mask: torch.Tensor) -> bool:
    """Whether a CPU boolean mask is all True (one compiled pass; no torch reduction dispatch)."""
    return bool(_all_set(mask.numpy()))
