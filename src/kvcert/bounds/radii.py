"""Per-token logit-error radii ``c_t ≥ |ε_t|`` for a compressed key cache.

* **Tier A** (deterministic, adaptive-safe, ``docs/math.md#tier-a-radius``): with per-band key-residual norms
  ``ρ_{t,b}`` over whole RoPE pairs, ``|ε_t| = sc·|⟨q, Δk_t⟩| ≤ sc·Σ_b ‖q_b‖·ρ_{t,b} =: c_t`` (Cauchy–Schwarz
  inside each band). Bands of whole rotary pairs make both norms RoPE-invariant.
* **Tier B** (subtractively dithered int8, non-adaptive queries, ``docs/math.md#tier-b-radius``): the residual is
  uniform on
  ``[−s/2, s/2]`` and independent of ``x``, so ``ε_t`` is sub-Gaussian with variance proxy
  ``σ²_t = (sc²/12)·Σ_g s_{t,g}²‖q_g‖²`` and ``P(∃t: |ε_t| > u_t) ≤ δ_loc`` for
  ``u_t = sqrt(2σ²_t ln(2S/δ_loc))``.

All outputs are float64.
"""

from __future__ import annotations

import math

import torch

from kvcert.bounds.rope import Pairing, band_norms, round_up_f32
from kvcert.bounds.softmax_tv import check_nonneg_finite


def _check_scale(scale: float) -> float:
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite positive softmax scale, got {scale}")
    return float(scale)


def query_band_norms(q: torch.Tensor, bands: int, pairing: Pairing = "rotate_half") -> torch.Tensor:
    """``‖q_b‖`` over the whole-RoPE-pair bands of the key witness: ``q[..., D] -> [..., bands]`` (float64).

    Compute once per decode step and reuse for every token via ``tier_a_radius_from_qnorms``.
    """
    if not torch.isfinite(q).all():
        raise ValueError("q contains non-finite entries")
    return band_norms(q, bands, pairing)


def _as_f32_up(x: torch.Tensor) -> torch.Tensor:
    """A float32 copy of a non-negative tensor that is never below it (exact for float32/16 input)."""
    return round_up_f32(x) if x.dtype == torch.float64 else x.to(torch.float32)


def tier_a_radius_from_qnorms(q_band_norms: torch.Tensor, key_band_norms: torch.Tensor, scale: float) -> torch.Tensor:
    """Tier-A radii ``c_t = scale·Σ_b ‖q_b‖·ρ_{t,b}`` from precomputed query band norms (one batched matmul).

    ``q_band_norms[..., B]`` and ``key_band_norms[..., S, B]`` broadcast over leading dims; returns float64
    ``[..., S]``. GQA fast path: pass ``q_band_norms[..., G, B]`` with ``key_band_norms[..., 1, S, B]`` (one
    KV head read by ``G`` query heads) to get ``[..., G, S]`` without expanding the keys.

    Rounding: the matmul runs in float32 on inputs rounded up to float32. A sum of ``B`` non-negative
    products has relative error ≤ γ_{B+1} = (B+1)u/(1−(B+1)u), u = 2^-24, plus ≤ B·2^-150 absolute from
    subnormal products; the result is multiplied by ``1 + (B+2)·2^-23 ≥ 1/(1 − (B+1)u)`` and raised by
    ``B·2^-149`` in float64, so the returned radius is never below the exact one.
    """
    sc = _check_scale(scale)
    qn = _as_f32_up(check_nonneg_finite(q_band_norms, "q_band_norms", None))
    kn = _as_f32_up(check_nonneg_finite(key_band_norms, "key_band_norms", None))
    bands = kn.shape[-1] if kn.dim() else 0
    if kn.dim() < 2 or qn.dim() < 1 or qn.shape[-1] != bands:
        raise ValueError(
            f"band dims differ or shapes invalid: q_band_norms {tuple(qn.shape)}, key_band_norms {tuple(kn.shape)}"
        )
    return tier_a_radius_f32(qn, kn, sc)


