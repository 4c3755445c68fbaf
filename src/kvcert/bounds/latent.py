"""Latent-KV (MLA) logit-error radii: a latent residual pushed through the key up-projection.

An MLA cache stores a latent ``c_t ∈ ℝ^r`` per token plus a shared decoupled RoPE key ``k_pe,t``. Head
``h`` reconstructs ``k_nope = W_UK^{(h)} c_t`` (``W_UK^{(h)} ∈ ℝ^{d_nope×r}``) and scores

    s_t = sm·( q_nopeᵀ W_UK^{(h)} c_t + q_peᵀ k_pe,t ).

A stored latent ``ĉ_t = c_t + Δc_t`` and rope key ``k̂_pe,t = k_pe,t + Δk_pe,t`` change the score by

    ε_t = sm·( u_hᵀ Δc_t + q_peᵀ Δk_pe,t ),    u_h := W_UK^{(h)ᵀ} q_nope  (effective query,
    ``docs/memory-meters.md#latent-kv``)

so, by Cauchy–Schwarz inside each band (Tier A, deterministic, any query):

    |ε_t| ≤ c_t := sm·( Σ_b ‖u_{h,b}‖·‖Δc_{t,b}‖ + Σ_b ‖q_pe,b‖·‖Δk_pe,t,b‖ ).

The latent carries no RoPE, so any partition of its ``r`` coordinates is valid (contiguous chunks here); the
rope part needs bands of whole rotary pairs in the layout of the *stored* rope key (``pairing``; transformers'
DeepSeek models store it post-RoPE in the ``rotate_half`` layout) so that its band norms are
position-invariant. For a subtractively dithered latent (Tier B, non-adaptive
queries) the two independent parts add variances: ``σ²_t = sm²(Σ_j u_j² s_{t,j}²/12 + Σ_j q_pe,j² s_pe²/12)``.
"""

from __future__ import annotations

import torch

from kvcert.bounds.radii import query_band_norms, tier_a_radius_from_qnorms, tier_b_sigma2
from kvcert.bounds.rope import Pairing, band_norms


def effective_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``u_h = W_UK^{(h)ᵀ} q_nope,h`` in float64: ``q_nope[..., H, T, d_nope]``, ``w_uk[H, d_nope, r]`` ->
    ``[..., H, T, r]``.

    Contract: ``⟨q_nope,h, W_UK^{(h)} Δc⟩ = ⟨u_h, Δc⟩`` for every latent residual ``Δc``.
    """
    if w_uk.dim() != 3:
        raise ValueError(f"w_uk must have shape [H, d_nope, r], got {tuple(w_uk.shape)}")
    if q_nope.dim() < 3 or q_nope.shape[-3] != w_uk.shape[0] or q_nope.shape[-1] != w_uk.shape[1]:
        raise ValueError(
            f"q_nope {tuple(q_nope.shape)} does not match w_uk {tuple(w_uk.shape)} (need [..., H, T, d_nope])"
        )
    if not (torch.isfinite(q_nope).all() and torch.isfinite(w_uk).all()):
        raise ValueError("q_nope or w_uk contains non-finite entries")
    return torch.einsum("...htd,hdr->...htr", q_nope.to(torch.float64), w_uk.to(torch.float64))


def latent_band_norms(delta_c: torch.Tensor, bands: int = 8) -> torch.Tensor:
    """Per-band norms ``‖Δc_{t,b}‖`` over ``bands`` contiguous chunks of the latent: ``[..., r] -> [...,
    bands]``.

    The latent has no RoPE, so any partition is valid; contiguous chunks of ``r/bands`` coordinates are the
    interleaved-pair bands of ``kvcert.bounds.rope.band_norms`` (``r/bands`` must be even). Invariant:
    ``Σ_b ρ_b² = ‖Δc‖²``.
    """
    return band_norms(delta_c, bands, "interleaved")


def latent_tier_a_radius(
    u: torch.Tensor,
    latent_norms: torch.Tensor,
    scale: float,
    q_pe: torch.Tensor | None = None,
    pe_norms: torch.Tensor | None = None,
    pairing: Pairing = "rotate_half",
) -> torch.Tensor:
    """Deterministic radii ``c_t ≥ |ε_t|`` for an MLA read (module docstring).

    ``u[..., T, r]`` effective queries; ``latent_norms[..., S, B]`` band norms of ``Δc`` (from
    ``latent_band_norms``); optional ``q_pe[..., T, d_pe]`` with ``pe_norms[..., S, B_pe]`` (band norms of
    ``Δk_pe`` over whole rotary pairs of ``pairing``). Leading dims broadcast; returns float64 ``[..., T,
    S]``.
    Omitting the rope part asserts that ``k_pe`` is stored exactly.
    """
    if (q_pe is None) != (pe_norms is None):
        raise ValueError("q_pe and pe_norms must be given together")
    un = band_norms(u, latent_norms.shape[-1], "interleaved")
    c = tier_a_radius_from_qnorms(un, latent_norms.unsqueeze(-3), scale)
    if q_pe is not None and pe_norms is not None:
        qn = query_band_norms(q_pe, pe_norms.shape[-1], pairing)
        c = c + tier_a_radius_from_qnorms(qn, pe_norms.unsqueeze(-3), scale)
    return c


def latent_tier_b_sigma2(
    u: torch.Tensor,
    latent_steps: torch.Tensor,
    scale: float,
    group_size: int,
    q_pe: torch.Tensor | None = None,
    pe_steps: torch.Tensor | None = None,
    pe_group_size: int | None = None,
) -> torch.Tensor:
    """Sub-Gaussian variance proxy of ``ε_t`` for subtractively dithered latents (and rope keys).

    ``σ²_t = sm²·(Σ_g s_{t,g}²‖u_g‖²/12 + Σ_g s_pe,{t,g}²‖q_pe,g‖²/12)``; ``u[..., T, r]``,
    ``latent_steps[..., S, r/group_size]``; returns ``[..., T, S]``. Premises: dither residuals independent,
    uniform on ``[−s/2, s/2]`` and independent of the query (non-adaptive); the two parts are independent, so
    their proxies add. Feed the result to ``kvcert.bounds.tier_b_radius``.
    """
    if (q_pe is None) != (pe_steps is None) or (q_pe is not None and pe_group_size is None):
        raise ValueError("q_pe, pe_steps and pe_group_size must be given together")
    s2 = tier_b_sigma2(u, latent_steps.unsqueeze(-3), scale, group_size)
    if q_pe is not None and pe_steps is not None and pe_group_size is not None:
        s2 = s2 + tier_b_sigma2(q_pe, pe_steps.unsqueeze(-3), scale, pe_group_size)
    return s2
