"""RC tiered-cache read path with its four-rung fallback ladder (``docs/ladder.md``, ``ladder=True``).

For one layer and one forward call with queries ``q[B, Hq, Q, D]`` over ``S`` stored tokens, per KV head:

1. **Phase 1 (scoring).** Served logits ``s̃`` from the decoded keys, block log-masses ``ℓ_b`` and normalised
   block masses ``p_b``; Tier-A radii ``c_t`` (band witness + float32 rounding, sound for any codec).
2. **Rung 1 (adaptive selector).** Per cell, the top blocks until ``Σ p_b ≥ tau_cov``, clamped to
   ``[k_min, k_max]``; ``K*`` doubles while the estimated tail mass exceeds ``tail_trigger``. A KV head pages
   in the exact keys of the union of its cells' blocks ``F``.
3. **Rung 2 (value promotion).** Value blocks with ``ρ̂_b·η_b > v_tol`` for any cell are read exact.
4. **Phase 2.** Attention over mixed keys/values (exact on ``F`` / promoted blocks, decoded elsewhere) with
   the certified bound ``‖O − O_ref‖₂ ≤ E_key + E_val + ξ`` (``kvcert.bounds.rc``; ``ξ`` float32 slack).
5. **Rung 3 (per query head).** Ranking consistency: if the top paged block by exact log-mass differs from
   the top by served log-mass, or a tail block has ``ℓ̃_b + max_{t∈b} c_t`` above the top exact log-mass,
   that query head is recomputed by exact SDPA over the host tier.
6. **Rung 4 (per layer).** Score-consistency monitor: a paged token with
   ``|s^exact_t − s̃_t| > c_t + φ_t + eps_guard`` means the witness or metadata is wrong (cache-preserving
   contract broken); every head of the layer is recomputed by exact SDPA.

Contract: every output is within its stated bound, or (rungs 3/4) it **is** the ``exact`` (dense fallback) output
for that head, bit for bit. Rungs 1–3 are quality heuristics; soundness comes from the bound (and from
rung 4 when the witness itself is corrupt).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcert.attention.certified import ReadResult, group_heads, masked_logits, probs64, served_meter, ungroup_heads
from kvcert.attention.exact import ExactAttention
from kvcert.bounds import query_band_norms, tier_a_radius_from_qnorms, true_tv
from kvcert.bounds.rc import (
    block_log_mass,
    block_max,
    block_sum,
    key_term,
    logit_rounding_radius,
    output_rounding_slack,
    select_blocks,
    value_term,
)
from kvcert.cache.store import LayerStore


@dataclass(frozen=True)
class LadderConfig:
    """Parameters of the RC read path (defaults from RC: block 16, τ_cov 0.995, K ∈ [2, 128], v_tol 0.05)."""

    block_size: int = 16
    tau_cov: float = 0.995
    k_min: int = 2
    k_max: int = 128
    v_tol: float = 0.05
    tail_trigger: float = 0.02
    eps_guard: float = 1e-6
    validate: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.block_size, int) and self.block_size >= 1):
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if not 0.0 < self.tau_cov <= 1.0:
            raise ValueError(f"tau_cov must be in (0, 1], got {self.tau_cov}")
        if not 1 <= self.k_min <= self.k_max:
            raise ValueError(f"need 1 <= k_min <= k_max, got k_min={self.k_min}, k_max={self.k_max}")
        if not self.v_tol >= 0:
            raise ValueError(f"v_tol must be >= 0, got {self.v_tol}")
        if not 0.0 <= self.tail_trigger < 1.0:
            raise ValueError(f"tail_trigger must be in [0, 1), got {self.tail_trigger}")
        if not self.eps_guard >= 0:
            raise ValueError(f"eps_guard must be >= 0, got {self.eps_guard}")


@dataclass
class LadderStats:
    """Per-rung counters accumulated over reads (all counts are empirical telemetry, not bounds).

    ``rung1``: cells whose ``K*`` was doubled; ``rung2``: value blocks promoted (per KV head);
    ``rung3``: (row, query head) reads recomputed exactly; ``rung4``: layer reads recomputed exactly;
    ``blocks_paged``: key blocks paged in (per KV head); ``cells`` and ``reads``: totals seen.
    ``last_key_paged`` / ``last_value_promoted``: token masks ``[B, Hkv, S]`` of the most recent read
    (inspection and brute-force checks).
    """

    reads: int = 0
    cells: int = 0
    rung1: int = 0
    rung2: int = 0
    rung3: int = 0
    rung4: int = 0
    blocks_paged: int = 0
    last_key_paged: torch.Tensor | None = None
    last_value_promoted: torch.Tensor | None = None


def _check_inputs(q: torch.Tensor, store: LayerStore, mask: torch.Tensor, scaling: float) -> None:
    if store.k is None or store.v is None:
        raise ValueError("store is empty: append K/V before reading")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, Hq, Q, D], got shape {tuple(q.shape)}")
    kb, hkv, s, d = store.k.served.view().shape
    if q.shape[0] != kb or q.shape[-1] != d or q.shape[1] % hkv:
        raise ValueError(f"q shape {tuple(q.shape)} does not fit the store's keys [B={kb}, Hkv={hkv}, D={d}]")
    if not torch.isfinite(q).all():
        raise ValueError("q contains non-finite entries")
    if mask.dtype != torch.bool or tuple(mask.shape) != (kb, 1, q.shape[2], s):
        raise ValueError(
            f"mask must be bool [B, 1, Q, S] = {(kb, 1, q.shape[2], s)}, got {mask.dtype} {tuple(mask.shape)}"
        )
    if not scaling > 0:
        raise ValueError(f"scaling must be > 0, got {scaling}")


def _to_tokens(blocks: torch.Tensor, bs: int, s: int) -> torch.Tensor:
    """Block flags ``[..., nb]`` -> token flags ``[..., S]``."""
    return blocks.repeat_interleave(bs, dim=-1)[..., :s]


def _masked_max(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``max`` of non-negative ``x`` over the last dim where ``keep`` (0 when nothing is kept)."""
    return torch.where(keep, x, torch.zeros_like(x)).amax(-1)


