"""Recurrent-state gate contraction (``docs/memory-meters.md#recurrent``): an **empirical** meter.

A gated recurrence ``S_t = a_t ⊙ S_{t−1} + B_t`` propagates a state error per channel as
``e_t ≤ a_t e_{t−1} + b_t`` (R2), which unrolls (discrete Grönwall, R1) to

    e_T ≤ (Π_{t≤T} a_t)·e_0 + Σ_s (Π_{s<i≤T} a_i)·b_s.

The long-run contraction criterion is ``Σ_t log a_t < 0`` **per channel** (a product), not ``ā < 1``; by
Jensen
``E[log a] ≤ log ā``, so the mean form understates contraction. Half-lives: ``ln 2 / (−E_t[log a])`` (log-sum)
vs ``ln 2 / (−ln ā)`` (mean). No certificate is claimed: the ``b_t`` are unknown at run time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

HIST_EDGES: tuple[float, ...] = (0.0, 0.5, 0.9, 0.99, 0.999, 1.01)
NEAR_ONE = 0.999
_LOG_FLOOR = 1e-12


def _check_factors(a: torch.Tensor) -> torch.Tensor:
    if a.dim() != 2 or a.shape[0] < 1:
        raise ValueError(f"a must have shape [T, C] with T >= 1, got {tuple(a.shape)}")
    x = a.to(torch.float64)
    if not torch.isfinite(x).all():
        raise ValueError("a contains non-finite entries")
    if ((x < 0) | (x > 1)).any():
        raise ValueError(f"forget-gate factors a must lie in [0, 1], got range [{x.min():.4g}, {x.max():.4g}]")
    return x


def half_life(mean_log: torch.Tensor) -> torch.Tensor:
    """``ln 2 / (−mean_log)`` steps; ``+inf`` where ``mean_log ≥ 0`` (no contraction)."""
    m = mean_log.to(torch.float64)
    return torch.where(m < 0, math.log(2.0) / (-m).clamp_min(1e-300), torch.full_like(m, float("inf")))


@dataclass(frozen=True)
class GateContraction:
    """Per-channel contraction profile of forget-gate factors ``a[T, C]`` (all float64 ``[C]`` unless noted).

    ``sum_log_a = Σ_t log a_t`` (the criterion; ``< 0`` contracts), ``mean_log_a = sum_log_a / T``,
    ``log_mean_a = log ā``, ``jensen_gap = log ā − E[log a] ≥ 0``, half-lives both ways, ``near_one`` the
    fraction of steps with ``a ≥ 0.999``, ``hist[C, 5]`` fractions over ``HIST_EDGES``.
    """

    steps: int
    a_mean: torch.Tensor
    a_min: torch.Tensor
    a_max: torch.Tensor
    sum_log_a: torch.Tensor
    mean_log_a: torch.Tensor
    log_mean_a: torch.Tensor
    jensen_gap: torch.Tensor
    half_life_logsum: torch.Tensor
    half_life_mean: torch.Tensor
    near_one: torch.Tensor
    hist: torch.Tensor

    @property
    def contracting(self) -> torch.Tensor:
        """``[C]`` boolean: ``Σ_t log a_t < 0`` (per-channel long-run contraction, empirical)."""
        return self.sum_log_a < 0


def gate_contraction(a: torch.Tensor) -> GateContraction:
    """Profile forget-gate factors ``a[T, C]`` (time × channel, values in ``[0, 1]``) per channel.

    ``log a`` is floored at ``log(1e−12)`` so that a hard reset (``a = 0``) stays finite.
    """
    x = _check_factors(a)
    log_a = x.clamp_min(_LOG_FLOOR).log()
    t = x.shape[0]
    sum_log = log_a.sum(0)
    mean_log = sum_log / t
    a_mean = x.mean(0)
    log_mean = a_mean.clamp_min(_LOG_FLOOR).log()
    edges = torch.tensor(HIST_EDGES, dtype=torch.float64)
    bucket = torch.bucketize(x, edges[1:-1], right=True)
    hist = torch.nn.functional.one_hot(bucket, len(HIST_EDGES) - 1).to(torch.float64).mean(0)
    return GateContraction(
        steps=t,
        a_mean=a_mean,
        a_min=x.min(0).values,
        a_max=x.max(0).values,
        sum_log_a=sum_log,
        mean_log_a=mean_log,
        log_mean_a=log_mean,
        jensen_gap=log_mean - mean_log,
        half_life_logsum=half_life(mean_log),
        half_life_mean=half_life(log_mean),
        near_one=(x >= NEAR_ONE).to(torch.float64).mean(0),
        hist=hist,
    )


def unrolled_state_error(a: torch.Tensor, b: torch.Tensor, e0: torch.Tensor | float) -> torch.Tensor:
    """R1: ``e_T ≤ (Π_t a_t)·e_0 + Σ_s (Π_{i>s} a_i)·b_s`` per channel; ``a, b [T, C]`` -> ``[C]`` (float64).

    Equals the recursion ``e_t = a_t e_{t−1} + b_t`` run to ``T`` (the tightest bound R2 implies).
    """
    x = _check_factors(a)
    bb = b.to(torch.float64)
    if bb.shape != x.shape or not torch.isfinite(bb).all() or (bb < 0).any():
        raise ValueError(f"b must be finite, non-negative and shaped like a {tuple(x.shape)}")
    e = torch.as_tensor(e0, dtype=torch.float64).expand(x.shape[1:])
    if not torch.isfinite(e).all() or (e < 0).any():
        raise ValueError("e0 must be finite and non-negative")
    # suffix products Π_{i>s} a_i, computed as a reversed cumulative product (exact for zeros, unlike
    # exp-cumsum-log)
    tail = torch.ones_like(x)
    if x.shape[0] > 1:
        tail[:-1] = torch.flip(torch.cumprod(torch.flip(x[1:], (0,)), 0), (0,))
    return x.prod(0) * e + (tail * bb).sum(0)
