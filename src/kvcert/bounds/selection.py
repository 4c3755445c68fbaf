"""Top-k selection meters: rank-prefix margin certificate, Lemma S2 lost/gained mass, selector→attention
ratio.

* **Rank-prefix stability** [Lean ``rank_prefix_stable``; ``docs/memory-meters.md#rank-prefix``]. If every score
moves
  by at most ``ε`` (``|s_i − s'_i| ≤ ε``) and the served margin ``s_(r) − s_(r+1) > 2ε``, the top-``r``
  *set* of
  ``s'`` equals that of ``s``. The factor 2 cannot be halved (one side falls by ``ε``, the other rises by
  ``ε``).
  The premise is decided per row, so the certificate holds on a decidable subset of rows: **partial** tier.
* **Lemma S2** (``docs/memory-meters.md#lemma-s2``). With ``p`` the softmax over the original selection ``I`` and
  ``p̂`` the softmax over the
  perturbed selection ``Î`` (both zero outside their set),
  ``TV(p, p̂) = ½(m_out + m_in) + ½Σ_{I∩Î}|p_i − p̂_i|`` with ``m_out = Σ_{I∖Î} p``, ``m_in = Σ_{Î∖I} p̂``,
  so the selection stage is the contract ``(a_S, b_S) = (1, ½(m_out + m_in))`` in ``selector_dist:tv``.
* **Selector→attention ratio** (``docs/memory-meters.md#selector-ratio``, empirical). ``m_attn`` / ``m_sel`` are the
  masses the selection omits
under
  the attention softmax and the selector softmax; ``ρ = m_attn / max(m_sel, 1e−9)`` is a measurement, never
  a bound.

Scores are ``[..., S]`` with a mandatory boolean ``valid[..., S]`` mask of the same shape (no implicit
broadcasting: invalid slots may hold garbage such as 1e38). All mass computations run in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASKED = -1e300


def _check_scores(scores: torch.Tensor, valid: torch.Tensor, name: str = "scores") -> torch.Tensor:
    if valid.dtype != torch.bool:
        raise ValueError(f"valid must be a boolean mask, got dtype {valid.dtype}")
    if valid.shape != scores.shape:
        raise ValueError(f"valid {tuple(valid.shape)} must have exactly the shape of {name} {tuple(scores.shape)}")
    x = scores.to(torch.float64)
    if not torch.isfinite(x[valid]).all():
        raise ValueError(f"{name} contains non-finite entries at valid positions")
    return x.masked_fill(~valid, _MASKED)


def _check_rank(r: int, n: int, name: str = "r") -> None:
    if not (1 <= r <= n):
        raise ValueError(f"{name} must lie in [1, {n}], got {r}")


def topk_mask(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean ``[..., S]`` mask of the top-``k`` valid entries per row (all valid entries if fewer than
    ``k``)."""
    x = _check_scores(scores, valid)
    _check_rank(k, x.shape[-1], "k")
    idx = x.topk(k, dim=-1).indices
    return torch.zeros_like(valid).scatter_(-1, idx, True) & valid


@dataclass(frozen=True)
class RankPrefixCertificate:
    """Per-row result of the rank-prefix margin test for one prefix length ``r``.

    ``margin = s_(r) − s_(r+1)`` of the served scores (clamped at 0; ``+inf`` on trivial rows), ``eps`` the
    per-row score radius, ``trivial`` rows with at most ``r`` valid entries (the prefix is everything valid,
    so
    it cannot change), ``certified = trivial | (margin > 2·eps)``.
    """

    r: int
    margin: torch.Tensor
    eps: torch.Tensor
    trivial: torch.Tensor
    certified: torch.Tensor


def rank_prefix_certificate(
    served: torch.Tensor, valid: torch.Tensor, eps: torch.Tensor | float, r: int
) -> RankPrefixCertificate:
    """Certify per row that the top-``r`` set of any ``s`` with ``‖s − served‖_∞ ≤ eps`` equals that of
    ``served``.

    ``served[..., S]`` scores, ``valid[..., S]`` boolean, ``eps`` a non-negative scalar or ``[...]`` per-row
    radius.
    Sound for every row flagged ``certified`` (module docstring); uncertified rows carry no claim.
    """
    x = _check_scores(served, valid, "served")
    _check_rank(r, x.shape[-1])
    e = torch.as_tensor(eps, dtype=torch.float64).expand(x.shape[:-1])
    if not (torch.isfinite(e).all() and (e >= 0).all()):
        raise ValueError("eps must be finite and non-negative")
    n_valid = valid.sum(-1)
    trivial = n_valid <= r
    if r < x.shape[-1]:
        vals = x.topk(r + 1, dim=-1).values
        margin = (vals[..., r - 1] - vals[..., r]).clamp_min(0.0)
    else:
        margin = torch.zeros(x.shape[:-1], dtype=torch.float64)
    margin = torch.where(trivial, torch.full_like(margin, float("inf")), margin)
    return RankPrefixCertificate(r, margin, e.clone(), trivial, trivial | (margin > 2.0 * e))


