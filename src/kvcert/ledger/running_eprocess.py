"""Running e-process (drift sentinel): ``log M_t`` accumulated per write batch (``docs/ledger.md#drift-sentinel``).

One instance per request account and one global instance that is never reset. Factors come from
:func:`kvcert.bounds.eprocess.eprocess_log_factor`; the factors of one write batch are multiplied in at
once (anytime validity at batch granularity) and the **post-update** maximum is reported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvcert.bounds.eprocess import alarm_threshold


@dataclass
class EProcess:
    """``log M`` (starts at 0), its post-update maximum, factor count and the sticky ``crossed`` flag."""

    delta_e: float = 0.01
    log_m: float = 0.0
    log_m_max: float = float("-inf")
    n_factors: int = 0
    crossed: bool = False

    def update(self, log_factors: np.ndarray) -> None:
        """Multiply in one batch of factors; alarm (sticky) when ``log M ≥ ln(1/δ_e)``."""
        if log_factors.size and not np.all(np.isfinite(log_factors)):
            raise ValueError("log_factors must be finite")
        self.add(float(np.sum(log_factors, dtype=np.float64)), int(log_factors.size))

    def add(self, log_sum: float, n: int) -> None:
        """Multiply in one batch of ``n`` factors given by the sum of their logs (nothing if ``n == 0``)."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n == 0:
            return
        if not math.isfinite(log_sum):
            raise ValueError("log_factors must be finite")
        self.log_m += log_sum
        self.n_factors += n
        self.log_m_max = max(self.log_m_max, self.log_m)
        self.crossed = self.crossed or self.log_m >= alarm_threshold(self.delta_e)

    def to_dict(self) -> dict[str, float | int | bool | None]:
        """JSON form; an empty process reports ``log_m_max = None`` (no evidence yet)."""
        return {
            "log_m": self.log_m,
            "log_m_max": None if self.n_factors == 0 else self.log_m_max,
            "n_factors": self.n_factors,
            "crossed": self.crossed,
            "delta_e": self.delta_e,
        }
