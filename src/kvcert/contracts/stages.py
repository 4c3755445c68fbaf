"""Local contracts of memory stages that are not bridges (spec §2.3, §3.2, §3.6)."""

from __future__ import annotations

import math

from kvcert.contracts.contract import Contract
from kvcert.contracts.metric import KV_ENTRY_L2, KV_ENTRY_REL, SELECTOR_DIST_TV, Metric
from kvcert.contracts.tiers import Tier


def store_witness(witness: float) -> Contract:
    """``U_store``: ``kv_entry:l2@write -> kv_entry:l2@write``, ``(1, W, 0)``, certified.

    ``W = Σ_b ‖Δ_b‖₂ >= ‖Δ‖₂`` is the band witness of the stored entry's residual (triangle inequality
    over bands), so the stored entry's error is at most the upstream error plus ``W``.
    """
    return _additive("store_witness", witness, KV_ENTRY_L2,
                     "band witness Σ_b‖Δ_b‖ >= ‖Δ‖ (triangle inequality) [band_witness]")


def relative_store_witness(witness_rel: float) -> Contract:
    """``U_store`` in the dimensionless form ``kv_entry:rel_witness@write`` (``W/‖x‖``), ``(1, W_rel, 0)``.

    Not composable with score or selector metrics without a bridge: it carries no absolute scale.
    """
    return _additive("relative_store_witness", witness_rel, KV_ENTRY_REL,
                     "band witness relative to ‖x‖ [band_witness]")


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


def _additive(name: str, witness: float, metric: Metric, reason: str) -> Contract:
    w = float(witness)
    if not math.isfinite(w) or w < 0.0:
        raise ValueError(f"witness must be finite and >= 0, got {witness!r}")
    return Contract(name=name, a=1.0, b=w, delta=0.0, tier=Tier.CERTIFIED, m_in=metric, m_out=metric,
                    reason=reason)