def tier_a_radius_f32(q_band_norms: torch.Tensor, key_band_norms: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`tier_a_radius_from_qnorms` without input checks, for the read path's hot loop.

    Premise (the caller's): both inputs are float32, finite, non-negative and never below the exact band
    norms (e.g. the store's write-time witnesses and :func:`round_up_f32` of float64 query band norms);
    ``scale`` is a finite positive float. Same rounding argument and the same result.
    """
    bands = key_band_norms.shape[-1]
    if key_band_norms.dim() >= 3 and key_band_norms.shape[-3] == 1 and q_band_norms.dim() >= 2:
        # [..., G, B] @ [..., B, S] -> [..., G, S]: the G query heads share one key matrix
        dots = torch.matmul(q_band_norms, key_band_norms.squeeze(-3).transpose(-1, -2))
    else:
        dots = torch.matmul(key_band_norms, q_band_norms.unsqueeze(-1)).squeeze(-1)
    inflate = scale * (1.0 + (bands + 2) * 2.0**-23)
    return dots.to(torch.float64).mul_(inflate).add_(bands * 2.0**-149 * scale)


def tier_a_radius(
    q: torch.Tensor, key_band_norms: torch.Tensor, scale: float, pairing: Pairing = "rotate_half"
) -> torch.Tensor:
    """Deterministic Tier-A radii ``c_t = scale·Σ_b ‖q_b‖·ρ_{t,b} ≥ |scale·⟨q, Δk_t⟩|`` for any query.

    ``q[..., D]``, ``key_band_norms[..., S, B]`` (band norms of the key residual ``Δk_t`` over whole RoPE
    pairs of the declared ``pairing``); returns ``c[..., S]`` in float64. Valid pre- or post-RoPE, at any
    positions.
    """
    return tier_a_radius_from_qnorms(query_band_norms(q, key_band_norms.shape[-1], pairing), key_band_norms, scale)


def _dither_query(
    q: torch.Tensor, steps: torch.Tensor, group_size: int, channel_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The checked inputs of the Tier-B radii: the query in float64 with bypassed channels zeroed, and the steps."""
    if not torch.isfinite(q).all():
        raise ValueError("q contains non-finite entries")
    s = check_nonneg_finite(steps, "steps")
    d = q.shape[-1]
    if group_size < 1 or d % group_size:
        raise ValueError(f"group_size={group_size} must divide the head dimension D={d}")
    if s.dim() < 2 or s.shape[-1] != d // group_size:
        raise ValueError(f"steps must have shape [..., S, {d // group_size}], got {tuple(s.shape)}")
    q64 = q.to(torch.float64)
    if channel_mask is not None:
        if channel_mask.shape != (d,):
            raise ValueError(f"channel_mask must have shape ({d},), got {tuple(channel_mask.shape)}")
        if not bool(((channel_mask == 0) | (channel_mask == 1)).all()):
            raise ValueError("channel_mask entries must be 0 (bypassed) or 1 (quantised)")
        q64 = q64 * channel_mask.to(torch.float64)
    return q64, s


def _group_sums(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x[..., D] -> [..., D/group_size]``: the sum over each group of contiguous channels."""
    return x.unflatten(-1, (x.shape[-1] // group_size, group_size)).sum(-1)


def tier_b_sigma2(
    q: torch.Tensor,
    steps: torch.Tensor,
    scale: float,
    group_size: int = 32,
    channel_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sub-Gaussian variance proxy of ``ε_t`` under subtractive dither: ``(scale²/12)·Σ_g s_{t,g}²‖q_g‖²``.

    ``q[..., D]``; ``steps[..., S, D/group_size]`` are the quantiser steps of contiguous channel groups;
    ``channel_mask[D]`` (1 = quantised, 0 = bypassed/exact) removes bypassed channels from ``‖q_g‖``.
    Premise: per-channel residuals independent, uniform on ``[−s/2, s/2]`` and independent of ``q``
    (non-adaptive query); then ``E e^{λε_t} ≤ exp(λ²σ²_t/2)`` [Lean ``sinh_le_mul_exp_sq_div_six``].
    """
    sc = _check_scale(scale)
    q64, s = _dither_query(q, steps, group_size, channel_mask)
    qg2 = _group_sums(q64.square(), group_size)
    return torch.matmul(s.square(), qg2.unsqueeze(-1)).squeeze(-1) * (sc * sc / 12.0)


def tier_b_radius(sigma2: torch.Tensor, n_tokens: int, delta_loc: float) -> torch.Tensor:
    """Union radius ``u_t = sqrt(2σ²_t ln(2S/δ_loc))``: all ``S = n_tokens`` tokens obey ``|ε_t| ≤ u_t``
    with probability ≥ 1−δ_loc.

    The factor 2 in the logarithm pays for the two-sided tail ``P(|ε_t| > u) ≤ 2e^{−u²/(2σ²_t)}``. The union runs
    over ``n_tokens``, so it must count every token ``sigma2[..., S]`` holds (``n_tokens >= S``; a smaller count would
    give a radius the union does not pay for, and is refused).
    """
    s2 = check_nonneg_finite(sigma2, "sigma2")
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 1:
        raise ValueError(f"n_tokens must be an int >= 1, got {n_tokens!r}")
    if s2.dim() > 0 and n_tokens < s2.shape[-1]:
        raise ValueError(
            f"n_tokens={n_tokens} is below the {s2.shape[-1]} tokens sigma2 holds: the union bound must count every "
            "token it covers"
        )
    if not (0.0 < delta_loc <= 1.0):
        raise ValueError(f"delta_loc must lie in (0, 1], got {delta_loc}")
    return torch.sqrt(2.0 * s2 * math.log(2.0 * n_tokens / delta_loc))


#: channels per query whose exact uniform law enters the uniform-law radius (the rest enter through ``y²/6``)
UNIFORM_CHANNELS = 16
#: multiples of the sub-Gaussian optimum ``λ₀ = sqrt(2L)/σ_t`` at which the uniform-law Chernoff bound is evaluated
UNIFORM_LAMBDAS: tuple[float, ...] = tuple(0.5 * 16.0 ** (j / 15) for j in range(16))
#: points of the per-query table of ``F_g(μ) = Σ_{i∈top∩g} ψ(μ·w_i)`` (geometric over the arguments it serves)
UNIFORM_TABLE = 512
_PSI_ROUND = 1.0 + 2.0**-40  # covers the few-ulp error of each ψ and of the radius formula (docs/math.md)


def psi_upper(y: torch.Tensor) -> torch.Tensor:
    """An upper bound of ``ψ(y) = ln(sinh(y)/y)`` (the log-MGF of ``U[−1, 1]`` at ``y ≥ 0``), float64.

    Below ``y = 1/2`` the polynomial ``y²/6 − y⁴/180 + y⁶/2835``, which bounds ψ from above for every ``y ≥ 0``
    (``docs/math.md#tier-b-uniform``); above, ``y − ln(2y) + ln(1 − e^{−2y})``; each lifted by :data:`_PSI_ROUND`.
    """
    y = y.to(torch.float64)
    y2 = y * y
    out = (y2 / 2835.0).sub_(1.0 / 180.0).mul_(y2).add_(1.0 / 6.0).mul_(y2)  # the polynomial, everywhere
    large = y >= 0.5
    yl = y[large]  # the identity only where it is taken
    out.masked_scatter_(large, torch.exp(yl * -2.0).neg_().log1p_().sub_(torch.log(yl * 2.0)).add_(yl))
    return out.mul_(_PSI_ROUND)


def _top_psi_sums(mu: torch.Tensor, w: torch.Tensor, group: torch.Tensor, member: torch.Tensor) -> torch.Tensor:
    """Upper bounds of ``F(μ) = Σ_i ψ(μ_{g(i)}·w_i)`` (the top channels' log-MGF at ``λ``) for every column of
    ``mu[..., G, N] ≥ 0`` (``μ_g = λ·s_g``); ``w[..., k]`` the channels' weights ``sc·|q_i|/2``, ``group[..., k]``
    their groups ``g(i)`` and ``member[..., G, k]`` the same as 0/1. Few columns (``N ≤ G·`` :data:`UNIFORM_TABLE`):
    ψ at each argument. Many: per group, ``F_g(μ) = Σ_{g(i)=g} ψ(μ·w_i)`` from a table of :data:`UNIFORM_TABLE`
    geometric points at or above each argument (``F_g`` increases, so the next point up bounds it)."""
    groups, n = mu.shape[-2], mu.shape[-1]
    if n <= groups * UNIFORM_TABLE:
        by_channel = mu.gather(-2, group.unsqueeze(-1).expand(*group.shape, n))  # [..., k, N]
        return psi_upper(by_channel * w.unsqueeze(-1)).sum(-2)
    pos = mu > 0
    lo = torch.where(pos, mu, math.inf).amin(-1, keepdim=True)
    hi = mu.amax(-1, keepdim=True)
    lo = torch.where(torch.isfinite(lo), lo, 1.0)
    hi = torch.maximum(hi, lo)
    frac = torch.linspace(0.0, 1.0, UNIFORM_TABLE, dtype=torch.float64)
    grid = (lo * torch.exp(torch.log(hi / lo) * frac)).cummax(-1).values  # [..., G, K]
    grid[..., -1:] = hi  # the table reaches the largest argument exactly
    own = grid.gather(-2, group.unsqueeze(-1).expand(*group.shape, UNIFORM_TABLE))  # [..., k, K]: g(i)'s points
    table = torch.matmul(member, psi_upper(own * w.unsqueeze(-1)))  # [..., G, K]: Σ_{g(i)=g} ψ(point·w_i)
    at = torch.searchsorted(grid.contiguous(), mu.contiguous())  # first point >= the argument
    val = table.gather(-1, at.clamp(max=UNIFORM_TABLE - 1))
    val = torch.where(at < UNIFORM_TABLE, val, math.inf)  # (cannot happen: hi is a table point)
    return torch.where(pos, val, 0.0).sum(-2)


def tier_b_radius_uniform(
    q: torch.Tensor,
    steps: torch.Tensor,
    scale: float,
    n_tokens: int,
    delta_loc: float,
    group_size: int = 32,
    channel_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tier-B radii from the residual's uniform law, never above the union radius :func:`tier_b_radius`: all
    ``S = n_tokens`` tokens obey ``|ε_t| ≤ x_t`` with probability ≥ 1−δ_loc (``docs/math.md#tier-b-uniform``).

    Under the Tier-B premise ``ε_t = Σ_i a_{t,i} U_i`` with ``a_{t,i} = sc·|q_i|·s_{t,g(i)}/2`` and ``U_i``
    independent uniform on ``[−1, 1]``, so ``ln E e^{λε_t} = Σ_i ψ(λa_{t,i})`` exactly. The bound keeps ψ on the
    :data:`UNIFORM_CHANNELS` largest ``|q_i|`` and ``ψ(y) ≤ y²/6`` on the rest (``R_t = Σ_rest a²``); Chernoff at
    any ``λ > 0`` fixed before the dither gives ``P(|ε_t| > x_t(λ)) ≤ 2e^{−L}``, ``L = ln(2S/δ_loc)``, for

    ``x_t(λ) = (Σ_top ψ(λa_{t,i}) + λ²R_t/6 + L)/λ``,

    taken at the multiples :data:`UNIFORM_LAMBDAS` of ``sqrt(2L)/σ_t`` (the ψ sums from a per-query table, read at
    or above each argument); also ``|ε_t| ≤ Σ_i a_{t,i}`` always. The least of these and the union radius is
    returned, so the event ``{∀t: |ε_t| ≤ x_t}`` lies inside the union radius's event. Shapes as
    :func:`tier_b_sigma2`: ``q[..., D]``, ``steps[..., S, D/group_size]`` -> ``[..., S]``.
    """
    sc = _check_scale(scale)
    union = tier_b_radius(tier_b_sigma2(q, steps, scale, group_size, channel_mask), n_tokens, delta_loc)
    q64, s = _dither_query(q, steps, group_size, channel_mask)
    absq = q64.abs()
    groups = s.shape[-1]
    top, idx = absq.topk(min(UNIFORM_CHANNELS, absq.shape[-1]), dim=-1)  # [..., k]
    group = idx // group_size  # [..., k]
    member = (group.unsqueeze(-2) == torch.arange(groups).unsqueeze(-1)).to(torch.float64)  # [..., G, k]
    rest2 = _group_sums(absq.scatter(-1, idx, 0.0).square(), group_size)  # [..., G]
    r = torch.matmul(s.square(), rest2.unsqueeze(-1)).squeeze(-1) * (sc * sc / 4.0)  # Σ_rest a², [..., S]
    top2 = torch.matmul(s.square(), (member * top.square().unsqueeze(-2)).sum(-1).unsqueeze(-1)).squeeze(-1)
    m2 = r + top2 * (sc * sc / 4.0)  # Σ_i a_i² = 3σ²_t
    log_term = math.log(2.0 * n_tokens / delta_loc)
    lam = math.sqrt(6.0 * log_term) / m2.sqrt().clamp(min=1e-300)
    lam = lam.unsqueeze(-1) * torch.tensor(UNIFORM_LAMBDAS, dtype=torch.float64)  # [..., S, J]
    lead = torch.broadcast_shapes(s.shape[:-2], q64.shape[:-1])
    mu = lam.unsqueeze(-2) * s.expand(*lead, *s.shape[-2:]).unsqueeze(-1)  # [..., S, G, J]: λ·s_{t,g}
    n, j = mu.shape[-3], mu.shape[-1]
    mu = (mu * (1.0 + 2.0**-50)).movedim(-2, -3).flatten(-2)  # [..., G, S·J], rounded up
    psi_sum = _top_psi_sums(mu, (sc / 2.0) * top, group, member).unflatten(-1, (n, j))  # [..., S, J]
    best = ((psi_sum + lam * lam * r.unsqueeze(-1) / 6.0 + log_term) / lam).amin(-1)
    l1 = torch.matmul(s, _group_sums(absq, group_size).unsqueeze(-1)).squeeze(-1) * (sc / 2.0)
    cheb = torch.minimum(best, l1) * _PSI_ROUND
    cheb = torch.where(torch.isfinite(cheb), cheb, math.inf)
    return torch.where(m2 > 0, torch.minimum(cheb, union), torch.zeros_like(union))


def dither_witness_moments(
    steps: torch.Tensor,
    group_size: int,
    bands: int = 8,
    pairing: Pairing = "rotate_half",
    channel_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean bound ``m ≥ E W`` and bounded-difference constant ``C`` of the scalar dither witness.

    For subtractive dither the residual coordinates ``r_c`` are independent and uniform on
    ``[−s_c/2, s_c/2]`` (``s_c`` the step of channel ``c``'s group, 0 for bypassed channels). The scalar
    witness ``W = Σ_b ‖r_b‖`` over bands of whole RoPE pairs then satisfies

    * ``E W ≤ m = Σ_b (Σ_{c∈b} s_c²/12)^{1/2}`` (Jensen: ``E‖r_b‖ ≤ (E‖r_b‖²)^{1/2}``), and
    * changing one coordinate moves ``W`` by at most ``s_c`` (reverse triangle inequality), so
      ``C = Σ_c s_c²`` is McDiarmid's constant — the inputs of the drift e-process factor
      ``exp(λ(W − m) − λ²C/8)`` (:mod:`kvcert.bounds.eprocess`).

    ``steps[..., G]`` per-group steps with ``G·group_size = D``; returns float64 ``(m[...], C[...])``.
    """
    s = check_nonneg_finite(steps, "steps")
    if group_size < 1 or s.dim() < 1:
        raise ValueError(f"group_size must be >= 1 and steps at least 1-d, got {group_size}, {tuple(s.shape)}")
    per_channel = s.repeat_interleave(group_size, dim=-1)
    if channel_mask is not None:
        if channel_mask.shape[-1] != per_channel.shape[-1]:
            raise ValueError(f"channel_mask last dim {channel_mask.shape[-1]} != D = {per_channel.shape[-1]}")
        per_channel = per_channel * channel_mask.to(torch.float64)
    m = band_norms(per_channel, bands, pairing).sum(-1) / math.sqrt(12.0)
    c = per_channel.square().sum(-1)
    return m, c
