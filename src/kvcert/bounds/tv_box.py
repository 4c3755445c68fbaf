"""The box supremum: the least TV bound that per-token radii allow, up to a grid (``docs/math.md#box-supremum``).

Setting of :mod:`kvcert.bounds.softmax_tv`: the served ``p̃`` is observed, the exact ``p_t = p̃_t w_t/μ`` with
``w_t = e^{−ε_t}`` and ``μ = Σ_t p̃_t w_t``, and all that is known of ``ε`` is ``|ε_t| ≤ c_t``, i.e. ``w`` lies in the
box ``l_t ≤ w_t ≤ h_t`` (``l = e^{−c}``, ``h = e^{c}``). Then

* ``TV(p, p̃) = (1/μ)·Σ_t p̃_t (w_t − μ)₊ = (1/μ)·Σ_t p̃_t (μ − w_t)₊`` (positive and negative parts of ``p − p̃``),
* ``μ ∈ [B₋, A]`` with ``B₋ = Σ p̃ l``, ``A = Σ p̃ h``.

For every interval ``[a, b] ∋ μ`` and every ``λ ≥ 0`` (weak Lagrange duality on the constraint ``Σ p̃ w = μ``, and a
convex function of ``w_t`` is largest at an end of ``[l_t, h_t]``):

* up form: ``TV ≤ (1/a)·(λb + Σ_t p̃_t max((h_t − a)₊ − λh_t, (l_t − a)₊ − λl_t))``,
* down form: ``TV ≤ (1/a)·(−λa + Σ_t p̃_t max((b − h_t)₊ + λh_t, (b − l_t)₊ + λl_t))``.

:func:`tv_box` cuts ``[B₋, A]`` into geometric intervals, takes on each the smaller form at the ``λ`` that minimises it
(the breakpoint where the dual's slope changes sign, found by sorting; any ``λ ≥ 0`` is sound, so the choice only
decides tightness) and returns the largest over the intervals. As the grid refines this tends to the supremum of the
TV over the box with token masses split freely (the LP relaxation), which is at least the supremum over the box, the
least bound any ``(p̃, c)`` form can give (``tanh(c/2)`` for equal radii, where ``ptm`` gives about ``c``). Splitting
lets a dominant token count as partly raised and partly lowered, which its single ``ε_t`` cannot do, so the heaviest
tokens enter exactly: the supremum over the box is attained at a vertex (``TV = max_U Σ_U (p_t − p̃_t)`` and each
sum is monotone in every ``w_t``), so it is the largest of the suprema with those tokens pinned to either end.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kvcert.bounds.softmax_tv import _EXP_SAFE, check_broadcast, check_nonneg_finite, check_served, live_rows

F64 = torch.float64
_U = 2.0**-53
#: relative widening of ``e^{±c}``: ``torch.exp`` is within a few ulps of the exact value
_EXP_WIDEN = 8 * _U
#: elements per chunk of the ``[rows, intervals, S]`` work tensors
_CHUNK = 1 << 22
#: the first, coarse grid of :func:`box_refined` under a gate's threshold
COARSE_INTERVALS = 4
#: at most this many tokens enter exactly (2^8 = 256 cases per row)
_MAX_EXACT = 8
#: :func:`tv_box`'s defaults, which :func:`box_refined` uses
_INTERVALS, _EXACT = 16, 1
#: radius classes per octave of the coarse pass of :func:`box_refined` (:func:`round_radii`)
COARSE_CLASSES = 8
#: largest ``classes`` of :func:`round_radii`, and the floor below which a positive radius is raised to ``2^-1000``
_MAX_CLASSES = 64
_RADIUS_FLOOR = 2.0**-1000
_POWERS_OF_TWO = tuple(1 << i for i in range(7))


def _gamma(n: int) -> float:
    """``γ_n = n·u/(1 − n·u)``: the relative error bound of a float64 sum of ``n`` terms (any order)."""
    return n * _U / (1.0 - n * _U)


def _grid(lo: torch.Tensor, hi: torch.Tensor, cuts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Interval ends ``(a, b)`` ``[rows, cuts]`` of ``cuts`` geometric intervals of ``[lo, hi]`` (``0 < lo ≤ hi``).
    Consecutive intervals share their ends and the first and last ends are ``lo`` and ``hi`` exactly, so the intervals
    with ``a ≤ b`` cover ``[lo, hi]`` whatever the rounding of the cut points (an interval with ``a > b`` only adds a
    value to the maximum)."""
    f = torch.arange(cuts + 1, dtype=F64, device=lo.device) / cuts
    ends = torch.exp(torch.lerp(torch.log(lo).unsqueeze(-1), torch.log(hi).unsqueeze(-1), f))
    ends[:, 0], ends[:, -1] = lo, hi
    return ends[:, :-1], ends[:, 1:]


