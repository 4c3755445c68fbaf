"""Typed contract calculus (pure Python, no torch).

Metrics ``object:norm@site``, tiers, local contracts ``e_out <= a·e_in + b`` (prob. ``delta``),
metric-checked chains, bridges, the tier registry of every emitted metric, and bound/reading
verdicts. See ``docs/contracts.md``.
"""

from kvcert.contracts import bridges, stages
from kvcert.contracts.chain import INPUT, Chain, Composed, Evaluation, MetricMismatch, StageResult
from kvcert.contracts.contract import Contract, Premise, PremiseViolation
from kvcert.contracts.metric import (
    ATTN_DIST_TV,
    ATTN_LOGIT_LINF,
    ATTN_OUT_L2,
    KV_BLOCK_L2,
    KV_BLOCK_LINF,
    KV_ENTRY_L2,
    KV_ENTRY_REL,
    NORM_RANGES,
    SELECTOR_DIST_TV,
    SELECTOR_SCORE_LINF,
    SITES,
    Metric,
)
from kvcert.contracts.registry import (
    REGISTRY,
    Emission,
    ReferenceRequired,
    Registration,
    TierRegistry,
    UnregisteredMetric,
    check_bound_input,
    check_emittable,
    emit,
    register,
)
from kvcert.contracts.tiers import Tier, weakest
from kvcert.contracts.verdict import (
    Bound,
    Reading,
    Verdict,
    as_bound,
    as_reading,
    format_bound,
    tv_verdict,
    tv_verdict_of,
)

__all__ = [
    "ATTN_DIST_TV",
    "ATTN_LOGIT_LINF",
    "ATTN_OUT_L2",
    "INPUT",
    "KV_BLOCK_L2",
    "KV_BLOCK_LINF",
    "KV_ENTRY_L2",
    "KV_ENTRY_REL",
    "NORM_RANGES",
    "REGISTRY",
    "SELECTOR_DIST_TV",
    "SELECTOR_SCORE_LINF",
    "SITES",
    "Bound",
    "Chain",
    "Composed",
    "Contract",
    "Emission",
    "Evaluation",
    "Metric",
    "MetricMismatch",
    "Premise",
    "PremiseViolation",
    "Reading",
    "ReferenceRequired",
    "Registration",
    "StageResult",
    "Tier",
    "TierRegistry",
    "UnregisteredMetric",
    "Verdict",
    "as_bound",
    "as_reading",
    "bridges",
    "check_bound_input",
    "check_emittable",
    "emit",
    "format_bound",
    "register",
    "stages",
    "tv_verdict",
    "tv_verdict_of",
    "weakest",
]
