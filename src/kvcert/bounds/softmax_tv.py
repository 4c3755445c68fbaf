"""Sound upper bounds on the total variation between exact and served (perturbed) softmax attention.

Setting (``docs/math.md#notation``, ``docs/math.md#softmax-tv-bounds``). Exact logits ``s``, served logits
``s̃ = s + ε``; the served
distribution ``p̃ = softmax(s̃)`` is observable, the exact one is ``p_t = p̃_t e^{-ε_t}/Z`` with
``Z = Σ_t p̃_t e^{-ε_t}``. Every ``(p, c)`` form below bounds ``TV(p, p̃) = ½Σ_t|p_t − p̃_t|`` for **every**
``ε`` with ``|ε_t| ≤ c_t``, using only ``p̃`` and the per-token radii ``c``. With
``A = Σ_t p̃_t e^{c_t}`` and ``B₋ = Σ_t p̃_t e^{-c_t}``:

==============  ======================================================  =============================
form            bound                                                   provenance
==============  ======================================================  =============================
``eform``       ``½(A² − 1)``                                           Lean ``SoftmaxTV.tv_le_eform``
``two_sided``   ``½(A/B₋ − B₋/A)``                                      artifact p37
``ptm``         ``½Σ p̃_t·min(A e^{c_t} − 1, e^{c_t}/B₋ − e^{-c_t}/A)``  artifact p37
``meter``       ``min(1, eform, two_sided, ptm)``                       cell certificate
``tanh_max``    ``tanh(max_t c_t)``                                     Lean ``tv_le_tanh``
``tanh_osc``    ``tanh((c_(1) + c_(2))/4)``                             **paper-level, not machine-checked**
==============  ======================================================  =============================

Tokens with ``p̃_t = 0`` (masked) have ``p_t = 0`` as well, so they contribute nothing; the ``max`` of
the tanh forms is taken over the support of ``p̃``. Everything is evaluated in float64; ``A`` and
``B₋`` are computed once per call (one ``exp`` of ``c``) and shared by all forms. Overflow yields the
trivial bound (1 when clipped, ``+inf`` unclipped), never NaN. Bad input raises ``ValueError``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcert.checks import fail_if

FORMS: tuple[str, ...] = ("eform", "two_sided", "ptm", "meter", "tanh_max", "tanh_osc")
#: forms whose soundness is only argued on paper (flag them wherever their numbers are reported)
PAPER_LEVEL_FORMS: tuple[str, ...] = ("tanh_osc",)

# With every radius <= 300, A, 1/B₋ <= e^300 and every per-token product stays below e^600 < e^709 (the
# float64 maximum). Above it the bounds are astronomically trivial; only overflow-safe paths are used.
_EXP_SAFE = 300.0
# a served row must be a probability vector up to low-precision softmax rounding
_MASS_TOL = 1e-2


def _check_range(x: torch.Tensor | float, name: str) -> torch.Tensor:
    """``x`` as a tensor after the check that every entry is finite and ``>= 0`` (ValueError naming ``name``),
    made through :func:`kvcert.checks.fail_if`: at once, or deferred to its owner's read-back."""
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x, dtype=torch.float64)
    if not x.numel():
        return x
    if not x.is_contiguous() and x.dim() >= 2 and x.mT.is_contiguous():
        x_dense = x.mT  # same elements in memory order (e.g. a band-major store): a much faster reduction
    else:
        x_dense = x
    lo, hi = torch.aminmax(x_dense)  # NaN propagates into both and fails the check

    def error() -> ValueError:
        return ValueError(f"{name} must be finite and non-negative (min={lo.item()}, max={hi.item()})")

    fail_if(~((lo >= 0) & (hi < math.inf)), error)
    return x


def check_nonneg_finite(x: torch.Tensor | float, name: str, dtype: torch.dtype | None = torch.float64) -> torch.Tensor:
    """Return ``x`` (cast to ``dtype`` unless None) after checking every entry is finite and ``>= 0``.

    Raises ``ValueError`` naming ``name`` otherwise (fail closed on NaN, inf and negative values), at once or, inside
    :func:`kvcert.checks.deferred`, when the block's owner reads its checks back.
    """
    x = _check_range(x, name)
    return x if dtype is None else x.to(dtype)


def check_broadcast(**named: torch.Tensor | torch.Size) -> None:
    """``ValueError`` naming every argument with its shape (a tensor's, or a shape given as such) unless the shapes
    broadcast together (instead of torch's unnamed size error further in)."""
    shapes = {name: t.shape if isinstance(t, torch.Tensor) else t for name, t in named.items()}
    try:
        torch.broadcast_shapes(*shapes.values())
    except RuntimeError:
        listed = ", ".join(f"{name} {tuple(s)}" for name, s in shapes.items())
        raise ValueError(f"shapes do not broadcast: {listed}") from None


