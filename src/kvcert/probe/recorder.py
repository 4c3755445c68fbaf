"""Collects one probe run's readings, self-check counts and chains, and the per-cell soundness checks they share.

Every reading takes its tier from the tier registry (an unregistered name is a hard error); ``bound`` marks a
sound upper bound on an error, never an empirical or offline (reference-dependent) value. The per-cell checks
compare a served read against the exact reference and count what must never happen (``witness_violations``).
"""

from __future__ import annotations

import math

import torch

from kvcert.bounds.softmax_tv import true_tv, tv_meter
from kvcert.contracts import Chain, Metric, Tier
from kvcert.contracts.registry import REGISTRY
from kvcert.probe.chains import LayerChain
from kvcert.probe.snapshot import ReadingRecord

WITNESS_RTOL = 1e-5
RADIUS_ATOL = 1e-9
Q_NORM = Metric("query", "l2", "consume")
TRUE_TV = Metric("attn_dist", "tv", "offline")


class Recorder:
    """Readings (tier from the registry), self-check counts, trigger count and chains of one probe run."""

    def __init__(self) -> None:
        self.readings: list[ReadingRecord] = []
        self.chains: list[LayerChain] = []
        self.counts = {"witness_violations": 0, "certified_flips": 0, "pooling_floor_violations": 0}
        self.triggers = 0

    def add(
        self,
        layer: int,
        path: str,
        metric: Metric,
        name: str,
        value: float,
        suffix: str = "",
        bound: bool = False,
        unclipped: bool = False,
    ) -> None:
        """Record ``value`` with the registered tier of ``name``; ``bound`` marks a sound upper bound on an
        error (never for empirical or offline values), everything else is a reading."""
        tier = REGISTRY.check_emittable(name).tier
        kind = "bound" if bound and tier is not Tier.EMPIRICAL and metric.site != "offline" else "reading"
        self.readings.append(
            ReadingRecord(layer, path, metric, float(value), tier, kind, name + suffix, unclipped and kind == "bound")
        )

    def chain(self, layer: int, path: str, chain: Chain, e_in: float, name: str) -> None:
        """Evaluate ``chain`` at ``e_in`` and record it (see :meth:`add_chain`)."""
        self.add_chain(LayerChain(layer, path, chain, e_in, chain.evaluate(e_in)), name)

    def add_chain(self, lc: LayerChain, name: str) -> None:
        """Record an evaluated chain and its value under ``name``, whose registered tier must be the chain's."""
        ev = lc.evaluation
        registered = REGISTRY.check_emittable(name).tier
        if ev.tier is not registered:
            raise ValueError(f"chain {name!r} evaluated at tier {ev.tier.value}, registered {registered.value}")
        self.chains.append(lc)
        value, unclipped = ev.value, ev.m_out.norm == "tv"
        if unclipped and (ev.tier is Tier.EMPIRICAL or not math.isfinite(value)):
            value, unclipped = min(value, 1.0), False  # TV <= 1 always: readings and overflows are clipped
        self.add(lc.layer, lc.path, ev.m_out, name, value, bound=True, unclipped=unclipped)

    def count_witness(self, band_norms: torch.Tensor, residual_norms: torch.Tensor) -> None:
        """Self-check: count entries whose band witness ``Σ_b ρ_b`` is below their true residual norm."""
        w = band_norms.sum(-1)
        self.counts["witness_violations"] += int((w < residual_norms * (1 - WITNESS_RTOL)).sum())


def served_softmax(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """``softmax`` over the visible entries (0 elsewhere)."""
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)


def cell_checks(
    rec: Recorder, exact: torch.Tensor, served: torch.Tensor, radius: torch.Tensor, visible: torch.Tensor
) -> tuple[float, float]:
    """Per-cell Tier-A soundness of a served read against the exact scores (``[..., T, S]``, float64).

    Counts cells with ``|s̃ − s| > c`` and cells whose true TV exceeds their certificate ``tv_meter(p̃, c)``
    into ``witness_violations``; returns ``(max certificate, max true TV)``.
    """
    err = (served - exact).abs()
    rec.counts["witness_violations"] += int((~(err <= radius + RADIUS_ATOL) & visible).sum())  # NaN counts
    p_served = served_softmax(served, visible)
    cert = tv_meter(p_served, torch.where(visible, radius, torch.zeros_like(radius)))
    tv = true_tv(served_softmax(exact, visible), p_served)
    rec.counts["witness_violations"] += int((~(tv <= cert + RADIUS_ATOL)).sum())
    return float(cert.max()), float(tv.max())
