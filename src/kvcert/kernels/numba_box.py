"""The dual variable of the box supremum on CPU, compiled (numba): a weighted selection per cell and interval instead
of a sort (``docs/math.md#box-supremum``).

:func:`kvcert.bounds.tv_box.tv_box` bounds the TV on each interval ``[a, b]`` of ``μ`` by the Lagrange dual ``g(·, λ)``
at one ``λ`` per interval, the minimiser at the interval's midpoint ``m``: the breakpoint ``λ_t`` of the token at which
the weight ``Σ p_t (h_t − l_t)`` of the tokens with larger breakpoints first reaches ``m − B₋``. The eager chooser
finds it by sorting the breakpoints of every interval. :func:`choose_lambda` finds the same breakpoint value by a
weighted quickselect, in expected linear time, over the cells of a read at once. The choice only decides how tight
the bound is: ``tv_box`` evaluates ``g`` soundly (rounding included) at whatever ``λ`` it is given, so nothing here
bears on soundness. Tested against the eager chooser.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

__all__ = ["choose_lambda"]


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _select_desc(brk: np.ndarray, w: np.ndarray, n: int, target: float) -> float:
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
def _choose(p: np.ndarray, h: np.ndarray, l: np.ndarray, mid: np.ndarray, b_sum: np.ndarray, out: np.ndarray) -> None:
    rows, s = p.shape
    brk = np.empty(s)
    w = np.empty(s)
    for r in range(rows):
        for i in range(mid.shape[1]):
            m = mid[r, i]
            n, total, top = 0, 0.0, 0.0
            for t in range(s):
                gap = h[r, t] - l[r, t]
                weight = p[r, t] * gap
                if weight > 0.0:
                    b = (max(h[r, t] - m, 0.0) - max(l[r, t] - m, 0.0)) / gap
                    brk[n], w[n] = b, weight
                    total += weight
                    top = max(top, b)
                    n += 1
            target = m - b_sum[r]
            if n == 0 or target > total:
                out[r, i] = 0.0  # the slope never turns negative: λ = 0
            elif target <= 0.0:
                out[r, i] = top  # already non-negative above every breakpoint
            else:
                out[r, i] = _select_desc(brk, w, n, target)


def choose_lambda(
    p: torch.Tensor, h: torch.Tensor, l: torch.Tensor, mid: torch.Tensor, b_sum: torch.Tensor
) -> torch.Tensor:
    """``λ`` ``[rows, I]`` for :func:`kvcert.bounds.tv_box.tv_box` (``p, h, l`` ``[rows, S]``, ``mid`` ``[rows, I]``,
    ``b_sum`` ``[rows]``; float64 CPU tensors): the dual minimiser at each midpoint (module doc)."""

    def arr(x: torch.Tensor) -> np.ndarray:
        return x.detach().to(torch.float64).contiguous().numpy()

    out = np.empty(tuple(mid.shape), dtype=np.float64)
    _choose(arr(p), arr(h), arr(l), arr(mid), arr(b_sum), out)
    return torch.from_numpy(out)
