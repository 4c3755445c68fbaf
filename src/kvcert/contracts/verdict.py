"""Bounds vs diagnostic readings, and saturation verdicts for TV-valued bounds (``docs/contracts.md#verdicts``).

A :class:`Bound` is a sound upper bound (tier certified or partial); only a Bound can be formatted
as a bound or given a verdict. A :class:`Reading` is a value without bound semantics: anything
empirical, and any value computed from *mean* coefficients (a "diagnostic reading"). The two are
distinct types; :func:`format_bound` and :func:`tv_verdict_of` refuse a Reading with ``TypeError``,
and a Reading's text never says "bound" or gives a verdict.

Verdicts for TV-denominated bounds (trivial value 1): ``< 0.5`` non-vacuous, ``[0.5, 1)`` marginal,
``>= 1`` saturated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from kvcert.contracts.chain import Evaluation
from kvcert.contracts.metric import Metric
from kvcert.contracts.tiers import Tier

NON_VACUOUS_BELOW = 0.5
SATURATED_AT = 1.0


class Verdict(Enum):
    """Saturation verdict of a TV-valued bound."""

    NON_VACUOUS = "non-vacuous"
    MARGINAL = "marginal"
    SATURATED = "saturated"


def tv_verdict(value: float) -> Verdict:
    """``< 0.5`` non-vacuous, ``[0.5, 1)`` marginal, ``>= 1`` (incl. ``inf``) saturated; ``ValueError`` on
    NaN or negative values."""
    value = float(value)
    if math.isnan(value) or value < 0.0:
        raise ValueError(f"value must be a TV bound >= 0, got {value!r}")
    if value < NON_VACUOUS_BELOW:
        return Verdict.NON_VACUOUS
    if value < SATURATED_AT:
        return Verdict.MARGINAL
    return Verdict.SATURATED


@dataclass(frozen=True)
class Bound:
    """A sound upper bound ``value`` on an error in ``metric``, failing with probability <= ``delta``.

    ``tier`` must be certified or partial: an empirical number is never a bound (``ValueError``).
    ``value`` may be ``inf`` (unclipped, saturated) but not NaN or negative.
    """

    value: float
    metric: Metric
    tier: Tier
    delta: float = 0.0

    def __post_init__(self) -> None:
        value = float(self.value)
        if math.isnan(value) or value < 0.0:
            raise ValueError(f"value must be >= 0 (inf allowed), got {self.value!r}")
        tier = Tier.parse(self.tier)
        if tier is Tier.EMPIRICAL:
            raise ValueError("tier must be certified or partial: an empirical value is a Reading")
        if not 0.0 <= float(self.delta) <= 1.0:
            raise ValueError(f"delta must be in [0, 1], got {self.delta!r}")
        object.__setattr__(self, "value", value)
        object.__setattr__(self, "metric", Metric.coerce(self.metric))
        object.__setattr__(self, "tier", tier)
        object.__setattr__(self, "delta", float(self.delta))

    @property
    def verdict(self) -> Verdict:
        """Saturation verdict; ``ValueError`` unless the metric is TV-valued."""
        if self.metric.norm != "tv":
            raise ValueError(f"verdicts apply to TV-valued bounds only, metric is {self.metric}")
        return tv_verdict(self.value)

    def __str__(self) -> str:
        verdict = f", {self.verdict.value}" if self.metric.norm == "tv" else ""
        return f"bound {self.value:.6g} on {self.metric} [{self.tier.value}, delta={self.delta:.3g}{verdict}]"


@dataclass(frozen=True)
class Reading:
    """A value with no bound semantics (empirical, or computed from mean coefficients)."""

    value: float
    metric: Metric
    tier: Tier
    note: str

    def __post_init__(self) -> None:
        if not isinstance(self.note, str) or not self.note.strip():
            raise ValueError("note must say what the reading is (e.g. 'mean query-norm coefficient')")
        object.__setattr__(self, "value", float(self.value))
        object.__setattr__(self, "metric", Metric.coerce(self.metric))
        object.__setattr__(self, "tier", Tier.parse(self.tier))

    def __str__(self) -> str:
        return f"diagnostic reading {self.value:.6g} in {self.metric} [{self.tier.value}; {self.note}]"


def format_bound(bound: Bound) -> str:
    """Text of a bound; ``TypeError`` for anything that is not a :class:`Bound` (e.g. a Reading)."""
    if not isinstance(bound, Bound):
        raise TypeError(
            f"only a Bound can be printed as a bound, got {type(bound).__name__}"
            + (": diagnostic readings have no bound semantics" if isinstance(bound, Reading) else "")
        )
    return str(bound)


def tv_verdict_of(bound: Bound) -> Verdict:
    """Verdict of a TV-valued :class:`Bound`; ``TypeError`` for a Reading or anything else."""
    if not isinstance(bound, Bound):
        raise TypeError(f"verdicts apply to Bounds only, got {type(bound).__name__}")
    return bound.verdict


def as_bound(evaluation: Evaluation) -> Bound:
    """The chain evaluation as a Bound; ``ValueError`` if the chain's tier is empirical.

    The caller asserts that every coefficient in the chain is a supremum over the reads covered
    (not a mean); otherwise use :func:`as_reading`.
    """
    return Bound(evaluation.value, evaluation.m_out, evaluation.tier, evaluation.delta)


def as_reading(evaluation: Evaluation, note: str) -> Reading:
    """The chain evaluation as a diagnostic Reading (e.g. computed from mean coefficients)."""
    return Reading(evaluation.value, evaluation.m_out, evaluation.tier, note)
