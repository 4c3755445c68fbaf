"""Pure math of the RC tiered-cache read path (``docs/ladder.md#rc-bound``): block masses, the adaptive block
selector, the mass lemma and the two-term output bound ``E_key + E_val``.

Setting, per attention cell. Exact logits ``s_t = sc·⟨q, k_t⟩`` (real arithmetic), served (scoring) logits
``s̃_t`` from the decoded keys with ``|s̃_t − s_t| ≤ c_t`` (Tier-A band witness plus float32 rounding, valid
for any codec and any query). ``p = softmax(s)``, ``p̃ = softmax(s̃)``. The tokens are cut into blocks of
``block`` consecutive slots; ``F`` is the set of blocks whose exact keys are paged in, ``T`` the *tail*:
visible tokens outside ``F`` whose stored key is compressed. Phase 2 attends over mixed keys (exact on
``F``, decoded on ``T``), so only ``T`` carries witness error; every token carries float32 rounding
``≤ φ_t``.

* **Mass lemma** (RC): ``α_T := Σ_{t∈T} p_t ≤ e^{2C}·α̂_T`` with ``α̂_T = Σ_{t∈T} p̃_t`` and
  ``C = max_t c_t`` over the visible tokens, because ``p_t/p̃_t = e^{s_t − s̃_t}·Z̃/Z ≤ e^{c_t}·e^{C}``.
* **Key term.** With ``p'`` the softmax of the real-arithmetic mixed logits, ``TV(p^mix, p) ≤ TV(p^mix, p')
  + TV(p', p) ≤ tanh(φ_max) + α_T(e^{2Δ_T} − 1)`` (Lean ``tv_le_tanh``; the tail form, ``docs/math.md#tail-form``, with
  ``Δ_T = max_{t∈T} c_t``), hence ``‖Σ_t (p^mix_t − p_t) v_t‖ ≤ 2·V_max·TV`` with ``V_max ≥ max_t ‖v_t‖``:

      E_key = 2·V_max·min(1, tanh(φ_max) + min(1, e^{2C}·α̂_T)·(e^{2Δ_T} − 1)).

  Factor choice: ``e^{2Δ}`` in the mass lemma, not the ``e^{3Δ}`` of RC's implementation — RC needs the
  extra ``e^{Δ}`` for INT8×INT8 scaled-query scoring; here the query is not quantized and the float32
  rounding of the scoring is inside ``c_t``. ``C ≥ Δ_T``, so this is ≤ RC's ``2V_max e^{2Δ}α̂_T(e^{2Δ}−1)``
  (plus the rounding term) whenever RC's Δ bounds every radius.
* **Value term** (convexity): ``‖Σ_t p^mix_t (v^mix_t − v_t)‖ ≤ Σ_b ρ_b η_b`` with ``ρ_b`` the Phase-2 block
  mass and ``η_b ≥ max_{t∈b} ‖v^mix_t − v_t‖`` (0 for value blocks promoted to exact).

Both terms are ``output:l2`` certificates (tier: certified, deterministic and adaptive-safe); they are a
different metric from the TV certificates of ``softmax_tv``. Everything is float64.
"""

from __future__ import annotations

import torch

from kvcert.bounds.softmax_tv import check_nonneg_finite, tv_tail

U_F32 = 2.0**-24
_U = U_F32


def gamma_f32(n: int) -> float:
    """Higham's ``γ_n = n·u/(1 − n·u)``, ``u = 2^-24``: relative rounding bound of an n-term float32 dot product."""
    return n * _U / (1 - n * _U)


#: relative inflation of a float64 softmax mass sum (covers its rounding for fewer than ~10^6 tokens)
_MASS_INFLATE = 1.0 + 1e-9


def _check_block(block: int) -> int:
    if not (isinstance(block, int) and block >= 1):
        raise ValueError(f"block must be a positive int, got {block!r}")
    return block


