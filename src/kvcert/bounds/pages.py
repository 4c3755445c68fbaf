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
* :func:`omitted_certificate` — with ``A = Σ_R p̃ e^{c}``, ``B₋ = Σ_R p̃ e^{−c}`` and
  ``U = Σ_P n_P e^{u_P − lse(s̃)}``: the omitted-mass bound ``m̄ = U/(B₋ + U) ≥ Σ_{t∉R} p_t``, the direct
  form ``D = 1 − B₋/(A + U) ≥ TV(p, p̃)``, and the composed certificate ``min(1, D, meter + m̄)``.

Pure math: imports only torch. Bad input (empty pages, non-finite keys or queries, shapes) raises
``ValueError`` naming the argument.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

F64 = torch.float64
_U64 = 2.0**-53
_F32_INF = torch.tensor(float("inf"), dtype=torch.float32)


def _finite(x: torch.Tensor, name: str) -> None:
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contains non-finite entries")


def _check_composed_inputs(p: torch.Tensor, radius: torch.Tensor, weights: torch.Tensor, meter: torch.Tensor) -> None:
    """The fail-closed checks of :func:`omitted_certificate`, fused into one reduction (one host synchronisation
    on a device); when one fails, the checks run again one by one to raise the first failure's own error."""
    ok = (
        torch.isfinite(p).all()
        & torch.isfinite(radius).all()
        & ~(radius < 0).any()
        & ~(p < 0).any()
        & ~(torch.isnan(weights).any() | (weights < 0).any())
        & ~(torch.isnan(meter).any() | (meter < 0).any())
    )
    if bool(ok):
        return
    _finite(p, "p_served")
    _finite(radius, "radius")
    if bool((radius < 0).any()) or bool((p < 0).any()):
        raise ValueError("p_served and radius must be non-negative")
    if bool(torch.isnan(weights).any()) or bool((weights < 0).any()):
        raise ValueError("weights must be non-negative (inf allowed)")
    raise ValueError("meter must be non-negative (inf allowed), got NaN or a negative entry")


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
    nan_bound, no_finite = torch.stack([torch.isnan(bound).any(), ~torch.isfinite(lse).all()]).tolist()  # one sync
    if nan_bound:
        raise ValueError("bound contains NaN: a page logit bound must be a number or +inf")
    if no_finite:
        raise ValueError("served_logits must have at least one finite entry per row")
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
    if keys.dim() < 2 or keys.shape[-2] == 0:
        raise ValueError(
            f"keys must be [..., N, D] with N > 0 (an empty page cannot be summarized), got shape {tuple(keys.shape)}"
        )
    _finite(keys, "keys")
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
    if bool(torch.isnan(bound).any()):
        raise ValueError("bound contains NaN: a token logit bound must be a number or +inf")
    n = bound.shape[-1]
    pages = -(-n // page_size)
    pad = pages * page_size - n
    u = torch.nn.functional.pad(torch.where(visible, bound.to(F64), float("-inf")), (0, pad), value=float("-inf"))
    pooled = torch.logsumexp(u.reshape(*u.shape[:-1], pages, page_size), dim=-1)
    seen = pooled > float("-inf")  # a visible token (its bound may be +inf)
    pooled = torch.where(seen, pooled, 0.0)
    pooled = pooled + (page_size + 4) * 2.0**-52 * (1.0 + pooled.abs())  # float64 logsumexp rounding
    return torch.where(seen, pooled, 0.0), seen.to(torch.int64)
