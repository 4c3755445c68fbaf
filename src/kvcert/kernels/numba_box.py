"""The box supremum on CPU, compiled (numba): every row's grid, dual variable and dual evaluations in one pass
(``docs/math.md#box-supremum``).

:func:`kvcert.bounds.tv_box.tv_box` bounds the TV of a cell on each interval ``[a, b]`` of ``μ`` by the Lagrange dual
``g(·, λ)`` at one ``λ`` per interval. Its tensor evaluation (:func:`kvcert.bounds.tv_box.box_rows`) takes some sixty
small tensor operations per call and sorts the breakpoints of every interval. :func:`box_rows` here computes the same
bound row by row:

* ``e^{±c}`` with the same widening (``8u``), ``A`` and ``B₋`` with the same ``γ_{S+2}``;
* the ``m`` heaviest tokens pinned to the ends of their boxes (``2^m`` cases, as there);
* the same geometric grid of ``[B₋, A]``, its first and last ends exactly ``B₋`` and ``A``;
* ``λ`` at each interval's geometric midpoint by a weighted quickselect instead of a sort (the same breakpoint);
* ``g(a, λ)/a`` and ``g(b, λ)/b`` in one pass over the tokens, each raised by ``γ_{S+8}`` of its terms' magnitudes,
  then divided and raised by ``4u``;
* with radius classes (``classes = K``), the tokens of each class as one entry of their summed mass at the class's
  end, and the allowances ``γ_{2S+2}`` and ``γ_{2S+16}`` for the sums of sums.

Soundness rests on the evaluation of ``g`` and on the interval ends covering ``[B₋, A]``, not on ``λ`` or on the cut
points, and the rounding allowances hold for any summation order, so this kernel is as sound as the tensor one. It is
tested against the tensor evaluation (equal up to summation order) and against the brute-force supremum.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from kvcert.bounds.softmax_tv import _EXP_SAFE
from kvcert.bounds.tv_box import _EXP_WIDEN, _RADIUS_FLOOR, _U, BoxRows, _gamma
from kvcert.bounds.tv_box import box_rows as tensor_box_rows
from kvcert.kernels import active

__all__ = ["box_rows", "rows_for"]

_TINY = float(np.finfo(np.float64).tiny)
#: class keys: ``(e + _E_OFFSET)·K + k`` for a class end ``(½ + k/(2K))·2^e`` with ``2^-1000 ≤ end < 2^10``
_E_OFFSET = 1001


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _select_desc(brk: np.ndarray, w: np.ndarray, n: int, target: float) -> float:  # pragma: no cover - compiled
    """The value ``v`` among ``brk[:n]`` with ``W(> v) < target <= W(>= v)``, ``W`` the weight ``w`` of the elements
    above (or at) a value; ``brk`` and ``w`` are permuted in place. Three-way quickselect on the middle element."""
    lo, hi = 0, n  # the live range [lo, hi)
    while hi - lo > 1:
        pivot = brk[(lo + hi) // 2]
        # three-way partition of [lo, hi): above pivot | equal | below
        i, gt, lt = lo, lo, hi
        while i < lt:
            if brk[i] > pivot:
                brk[i], brk[gt] = brk[gt], brk[i]
                w[i], w[gt] = w[gt], w[i]
                gt += 1
                i += 1
            elif brk[i] < pivot:
                lt -= 1
                brk[i], brk[lt] = brk[lt], brk[i]
                w[i], w[lt] = w[lt], w[i]
            else:
                i += 1
        above = 0.0
        for j in range(lo, gt):
            above += w[j]
        if above >= target:
            hi = gt
            continue
        equal = 0.0
        for j in range(gt, lt):
            equal += w[j]
        if above + equal >= target:
            return pivot
        target -= above + equal
        lo = lt
    return brk[lo]


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _lambda(
    p: np.ndarray, h: np.ndarray, l: np.ndarray, n: int, m: float, b_sum: float, brk: np.ndarray, w: np.ndarray
) -> float:  # pragma: no cover - compiled (tested via numba)
    """The dual minimiser at ``μ = m`` over the first ``n`` entries: entry ``t`` follows its ``h`` branch for ``λ <
    λ_t = ((h_t − m)₊ − (l_t − m)₊)/(h_t − l_t)``, so ``∂g/∂λ = m − B₋ − Σ_{λ_t > λ} p_t (h_t − l_t)``; the minimum
    is the breakpoint where the weight of the larger breakpoints first reaches ``m − B₋`` (``λ = 0`` if it never
    does)."""
    k, total, top = 0, 0.0, 0.0
    for t in range(n):
        gap = h[t] - l[t]
        weight = p[t] * gap
        if weight > 0.0:
            b = (max(h[t] - m, 0.0) - max(l[t] - m, 0.0)) / gap
            brk[k], w[k] = b, weight
            total += weight
            top = max(top, b)
            k += 1
    target = m - b_sum
    if k == 0 or target > total:
        return 0.0  # the slope never turns negative
    if target <= 0.0:
        return top  # already non-negative above every breakpoint
    return _select_desc(brk, w, k, target)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _duals(
    p: np.ndarray, h: np.ndarray, l: np.ndarray, n: int, a: float, b: float, lam: float, gam: float
) -> float:  # pragma: no cover - compiled (tested via numba)
    """``max(g(a, λ)/a, g(b, λ)/b)`` over the first ``n`` entries, each rounded up: ``g(μ, λ) = λμ + Σ_t p_t
    max((h_t − μ)₊ − λh_t, (l_t − μ)₊ − λl_t)``, raised by ``gam`` times the sum of its terms' magnitudes, clamped
    at 0, divided by ``μ`` and raised by ``4u``."""
    va, vb = lam * a, lam * b
    ma, mb = va, vb
    for t in range(n):
        pt, ht, lt = p[t], h[t], l[t]
        lh, ll = lam * ht, lam * lt
        ha, la = max(ht - a, 0.0), max(lt - a, 0.0)
        hb, lb = max(ht - b, 0.0), max(lt - b, 0.0)
        va += pt * max(ha - lh, la - ll)
        vb += pt * max(hb - lh, lb - ll)
        ma += pt * (ha + la + lh + ll)
        mb += pt * (hb + lb + lh + ll)
    ga = max(va + gam * ma, 0.0) / a * (1.0 + 4 * _U)
    gb = max(vb + gam * mb, 0.0) / b * (1.0 + 4 * _U)
    return max(ga, gb)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _class_end(c: float, classes: int) -> tuple[int, float]:  # pragma: no cover - compiled (tested via numba)
    """``(key, end)`` of radius ``c > 0``'s class (:func:`kvcert.bounds.tv_box.round_radii`: ``end ≥ c``, equal for a
    class end); ``key ≥ 1`` indexes the class among radii in ``[2^-1000, 2^10)``."""
    m, e = math.frexp(max(c, _RADIUS_FLOOR))
    k = int(math.ceil((m - 0.5) * (2 * classes)))
    if k >= classes:  # m·2^e rounds up to 2^e = ½·2^{e+1}
        k, e = 0, e + 1
    return (e + _E_OFFSET) * classes + k, math.ldexp(0.5 + k / (2 * classes), e)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _pin(
    pr: np.ndarray, cr: np.ndarray, m: int, pinned: np.ndarray, pc: np.ndarray, cc: np.ndarray
) -> None:  # pragma: no cover - compiled (tested via numba)
    """The ``m`` heaviest tokens (largest ``p``, lowest index first) as the first entries, marked in ``pinned``."""
    for i in range(m):
        best = -1
        for t in range(pr.shape[0]):
            if not pinned[t] and (best < 0 or pr[t] > pr[best]):
                best = t
        pinned[best] = True
        pc[i], cc[i] = pr[best], cr[best]


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _merge(
    pr: np.ndarray,
    cr: np.ndarray,
    classes: int,
    pinned: np.ndarray,
    pc: np.ndarray,
    cc: np.ndarray,
    n: int,
    table: np.ndarray,
    ends_of: np.ndarray,
    used: np.ndarray,
) -> int:  # pragma: no cover - compiled (tested via numba)
    """Append the supported, unpinned tokens to the entries from ``n`` on: one by one (``classes = 0``), or one
    entry per radius class with the class's summed mass at its end (``table``/``ends_of`` indexed by class key, left
    zeroed); returns the number of entries."""
    if not classes:
        for t in range(pr.shape[0]):
            if pr[t] > 0.0 and not pinned[t]:
                pc[n], cc[n] = pr[t], cr[t]
                n += 1
        return n
    k = 0
    for t in range(pr.shape[0]):
        if pr[t] > 0.0 and not pinned[t]:
            key, end = (0, 0.0) if cr[t] == 0.0 else _class_end(cr[t], classes)
            if table[key] == 0.0:
                used[k] = key
                ends_of[key] = end
                k += 1
            table[key] += pr[t]
    for j in range(k):
        pc[n], cc[n] = table[used[j]], ends_of[used[j]]
        table[used[j]] = 0.0
        n += 1
    return n


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _bound(
    pc: np.ndarray, cc: np.ndarray, n: int, m: int, intervals: int, g2: float, g8: float
) -> float:  # pragma: no cover - compiled (tested via numba)
    """The box bound of ``n`` entries whose first ``m`` are pinned: the largest interval value over the ``2^m``
    cases (module doc); ``g2``, ``g8`` the allowances of ``A``/``B₋`` and of each ``g``."""
    h0, l0 = np.empty(n), np.empty(n)
    for t in range(n):
        e = math.exp(cc[t])
        h0[t], l0[t] = e * (1.0 + _EXP_WIDEN), (1.0 - _EXP_WIDEN) / e
    h, l = np.empty(n), np.empty(n)
    brk, w = np.empty(n), np.empty(n)
    ends = np.empty(intervals + 1)
    res = 0.0
    for case in range(1 << m):
        h[:] = h0
        l[:] = l0
        for i in range(m):  # case j pins entry i to h where bit i of j is set, else to l
            end = h0[i] if (case >> i) & 1 else l0[i]
            h[i], l[i] = end, end
        b_sum, a_sum = 0.0, 0.0
        for t in range(n):
            b_sum += pc[t] * l[t]
            a_sum += pc[t] * h[t]
        hi = a_sum * (1.0 + g2)
        lo = max(b_sum * (1.0 - g2), _TINY)
        log_lo, log_hi = math.log(lo), math.log(hi)
        for k in range(intervals + 1):
            ends[k] = math.exp(log_lo + (log_hi - log_lo) * (k / intervals))
        ends[0], ends[intervals] = lo, hi  # the intervals cover [lo, hi] whatever the rounding of the cuts
        for k in range(intervals):
            a, b = ends[k], ends[k + 1]
            lam = _lambda(pc, h, l, n, math.sqrt(a * b), b_sum, brk, w)
            res = max(res, _duals(pc, h, l, n, a, b, lam, g8))
    return res


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _rows(
    p: np.ndarray, c: np.ndarray, intervals: int, exact: int, classes: int, g2: float, g8: float, out: np.ndarray
) -> None:  # pragma: no cover - compiled (tested via numba)
    """Every row's bound into ``out``; ``g2``, ``g8`` the allowances of ``A``/``B₋`` and of each ``g``."""
    rows, s = p.shape
    pc, cc = np.empty(s), np.empty(s)  # the row's entries: pinned tokens first, then tokens or classes
    m = min(exact, s)
    pinned = np.zeros(s, dtype=np.bool_)
    table = np.zeros((_E_OFFSET + 12) * max(classes, 1))  # mass per class key (0: unused)
    ends_of = np.empty_like(table)
    used = np.empty(s, dtype=np.int64)
    for r in range(rows):
        pr, cr = p[r], c[r]
        # first on the raw radii, which also keeps every class key inside the table; then on the entries, as a class
        # end may pass 300 (at most 337.5)
        if np.any((pr > 0.0) & (cr > _EXP_SAFE)):
            out[r] = math.inf
            continue
        _pin(pr, cr, m, pinned, pc, cc)
        n = _merge(pr, cr, classes, pinned, pc, cc, m, table, ends_of, used)
        pinned[:] = False
        out[r] = math.inf if np.any(cc[:n] > _EXP_SAFE) else _bound(pc, cc, n, m, intervals, g2, g8)