def _blocked(x: torch.Tensor, block: int, fill: float) -> torch.Tensor:
    """``x[..., S] -> [..., nb, block]``; the trailing partial block is padded with ``fill``."""
    s = x.shape[-1]
    nb = -(-s // block)
    return torch.nn.functional.pad(x, (0, nb * block - s), value=fill).reshape(*x.shape[:-1], nb, block)


def block_log_mass(logits: torch.Tensor, block: int) -> torch.Tensor:
    """Per-block log-mass ``ℓ_b = log Σ_{t∈b} e^{s_t}`` (RC Phase 1), float64 ``[..., nb]``.

    ``logits[..., S]`` with ``-inf`` for masked tokens; a block with no visible token gets ``-inf``.
    ``softmax_b(ℓ_b)`` is the normalised block mass ``p_b = Σ_{t∈b} softmax(s)_t``.
    """
    if torch.isnan(logits).any() or bool((logits == float("inf")).any()):
        raise ValueError("logits must not contain NaN or +inf (use -inf for masked tokens)")
    return torch.logsumexp(_blocked(logits.to(torch.float64), _check_block(block), float("-inf")), dim=-1)


def block_sum(x: torch.Tensor, block: int) -> torch.Tensor:
    """``Σ_{t∈b} x_t`` per block: ``[..., S] -> [..., nb]``."""
    return _blocked(x, _check_block(block), 0.0).sum(-1)


def block_max(x: torch.Tensor, block: int) -> torch.Tensor:
    """``max_{t∈b} x_t`` per block of a non-negative ``x[..., S]`` (partial block padded with 0)."""
    return _blocked(check_nonneg_finite(x, "x", None), _check_block(block), 0.0).amax(-1)


def select_blocks(
    p_block: torch.Tensor, tau_cov: float, k_min: int, k_max: int, tail_trigger: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RC adaptive selector with Rung 1. Returns ``(chosen[..., nb] bool, k_star[...], doubled[...] bool)``.

    Blocks are ranked by ``p_block`` (normalised block mass, descending, ties by index);
    ``K* = min{k : Σ_{i<k} p_(i) ≥ tau_cov}`` clamped to ``[k_min, k_max]`` (and to ``nb``). **Rung 1:** while
    the estimated tail mass ``Σ_{i≥K*} p_(i)`` exceeds ``tail_trigger``, ``K*`` doubles (up to ``nb``);
    ``doubled`` marks the rows where that happened. Rows of all-zero mass (nothing visible) select ``k_min``.
    """
    p = check_nonneg_finite(p_block, "p_block")
    if not 0.0 < tau_cov <= 1.0:
        raise ValueError(f"tau_cov must be in (0, 1], got {tau_cov}")
    if not 1 <= k_min <= k_max:
        raise ValueError(f"need 1 <= k_min <= k_max, got k_min={k_min}, k_max={k_max}")
    if not 0.0 <= tail_trigger < 1.0:
        raise ValueError(f"tail_trigger must be in [0, 1), got {tail_trigger}")
    nb = p.shape[-1]
    sp, order = torch.sort(p, dim=-1, descending=True, stable=True)
    # tail_after[k] = mass of ranks >= k (reverse cumsum: no cancellation); tail_after[nb] = 0
    tail_after = torch.cat([sp.flip(-1).cumsum(-1).flip(-1), torch.zeros_like(sp[..., :1])], -1)
    covered = (sp.cumsum(-1) >= tau_cov * (1.0 - 1e-12)).to(torch.int64)
    first = torch.where(covered.any(-1), covered.argmax(-1) + 1, torch.full_like(covered[..., 0], nb))
    k = first.clamp(min=k_min, max=k_max).clamp(max=nb)
    doubled = torch.zeros_like(k, dtype=torch.bool)
    while True:
        grow = (tail_after.gather(-1, k.unsqueeze(-1)).squeeze(-1) > tail_trigger) & (k < nb)
        if not bool(grow.any()):
            break
        doubled |= grow
        k = torch.where(grow, (2 * k).clamp(max=nb), k)
    rank = torch.arange(nb, device=order.device).expand_as(order)
    chosen = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order, rank < k.unsqueeze(-1))
    return chosen, k, doubled


def mass_lemma_bound(alpha_hat: torch.Tensor, c_max: torch.Tensor) -> torch.Tensor:
    """RC mass lemma: the exact tail mass ``α_T ≤ min(1, e^{2C}·α̂_T)``.

    ``alpha_hat`` is the served tail mass ``Σ_{t∈T} p̃_t`` (float64 softmax; inflated by ``1 + 1e-9`` for its
    rounding), ``c_max ≥ max_t |s̃_t − s_t|`` over **all** visible tokens (the served scoring perturbs all).
    """
    a = check_nonneg_finite(alpha_hat, "alpha_hat")
    cm = check_nonneg_finite(c_max, "c_max")
    return torch.minimum(a * _MASS_INFLATE * torch.exp(2.0 * cm), torch.ones_like(a))


def rc_tv_bound(
    alpha_hat: torch.Tensor, c_max: torch.Tensor, delta_tail: torch.Tensor, rounding: torch.Tensor
) -> torch.Tensor:
    """``TV(p^mix, p) ≤ min(1, tanh(φ_max) + min(1, e^{2C}α̂_T)·(e^{2Δ_T} − 1))`` (module docstring).

    ``delta_tail ≥ max_{t∈T} |s^mix_t − s_t|`` is the witness radius on the tail (0 when the tail is empty),
    ``rounding ≥ max_t`` float32 rounding of the Phase-2 logits over all visible tokens.
    """
    alpha = mass_lemma_bound(alpha_hat, c_max)
    tail = tv_tail(alpha, check_nonneg_finite(delta_tail, "delta_tail"), clip=True)
    return (torch.tanh(check_nonneg_finite(rounding, "rounding")) + tail).clamp(max=1.0)


def key_term(
    alpha_hat: torch.Tensor, c_max: torch.Tensor, delta_tail: torch.Tensor, rounding: torch.Tensor, v_max: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(E_key, tv)`` with ``E_key = 2·V_max·tv ≥ ‖Σ_t (p^mix_t − p_t)·v_t‖₂`` and ``tv`` from
    :func:`rc_tv_bound`; ``v_max ≥ max_t ‖v_t‖`` over the visible tokens (exact values)."""
    tv = rc_tv_bound(alpha_hat, c_max, delta_tail, rounding)
    return 2.0 * check_nonneg_finite(v_max, "v_max") * tv, tv


def value_term(block_mass: torch.Tensor, eta: torch.Tensor) -> torch.Tensor:
    """``E_val = Σ_b ρ_b η_b ≥ ‖Σ_t p_t (v̂_t − v_t)‖₂`` (convexity) for ``ρ_b = Σ_{t∈b} p_t`` and
    ``η_b ≥ max_{t∈b} ‖v̂_t − v_t‖``.

    ``block_mass[..., nb]`` and ``eta[..., nb]`` broadcast; float64 ``[...]``.
    """
    rho = check_nonneg_finite(block_mass, "block_mass")
    return (rho * check_nonneg_finite(eta, "eta")).sum(-1)


def logit_rounding_radius(
    q_norm: torch.Tensor, k_hat_norm: torch.Tensor, key_witness: torch.Tensor, scale: float, head_dim: int
) -> torch.Tensor:
    """``φ_t = sc·γ_{D+1}·‖q‖·(2‖k̂_t‖ + W_t)`` bounds the float32 rounding of ``sc·⟨q, k⟩`` for ``k = k̂_t``
    **and** for the exact ``k_t`` (``‖k_t‖ ≤ ‖k̂_t‖ + W_t``, ``W_t = Σ_b ρ_{t,b} ≥ ‖Δk_t‖``).

    Higham: a float32 dot product of length D has error ``≤ γ_D Σ|q_i k_i| ≤ γ_D‖q‖‖k‖``; the scale multiply
    adds one more rounding (``γ_D + u(1 + γ_D) ≤ γ_{D+1}``). Float64 ``[...]`` (inputs broadcast).
    """
    if not (scale > 0 and head_dim >= 1):
        raise ValueError(f"scale must be > 0 and head_dim >= 1, got scale={scale}, head_dim={head_dim}")
    n = head_dim + 1
    gamma = gamma_f32(n)
    qn = check_nonneg_finite(q_norm, "q_norm")
    kn = check_nonneg_finite(k_hat_norm, "k_hat_norm")
    w = check_nonneg_finite(key_witness, "key_witness")
    return scale * gamma * qn * (2.0 * kn + w)


def output_rounding_slack(n_tokens: int, v_dim: int, v_max: torch.Tensor) -> torch.Tensor:
    """``ξ = 2(S + D_v)·u·(1 + 10^{-6})·V_max`` bounds the float32 evaluation of ``Σ_t p_t v_t``
    (probabilities rounded to float32, relative ``u`` each, then a length-S float32 sum, ``γ_S``) with
    margin that also covers the float64 softmax rounding of ``p`` (relative ``O(S·2^{-53})``)."""
    return 2.0 * (n_tokens + v_dim) * _U * (1 + 1e-6) * check_nonneg_finite(v_max, "v_max")