def _dual(
    p: torch.Tensor, h: torch.Tensor, l: torch.Tensor, mu: torch.Tensor, lam: torch.Tensor, s: int
) -> torch.Tensor:
    """``g(μ, λ)/μ`` rounded up, ``g(μ, λ) = λμ + Σ_t p_t max((h_t − μ)₊ − λh_t, (l_t − μ)₊ − λl_t)``; ``p, h, l``
    ``[rows, 1, S]``, ``mu, lam`` ``[rows, I, 1]``. Every term is a few roundings of magnitudes at most
    ``(h − μ)₊ + (l − μ)₊ + λ(h + l)``, so the float64 sum is within ``γ_{S+8}`` of their total (any order)."""
    hv, lv = (h - mu).clamp(min=0.0), (l - mu).clamp(min=0.0)
    lin = (lam * mu).squeeze(-1)
    val = lin + (p * torch.maximum(hv - lam * h, lv - lam * l)).sum(-1)
    mag = lin + (p * (hv + lv + lam * (h + l))).sum(-1)
    return (val + _gamma(s + 8) * mag).clamp(min=0.0) / mu.squeeze(-1) * (1.0 + 4 * _U)


def sorted_lambda(
    p: torch.Tensor, h: torch.Tensor, l: torch.Tensor, mid: torch.Tensor, b_sum: torch.Tensor
) -> torch.Tensor:
    """The dual minimiser ``λ`` ``[rows, I]`` at each midpoint ``mid[rows, I]`` (``p, h, l`` ``[rows, S]``,
    ``b_sum = Σ p l``), by sorting (any device).

    At ``μ = m`` the term of token ``t`` follows its ``h`` branch for ``λ < λ_t = ((h_t − m)₊ − (l_t − m)₊)/(h_t −
    l_t)`` (``∈ [0, 1]``), so ``∂g/∂λ = m − B₋ − Σ_{λ_t > λ} p_t (h_t − l_t)``: sorted by decreasing ``λ_t``, the
    minimum is at the breakpoint where the running weight first reaches ``m − B₋`` (``λ = 0`` if it never does)."""
    p3, h3, l3, m3 = p.unsqueeze(1), h.unsqueeze(1), l.unsqueeze(1), mid.unsqueeze(-1)
    s = p.shape[-1]
    gap = h3 - l3
    brk = torch.where(gap > 0, ((h3 - m3).clamp(min=0.0) - (l3 - m3).clamp(min=0.0)) / gap.clamp(min=_U), 0.0)
    order = brk.argsort(-1, descending=True)
    cum = (p3 * gap).expand_as(brk).gather(-1, order).cumsum(-1)
    target = (m3 - b_sum.view(-1, 1, 1)).contiguous()
    k = torch.searchsorted(cum, target).clamp(max=s - 1)
    lam = brk.gather(-1, order).gather(-1, k)
    # m above A (no token weight reaches the target; an infeasible μ): the slope is positive for every λ ≥ 0, take 0
    return torch.where(target > cum[..., -1:], 0.0, lam).squeeze(-1)


def _interval_bounds(
    p: torch.Tensor,
    h: torch.Tensor,
    l: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    b_sum: torch.Tensor,
) -> torch.Tensor:
    """``max(g(a, λ)/a, g(b, λ)/b)`` per interval ``[a, b]`` (``[rows, I]``; module doc), ``λ`` by
    :func:`sorted_lambda` at the interval's geometric midpoint. ``p, h, l``: ``[rows, S]``; ``b_sum = Σ p l``."""
    lam = sorted_lambda(p, h, l, (a * b).sqrt(), b_sum).unsqueeze(-1)
    p3, h3, l3 = p.unsqueeze(1), h.unsqueeze(1), l.unsqueeze(1)
    s = p.shape[-1]
    return torch.maximum(_dual(p3, h3, l3, a.unsqueeze(-1), lam, s), _dual(p3, h3, l3, b.unsqueeze(-1), lam, s))


#: evaluates the box bound of prepared rows: ``(p[n, S], c[n, S], intervals, exact, classes) -> [n]`` float64,
#: unclipped (``+inf`` for a row with a supported radius above 300); ``p`` rows normalised, ``c ≥ 0`` and 0 where
#: ``p`` is 0; with ``classes > 0`` the evaluator raises the radii of all but the ``exact`` heaviest tokens to their
#: class ends (:func:`round_radii`), and may merge the tokens of a class (:func:`tv_box`).
#: :func:`box_rows` on any device; :func:`kvcert.kernels.numba_box.box_rows` compiled on the CPU.
BoxRows = Callable[[torch.Tensor, torch.Tensor, int, int, int], torch.Tensor]