def box_rows(p: torch.Tensor, c: torch.Tensor, intervals: int, exact: int, classes: int = 0) -> torch.Tensor:
    """The unclipped box bound of every row (``+inf`` where a supported radius exceeds 300), compiled:
    :data:`kvcert.bounds.tv_box.BoxRows`'s contract (``p[n, S]`` normalised rows, ``c[n, S] ≥ 0``, float64 CPU).
    With ``classes`` the tokens of each radius class (all but the ``exact`` heaviest) enter as one entry of their
    summed mass at the class's end (:func:`kvcert.bounds.tv_box.round_radii`, at least each of their radii; module
    doc). Returns float64 ``[n]``."""
    s = p.shape[-1]
    # a class's mass is a float64 sum of at most S masses before it enters a sum of at most S entries: γ_{2S+…}
    g2, g8 = (_gamma(2 * s + 2), _gamma(2 * s + 16)) if classes else (_gamma(s + 2), _gamma(s + 8))
    out = np.empty(p.shape[0], dtype=np.float64)
    _rows(p.detach().contiguous().numpy(), c.detach().contiguous().numpy(), intervals, exact, classes, g2, g8, out)
    return torch.from_numpy(out)


def rows_for(device: torch.device) -> BoxRows:
    """The box evaluator of a read on ``device``: :func:`box_rows` on the numba backend
    (:func:`kvcert.kernels.active`), the tensor evaluation on the others."""
    return box_rows if active(device) == "numba" else tensor_box_rows
