"""Two-term bound on the attention-output error from a key (TV) term and a value term.

Served output ``ô = Σ_t p̃_t v̂_t``, exact output ``o = Σ_t p_t v_t``, stored values ``v̂_t = v_t + Δv_t``.
Since ``Σ_t (p̃_t − p_t) = 0``, for any centre ``c``:

    ô − o = Σ_t p̃_t Δv_t + Σ_t (p̃_t − p_t)(v_t − c)
    ‖ô − o‖₂ ≤ Σ_t p̃_t ‖Δv_t‖ + 2·TV(p, p̃)·max_t (‖v̂_t − c‖ + ‖Δv_t‖)

(triangle inequality on the first sum, Hölder on the second, ``‖v_t − c‖ ≤ ‖v̂_t − c‖ + ‖Δv_t‖``).
The max runs over the support of ``p̃`` (masked tokens have ``p_t = p̃_t = 0``). The result is an
``output:l2`` certificate, a different metric from the TV certificates (``docs/math.md#output-bound``).
"""

from __future__ import annotations

import torch

from kvcert.bounds.softmax_tv import check_broadcast, check_nonneg_finite, check_served


def output_error_bound(
    p_served: torch.Tensor,
    tv: torch.Tensor,
    v_hat: torch.Tensor,
    v_res_norms: torch.Tensor,
    centre: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(total, key_term, value_term)`` with ``‖ô − o‖₂ ≤ total = key_term + value_term``.

    ``p_served[..., S]``, ``tv[...]`` (any sound bound on ``TV(p, p̃)``; values above 1 are replaced by the
    trivial 1), ``v_hat[..., S, Dv]`` the stored values, ``v_res_norms[..., S] ≥ ‖Δv_t‖``, optional
    ``centre[..., Dv]`` (default: the served output ``Σ p̃ v̂``). Float64 ``[...]`` outputs.
    """
    p, mass = check_served(p_served)
    check_broadcast(p_served=p, v_res_norms=torch.as_tensor(v_res_norms), v_hat_tokens=v_hat.shape[:-1])
    check_broadcast(p_served_rows=p.shape[:-1], tv=torch.as_tensor(tv))
    p = p / mass.unsqueeze(-1)
    t = torch.as_tensor(tv, dtype=torch.float64)
    if not bool((t >= 0).all()):  # NaN fails the comparison too; +inf (an unclipped overflow) is allowed
        raise ValueError("tv must be a non-negative TV bound (got NaN or a negative value)")
    t = t.clamp(max=1.0)  # TV ≤ 1 always, so inf (unclipped overflow) is replaced soundly
    if not torch.isfinite(v_hat).all():
        raise ValueError("v_hat contains non-finite entries")
    vh = v_hat.to(torch.float64)
    r = check_nonneg_finite(v_res_norms, "v_res_norms")
    served = torch.matmul(p.unsqueeze(-2), vh).squeeze(-2)
    if centre is None:
        ctr = served
    else:
        if not torch.isfinite(centre).all():
            raise ValueError("centre contains non-finite entries")
        ctr = centre.to(torch.float64)
    value_term = (p * r).sum(-1)
    spread = torch.linalg.vector_norm(vh - ctr.unsqueeze(-2), dim=-1) + r
    spread = torch.where(p > 0, spread, torch.zeros_like(spread)).amax(-1)
    key_term = 2.0 * t * spread
    return key_term + value_term, key_term, value_term