def round_radii(c: torch.Tensor, classes: int) -> torch.Tensor:
    """Each radius raised to the upper end of its class: ``c = m·2^e`` (``m ∈ [½, 1)``) becomes ``(½ + k/(2K))·2^e``
    with ``k = ⌈(m − ½)·2K⌉``, ``K = classes`` a power of two, so ``c ≤ ĉ < (1 + 1/K)·c``. Exact in floating point
    (``K`` and the mantissa arithmetic are powers of two) and idempotent; 0 stays 0 and positive radii below
    ``2^-1000`` are first raised to it (so every class end is a normal float)."""
    c = torch.where(c > 0, c.clamp(min=_RADIUS_FLOOR), c)
    m, e = torch.frexp(c)
    k = torch.ceil((m - 0.5) * (2 * classes)).clamp(min=0)
    return torch.where(c > 0, torch.ldexp(0.5 + k / (2 * classes), e), c)


def box_rows(p: torch.Tensor, c: torch.Tensor, intervals: int, exact: int, classes: int = 0) -> torch.Tensor:
    """The unclipped box bound of prepared rows (:data:`BoxRows`), as tensor operations on ``p``'s device.

    The ``exact`` heaviest tokens of each row are pinned to either end of their boxes (one case per vertex, module
    doc), the rest relaxed; ``[B₋, A]`` (widened by ``γ_{S+2}``) is cut into ``intervals`` geometric intervals and
    the row's bound is the largest interval value over its cases. With ``classes`` the other tokens' radii are
    raised to their class ends and evaluated one by one (the same bound as merged)."""
    s = p.shape[-1]
    # the heaviest tokens exactly: one case per vertex of their boxes (each pinned to its lower or upper end), the
    # rest relaxed; the supremum over the box is the largest over its vertices, so over these cases
    n, m = p.shape[0], min(exact, s)
    top = p.topk(m, -1).indices  # [rows, m]
    if classes:
        pinned = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, top, True)
        c = torch.where(pinned, c, round_radii(c, classes))
    huge = c.amax(-1) > _EXP_SAFE
    c = torch.where(huge.unsqueeze(-1), 0.0, c)
    e = torch.exp(c)
    h, l = e * (1.0 + _EXP_WIDEN), (1.0 - _EXP_WIDEN) / e
    cases = 1 << m
    corners = (torch.arange(cases, device=p.device).unsqueeze(-1) >> torch.arange(m, device=p.device)) & 1 == 1
    p = p.repeat_interleave(cases, 0)
    h, l = h.repeat_interleave(cases, 0), l.repeat_interleave(cases, 0)
    if m:  # case j pins token top[i] to h where bit i of j is set, else to l
        top = top.repeat_interleave(cases, 0)
        ends = torch.where(corners.repeat(n, 1), h.gather(-1, top), l.gather(-1, top))
        h, l = h.scatter(-1, top, ends), l.scatter(-1, top, ends)
    g = _gamma(s + 2)  # the dot product (γ_S) and the multiplication by 1 ± g
    b_sum = (p * l).sum(-1)
    a_hi = (p * h).sum(-1) * (1.0 + g)
    b_lo = (b_sum * (1.0 - g)).clamp(min=torch.finfo(F64).tiny)
    out = torch.empty(p.shape[0], dtype=F64, device=p.device)
    rows = max(1, _CHUNK // (intervals * s))
    for i in range(0, p.shape[0], rows):
        sl = slice(i, i + rows)
        a, b = _grid(b_lo[sl], a_hi[sl], intervals)
        out[sl] = _interval_bounds(p[sl], h[sl], l[sl], a, b, b_sum[sl]).amax(-1)
    return torch.where(huge, math.inf, out.view(n, cases).amax(-1))


def tv_box(
    p_served: torch.Tensor,
    radius: torch.Tensor,
    intervals: int = _INTERVALS,
    exact: int = _EXACT,
    clip: bool = True,
    rows: BoxRows = box_rows,
    classes: int = 0,
) -> torch.Tensor:
    """``TV(p, p̃) ≤`` the box supremum bound for every ``ε`` with ``|ε_t| ≤ c_t`` (module doc), float64 ``[...]``.

    ``p_served[..., S]`` (rows summing to 1 within 1e-2, renormalised as the other forms do), ``radius[..., S] ≥ 0``
    broadcastable; ``intervals``: geometric intervals of ``[B₋, A]``; ``exact``: the ``m`` heaviest tokens of a row
    enter exactly (``2^m`` cases, one per vertex of their boxes), the others relaxed (more of either: tighter and
    slower, ``O(2^m·intervals·S log S)`` per row). Tokens with ``p̃_t = 0`` carry no mass and are ignored. Rows with a
    supported radius above 300 get the trivial bound (1, or ``+inf`` with ``clip=False``). Rounding: ``e^{±c}`` is
    widened by ``8u``, ``A`` and ``B₋`` by ``γ_{S+2}``, and every interval's value by ``γ_{S+8}`` of its terms'
    magnitudes, so the returned value is never below the exact value of the bound. ``ValueError`` on non-finite or
    negative input, rows not summing to 1, ``intervals < 1``, ``exact`` not in ``[0, 8]`` or ``classes`` not 0 or
    a power of two up to 64. ``rows`` evaluates the prepared rows (:data:`BoxRows`; the compiled
    :func:`kvcert.kernels.numba_box.box_rows` on the CPU, the same bound up to summation order).

    ``classes = K > 0`` first raises the radius of every token but the ``exact`` heaviest to the end of its class
    (:func:`round_radii`, less than ``1 + 1/K`` times it): a larger box, so the bound stays sound and is at most a
    factor ``1 + 1/K`` in the radii looser, and the tokens of one class have one box, which the relaxed part of the
    bound treats as one token of their summed mass (module doc), so the compiled evaluator handles a handful of
    classes instead of ``S`` tokens. Rows whose rounded radii exceed 300 get the trivial bound.
    """
    if isinstance(intervals, bool) or not isinstance(intervals, int) or intervals < 1:
        raise ValueError(f"intervals must be a positive int, got {intervals!r}")
    if isinstance(exact, bool) or not isinstance(exact, int) or not 0 <= exact <= _MAX_EXACT:
        raise ValueError(f"exact must be an int in [0, {_MAX_EXACT}] (2^exact cases per row), got {exact!r}")
    if isinstance(classes, bool) or not isinstance(classes, int) or classes not in (0, *_POWERS_OF_TWO):
        raise ValueError(f"classes must be 0 or a power of two up to {_MAX_CLASSES}, got {classes!r}")
    p, c, batch = _prepared(p_served, radius)
    out = rows(p, c, intervals, exact, classes).to(p.device).reshape(batch)
    return out.clamp(0.0, 1.0) if clip else out


def _prepared(p_served: torch.Tensor, radius: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Size]:
    """Checked and flattened rows for a :data:`BoxRows` evaluator: ``p[n, S]`` renormalised, ``c[n, S]`` 0 where
    ``p`` is, and the batch shape (``ValueError`` as :func:`tv_box` says)."""
    p, mass = check_served(p_served)
    c = check_nonneg_finite(radius, "radius")
    check_broadcast(p_served=p, radius=c)
    p, c = torch.broadcast_tensors(p / mass.unsqueeze(-1), c)
    batch, s = p.shape[:-1], p.shape[-1]
    return p.reshape(-1, s), torch.where(p > 0, c, 0.0).reshape(-1, s), batch


def box_refined(
    p_served: torch.Tensor,
    radius: torch.Tensor,
    cert: torch.Tensor,
    threshold: float | None = None,
    rows: BoxRows = box_rows,
) -> torch.Tensor:
    """``min(cert, tv_box(p̃, c))`` per row of ``p_served[..., S]`` (a read's served distribution) and ``radius``, for
    ``cert[...]`` a sound certificate of the same rows (the meter); rows with no visible token (all ``p̃`` 0) keep
    ``cert``. Float64, on ``p_served``'s device.

    With a ``threshold`` (a gate's τ) the box is first computed on :data:`COARSE_INTERVALS` intervals with the radii
    in :data:`COARSE_CLASSES` classes per octave (``tv_box(..., classes=)``), and only the rows still above the
    threshold get the default grid over the exact radii: a gate needs to know which rows are ``<= τ``, and the coarse
    pass is as sound, a little looser and many times cheaper. One host synchronisation (which rows). ``rows``:
    as :func:`tv_box`'s."""
    p_live, live = live_rows(p_served)
    p, c, batch = _prepared(p_live, radius)
    base = cert.to(F64)
    if threshold is None:
        box = rows(p, c, _INTERVALS, _EXACT, 0).to(p.device).reshape(batch)
        return torch.where(live, torch.minimum(base, box), base)
    coarse = rows(p, c, COARSE_INTERVALS, _EXACT, COARSE_CLASSES).to(p.device).reshape(batch)
    out = torch.where(live, torch.minimum(base, coarse), base)
    again = (out > threshold) & live
    if bool(again.any()):
        flat = again.reshape(-1)
        out[again] = torch.minimum(out[again], rows(p[flat], c[flat], _INTERVALS, _EXACT, 0).to(p.device))
    return out
