"""Local contracts of memory stages that are not bridges (``docs/contracts.md#local-contracts``,
``docs/memory-meters.md``)."""

from __future__ import annotations

import math

from kvcert.contracts.contract import Contract
from kvcert.contracts.metric import (
    ATTN_LOGIT_LINF,
    KV_BLOCK_L2,
    KV_BLOCK_LINF,
    KV_ENTRY_L2,
    KV_ENTRY_REL,
    SELECTOR_DIST_TV,
    Metric,
)
from kvcert.contracts.tiers import Tier


def store_witness(witness: float) -> Contract:
    """``U_store``: ``kv_entry:l2@write -> kv_entry:l2@write``, ``(1, W, 0)``, certified.

    ``W = Σ_b ‖Δ_b‖₂ >= ‖Δ‖₂`` is the band witness of the stored entry's residual (triangle inequality
    over bands), so the stored entry's error is at most the upstream error plus ``W``.
    """
    return _additive(
        "store_witness", witness, KV_ENTRY_L2, "band witness Σ_b‖Δ_b‖ >= ‖Δ‖ (triangle inequality) [band_witness]"
    )


def relative_store_witness(witness_rel: float) -> Contract:
    """``U_store`` in the dimensionless form ``kv_entry:rel_witness@write`` (``W/‖x‖``), ``(1, W_rel, 0)``.

    Not composable with score or selector metrics without a bridge: it carries no absolute scale.
    """
    return _additive("relative_store_witness", witness_rel, KV_ENTRY_REL, "band witness relative to ‖x‖ [band_witness]")


def logit_rounding(slack: float) -> Contract:
    """Float32 evaluation of the logits: ``attn_logit:linf@consume`` to itself, ``(1, φ, 0)``, certified.

    The served and the exact logit are both computed as float32 dot products; Higham's bound gives
    ``|fl(sc·q·k) − sc·q·k| <= sc·γ_{D+1}·‖q‖·‖k‖`` for each, so the logit error the kernel actually sees is at
    most the exact-arithmetic error plus ``φ = max_t sc·γ_{D+1}·‖q‖·(2‖k̂_t‖ + W_t)`` (``‖k_t‖ <= ‖k̂_t‖ + W_t``).
    """
    return _additive(
        "logit_rounding",
        slack,
        ATTN_LOGIT_LINF,
        "Higham γ_{D+1} bound on both float32 logit dot products [read-path rounding slack]",
    )


def pool_l2(coefficient: float) -> Contract:
    """``U_pool``, ℓ2 form (Lemma P1): ``kv_block:l2@write -> kv_entry:l2@write``, ``(‖w‖₂, 0, 0)``, certified.

    A pooled entry ``c = Σ_j w_j x_j`` (``w >= 0``, ``Σ_j w_j = 1``) has error ``Δc = Σ_j w_j Δ_j``, so
    ``‖Δc‖₂ <= ‖w‖₂·(Σ_j ‖Δ_j‖₂²)^{1/2}`` by Cauchy–Schwarz. ``coefficient`` must bound ``‖w‖₂`` of every block the
    contract covers (a max over blocks); it lies in ``[1/√B, 1]``.
    """
    a = float(coefficient)
    if not math.isfinite(a) or not 0.0 < a <= 1.0 + 1e-12:
        raise ValueError(f"coefficient ‖w‖₂ must lie in (0, 1] for pooling weights w >= 0, Σw = 1, got {coefficient!r}")
    return Contract(
        name="pool_l2",
        a=a,
        b=0.0,
        delta=0.0,
        tier=Tier.CERTIFIED,
        m_in=KV_BLOCK_L2,
        m_out=KV_ENTRY_L2,
        reason="Cauchy-Schwarz ‖Σ_j w_j Δ_j‖ <= ‖w‖₂·(Σ_j ‖Δ_j‖²)^{1/2} [pool contract, ℓ2 form]",
    )


def pool_linf() -> Contract:
    """``U_pool``, ℓ∞ form (Lemma P1): ``kv_block:linf@write -> kv_entry:l2@write``, ``(1, 0, 0)``, certified.

    ``‖Σ_j w_j Δ_j‖₂ <= Σ_j w_j ‖Δ_j‖₂ <= max_j ‖Δ_j‖₂`` (convexity); no assumption beyond ``w >= 0``, ``Σw = 1``.
    """
    return Contract(
        name="pool_linf",
        a=1.0,
        b=0.0,
        delta=0.0,
        tier=Tier.CERTIFIED,
        m_in=KV_BLOCK_LINF,
        m_out=KV_ENTRY_L2,
        reason="convexity ‖Σ_j w_j Δ_j‖ <= max_j ‖Δ_j‖ [pool_linf]",
    )


def selection_s2(lost_mass: float, gained_mass: float) -> Contract:
    """Lemma S2: ``selector_dist:tv -> selector_dist:tv``, ``(a_S, b_S) = (1, ½(m_out + m_in))``, partial.

    ``TV(p, p̂) <= ½(Σ_{I∖Î} p + Σ_{Î∖I} p̂) + TV_common``: selection adds half the swapped mass and does
    not amplify. Masses are under the *indexer* softmax (selector-score mass), each in [0, 1].
    """
    for value, name in ((lost_mass, "lost_mass"), (gained_mass, "gained_mass")):
        if not math.isfinite(float(value)) or not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"{name} must be a probability mass in [0, 1], got {value!r}")
    return Contract(
        name="selection_s2",
        a=1.0,
        b=0.5 * (float(lost_mass) + float(gained_mass)),
        delta=0.0,
        tier=Tier.PARTIAL,
        m_in=SELECTOR_DIST_TV,
        m_out=SELECTOR_DIST_TV,
        reason="Lemma S2 lost/gained selector mass; measured on perturbed selections [topk_margin]",
    )


def _additive(name: str, offset: float, metric: Metric, reason: str) -> Contract:
    w = float(offset)
    if not math.isfinite(w) or w < 0.0:
        raise ValueError(f"{name}: offset b must be finite and >= 0, got {offset!r}")
    return Contract(name=name, a=1.0, b=w, delta=0.0, tier=Tier.CERTIFIED, m_in=metric, m_out=metric, reason=reason)
