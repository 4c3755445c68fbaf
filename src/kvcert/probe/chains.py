"""A per-layer composed contract chain as the probe reports it: value, tier, verdict, dominant stage."""

from __future__ import annotations

from dataclasses import dataclass

from kvcert.contracts import Chain, Evaluation, Tier, tv_verdict


@dataclass(frozen=True)
class LayerChain:
    """The composed chain of one (layer, path), its evaluation, tier, verdict and dominant stage.

    ``verdict`` is the TV saturation verdict for certified/partial TV chains, ``None`` otherwise (an empirical
    value is a reading and gets no verdict).
    """

    layer: int
    path: str
    chain: Chain
    e_in: float
    evaluation: Evaluation

    @property
    def tier(self) -> Tier:
        """Weakest tier along the chain."""
        return self.evaluation.tier

    @property
    def dominant_stage(self) -> str:
        """The source with the largest share of the chain value."""
        return self.evaluation.dominant_stage

    @property
    def verdict(self) -> str | None:
        """``non-vacuous`` / ``marginal`` / ``saturated`` for a TV bound; ``None`` for a reading."""
        ev = self.evaluation
        if ev.tier is Tier.EMPIRICAL or ev.m_out.norm != "tv":
            return None
        return tv_verdict(ev.value).value
