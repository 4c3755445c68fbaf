"""Paired statistics for comparing two schemes scored on the same samples.

Both functions take per-sample scores of a *reference* run (e.g. the uncompressed cache) and a
*candidate* run on the same samples, in the same order. Numbers produced here are empirical-tier
statistics: they describe sampling uncertainty over the evaluated samples, not a certified bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_RESAMPLES = 10_000


@dataclass(frozen=True)
class PairedBootstrap:
    """Percentile bootstrap CI for ``mean(candidate) - mean(reference)`` over paired samples."""

    diff: float
    low: float
    high: float
    confidence: float
    resamples: int
    seed: int
    n: int
    tier: str = "empirical"


@dataclass(frozen=True)
class McNemar:
    """Exact McNemar test on paired binary outcomes.

    ``ref_only``: samples the reference got right and the candidate wrong; ``cand_only``: the reverse.
    ``p_exact`` is the two-sided exact binomial p-value on the discordant pairs,
    ``min(1, 2 * P[X <= min(ref_only, cand_only)])`` with ``X ~ Binomial(ref_only + cand_only, 1/2)``;
    ``p_mid`` is the mid-p variant ``p_exact - P[X = min(...)]`` (twice the one-sided mid-p), capped at 1.
    """

    ref_only: int
    cand_only: int
    p_exact: float
    p_mid: float
    tier: str = "empirical"


def _paired_arrays(reference: Sequence[float], candidate: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    ref = np.asarray(reference, dtype=np.float64)
    cand = np.asarray(candidate, dtype=np.float64)
    if ref.ndim != 1 or cand.ndim != 1:
        raise ValueError("reference and candidate must be 1-D sequences of per-sample scores")
    if ref.shape != cand.shape:
        raise ValueError(f"reference and candidate must be paired: lengths {ref.size} != {cand.size}")
    if ref.size == 0:
        raise ValueError("reference and candidate must not be empty")
    if not (np.isfinite(ref).all() and np.isfinite(cand).all()):
        raise ValueError("reference and candidate must be finite")
    return ref, cand


def paired_bootstrap(
    reference: Sequence[float],
    candidate: Sequence[float],
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    confidence: float = 0.95,
) -> PairedBootstrap:
    """Paired percentile bootstrap of the mean score difference ``candidate - reference``.

    Sample indices are drawn with replacement (the same indices for both runs, which keeps the pairing),
    ``resamples`` times from ``numpy.random.default_rng(seed)``; the CI endpoints are the
    ``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` inverted-CDF quantiles of the resampled
    differences, so each endpoint is an attained resampled value. Same inputs and seed -> same CI.
    """
    ref, cand = _paired_arrays(reference, candidate)
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    delta = cand - ref
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, delta.size, size=(resamples, delta.size))
    means = delta[idx].mean(axis=1)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha], method="inverted_cdf")
    return PairedBootstrap(
        diff=float(delta.mean()),
        low=float(low),
        high=float(high),
        confidence=confidence,
        resamples=resamples,
        seed=seed,
        n=int(delta.size),
    )


def mcnemar(reference: Sequence[bool | int], candidate: Sequence[bool | int]) -> McNemar:
    """Exact (binomial) McNemar test for paired correct/incorrect outcomes (values must be 0/1)."""
    ref, cand = _paired_arrays(reference, candidate)
    for arg, arr in (("reference", ref), ("candidate", cand)):
        if not np.isin(arr, (0.0, 1.0)).all():
            raise ValueError(f"{arg} must hold binary outcomes (0/1 or bool)")
    ref_only = int(((ref == 1) & (cand == 0)).sum())
    cand_only = int(((ref == 0) & (cand == 1)).sum())
    n = ref_only + cand_only
    k = min(ref_only, cand_only)
    total = 2**n
    tail = sum(math.comb(n, i) for i in range(k + 1))
    p_exact = min(1.0, 2 * tail / total)
    p_mid = min(1.0, (2 * tail - math.comb(n, k)) / total)
    return McNemar(ref_only=ref_only, cand_only=cand_only, p_exact=p_exact, p_mid=p_mid)
