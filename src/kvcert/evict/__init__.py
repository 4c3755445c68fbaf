"""Eviction policies with observability (``docs/eviction.md``): StreamingLLM, H2O, SnapKV, RMM, Belady oracle.

Policies share one tensor-level scorer interface (``EvictionPolicy`` in ``base.py``): decode budget mode
(``observe`` / ``set_kappa`` / ``select`` / ``on_evict`` / ``reset``) and prefill compression
(``prefill_keep``). ``mass`` makes eviction observable (TV = evicted mass), ``trace`` records and replays
attention traces, ``synthetic`` generates the delayed-reuse task, ``run_trace`` records a cache run's exact
trace and compares its kept sets with Belady's. See ``docs/eviction.md``.
"""

from kvcert.evict.base import (
    EvictionPolicy,
    GqaAggregation,
    aggregate_gqa,
    causal_attention,
    keep_top,
    prefill_kept_count,
)
from kvcert.evict.belady import Belady, served_mass_ceiling
from kvcert.evict.h2o import H2O
from kvcert.evict.kappa import KAPPA_KINDS, KappaKind, compute_kappa, token_probability
from kvcert.evict.mass import (
    EvictionReading,
    evicted_mass,
    selection_tv,
    served_attention,
    serving_reading,
    validate_reading,
)
from kvcert.evict.prefill_attention import EVERY_ROW, PrefillAttention, PrefillReads, observed_attention
from kvcert.evict.rmm import RMM
from kvcert.evict.run_trace import RunTrace
from kvcert.evict.snapkv import SnapKV
from kvcert.evict.streaming import StreamingLLM
from kvcert.evict.synthetic import delayed_reuse_trace
from kvcert.evict.trace import (
    AttentionTrace,
    ReplayResult,
    gap_closed,
    overlap,
    replay,
    trace_from_attentions,
)

__all__ = [
    "KAPPA_KINDS",
    "RMM",
    "AttentionTrace",
    "Belady",
    "EvictionPolicy",
    "EvictionReading",
    "GqaAggregation",
    "H2O",
    "KappaKind",
    "ReplayResult",
    "RunTrace",
    "SnapKV",
    "StreamingLLM",
    "aggregate_gqa",
    "causal_attention",
    "compute_kappa",
    "delayed_reuse_trace",
    "evicted_mass",
    "gap_closed",
    "keep_top",
    "observed_attention",
    "EVERY_ROW",
    "PrefillAttention",
    "PrefillReads",
    "overlap",
    "prefill_kept_count",
    "replay",
    "selection_tv",
    "served_attention",
    "served_mass_ceiling",
    "serving_reading",
    "token_probability",
    "trace_from_attentions",
    "validate_reading",
]
