"""Evaluation: RULER tasks generated offline, long-text corpora, the generation/perplexity harness and
paired statistics (all numbers produced here are empirical-tier)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvcert.eval.corpora import CORPORA, load_corpus  # noqa: E402
from kvcert.eval.harness import (  # noqa: E402
    CacheFactory,
    PerplexityResult,
    Prediction,
    generate_answers,
    perplexity,
    prompt_ids,
)
from kvcert.eval.ruler import MIN_CONTEXT, TASK_NAMES, Sample, load_task, score, task_config  # noqa: E402
from kvcert.eval.stats import McNemar, PairedBootstrap, mcnemar, paired_bootstrap  # noqa: E402

__all__ = [
    "CORPORA",
    "MIN_CONTEXT",
    "TASK_NAMES",
    "CacheFactory",
    "McNemar",
    "PairedBootstrap",
    "PerplexityResult",
    "Prediction",
    "Sample",
    "generate_answers",
    "load_corpus",
    "load_task",
    "mcnemar",
    "paired_bootstrap",
    "perplexity",
    "prompt_ids",
    "score",
    "task_config",
]