def check_served(p_served: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``p_served[..., S]`` (entries finite and ``>= 0``, rows summing to 1 within ``1e-2``: each check
    through :func:`kvcert.checks.fail_if`) and return it (float64) with its row mass ``[...]``."""
    p = check_nonneg_finite(p_served, "p_served")
    if p.dim() == 0 or p.shape[-1] == 0:
        raise ValueError(f"p_served must have a non-empty last (token) dimension, got shape {tuple(p.shape)}")
    mass = p.sum(-1)
    lo, hi = torch.aminmax(mass)

    def error() -> ValueError:
        return ValueError(f"p_served rows must sum to 1 (row masses range over [{lo.item()}, {hi.item()}])")

    fail_if(~((lo >= 1.0 - _MASS_TOL) & (hi <= 1.0 + _MASS_TOL)), error)
    return p, mass


@dataclass(frozen=True)
class Moments:
    """Shared intermediates of the ``(p̃, c)`` forms: ``p̃``, ``e^{±c}``, ``A`` and ``B₋`` (float64)."""

    p: torch.Tensor  # [..., S] served probabilities (float64, as given)
    mass: torch.Tensor  # [...] row mass Σ p̃ (within 1e-2 of 1); every sum is divided by it
    exp_c: torch.Tensor  # [..., S] e^{c}
    exp_neg_c: torch.Tensor  # [..., S] e^{-c}
    a: torch.Tensor  # [...] A = Σ p̃ e^{c} >= 1
    b: torch.Tensor  # [...] B₋ = Σ p̃ e^{-c} <= 1
    huge_rows: torch.Tensor  # [...] rows with a supported radius > _EXP_SAFE


def moments(p_served: torch.Tensor, radius: torch.Tensor) -> Moments:
    """Validate inputs; compute ``A = Σ p̃_t e^{c_t}`` and ``B₋ = Σ p̃_t e^{-c_t}`` with one ``exp`` of ``c``.

    Rows of ``p̃`` are renormalised to mass 1 (they must already sum to 1 within 1e-2). ``A`` is clamped to
    ``≥ 1`` and ``B₋`` to ``≤ 1`` (true in exact arithmetic; the clamp removes rounding and only loosens
    every form). Radii of zero-probability tokens are irrelevant (those tokens have zero mass in both
    distributions) and are zeroed (no host sync decides whether any radius is huge: with every radius at most
    ``_EXP_SAFE`` the zeroed radii change no sum, since ``0·e^{±c}`` and ``0·gap`` are 0 either way). Raises
    ``ValueError`` naming ``p_served`` or ``radius`` on non-finite or negative input (through
    :func:`kvcert.checks.fail_if`).
    """
    p, mass = check_served(p_served)
    c = _check_range(radius, "radius").to(torch.float64)
    check_broadcast(p_served=p, radius=c)
    if p.shape != c.shape:
        p, c = torch.broadcast_tensors(p, c)
        mass = mass.expand(p.shape[:-1])
    c = torch.where(p > 0, c, 0.0)
    huge_rows = c.amax(-1) > _EXP_SAFE
    # with every radius <= _EXP_SAFE no product below can overflow; above it, e^{c} may be inf but only on
    # tokens with p̃ > 0, so A = inf and B₋ >= 0 without NaN
    exp_c = torch.exp(c)
    exp_neg_c = torch.reciprocal(exp_c)
    a = (torch.linalg.vecdot(p, exp_c) / mass).clamp_(min=1.0)
    b = (torch.linalg.vecdot(p, exp_neg_c) / mass).clamp_(max=1.0)
    return Moments(p=p, mass=mass, exp_c=exp_c, exp_neg_c=exp_neg_c, a=a, b=b, huge_rows=huge_rows)


def _finish(bound: torch.Tensor, clip: bool) -> torch.Tensor:
    return bound.clamp(0.0, 1.0) if clip else bound.clamp(min=0.0)


def _eform(m: Moments) -> torch.Tensor:
    return 0.5 * (m.a * m.a - 1.0)


def _two_sided(m: Moments) -> torch.Tensor:
    # B₋ may underflow to 0 (all radii > 745): A/0 = inf, 0/A = 0, so the result is inf, never NaN.
    return 0.5 * (m.a / m.b - m.b / m.a)


def _ptm(m: Moments) -> torch.Tensor:
    # Σ p̃ min(f₁, f₂) = Σ p̃ f₂ − Σ p̃ (f₂ − f₁)₊ with f₁ = A e^{c} − 1, f₂ = e^{c}/B₋ − e^{-c}/A,
    # Σ p̃ f₂ ≤ A/B₋ − B₋/A (equality before the clamps of A, B₋), f₂ − f₁ = 1 − (A − 1/B₋)e^{c} − e^{-c}/A.
    two = _two_sided(m)
    k1 = (m.a - 1.0 / m.b).unsqueeze(-1)
    inv_a = (1.0 / m.a).unsqueeze(-1)
    gap = torch.addcmul(1.0 - m.exp_c * k1, m.exp_neg_c, inv_a, value=-1.0).clamp_(min=0.0)
    ptm = two - 0.5 * torch.linalg.vecdot(m.p, gap) / m.mass
    # rows with a radius > _EXP_SAFE may overflow (inf − inf): use the larger, still sound, Σ p̃ f₂ ≤ two_sided
    return torch.where(m.huge_rows, two, ptm)


def _meter_unclipped(m: Moments) -> torch.Tensor:
    # min(eform, two_sided, ptm): _ptm is two_sided minus a non-negative sum (or two_sided itself), so the
    # two_sided term of the min is already accounted for
    return torch.minimum(_eform(m), _ptm(m))


def tv_eform(p: torch.Tensor, c: torch.Tensor, clip: bool = True) -> torch.Tensor:
    """P1's e-form: ``TV(p, p̃) ≤ ½(A² − 1)``, ``A = Σ_t p̃_t e^{c_t}``, for all ``|ε_t| ≤ c_t``. [Lean]

    ``p[..., S]`` is the served distribution, ``c[..., S] ≥ 0`` broadcastable; returns float64 ``[...]``.
    """
    return _finish(_eform(moments(p, c)), clip)


def tv_two_sided(p: torch.Tensor, c: torch.Tensor, clip: bool = True) -> torch.Tensor:
    """Two-sided form ``TV ≤ ½(A/B₋ − B₋/A)``: ``p_t/p̃_t ∈ [e^{-c_t}/A, e^{c_t}/B₋] ∋ 1``. [artifact p37]"""
    return _finish(_two_sided(moments(p, c)), clip)


def tv_ptm(p: torch.Tensor, c: torch.Tensor, clip: bool = True) -> torch.Tensor:
    """Per-token-min form ``½Σ_t p̃_t·min(A e^{c_t} − 1, e^{c_t}/B₋ − e^{-c_t}/A)``. [artifact p37]

    Both arguments of the ``min`` bound ``|p_t/p̃_t − 1|`` (AM–GM resp. the interval of ``tv_two_sided``),
    so ``ptm ≤ min(eform, two_sided)`` in exact arithmetic.
    """
    return _finish(_ptm(moments(p, c)), clip)


def tv_meter(p: torch.Tensor, c: torch.Tensor, clip: bool = True) -> torch.Tensor:
    """Cell certificate ``min(1, eform, two_sided, ptm)``.

    ``clip=False`` drops the 1 (may exceed 1; ``+inf`` on overflow), as risk-ranked gating needs.
    """
    return _finish(_meter_unclipped(moments(p, c)), clip)


def meter_and_unclipped(p: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``(tv_meter(p, c), tv_meter(p, c, clip=False))`` from one pass over the tokens."""
    raw = _meter_unclipped(moments(p, c))
    return raw.clamp(max=1.0), raw


def probs64(logits: torch.Tensor) -> torch.Tensor:
    """``softmax`` evaluated in float64; fully masked rows give all-zero rows instead of NaN."""
    return torch.softmax(logits, dim=-1, dtype=torch.float64).nan_to_num_(nan=0.0)


def live_rows(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p̃ with every fully masked row (all 0) replaced by a one-hot row, live [...])``: a form can then evaluate
    every row, and the caller keeps its own value for the rows that are not live (no host sync to find them)."""
    live = p.sum(-1) > 0
    onehot = torch.zeros(p.shape[-1], dtype=p.dtype, device=p.device)
    onehot[0] = 1.0
    return torch.where(live.unsqueeze(-1), p, onehot), live


def served_meter(p: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(clipped, unclipped)`` meter per row; fully masked rows (no visible token) get 0 (:func:`live_rows`)."""
    if p.dim() == 0 or p.shape[-1] == 0:
        return meter_and_unclipped(p, c)  # raises: no token dimension
    p_eval, live = live_rows(p)
    clipped, raw = meter_and_unclipped(p_eval, c)
    return torch.where(live, clipped, 0.0), torch.where(live, raw, 0.0)


def _support_radii(p: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Radii with zero-probability (masked) tokens set to 0: they carry no mass in either distribution."""
    p, _ = check_served(p)
    c = check_nonneg_finite(c, "radius")
    p, c = torch.broadcast_tensors(p, c)
    return torch.where(p > 0, c, torch.zeros_like(c))


def tv_tanh_max(p: torch.Tensor, c: torch.Tensor, clip: bool = True) -> torch.Tensor:
    """Deterministic tanh form ``TV ≤ tanh(max_t c_t)`` (max over the support of ``p̃``). [Lean ``tv_le_tanh``]

    Always ≤ 1, so ``clip`` has no effect; it is accepted for a uniform signature.
    """
    del clip
    return torch.tanh(_support_radii(p, c).amax(-1))


def tv_tanh_osc(p: torch.Tensor, c: torch.Tensor, clip: bool = True) -> torch.Tensor:
    """Centred tanh form ``TV ≤ tanh(osc/4)`` with ``osc = max ε − min ε ≤ c_(1) + c_(2)``.

    **Paper-level (P2 eq. (tanh), artifact p90), NOT machine-checked**: report it flagged
    (see ``PAPER_LEVEL_FORMS``). The two largest radii are taken over the support of ``p̃``; a single
    supported token gives ``osc = 0`` in truth, and the returned ``tanh(c_(1)/4)`` is still ≥ 0.
    """
    del clip
    cs = _support_radii(p, c)
    if cs.shape[-1] == 1:
        return torch.tanh(cs[..., 0] / 4.0)
    return torch.tanh(torch.topk(cs, 2, dim=-1).values.sum(-1) / 4.0)


def tv_uniform(eps: torch.Tensor | float, clip: bool = True) -> torch.Tensor:
    """Uniform-radius form ``TV ≤ ½(e^{2ε} − 1)`` for ``‖s − s̃‖_∞ ≤ ε`` (e-form with ``c ≡ ε``). [Lean]"""
    e = check_nonneg_finite(eps, "eps")
    return _finish(0.5 * torch.expm1(2.0 * e), clip)


def tv_tail(alpha_t: torch.Tensor | float, delta: torch.Tensor | float, clip: bool = True) -> torch.Tensor:
    """Tail-restricted form ``TV ≤ α_T (e^{2Δ} − 1)`` (proof: ``docs/math.md#tail-form``, via the p-weighted form).

    Premise: only the tokens in ``T`` carry logit error, ``|ε_t| ≤ Δ`` on ``T``, and ``α_T`` is the **exact**
    (not served) mass of ``T``. ``alpha_t ∈ [0, 1]``, ``delta ≥ 0``; they broadcast.
    """
    alpha = check_nonneg_finite(alpha_t, "alpha_t")
    if alpha.numel() and not bool(alpha.amax() <= 1.0):
        raise ValueError(f"alpha_t is a probability mass and must be <= 1 (max={alpha.amax().item()})")
    d = check_nonneg_finite(delta, "delta")
    alpha, d = torch.broadcast_tensors(alpha, d)
    growth = torch.expm1(2.0 * d)
    return _finish(torch.where(alpha > 0, alpha * growth, torch.zeros_like(growth)), clip)


def true_tv(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Exact total variation ``½Σ_t |p_t − q_t|`` over the last dim, in float64. ``ValueError`` naming both shapes
    when they do not broadcast, and naming ``p`` or ``q`` when an entry is NaN, infinite or negative: a NaN distance
    would compare as no violation wherever it is checked against a bound."""
    check_broadcast(p=p, q=q)
    return 0.5 * (check_nonneg_finite(p, "p") - check_nonneg_finite(q, "q")).abs().sum(-1)


_FORM_FNS: dict[str, Callable[[Moments], torch.Tensor]] = {
    "eform": _eform,
    "two_sided": _two_sided,
    "ptm": _ptm,
    "meter": _meter_unclipped,
}
_TANH_FNS: dict[str, Callable[..., torch.Tensor]] = {"tanh_max": tv_tanh_max, "tanh_osc": tv_tanh_osc}


def tv_bound(p_served: torch.Tensor, radius: torch.Tensor, form: str = "meter", clip: bool = True) -> torch.Tensor:
    """Upper bound on ``TV(softmax(s), softmax(s + ε))`` valid for every ``|ε_t| ≤ radius_t``.

    Dispatches to the form named by ``form`` (one of ``FORMS``); ``tanh_osc`` is paper-level only.
    """
    if form in _FORM_FNS:
        return _finish(_FORM_FNS[form](moments(p_served, radius)), clip)
    if form in _TANH_FNS:
        return _TANH_FNS[form](p_served, radius)
    raise ValueError(f"unknown form {form!r}; known forms: {', '.join(FORMS)}")
