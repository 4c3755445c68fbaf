"""Page summaries of keys and a sound bound on the attention mass of tokens that were not read.

Setting (``docs/math.md#resident-certificate``). A cell's tokens split into a *resident* set ``R`` (read: served logits
``s̃_t`` with ``|s̃_t − s_t| ≤ c_t``) and *omitted* pages ``P`` (not read; only a summary of their keys is on
the device). The served distribution ``p̃`` is the softmax of ``s̃`` over ``R`` (zero on the omitted tokens),
the exact one ``p`` the softmax of the exact logits ``s`` over every visible token.

* :func:`summarize_pages` — per page of consecutive keys: a per-channel box ``lo ≤ k ≤ hi`` rounded
  *outward* to the storage dtype (float16 by default), a ball (centre ``m`` in the storage dtype, float32 radius
  ``r ≥ max ‖k − m‖`` rounded up), a float32 upper bound on the largest key norm, and the token count. The
  rounding makes box and ball contain every key of the page exactly.
* :func:`page_logit_bound` — ``u_P ≥ sc·⟨q, k⟩ + 3·sc·γ·‖q‖·‖k‖`` for every key ``k`` of page ``P``: the smallest
  of the box bound ``sc·Σ_i max(q_i lo_i, q_i hi_i)``, the ball bound ``sc·(⟨q, m⟩ + ‖q‖ r)`` and ``sc·‖q‖·N_P``,
  plus three times the float32 logit rounding allowance ``sc·γ·‖q‖·‖k‖`` of the caller, with the float64
  evaluation error added on top.
* :func:`sketch_keys` / :func:`token_logit_bound` / :func:`pool_pages` — the same contract per token from an int8
  sketch of every omitted key (codes + per-token scale and error witness), pooled per page as
  ``log Σ_{t∈P} e^{u_t}``: far tighter than a page box, at half the keys' float16 bytes (plus 12 bytes per token).
* :func:`basis_sketch` / :func:`basis_sketch_in` / :func:`basis_logit_bound` — the same per-token contract from a
  smaller sketch (``docs/math.md#basis-sketch``): per (row, KV head) a head basis ``A`` (int8 coefficients per
  token) and a tail basis ``B`` (packed int4 or 2-bit coefficients of what ``A`` leaves), with one error witness
  against ``‖Aᵀq‖`` and one against ``‖q − AAᵀq‖``; ``r + (D − r)/2 + 10`` (int4 tail) or ``r + (D − r)/4 + 10``
  (2-bit tail) bytes per token plus the bases. Sound for any stored ``A``, ``B`` (no orthonormality assumed);
  :func:`principal_basis` takes them from the keys alone, :func:`query_aware_basis` from the keys and the queries.
* :func:`key_page_bound` — the same pooled contract for a page whose keys were paged in (its values not): from
  the computed logits and their rounding radii, ``u_t = l_t + c_t`` rounded up (``docs/math.md#key-only-pages``);
  as tight as the page's exact mass allows, and within a summary's bound.
* :func:`omitted_certificate` — with ``A = Σ_R p̃ e^{c}``, ``B₋ = Σ_R p̃ e^{−c}`` and
  ``U = Σ_P n_P e^{u_P − lse(s̃)}``: the omitted-mass bound ``m̄ = U/(B₋ + U) ≥ Σ_{t∉R} p_t``, the direct
  form ``D = 1 − B₋/(A + U) ≥ TV(p, p̃)``, and the composed certificate ``min(1, D, meter + m̄)``.

Pure math: imports only torch. Bad input (empty pages, non-finite keys or queries, shapes) raises
``ValueError`` naming the argument.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcert.bounds.spectral import spectral_norm_up
from kvcert.checks import fail_if

F64 = torch.float64
_U64 = 2.0**-53
_F32_INF = torch.tensor(float("inf"), dtype=torch.float32)


def _finite(x: torch.Tensor, name: str) -> None:
    """``ValueError`` naming ``name`` unless every entry of ``x`` is finite (:func:`kvcert.checks.fail_if`: at once,
    or deferred to the owner's read-back)."""
    fail_if(~torch.isfinite(x).all(), lambda: ValueError(f"{name} contains non-finite entries"))


def _check_composed_inputs(p: torch.Tensor, radius: torch.Tensor, weights: torch.Tensor, meter: torch.Tensor) -> None:
    """The fail-closed checks of :func:`omitted_certificate`, fused into one reduction (one host synchronisation
    on a device, or none here inside :func:`kvcert.checks.deferred`); when it fails, the checks run again one by
    one to raise the first failure's own error."""
    ok = (
        torch.isfinite(p).all()
        & torch.isfinite(radius).all()
        & ~(radius < 0).any()
        & ~(p < 0).any()
        & ~(torch.isnan(weights).any() | (weights < 0).any())
        & ~(torch.isnan(meter).any() | (meter < 0).any())
    )
    fail_if(~ok, lambda: _composed_error(p, radius, weights))


def _composed_error(p: torch.Tensor, radius: torch.Tensor, weights: torch.Tensor) -> ValueError:
    """The error of the first failed check of :func:`_check_composed_inputs` (its failure path: one read-back per
    check)."""
    for x, name in ((p, "p_served"), (radius, "radius")):
        if not bool(torch.isfinite(x).all()):
            return ValueError(f"{name} contains non-finite entries")
    if bool((radius < 0).any()) or bool((p < 0).any()):
        return ValueError("p_served and radius must be non-negative")
    if bool(torch.isnan(weights).any()) or bool((weights < 0).any()):
        return ValueError("weights must be non-negative (inf allowed)")
    return ValueError("meter must be non-negative (inf allowed), got NaN or a negative entry")


def _times(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a·b`` with ``0·∞ = 0`` (``a ≥ 0`` a factor of a query norm: a zero query has logit exactly 0 against any
    key, an infinite key norm included)."""
    return torch.where(a == 0, 0.0, a * b)


def _check_query(q: torch.Tensor, head_dim: int, scaling: float, gamma: float) -> None:
    """``ValueError`` unless ``scaling > 0``, ``gamma >= 0``, ``q`` finite with the summary's head dim."""
    if not scaling > 0 or not gamma >= 0:
        raise ValueError(f"scaling must be > 0 and gamma >= 0, got {scaling}, {gamma}")
    _finite(q, "q")
    if q.shape[-1] != head_dim:
        raise ValueError(f"q has head dim {q.shape[-1]}, the summary {head_dim}")


def _round_out(x: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """Cast float64 ``x`` to ``dtype`` rounding up (``up``) or down: the result is ``≥ x`` resp. ``≤ x``.

    Beyond the dtype's range the cast gives ``±inf`` on the safe side (an infinite bound, never a wrong one).
    """
    y = x.to(dtype)
    wrong = y.to(F64) < x if up else y.to(F64) > x
    toward = torch.full_like(y, float("inf") if up else float("-inf"))
    return torch.where(wrong, torch.nextafter(y, toward), y)


@dataclass(frozen=True)
class PageSummary:
    """Summaries of ``P`` pages of keys, batched over leading dims ``[...]``.

    ``lo``/``hi`` ``[..., P, D]`` (storage dtype): every key ``k`` of page ``j`` has ``lo_j ≤ k ≤ hi_j``
    channel-wise, exactly (outward rounding). ``norm`` ``[..., P]`` float32: ``≥ max_{k∈j} ‖k‖₂``.
    ``centre`` ``[..., P, D]`` (storage dtype) and ``radius`` ``[..., P]`` float32: ``‖k − centre_j‖₂ ≤ radius_j``.
    ``count`` ``[P]`` int64: tokens in page ``j`` (every page but possibly the last has ``page_size``).
    """

    lo: torch.Tensor
    hi: torch.Tensor
    centre: torch.Tensor
    radius: torch.Tensor
    norm: torch.Tensor
    count: torch.Tensor
    page_size: int

    @property
    def pages(self) -> int:
        """Number of pages ``P``."""
        return self.count.shape[0]

    @property
    def nbytes(self) -> int:
        """Device bytes of the summary (box, norms and counts)."""
        return sum(
            t.numel() * t.element_size() for t in (self.lo, self.hi, self.centre, self.radius, self.norm, self.count)
        )


def summarize_pages(keys: torch.Tensor, page_size: int, dtype: torch.dtype = torch.float16) -> PageSummary:
    """Summarize ``keys[..., N, D]`` in pages of ``page_size`` consecutive tokens (the last page may be short).

    Contract: for every page ``j`` and key ``k`` in it, ``lo_j ≤ k ≤ hi_j`` (each channel; the min/max are
    exact in float64 and rounded outward to ``dtype``), ``‖k − centre_j‖₂ ≤ radius_j`` (centre: the box
    midpoint cast to ``dtype``; the distance to the *stored* centre is evaluated in float64) and
    ``‖k‖₂ ≤ norm_j`` (each float64 norm inflated by its rounding allowance ``(D + 4)·2^-53``, rounded up to
    float32). Raises ``ValueError`` for ``N == 0`` (an empty page has nothing to summarize),
    ``page_size < 1``, a non-float ``dtype`` or non-finite keys.
    """
    if keys.dim() < 2:
        raise ValueError(f"keys must be [..., N, D], got shape {tuple(keys.shape)}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")
    n, d = keys.shape[-2:]
    if n == 0:
        raise ValueError("keys hold no tokens: an empty page cannot be summarized")
    _finite(keys, "keys")
    x = keys.to(F64)
    pages = -(-n // page_size)
    pad = pages * page_size - n
    lead = x.shape[:-2]
    padded = torch.nn.functional.pad(x, (0, 0, 0, pad)).reshape(*lead, pages, page_size, d)
    valid = (torch.arange(pages * page_size, device=x.device) < n).reshape(pages, page_size, 1)
    lo = torch.where(valid, padded, float("inf")).amin(-2)
    hi = torch.where(valid, padded, float("-inf")).amax(-2)
    inflate = 1.0 + (d + 4) * _U64
    norm = padded.norm(dim=-1).amax(-1) * inflate  # padding rows are 0
    centre = (0.5 * (lo + hi)).to(dtype)
    centre = torch.where(torch.isfinite(centre), centre, 0.0)  # out of range: centre at 0
    dist = torch.where(valid[..., 0], (padded - centre.to(F64).unsqueeze(-2)).norm(dim=-1), 0.0)
    count = torch.full((pages,), page_size, dtype=torch.int64, device=x.device)
    count[-1] = n - (pages - 1) * page_size
    return PageSummary(
        _round_out(lo, dtype, up=False),
        _round_out(hi, dtype, up=True),
        centre,
        _round_out(dist.amax(-1) * inflate, torch.float32, up=True),
        _round_out(norm, torch.float32, up=True),
        count,
        page_size,
    )


def page_logit_bound(q: torch.Tensor, summary: PageSummary, scaling: float, gamma: float) -> torch.Tensor:
    """Upper bound ``u[..., M, P]`` on every page's logits for queries ``q[..., M, D]`` (leading dims as the summary).

    Contract: for every key ``k`` of page ``j`` (so ``lo_j ≤ k ≤ hi_j`` and ``‖k‖ ≤ N_j``),
    ``u_{m,j} ≥ sc·⟨q_m, k⟩ + 3·sc·γ·‖q_m‖·‖k‖``. With ``γ`` the caller's relative rounding bound of one float32
    logit (the read path: ``γ_{D+1}``), ``u`` dominates both the computed exact logit (``≤ sc⟨q,k⟩ + sc·γ‖q‖‖k‖``)
    and a computed served logit of the same exact key plus its rounding radius ``2·sc·γ·‖q‖‖k‖`` (what a recalled
    token is served with). Evaluation: ``sc·min(Σ_i max(q_i lo_i, q_i hi_i), ‖q‖·N_j) + 3·sc·γ·‖q‖·N_j`` in float64
    plus ``(D + 16)·2^-52·sc·(Σ_i |q_i|·max(|lo_i|, |hi_i|) + 4‖q‖·N_j)``, which covers every float64 rounding of
    the evaluation (each term's magnitude is at most that sum). A box entry outside the storage range is
    ``±inf`` there, which the ball and norm bounds keep finite (never NaN). The ball term
    ``sc·(⟨q, m⟩ + ‖q‖ r)`` adds ``Σ_i |q_i m_i| + ‖q‖ r`` to the evaluation bracket.
    """
    _check_query(q, summary.lo.shape[-1], scaling, gamma)
    d = q.shape[-1]
    qd = q.to(F64).unsqueeze(-2)  # [..., M, 1, D]
    lo, hi = summary.lo.to(F64).unsqueeze(-3), summary.hi.to(F64).unsqueeze(-3)  # [..., 1, P, D]
    zero = qd == 0
    term = torch.where(zero, 0.0, torch.where(qd > 0, qd * hi, qd * lo))
    box = term.sum(-1)  # [..., M, P]
    mag = torch.where(zero, 0.0, qd.abs() * torch.maximum(lo.abs(), hi.abs())).sum(-1)
    qn = q.to(F64).norm(dim=-1, keepdim=True)  # [..., M, 1]
    qk = _times(qn, summary.norm.to(F64).unsqueeze(-2))  # [..., M, P] ≥ ‖q‖·‖k‖
    centre = summary.centre.to(F64).unsqueeze(-3)  # [..., 1, P, D]
    ball_dot = (qd * centre).sum(-1)
    ball_r = _times(qn, summary.radius.to(F64).unsqueeze(-2))
    ball_mag = (qd * centre).abs().sum(-1) + ball_r
    best = torch.minimum(torch.minimum(box, qk), ball_dot + ball_r)
    err = (d + 16) * 2.0**-52 * scaling * (torch.where(torch.isinf(mag), 0.0, mag) + ball_mag + 4.0 * qk)
    return scaling * best + _times(qk.new_tensor(3.0 * scaling * gamma), qk) + err


@dataclass(frozen=True)
class OmittedCertificate:
    """Per-cell terms of :func:`omitted_certificate` (all float64, shape ``[...]``)."""

    a: torch.Tensor  # A = Σ_R p̃ e^{c}
    b: torch.Tensor  # B₋ = Σ_R p̃ e^{−c}
    u: torch.Tensor  # U = Σ_P n_P e^{u_P − lse(s̃)} (omitted mass relative to the served normaliser)
    mass: torch.Tensor  # m̄ = U/(B₋ + U) ≥ exact omitted mass
    direct: torch.Tensor  # D = 1 − B₋/(A + U) ≥ TV
    certificate: torch.Tensor  # min(1, D, meter + m̄) ≥ TV


def page_weights(served_logits: torch.Tensor, bound: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``w[..., P] = n_P · e^{u_P − lse(s̃)}`` (float64): each page's mass bound relative to the served normaliser.

    ``served_logits[..., S]`` the served resident logits (``-inf`` where masked; at least one finite per row),
    ``bound[..., P]`` page logit bounds (:func:`page_logit_bound`), ``counts[..., P]`` visible tokens per page
    (broadcastable). Inflated by ``1 + 8·2^-52`` for the float64 ``exp``/``logsumexp`` rounding. A ``+inf`` bound
    (an unbounded page) gives ``w = +inf``; a NaN bound raises ``ValueError`` (it bounds nothing).
    """
    lse = torch.logsumexp(served_logits.to(F64), dim=-1, keepdim=True)
    nan_bound = torch.isnan(bound).any()

    def error() -> ValueError:
        if bool(nan_bound):
            return ValueError("bound contains NaN: a page logit bound must be a number or +inf")
        return ValueError("served_logits must have at least one finite entry per row")

    fail_if(nan_bound | ~torch.isfinite(lse).all(), error)  # one fused check
    w = counts.to(F64) * torch.exp(bound.to(F64) - lse) * (1.0 + 8 * 2.0**-52)
    return torch.where(counts.to(F64).expand_as(w) > 0, w, 0.0)


def omitted_certificate(
    p_served: torch.Tensor, radius: torch.Tensor, weights: torch.Tensor, meter: torch.Tensor
) -> OmittedCertificate:
    """Compose the resident quantization certificate with the omitted-mass bound
    (``docs/math.md#resident-certificate``).

    ``p_served[..., S]`` served distribution over the resident tokens (float64 softmax of ``s̃``; masked tokens
    0), ``radius[..., S]`` with ``|s̃_t − s_t| ≤ c_t`` on visible resident tokens, ``weights[..., P]`` from
    :func:`page_weights` (pages whose logits are bounded by ``u_P``), ``meter[...]`` a sound bound on
    ``TV(p^R, p̃)`` with ``p^R`` the exact distribution restricted to ``R``. Returns ``m̄ ≥ Σ_{t∉R} p_t`` and
    ``certificate ≥ TV(p, p̃)``. Float64 rounding of ``A``, ``B₋`` (sums of at most ``S`` terms) is covered by
    inflating ``A`` and deflating ``B₋`` by ``(S + 4)·2^-52`` relative; ``U`` already carries its allowance.
    """
    p = p_served.to(F64)
    if p.shape != radius.shape:
        raise ValueError(f"p_served {tuple(p.shape)} and radius {tuple(radius.shape)} must have the same shape")
    _check_composed_inputs(p, radius, weights, meter)
    s = p.shape[-1]
    rel = (s + 4) * 2.0**-52
    ec = torch.exp(radius.to(F64))
    a = (p * ec).sum(-1) * (1.0 + rel)
    b = (p / ec).sum(-1) * (1.0 - rel)
    u = weights.to(F64).sum(-1)
    inf = torch.isinf(u)
    uf = torch.where(inf, 0.0, u)
    # a row with no visible token (p̃ ≡ 0, nothing omitted visible either) has nothing to bound: 0
    mass = torch.where(inf, 1.0, uf / (b + uf).clamp(min=1e-300)).clamp(0.0, 1.0)
    direct = torch.where(inf, 1.0, 1.0 - b / (a + uf).clamp(min=1e-300)).clamp(0.0, 1.0)
    cert = torch.minimum(direct, meter.to(F64) + mass).clamp(max=1.0)
    return OmittedCertificate(a, b, u, mass, direct, cert)


@dataclass(frozen=True)
class KeySketch:
    """Per-token int8 sketch of keys ``[..., N, D]``: ``k̂_t = scale_t · codes_t`` with ``‖k_t − k̂_t‖₂ ≤ err_t``.

    ``codes`` int8 ``[..., N, D]``; ``scale``, ``err``, ``norm`` float32 ``[..., N]`` (``norm ≥ ‖k_t‖₂``).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    err: torch.Tensor
    norm: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Device bytes of the sketch (codes and the three per-token floats)."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.err, self.norm))


def sketch_keys(keys: torch.Tensor) -> KeySketch:
    """Symmetric per-token int8 sketch of ``keys[..., N, D]`` with a rounded-up error witness.

    Contract: ``‖k_t − scale_t·codes_t‖₂ ≤ err_t`` and ``‖k_t‖₂ ≤ norm_t``, both evaluated in float64 from the
    *stored* scale and codes, inflated by ``(D + 4)·2^-53`` and rounded up to float32. Raises ``ValueError`` for
    no tokens or non-finite keys.
    """
    _check_keys(keys)
    x = keys.to(F64)
    d = x.shape[-1]
    amax = x.abs().amax(-1)
    scale = torch.where(amax > 0, amax / 127.0, 1.0).to(torch.float32)
    codes = torch.round(x / scale.to(F64).unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    khat = codes.to(F64) * scale.to(F64).unsqueeze(-1)
    inflate = 1.0 + (d + 4) * _U64
    return KeySketch(
        codes,
        scale,
        _round_out((x - khat).norm(dim=-1) * inflate, torch.float32, up=True),
        _round_out(x.norm(dim=-1) * inflate, torch.float32, up=True),
    )


def token_logit_bound(q: torch.Tensor, sketch: KeySketch, scaling: float, gamma: float) -> torch.Tensor:
    """Per-token bound ``u[..., M, N] ≥ sc·⟨q_m, k_t⟩ + 3·sc·γ·‖q_m‖·‖k_t‖`` from an int8 sketch (the contract of
    :func:`page_logit_bound` for pages of one token): ``sc·(⟨q, k̂_t⟩ + ‖q‖·err_t) + 3·sc·γ·‖q‖·norm_t`` in float64
    plus ``(D + 16)·2^-52·sc·(Σ_i |q_i k̂_ti| + ‖q‖·err_t + 4‖q‖·norm_t)`` for the evaluation's rounding.
    """
    _check_query(q, sketch.codes.shape[-1], scaling, gamma)
    d = q.shape[-1]
    q64 = q.to(F64)
    khat = sketch.codes.to(F64) * sketch.scale.to(F64).unsqueeze(-1)
    dot = q64 @ khat.transpose(-1, -2)
    mag = q64.abs() @ khat.abs().transpose(-1, -2)
    qn = q64.norm(dim=-1, keepdim=True)
    e, nrm = _times(qn, sketch.err.to(F64).unsqueeze(-2)), _times(qn, sketch.norm.to(F64).unsqueeze(-2))
    err = (d + 16) * 2.0**-52 * scaling * (mag + e + 4.0 * nrm)
    return scaling * (dot + e) + _times(nrm.new_tensor(3.0 * scaling * gamma), nrm) + err


def pool_pages(bound: torch.Tensor, visible: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logit bounds ``[..., N]`` -> per-page ``(log Σ_{t∈P visible} e^{u_t}, 1[P has a visible token])``.

    ``n_P e^{u_P}`` with these is exactly ``Σ_{t∈P visible} e^{u_t}``, so :func:`page_weights` and
    :func:`omitted_certificate` take them unchanged; pages are ``page_size`` consecutive tokens. A page holding a
    visible token with ``u_t = +inf`` pools to ``+inf`` (counted, never dropped); a NaN bound raises ``ValueError``.
    """
    fail_if(
        torch.isnan(bound).any(), lambda: ValueError("bound contains NaN: a token logit bound must be a number or +inf")
    )
    return _pool(bound, visible, page_size)


def _pool(bound: torch.Tensor, visible: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pool_pages` after its input check."""
    n = bound.shape[-1]
    pages = -(-n // page_size)
    pad = pages * page_size - n
    u = torch.nn.functional.pad(torch.where(visible, bound.to(F64), float("-inf")), (0, pad), value=float("-inf"))
    pooled = torch.logsumexp(u.reshape(*u.shape[:-1], pages, page_size), dim=-1)
    seen = pooled != float("-inf")  # a visible token (its bound may be +inf; NaN stays NaN, counted)
    pooled = torch.where(seen, pooled, 0.0)
    pooled = pooled + (page_size + 4) * 2.0**-52 * (1.0 + pooled.abs())  # float64 logsumexp rounding
    return torch.where(seen, pooled, 0.0), seen.to(torch.int64)


def key_page_bound(
    logits: torch.Tensor, radius: torch.Tensor, visible: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Page logit bounds from the pages' own keys: ``(ū[..., P], seen[..., P])`` with
    ``seen_P·e^{ū_P} ≥ Σ_{t∈P visible} e^{s_t}``, for :func:`page_weights` (``docs/math.md#key-only-pages``).

    ``logits[..., N]`` the computed logits ``l_t`` of ``P = N / page_size`` pages of consecutive tokens (page ``j``:
    tokens ``j·page_size`` to ``(j + 1)·page_size − 1``), ``radius[..., N]`` with ``|l_t − s_t| ≤ c_t`` on every visible
    token (the radius of a recalled token), ``visible[..., N]`` bool. Per token ``u_t = fl(l_t + c_t)`` moved one
    float64 step up, so ``u_t ≥ l_t + c_t ≥ s_t`` whatever the rounding of the sum; pooled by :func:`pool_pages`
    (its ``logsumexp`` allowance included). Invisible tokens count for nothing (their logits and radii are not
    read). A NaN logit or a NaN or negative radius on a visible token makes its page's bound NaN, which
    :func:`page_weights` rejects with a ``ValueError`` (no check here: it would cost a host sync per read). Raises
    ``ValueError`` for shapes that differ or ``N`` not a multiple of ``page_size``.
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if logits.shape != radius.shape or logits.shape != visible.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)}, radius {tuple(radius.shape)} and visible {tuple(visible.shape)} "
            "must have the same shape"
        )
    if logits.shape[-1] % page_size:
        raise ValueError(f"logits hold {logits.shape[-1]} tokens, not whole pages of {page_size}")
    c = radius.to(F64)
    up = torch.nextafter(logits.to(F64) + c, torch.tensor(float("inf"), dtype=F64, device=c.device))
    up = torch.where(c < 0, float("nan"), up)  # fail closed without a host sync: NaN propagates to the page
    return _pool(torch.where(visible, up, 0.0), visible, page_size)


_BF16 = torch.bfloat16


@dataclass(frozen=True)
class BasisSketch:
    """Per-token sketch of keys ``[..., N, D]`` in a stored basis split into a head ``A`` (``r`` vectors, int8
    coefficients) and a tail ``B`` (int4 or 2-bit coefficients of what ``A`` leaves): ``k_t ≈ A·â_t + B·b̂_t``.

    ``basis`` ``A`` ``[..., D, r]`` and ``tail`` ``B`` ``[..., D, D − r]`` (one pair per leading index, e.g. per
    (row, KV head); any matrices: no bound relies on orthonormality), stored at :data:`BASES_DTYPES` of
    ``tail_bits``: float32 / float16 with the int4 tail, float16 / float8 e4m3 with the 2-bit tail. ``codes`` int8
    ``[..., N, r]`` with ``â_t = scale_t·codes_t``; ``tail_codes`` uint8 with ``b̂_t = tail_scale_t·c_t`` and
    ``tail_bits`` (:data:`TAIL_BITS`) saying how the codes ``c`` are packed: 4 — ``[..., N, ⌈(D − r)/2⌉]``, two
    codes ``c + 8``, ``c ∈ [−7, 7]``, per byte; 2 — ``[..., N, ⌈(D − r)/4⌉]``, four codes ``(c + 3)/2``,
    ``c ∈ {−3, −1, 1, 3}``, per byte (low bits first in both). Per token, bfloat16: ``scale``, ``tail_scale``,
    ``coef_err ≥ ‖Aᵀk_t − â_t‖ + δ·‖Aᵀk_t‖`` (``δ ≥ ‖I − AᵀA‖_F``), ``perp_err ≥ ‖k_t − AAᵀk_t − B·b̂_t‖`` and
    ``norm ≥ ‖k_t‖``.

    Page spectra (``page_size > 0``, ``docs/math.md#page-spectral-witness``): per page ``P`` of ``page_size``
    consecutive tokens, float32 ``coef_spec[..., P] ≥ ‖[Aᵀk_t − â_t]_{t∈P}‖₂ + δ·‖(‖Aᵀk_t‖)_{t∈P}‖₂`` and
    ``perp_spec[..., P] ≥ ‖[k_t − AAᵀk_t − B·b̂_t]_{t∈P}‖₂`` (spectral norms of the matrices whose columns are the
    page's residuals); :func:`basis_page_bound` uses them. ``page_size = 0``: none stored.
    """

    basis: torch.Tensor
    tail: torch.Tensor
    codes: torch.Tensor
    tail_codes: torch.Tensor
    scale: torch.Tensor
    tail_scale: torch.Tensor
    coef_err: torch.Tensor
    perp_err: torch.Tensor
    norm: torch.Tensor
    tail_bits: int = 4
    page_size: int = 0
    coef_spec: torch.Tensor | None = None
    perp_spec: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Device bytes of the sketch: both bases, both codes, the five per-token bfloat16 numbers and, with page
        spectra, the two float32 numbers per page."""
        parts = (
            self.basis,
            self.tail,
            self.codes,
            self.tail_codes,
            self.scale,
            self.tail_scale,
            self.coef_err,
            self.perp_err,
            self.norm,
            *(t for t in (self.coef_spec, self.perp_spec) if t is not None),
        )
        return sum(t.numel() * t.element_size() for t in parts)

    def tail_coefficients(self) -> torch.Tensor:
        """``b̂`` float64 ``[..., N, D − r]`` decoded from the packed tail codes (exact: a bfloat16 scale times a
        code of at most 3 bits fits the float64 significand)."""
        fields = _unpack(self.tail_codes, self.tail.shape[-1], self.tail_bits)
        codes = fields - 8 if self.tail_bits == 4 else 2 * fields - 3
        return codes.to(F64) * self.tail_scale.to(F64).unsqueeze(-1)

    def estimate(self) -> torch.Tensor:
        """Point estimate ``k̂_t = A·â_t + B·b̂_t`` float32 ``[..., N, D]`` (for ranking tokens; no bound uses it)."""
        coef = self.codes.to(F64) * self.scale.to(F64).unsqueeze(-1)
        head = coef @ self.basis.to(F64).transpose(-1, -2)
        return (head + self.tail_coefficients() @ self.tail.to(F64).transpose(-1, -2)).to(torch.float32)


# tail code widths of :func:`basis_sketch_in`: 4 — symmetric integers ``[−7, 7]``; 2 — odd integers ``{−3, −1, 1, 3}``
TAIL_BITS: tuple[int, ...] = (4, 2)
# storage dtypes of the bases ``(A, B)`` per tail width: the 2-bit tail's coding error (about 0.4 of ``‖k⊥‖``) dwarfs
# the bases' rounding, so it stores them coarser (half the bytes per (row, KV head)); any stored pair is sound
BASES_DTYPES: dict[int, tuple[torch.dtype, torch.dtype]] = {
    4: (torch.float32, torch.float16),
    2: (torch.float16, torch.float8_e4m3fn),
}


def _pack(fields: torch.Tensor, bits: int) -> torch.Tensor:
    """int64 ``fields`` in ``[0, 2^bits)`` ``[..., n]`` -> uint8 ``[..., ⌈n·bits/8⌉]`` (``8/bits`` fields per byte,
    low bits first; ``bits`` divides 8)."""
    per = 8 // bits
    n = fields.shape[-1]
    padded = torch.nn.functional.pad(fields, (0, -n % per)).reshape(*fields.shape[:-1], -(-n // per), per)
    shifts = torch.arange(per, device=fields.device) * bits
    return (padded << shifts).sum(-1).to(torch.uint8)


def _unpack(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`_pack`: int64 ``[..., n]``."""
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device) * bits
    return ((packed.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)[..., :n]


def _frob_up(x: torch.Tensor) -> torch.Tensor:
    """``≥ ‖x‖_F`` over the last two dims of float64 ``x`` (the computed norm inflated for its rounding)."""
    n = x.shape[-1] * x.shape[-2]
    return x.flatten(-2).norm(dim=-1) * (1.0 + (n + 4) * _U64)


def principal_basis(keys: torch.Tensor) -> torch.Tensor:
    """Float64 ``[..., D, D]``: the eigenvectors of ``Σ_t k_t k_tᵀ`` (uncentred), largest eigenvalue first.

    Any matrices are sound for :func:`basis_sketch_in`; this choice puts most of the keys' energy in the head.
    """
    x = keys.to(F64)
    _, vecs = torch.linalg.eigh(x.transpose(-1, -2) @ x)
    return vecs.flip(-1)


def query_aware_basis(keys: torch.Tensor, query_gram: torch.Tensor) -> torch.Tensor:
    """Float64 ``[..., D, D]``: the eigenvectors, largest eigenvalue first, of ``K/tr K + Q/tr Q`` with
    ``K = Σ_t k_t k_tᵀ`` over ``keys[..., N, D]`` and ``Q = query_gram[..., D, D]`` (``Σ_m q_m q_mᵀ`` over queries
    the head has read with; ``docs/math.md#query-aware-basis``). Where ``tr Q`` is 0 or ``Q`` is not finite the key
    term alone (:func:`principal_basis`); where ``tr K`` is 0 the query term alone.

    Any matrices are sound for :func:`basis_sketch_in`; this choice aims the head at the directions both the keys
    and the queries occupy, so that the tail's coding error meets a small ``‖q − AAᵀq‖`` in the bound.
    ``ValueError`` unless ``query_gram`` is ``[..., D, D]`` matching ``keys``.
    """
    x = keys.to(F64)
    d = x.shape[-1]
    if query_gram.shape != (*x.shape[:-2], d, d):
        raise ValueError(f"query_gram must be [..., D, D] = {(*x.shape[:-2], d, d)}, got {tuple(query_gram.shape)}")
    gk, gq = x.transpose(-1, -2) @ x, query_gram.to(F64)
    tk = gk.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None]
    tq = gq.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None]
    usable = torch.isfinite(gq).flatten(-2).all(-1)[..., None, None] & (tq > 0) & torch.isfinite(tq)
    # K = 0 where tr K = 0; an unusable Q is dropped whole by the where (its NaN or inf never reaches the sum)
    mixed = gk / torch.where(tk > 0, tk, 1.0) + torch.where(usable, gq / torch.where(usable, tq, 1.0), 0.0)
    _, vecs = torch.linalg.eigh(mixed)
    return vecs.flip(-1)


def basis_sketch(
    keys: torch.Tensor, rank: int, tail_bits: int = 4, page_size: int = 0, query_gram: torch.Tensor | None = None
) -> BasisSketch:
    """Sketch ``keys[..., N, D]`` in their principal basis (:func:`principal_basis`), or with a ``query_gram`` in the
    query-aware basis (:func:`query_aware_basis`): head the leading ``min(rank, D)`` vectors, tail the rest, its
    codes ``tail_bits`` wide, with page spectra for pages of ``page_size`` tokens when it is positive
    (:func:`basis_sketch_in`). Raises ``ValueError`` for ``rank < 1``, a width not in :data:`TAIL_BITS`, no tokens,
    non-finite keys or a ``query_gram`` of the wrong shape."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive int, got {rank!r}")
    _check_tail_bits(tail_bits)
    _check_keys(keys)
    vecs = principal_basis(keys) if query_gram is None else query_aware_basis(keys, query_gram)
    r = min(rank, keys.shape[-1])
    return basis_sketch_in(keys, vecs[..., :r], vecs[..., r:], tail_bits, page_size)


def _check_tail_bits(tail_bits: object) -> None:
    if isinstance(tail_bits, bool) or tail_bits not in TAIL_BITS:
        raise ValueError(f"tail_bits must be one of {TAIL_BITS}, got {tail_bits!r}")


def _check_keys(keys: torch.Tensor) -> None:
    """``ValueError`` unless ``keys`` is ``[..., N, D]`` with ``N > 0`` and every entry finite (the keys a sketch
    summarizes)."""
    if keys.dim() < 2 or keys.shape[-2] == 0:
        raise ValueError(
            f"keys must be [..., N, D] with N > 0 (an empty page cannot be summarized), got shape {tuple(keys.shape)}"
        )
    _finite(keys, "keys")


def _symmetric_codes(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric codes of float64 ``x[..., N, m]`` in ``[−levels, levels]`` and their bfloat16 scale
    ``≥ max_j |x_j| / levels`` (rounded up; 1 for an all-zero row). ``ValueError`` beyond the bfloat16 range."""
    amax = x.abs().amax(-1) if x.shape[-1] else x.new_zeros(x.shape[:-1])
    scale = _round_out(torch.where(amax > 0, amax / levels, 1.0), _BF16, up=True)
    if not bool(torch.isfinite(scale).all()):
        raise ValueError("keys are beyond the bfloat16 range of the sketch's scale")
    codes = torch.round(x / scale.to(F64).unsqueeze(-1)).clamp(-levels, levels).to(torch.int64)
    return codes, scale


def _odd2_codes(x: torch.Tensor, iterations: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 2-bit codes of float64 ``x[..., N, m]`` in ``{−3, −1, 1, 3}`` and their bfloat16 scale ``s``:
    ``s·c`` is the uniform 4-level quantizer without a zero level, its step fitted per token by alternating the
    nearest-code assignment and the least-squares scale ``Σ_j x_j c_j / Σ_j c_j²`` (neither step raises
    ``‖x − s·c‖``), started at the Gaussian optimum ``s = 0.498·rms(x)``. The codes are the nearest ones to the
    *stored* scale. Any ``s`` is sound (the caller measures the residual); an all-zero row gets ``s = 0`` (its
    ``b̂`` is exactly 0). ``ValueError`` beyond the bfloat16 range."""
    zero = x.abs().amax(-1) == 0 if x.shape[-1] else torch.ones(x.shape[:-1], dtype=torch.bool, device=x.device)

    def nearest(s: torch.Tensor) -> torch.Tensor:
        s = torch.where(zero, 1.0, s).unsqueeze(-1)
        return (2.0 * torch.round((x / s - 1.0) / 2.0) + 1.0).clamp(-3.0, 3.0)

    s = 0.498 * x.norm(dim=-1) / max(x.shape[-1], 1) ** 0.5
    for _ in range(iterations):
        c = nearest(s)
        s = (x * c).sum(-1) / (c * c).sum(-1).clamp(min=1.0)  # > 0 unless the row is all zero (x_j·c_j = |x_j c_j|)
    scale = torch.where(zero, 0.0, _round_out(s, _BF16, up=True).to(F64)).to(_BF16)
    if not bool(torch.isfinite(scale).all()):
        raise ValueError("keys are beyond the bfloat16 range of the sketch's scale")
    return nearest(scale.to(F64)).to(torch.int64), scale


def _check_bases(
    keys: torch.Tensor, basis: torch.Tensor, tail: torch.Tensor, tail_bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored head and tail bases (dtypes :data:`BASES_DTYPES` of ``tail_bits``); ``ValueError`` unless finite
    ``[..., D, ·]`` fitting ``keys`` before and after the rounding to storage (a float16 overflow is refused)."""
    _finite(basis, "basis")
    _finite(tail, "tail")
    head_dtype, tail_dtype = BASES_DTYPES[tail_bits]
    stored, stored_tail = basis.to(head_dtype), tail.to(tail_dtype)
    for name, m in (("basis", stored), ("tail", stored_tail)):
        _finite(m.to(torch.float32), name)
        if m.dim() != keys.dim() or m.shape[:-2] != keys.shape[:-2] or m.shape[-2] != keys.shape[-1]:
            raise ValueError(f"{name} must be [..., D, ·] for keys {tuple(keys.shape)}, got {tuple(m.shape)}")
    return stored, stored_tail


def basis_sketch_in(
    keys: torch.Tensor, basis: torch.Tensor, tail: torch.Tensor, tail_bits: int = 4, page_size: int = 0
) -> BasisSketch:
    """Sketch ``keys[..., N, D]`` in a head ``basis[..., D, r]`` and a ``tail[..., D, m]``, stored at the dtypes
    :data:`BASES_DTYPES` gives ``tail_bits`` (int4 tail: float32 / float16; 2-bit tail: float16 / float8 e4m3); any
    finite matrices, orthonormal or not.

    Contract (``docs/math.md#basis-sketch``), for the *stored* ``A``, ``B`` and every token:
    ``coef_err_t ≥ ‖Aᵀk_t − â_t‖ + δ·‖Aᵀk_t‖`` with ``δ ≥ ‖I − AᵀA‖_F``, ``perp_err_t ≥ ‖k_t − AAᵀk_t − B·b̂_t‖``,
    ``norm_t ≥ ‖k_t‖``. Every quantity is evaluated in float64 from the stored tensors; each computed norm is
    inflated by ``1 + (D + r + 8)·2^-53`` and the products with ``A`` and ``B`` get absolute allowances
    (``(D + r + 16)·2^-52·(1 + ‖A‖_F)²·‖k_t‖`` for ``Aᵀk`` and ``A(Aᵀk)``, whose rounding errors are at most
    ``(D + r + 2)·2^-53·(1 + ‖A‖_F)²·‖k_t‖``; ``(D + 16)·2^-52·(‖k⊥‖ + ‖B‖_F·‖b̂_t‖)`` for ``B·b̂_t``); then
    rounded up to bfloat16. Codes: symmetric per token, int8 for ``Aᵀk_t``; for ``Bᵀ(k_t − AAᵀk_t)`` int4
    (``tail_bits=4``, integers in ``[−7, 7]``, scale ``max|·|/7``) or 2-bit (``tail_bits=2``, :func:`_odd2_codes`).
    The contract does not depend on the tail code: ``perp_err`` is measured against the decoded ``b̂_t`` (exact in
    float64), whatever the code and its rounding. With ``page_size > 0`` also the page spectra of
    :class:`BasisSketch` (:func:`_page_spectra`). Raises ``ValueError`` for no tokens, non-finite keys or bases,
    bases whose shape does not fit the keys, a width not in :data:`TAIL_BITS`, a negative ``page_size``, or keys
    beyond the bfloat16 range of the scales.
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 0:
        raise ValueError(f"page_size must be a non-negative int (0: no page spectra), got {page_size!r}")
    _check_tail_bits(tail_bits)
    _check_keys(keys)
    a_stored, b_stored = _check_bases(keys, basis, tail, tail_bits)
    x, a, b = keys.to(F64), a_stored.to(F64), b_stored.to(F64)
    d, r = a.shape[-2:]
    inflate = 1.0 + (d + r + 8) * _U64
    f_up = _frob_up(a)
    eye = torch.eye(r, dtype=F64, device=x.device)
    delta = _frob_up(eye - a.transpose(-1, -2) @ a) + (d + 16) * 2.0**-52 * f_up**2 * inflate  # ≥ ‖I − AᵀA‖_F
    knorm = x.norm(dim=-1) * inflate  # [..., N] ≥ ‖k_t‖
    slack = (d + r + 16) * 2.0**-52 * ((1.0 + f_up) ** 2).unsqueeze(-1) * knorm
    coef = x @ a  # [..., N, r] ≈ Aᵀk_t
    codes, scale = _symmetric_codes(coef, 127)
    ahat = codes.to(F64) * scale.to(F64).unsqueeze(-1)
    coef_err = (coef - ahat).norm(dim=-1) * inflate + slack
    coef_err = coef_err + delta.unsqueeze(-1) * (coef.norm(dim=-1) * inflate + slack)
    perp = x - coef @ a.transpose(-1, -2)  # ≈ k_t − AAᵀk_t, within slack
    tail_codes, tail_scale = _symmetric_codes(perp @ b, 7) if tail_bits == 4 else _odd2_codes(perp @ b)
    bhat = tail_codes.to(F64) * tail_scale.to(F64).unsqueeze(-1)
    rebuilt = bhat @ b.transpose(-1, -2)
    g_up = _frob_up(b).unsqueeze(-1)
    perp_n = perp.norm(dim=-1) * inflate
    room = (d + 16) * 2.0**-52 * (perp_n + g_up * bhat.norm(dim=-1) * inflate)
    perp_err = (perp - rebuilt).norm(dim=-1) * inflate + slack + room
    spectra: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    if page_size:
        # per-token allowances on the computed residual columns, as in coef_err / perp_err
        coef_cols = _PageColumns(coef - ahat, slack, delta.unsqueeze(-1) * (coef.norm(dim=-1) * inflate + slack))
        spectra = _page_spectra(coef_cols, _PageColumns(perp - rebuilt, slack + room, None), page_size, inflate)
    return BasisSketch(
        a_stored,
        b_stored,
        codes.to(torch.int8),
        _pack(tail_codes + 8 if tail_bits == 4 else (tail_codes + 3) // 2, tail_bits),
        scale,
        tail_scale,
        _round_out(coef_err * inflate, _BF16, up=True),
        _round_out(perp_err * inflate, _BF16, up=True),
        _round_out(knorm, _BF16, up=True),
        tail_bits,
        page_size,
        *spectra,
    )


@dataclass(frozen=True)
class _PageColumns:
    """Computed residual columns ``cols[..., N, m]`` with ``‖c_t − ĉ_t‖ ≤ allow[..., N]`` for the exact ones, and
    an optional per-token term ``extra[..., N]`` (non-negative) added in the page's 2-norm."""

    cols: torch.Tensor
    allow: torch.Tensor
    extra: torch.Tensor | None


def _page_spectra(
    head: _PageColumns, tail: _PageColumns, page_size: int, inflate: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(coef_spec, perp_spec)`` float32 ``[..., P]`` rounded up: per page, ``‖C_P‖₂ ≤ ‖Ĉ_P‖₂ + ‖C_P − Ĉ_P‖_F``
    (Weyl) with ``‖C_P − Ĉ_P‖_F ≤ ‖(allow_t)_{t∈P}‖₂``, ``‖Ĉ_P‖₂`` from :func:`~kvcert.bounds.spectral.spectral_norm_up`
    (rigorous), plus ``‖(extra_t)_{t∈P}‖₂``; every float64 norm inflated by ``inflate``, the sums by ``1 + 8u``.
    The last page is padded with zero columns (they change no norm)."""
    out = []
    n = head.cols.shape[-2]
    pages = -(-n // page_size)
    pad = pages * page_size - n

    def page_l2(x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.pad(x, (0, pad)).reshape(*x.shape[:-1], pages, page_size)
        return x.norm(dim=-1) * inflate

    for part in (head, tail):
        cols = torch.nn.functional.pad(part.cols, (0, 0, 0, pad)).reshape(*part.cols.shape[:-2], pages, page_size, -1)
        spec = spectral_norm_up(cols) * inflate  # of the exactly subtracted columns, not their rounded difference
        total = spec + page_l2(part.allow)
        if part.extra is not None:
            total = total + page_l2(part.extra)
        out.append(_round_out(total * (1.0 + 8 * _U64), torch.float32, up=True))
    return out[0], out[1]


@dataclass(frozen=True)
class _BasisTerms:
    """The pieces of :func:`basis_logit_bound` per (query ``m``, token ``t``), float64 ``[..., M, N]`` unless stated:
    the computed ``dot = ⟨ũ, â_t⟩ + ⟨w̃, b̂_t⟩``, the two Cauchy–Schwarz terms ``e1 = ‖Aᵀq‖⁺·coef_err_t`` and
    ``e2 = ‖q⊥‖⁺·perp_err_t``, ``coded`` (what the computed projections ``ũ``, ``w̃`` may miss against ``â_t``,
    ``b̂_t``), ``mag`` (the absolute dot, for its rounding), ``nrm = ‖q‖⁺·norm_t``, and the upper bounds
    ``head_n ≥ ‖Aᵀq‖``, ``perp_n ≥ ‖q⊥‖`` ``[..., M, 1]``."""

    dot: torch.Tensor
    e1: torch.Tensor
    e2: torch.Tensor
    coded: torch.Tensor
    mag: torch.Tensor
    nrm: torch.Tensor
    head_n: torch.Tensor
    perp_n: torch.Tensor


def _basis_terms(q: torch.Tensor, sketch: BasisSketch, scaling: float, gamma: float) -> _BasisTerms:
    """:class:`_BasisTerms` of ``q[..., M, D]`` against every token of ``sketch`` (see :func:`basis_logit_bound`)."""
    _check_query(q, sketch.basis.shape[-2], scaling, gamma)
    d, r = sketch.basis.shape[-2:]
    inflate = 1.0 + (d + r + 8) * _U64
    q64, a, b = q.to(F64), sketch.basis.to(F64), sketch.tail.to(F64)
    qn = q64.norm(dim=-1, keepdim=True) * inflate  # [..., M, 1] ≥ ‖q‖
    rho = (d + r + 16) * 2.0**-52 * ((1.0 + _frob_up(a)) ** 2)[..., None, None] * qn
    qu = q64 @ a  # [..., M, r] ≈ Aᵀq
    q_perp = q64 - qu @ a.transpose(-1, -2)
    head_n = qu.norm(dim=-1, keepdim=True) * inflate + rho  # ≥ ‖Aᵀq‖
    perp_n = q_perp.norm(dim=-1, keepdim=True) * inflate + rho  # ≥ ‖q⊥‖
    qw = q_perp @ b  # [..., M, D − r] ≈ Bᵀq⊥
    rho_b = _frob_up(b)[..., None, None] * (rho + (d + 16) * 2.0**-52 * perp_n)
    ahat = sketch.codes.to(F64) * sketch.scale.to(F64).unsqueeze(-1)  # [..., N, r]
    bhat = sketch.tail_coefficients()  # [..., N, D − r]
    dot = qu @ ahat.transpose(-1, -2) + qw @ bhat.transpose(-1, -2)  # [..., M, N]
    mag = qu.abs() @ ahat.abs().transpose(-1, -2) + qw.abs() @ bhat.abs().transpose(-1, -2)
    e1 = _times(head_n, sketch.coef_err.to(F64).unsqueeze(-2))
    e2 = _times(perp_n, sketch.perp_err.to(F64).unsqueeze(-2))
    coded = rho * (ahat.norm(dim=-1) * inflate).unsqueeze(-2) + _times(
        rho_b, (bhat.norm(dim=-1) * inflate).unsqueeze(-2)
    )
    nrm = _times(qn, sketch.norm.to(F64).unsqueeze(-2))
    return _BasisTerms(dot, e1, e2, coded, mag, nrm, head_n, perp_n)


def basis_logit_bound(q: torch.Tensor, sketch: BasisSketch, scaling: float, gamma: float) -> torch.Tensor:
    """Per-token bound ``u[..., M, N] ≥ sc·⟨q_m, k_t⟩ + 3·sc·γ·‖q_m‖·‖k_t‖`` from a :class:`BasisSketch`
    (the contract of :func:`token_logit_bound`).

    For any matrices ``A``, ``B``, with ``q⊥ = q − AAᵀq`` (``docs/math.md#basis-sketch``):
    ``⟨q, k⟩ = ⟨Aᵀq, â⟩ + ⟨Aᵀq, Aᵀk − â⟩ + (Aᵀq)ᵀ(I − AᵀA)(Aᵀk) + ⟨Bᵀq⊥, b̂⟩ + ⟨q⊥, k − AAᵀk − B b̂⟩
    ≤ ⟨Aᵀq, â⟩ + ‖Aᵀq‖·coef_err + ⟨Bᵀq⊥, b̂⟩ + ‖q⊥‖·perp_err``, and ``⟨q, k⟩ ≤ ‖q‖·norm``; the bound takes the
    smaller. Evaluated in float64 with ``ũ = fl(Aᵀq)``, ``fl(q − Aũ)`` and ``w̃ = fl(Bᵀ fl(q − Aũ))``: ``‖Aᵀq‖``
    and ``‖q⊥‖`` are bounded by the computed norms inflated by ``1 + (D + r + 8)·2^-53`` plus
    ``ρ = (D + r + 16)·2^-52·(1 + ‖A‖_F)²·‖q‖``; ``⟨Aᵀq, â⟩`` by the computed dot plus ``ρ·‖â‖``, ``⟨Bᵀq⊥, b̂⟩``
    by the computed dot plus ``ρ_B·‖b̂‖`` with ``ρ_B = ‖B‖_F·(ρ + (D + 16)·2^-52·‖q⊥‖)``; the final sums get
    ``(D + r + 16)·2^-52·sc·(Σ_j |ũ_j â_j| + Σ_j |w̃_j b̂_j| + every added term)``.
    """
    t = _basis_terms(q, sketch, scaling, gamma)
    return _token_bound(t, sketch, scaling, gamma)[0]


def _token_bound(
    t: _BasisTerms, sketch: BasisSketch, scaling: float, gamma: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(u, allow, tails)`` ``[..., M, N]``: the per-token bound of :func:`basis_logit_bound` from its terms, its
    float64 allowance ``(D + r + 16)·2^-52·sc·(mag + e1 + e2 + coded + 4·nrm)`` and the ``3·sc·γ·nrm`` term."""
    d, r = sketch.basis.shape[-2:]
    extra = t.e1 + t.e2 + t.coded
    best = torch.minimum(t.dot + extra, t.nrm)
    allow = (d + r + 16) * 2.0**-52 * scaling * (t.mag + extra + 4.0 * t.nrm)
    tails = _times(t.nrm.new_tensor(3.0 * scaling * gamma), t.nrm)
    return scaling * best + tails + allow, allow, tails


def basis_page_bound(
    q: torch.Tensor, sketch: BasisSketch, visible: torch.Tensor, scaling: float, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-page bounds ``(ū[..., M, P], seen[..., M, P])`` with ``seen_P·e^{ū_P} ≥ Σ_{t∈P visible} e^{s_t}``
    (``s_t ≤ sc·⟨q_m, k_t⟩ + 3·sc·γ·‖q_m‖·‖k_t‖``, the contract of :func:`pool_pages`), from a :class:`BasisSketch`
    with page spectra (``docs/math.md#page-spectral-witness``); ``visible[..., M, N]``.

    Per token ``u_t`` is :func:`basis_logit_bound`, ``ŝ_t = min(fl(sc·dot_t), u_t)`` a point and ``c_t ≥ u_t − ŝ_t ≥ 0``
    (rounded up). The exact residual ``x_t = s_t − ŝ_t`` obeys ``x_t ≤ c_t`` and, over a page,
    ``‖(x_t⁺)_{t∈P}‖₂ ≤ E_P = sc·(‖Aᵀq‖⁺·coef_spec_P + ‖q⊥‖⁺·perp_spec_P) + ‖(ρ_t)_{t∈P}‖₂`` (the residual is
    ``⟨Aᵀq, Aᵀk_t − â_t⟩ + (Aᵀq)ᵀ(I − AᵀA)(Aᵀk_t) + ⟨q⊥, k_t − AAᵀk_t − B b̂_t⟩`` plus the per-token rounding
    ``ρ_t`` of :func:`basis_logit_bound`: ``sc·coded + 3·sc·γ·nrm`` and twice its float64 allowance). By convexity
    ``e^{x} ≤ 1 + x·(e^{c} − 1)/c`` on ``[0, c]``, so
    ``Σ_P e^{s_t} ≤ Σ_P e^{ŝ_t} + ‖(e^{ŝ_t}(e^{c_t} − 1)/c_t)_P‖₂·E_P`` (Cauchy–Schwarz over the page's tokens).
    ``ū_P`` is the smaller of its logarithm (with float64 allowances) and the pooled per-token bound. Raises
    ``ValueError`` when the sketch has no page spectra, ``visible`` does not match the bounds, or a bound is NaN.
    """
    if sketch.page_size < 1 or sketch.coef_spec is None or sketch.perp_spec is None:
        raise ValueError("basis_page_bound needs a BasisSketch with page spectra (basis_sketch(..., page_size=P))")
    t = _basis_terms(q, sketch, scaling, gamma)
    u, allow, tails = _token_bound(t, sketch, scaling, gamma)
    if visible.shape != u.shape:
        raise ValueError(f"visible must match the bounds {tuple(u.shape)}, got {tuple(visible.shape)}")
    pooled, seen = pool_pages(u, visible, sketch.page_size)
    inf = torch.tensor(float("inf"), dtype=F64, device=u.device)
    point = torch.minimum(scaling * t.dot, u)
    c = torch.nextafter(u - point, inf).clamp(min=0.0)
    rho = scaling * t.coded + tails + 2.0 * allow
    ps = sketch.page_size
    n = u.shape[-1]
    pages = -(-n // ps)
    pad = pages * ps - n

    def paged(x: torch.Tensor, fill: float) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, pad), value=fill).reshape(*x.shape[:-1], pages, ps)

    vis = paged(visible, False)
    s_hat = paged(torch.where(visible, point, float("-inf")), float("-inf"))
    top = s_hat.amax(-1, keepdim=True).clamp(min=-1e300)  # a page without a visible token: no term (seen = 0)
    w = torch.exp(s_hat - top)  # e^{ŝ_t − top}, 0 off the visible tokens
    cc = paged(c, 0.0)
    # log((e^c − 1)/c) = c + log(1 − e^{−c}) − log c (≥ 0, increasing; 0 at c = 0), so that e^{ŝ−top}·(e^c − 1)/c is
    # one exp that underflows to 0 or overflows to inf, never 0·inf
    log_phi = torch.where(cc > 0, cc + torch.log(-torch.expm1(-cc)) - torch.log(cc.clamp(min=1e-300)), 0.0)
    lin = torch.where(vis, torch.exp(s_hat - top + log_phi.clamp(min=0.0)), 0.0).norm(dim=-1)  # [..., M, P]
    rho_p = torch.where(vis, paged(rho, 0.0), 0.0).norm(dim=-1)
    e_p = (
        scaling
        * (
            _times(t.head_n, sketch.coef_spec.to(F64).unsqueeze(-2))
            + _times(t.perp_n, sketch.perp_spec.to(F64).unsqueeze(-2))
        )
        + rho_p
    )
    spread = torch.where((lin > 0) & (e_p > 0), lin * e_p * (1.0 + (2 * ps + 16) * 2.0**-52), 0.0)
    total = (w.sum(-1) + spread) * (1.0 + (ps + 16) * 2.0**-52)
    spec = torch.log(total) + top.squeeze(-1)
    # float64 allowances: the exponents ŝ_t − top + log φ(c_t) (each off by a few ulps of its terms' magnitude),
    # then the log and the sum with top
    reach = torch.where(vis, s_hat.abs() + cc + log_phi.abs() + cc.clamp(min=1e-300).log().abs(), 0.0).amax(-1)
    spec = spec + 16 * 2.0**-52 * (1.0 + reach + top.squeeze(-1).abs()) + (ps + 16) * 2.0**-52 * (1.0 + spec.abs())
    return torch.where(seen.bool(), torch.minimum(pooled, spec), 0.0), seen