def prefix_flips(reference: torch.Tensor, served: torch.Tensor, valid: torch.Tensor, r: int) -> torch.Tensor:
    """``[...]`` boolean: the top-``r`` set of ``reference`` differs from that of ``served`` on this row."""
    return (topk_mask(reference, valid, r) != topk_mask(served, valid, r)).any(-1)


def hash_perturbation(scores: torch.Tensor, valid: torch.Tensor, eps: torch.Tensor | float) -> torch.Tensor:
    """Deterministic perturbation ``L' = L + u·eps`` with ``u = frac(sin(12.9898φ + 78.233)·43758.5453)·2 −
    1``.

    ``φ`` is the flat index of each entry, so no RNG is drawn (graph-capture safe); ``|L' − L| ≤ eps`` on
    valid
    entries, invalid entries are unchanged. ``eps`` is a scalar or per-row ``[...]`` radius.
    """
    x = _check_scores(scores, valid)
    e = torch.as_tensor(eps, dtype=torch.float64).expand(x.shape[:-1])
    phi = torch.arange(x.numel(), dtype=torch.float64).reshape(x.shape)
    h = torch.sin(12.9898 * phi + 78.233) * 43758.5453
    u = (h - torch.floor(h)) * 2.0 - 1.0
    return torch.where(valid, x + u * e.unsqueeze(-1), scores.to(torch.float64))


@dataclass(frozen=True)
class SelectionMass:
    """Lemma S2 terms per row: ``m_out = Σ_{I∖Î} p``, ``m_in = Σ_{Î∖I} p̂``, ``b_S = ½(m_out + m_in)``
    (float64)."""

    m_out: torch.Tensor
    m_in: torch.Tensor
    b_s: torch.Tensor


def _softmax_on(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.masked_fill(~mask, float("-inf")), dim=-1)


def selection_distributions(
    original: torch.Tensor, perturbed: torch.Tensor, valid: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(p, p̂, I, Î)``: the softmax of ``original`` over its top-``k`` set ``I`` and of ``perturbed`` over
    ``Î``.

    ``p`` and ``p̂`` are ``[..., S]`` and zero outside their selection.
    """
    i_mask = topk_mask(original, valid, k)
    j_mask = topk_mask(perturbed, valid, k)
    p = _softmax_on(original.to(torch.float64), i_mask)
    p_hat = _softmax_on(perturbed.to(torch.float64), j_mask)
    return p, p_hat, i_mask, j_mask


def lost_gained_mass(original: torch.Tensor, perturbed: torch.Tensor, valid: torch.Tensor, k: int) -> SelectionMass:
    """Lemma S2 selection term: ``b_S = ½(m_out + m_in)`` in ``selector_dist:tv`` (``a_S = 1``).

    Identity (tested): ``TV(p, p̂) = b_S + ½Σ_{I∩Î}|p_i − p̂_i|``, hence ``b_S ≤ TV(p, p̂)`` and the
    selection stage
    adds ``b_S`` to the common-support error without amplifying it.
    """
    p, p_hat, i_mask, j_mask = selection_distributions(original, perturbed, valid, k)
    m_out = (p * (i_mask & ~j_mask)).sum(-1).clamp(0.0, 1.0)  # a sub-mass of a distribution: clamp rounding
    m_in = (p_hat * (j_mask & ~i_mask)).sum(-1).clamp(0.0, 1.0)
    return SelectionMass(m_out, m_in, 0.5 * (m_out + m_in))


@dataclass(frozen=True)
class MassRatio:
    """Omitted masses per row and their ratio ``ρ = m_attn / max(m_sel, 1e−9)`` (empirical)."""

    m_attn: torch.Tensor
    m_sel: torch.Tensor
    rho: torch.Tensor


def omitted_mass(scores: torch.Tensor, valid: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """``Σ_{t valid, t ∉ selected} softmax(scores over valid)_t`` per row (float64).

    Identity: this equals ``TV(softmax over valid, softmax renormalised over selected)``.
    """
    x = _check_scores(scores, valid)
    if selected.shape != valid.shape or selected.dtype != torch.bool:
        raise ValueError("selected must be a boolean mask with the shape of valid")
    if (selected & ~valid).any():
        raise ValueError("selected contains invalid positions")
    p = _softmax_on(x, valid)
    return (p * (valid & ~selected)).sum(-1)


def selector_attention_ratio(
    attn_scores: torch.Tensor, selector_scores: torch.Tensor, valid: torch.Tensor, selected: torch.Tensor
) -> MassRatio:
    """Selector→attention mass ratio on the same (row, candidate set, selected set); **empirical**.

    ``ρ`` measured on truncation sets is a sample statistic; ``max ρ`` is not a confidence bound.
    """
    m_attn = omitted_mass(attn_scores, valid, selected)
    m_sel = omitted_mass(selector_scores, valid, selected)
    return MassRatio(m_attn, m_sel, m_attn / m_sel.clamp_min(1e-9))