@torch.no_grad()
def ladder_read(
    q: torch.Tensor,
    store: LayerStore,
    mask: torch.Tensor,
    scaling: float,
    cfg: LadderConfig,
    exact: ExactAttention,
    stats: LadderStats | None = None,
) -> ReadResult:
    """Serve one layer's attention through the RC ladder and bound every (query head, query) cell.

    ``mask[B, 1, Q, S]`` is the boolean visibility mask. ``exact(k, v, mask)``
    (:class:`~kvcert.attention.exact.ExactAttention`) returns the dense output ``[B, Q, Hq, Dv]`` over the exact
    keys/values; rung 3/4 heads return exactly that tensor's slices. Guarantee per cell: ``‖out − O_ref‖₂ ≤
    out_bound`` with ``O_ref = Σ_t p_t v_t`` the exact (real-arithmetic) attention over the host tier, ``out_bound =
    E_key + E_val + ξ`` for served cells and ``2·V_max·tanh(φ_max) + ξ`` (rounding only) for exact cells. Counters
    are added to ``stats`` if given.
    """
    _check_inputs(q, store, mask, scaling)
    assert store.k is not None and store.v is not None
    b, hq, nq, d = q.shape
    khat, vhat = store.k.served.view(), store.v.served.view()
    host_k, host_v = store.k.host.view(), store.v.host.view()
    hkv, s, dv = khat.shape[1], khat.shape[2], vhat.shape[-1]
    g, bs = hq // hkv, cfg.block_size
    qg = group_heads(q.to(torch.float32), hkv)  # [B, Hkv, M, D]
    m = mask[:, :, None].expand(b, hkv, g, nq, s).reshape(b, hkv, g * nq, s)

    # Phase 1: served scoring, radii, block masses.
    logits = masked_logits(qg, khat, m, scaling)
    p_hat = probs64(logits)
    k_band = store.k_band.view()  # ρ_{t,b} (glossary: store names)
    qb = query_band_norms(qg, store.bands, store.pairing)
    c_a = tier_a_radius_from_qnorms(qb, k_band.unsqueeze(2), scaling)
    qn = qg.to(torch.float64).norm(dim=-1, keepdim=True)
    k_wit = k_band.to(torch.float64).sum(-1).unsqueeze(2)  # W_t = Σ_b ρ_{t,b}
    phi_t = logit_rounding_radius(qn, store.k_hat_norm.view().unsqueeze(2), k_wit, scaling, d)  # φ_t [B, Hkv, M, S]
    c = c_a + phi_t
    cert_pre, raw = served_meter(p_hat, c)
    tanh = torch.tanh(_masked_max(c, m))
    lm = block_log_mass(logits, bs)  # [B, Hkv, M, nb]
    p_block = torch.nan_to_num(torch.softmax(lm, dim=-1), nan=0.0)

    # Rung 1: adaptive selector (per cell), paged as the union over the KV head's cells.
    chosen, _, doubled = select_blocks(p_block, cfg.tau_cov, cfg.k_min, cfg.k_max, cfg.tail_trigger)
    f_blocks = chosen.any(2)  # [B, Hkv, nb]
    f_tok = _to_tokens(f_blocks, bs, s)
    key_exact = store.k.exact.view()
    # Rung 2: promote value blocks whose served mass times value residual exceeds v_tol.
    eta = block_max(store.v_res.view().to(torch.float64), bs)  # [B, Hkv, nb]
    promote = (p_block * eta.unsqueeze(2) > cfg.v_tol).any(2)
    v_tok = _to_tokens(promote, bs, s)

    # Phase 2: mixed keys / values.
    kmix = torch.where(f_tok.unsqueeze(-1), host_k.to(torch.float32), khat)
    vmix = torch.where(v_tok.unsqueeze(-1), host_v.to(torch.float32), vhat)
    lmix = masked_logits(qg, kmix, m, scaling)
    p_mix = probs64(lmix)
    out = torch.matmul(p_mix.to(torch.float32), vmix)  # [B, Hkv, M, Dv]

    # Rung 4 monitor: paged compressed tokens must satisfy |s_exact − s̃| ≤ c + φ + eps_guard.
    seen = m & (f_tok & ~key_exact).unsqueeze(2)
    gap = torch.where(seen, (lmix - logits).abs().to(torch.float64), torch.zeros_like(c))
    rung4 = bool((gap > c + phi_t + cfg.eps_guard).any())

    # Rung 3: ranking consistency per cell, any cell of a query head sends that head to exact SDPA.
    l_exact = block_log_mass(lmix, bs)
    neg = torch.full_like(lm, float("-inf"))
    fb = f_blocks.unsqueeze(2).expand_as(lm)
    top_exact, arg_exact = torch.where(fb, l_exact, neg).max(-1)
    arg_served = torch.where(fb, lm, neg).argmax(-1)
    delta_b = block_max(torch.where(m, c, torch.zeros_like(c)), bs)
    boundary = (~fb & (lm + delta_b > top_exact.unsqueeze(-1))).any(-1)
    live = m.any(-1)
    cell_fail = live & ((arg_exact != arg_served) | boundary)
    head_exact = cell_fail.reshape(b, hkv, g, nq).any(-1).reshape(b, hq)
    if rung4:
        head_exact = torch.ones_like(head_exact)

    # Certified two-term bound for the served cells (kvcert.bounds.rc).
    tail = m & (~f_tok & ~key_exact).unsqueeze(2)
    alpha_hat = torch.where(tail, p_hat, torch.zeros_like(p_hat)).sum(-1)
    v_norm = vhat.to(torch.float64).norm(dim=-1) + store.v_res.view().to(torch.float64)
    v_max = _masked_max(v_norm.unsqueeze(2).expand_as(c), m)
    phi_max = _masked_max(phi_t, m)
    e_key, tv = key_term(alpha_hat, _masked_max(c, m), _masked_max(c, tail), phi_max, v_max)
    eta_eff = torch.where(promote, torch.zeros_like(eta), eta)
    e_val = value_term(block_sum(p_mix, bs), eta_eff.unsqueeze(2))
    slack = output_rounding_slack(s, dv, v_max)
    bound = e_key + e_val + slack

    exact_cell = head_exact.reshape(b, hkv, g, 1).expand(b, hkv, g, nq).reshape(b, hkv, g * nq)
    zero = torch.zeros_like(bound)
    exact_bound = 2.0 * v_max * torch.tanh(phi_max) + slack
    out_hf = out.reshape(b, hq, nq, dv).transpose(1, 2)
    if rung4:
        out_hf = exact(host_k, host_v, mask)
    elif bool(head_exact.any()):
        ex = exact(host_k, host_v, mask)
        out_hf = torch.where(head_exact.view(b, 1, hq, 1), ex.to(out_hf.dtype), out_hf)

    repaired = head_exact.reshape(b, hkv, g).any(-1)
    elt = host_k.element_size()
    partial = ((f_tok & ~key_exact).sum(-1) * d + (v_tok & ~store.v.exact.view()).sum(-1) * dv) * elt
    paged = torch.where(repaired, torch.full_like(partial, s * (d + dv) * elt), partial)
    if stats is not None:
        stats.reads += 1
        stats.cells += b * hq * nq
        stats.rung1 += int(doubled.sum())
        stats.rung2 += int(promote.sum())
        stats.rung3 += 0 if rung4 else int(head_exact.sum())
        stats.rung4 += int(rung4)
        stats.blocks_paged += int(f_blocks.sum())
        stats.last_key_paged, stats.last_value_promoted = f_tok, v_tok

    result = ReadResult(
        out=out_hf,
        cert_pre=ungroup_heads(cert_pre, hq, nq),
        raw=ungroup_heads(raw, hq, nq),
        cert=ungroup_heads(torch.where(exact_cell, zero, tv), hq, nq),
        tanh=ungroup_heads(tanh, hq, nq),
        cert_b=None,
        out_bound=ungroup_heads(torch.where(exact_cell, exact_bound, bound), hq, nq),
        key_term=ungroup_heads(torch.where(exact_cell, zero, e_key), hq, nq),
        value_term=ungroup_heads(torch.where(exact_cell, zero, e_val), hq, nq),
        repaired=repaired,
        blocks=f_blocks.sum(-1),
        values_promoted=promote.any(-1),
        bytes_paged=int(paged.sum()),
    )
    if cfg.validate:
        # reference in float64 (stand-in for real arithmetic, which is what the bounds are relative to)
        p_exact = probs64(masked_logits(qg.to(torch.float64), host_k.to(torch.float64), m, scaling))
        o_exact = torch.matmul(p_exact, host_v.to(torch.float64))
        err = (out_hf.to(torch.float64).transpose(1, 2).reshape(b, hkv, g * nq, dv) - o_exact).norm(dim=-1)
        # TV ≤ 1 is exact; the float64 sum of |p − p̃| can exceed it by rounding when p ⟂ p̃
        result.true_tv = ungroup_heads(true_tv(p_hat, p_exact).clamp(max=1.0), hq, nq)
        result.true_out_err = ungroup_heads(err, hq, nq)
    return result
