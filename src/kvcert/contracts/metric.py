"""Error metrics as types: ``object:norm@site``.

A metric names *what* is perturbed (the object, e.g. ``kv_entry``), *how* the perturbation is
measured (the norm, e.g. ``l2`` or ``tv``) and *where* it is observed (the site: ``write``,
``consume`` or ``offline``). Two metrics are equal only if all three parts are equal; a contract
chain composes only across equal metrics (``docs/contracts.md#metrics``), so an error measured at the write site can
never be silently reused as a consume-site error, and a relative witness can never be added to a
selector TV.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

SITES: frozenset[str] = frozenset({"write", "consume", "offline"})
"""Observation sites. ``write``: at write/readback; ``consume``: what the kernel is about to read;
``offline``: computed after the fact (e.g. against a stored reference)."""

NORM_RANGES: dict[str, tuple[float, float]] = {
    "tv": (0.0, 1.0),  # total-variation distance between two distributions
    "prob": (0.0, 1.0),  # a probability
    "frac": (0.0, 1.0),  # a fraction of a population (coverage, near-one tail, ...)
    "mass": (0.0, 1.0),  # probability mass of a subset
    "l1": (0.0, math.inf),
    "l2": (0.0, math.inf),
    "linf": (0.0, math.inf),
    "rel_witness": (0.0, math.inf),  # band witness divided by ||x||
    "ratio": (0.0, math.inf),  # ratio of two non-negative quantities
    "count": (0.0, math.inf),
    "steps": (0.0, math.inf),  # a duration in decode steps (e.g. a half-life)
    "log": (-math.inf, math.inf),  # a logarithm (e.g. sum_t log a_t); any finite real
}
"""Every norm kvcert knows, with the physical range of a value measured in it (closed intervals;
an infinite endpoint means unbounded on that side, values themselves must still be finite)."""

_IDENT = re.compile(r"[a-z][a-z0-9_]*")
_TEXT = re.compile(r"([a-z][a-z0-9_]*):([a-z][a-z0-9_]*)@([a-z][a-z0-9_]*)")


@dataclass(frozen=True)
class Metric:
    """An error metric ``obj:norm@site``; equality and hashing use all three parts."""

    obj: str
    norm: str
    site: str

    def __post_init__(self) -> None:
        if not isinstance(self.obj, str) or not _IDENT.fullmatch(self.obj):
            raise ValueError(f"obj must be a lower-case identifier, got {self.obj!r}")
        if self.norm not in NORM_RANGES:
            raise ValueError(f"norm must be one of {sorted(NORM_RANGES)}, got {self.norm!r}")
        if self.site not in SITES:
            raise ValueError(f"site must be one of {sorted(SITES)}, got {self.site!r}")

    @classmethod
    def parse(cls, text: str) -> Metric:
        """Parse ``"obj:norm@site"`` (e.g. ``"kv_entry:l2@write"``); ``ValueError`` if malformed."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str like 'kv_entry:l2@write', got {type(text).__name__}")
        match = _TEXT.fullmatch(text)
        if match is None:
            raise ValueError(f"text must have the form 'object:norm@site', got {text!r}")
        return cls(*match.groups())

    @classmethod
    def coerce(cls, value: Metric | str) -> Metric:
        """Return ``value`` if it is a Metric, else parse it."""
        return value if isinstance(value, Metric) else cls.parse(value)

    @property
    def physical_range(self) -> tuple[float, float]:
        """Closed interval that a finite value measured in this metric's norm must lie in."""
        return NORM_RANGES[self.norm]

    def __str__(self) -> str:
        return f"{self.obj}:{self.norm}@{self.site}"


KV_ENTRY_L2 = Metric("kv_entry", "l2", "write")
KV_ENTRY_REL = Metric("kv_entry", "rel_witness", "write")
ATTN_LOGIT_LINF = Metric("attn_logit", "linf", "consume")
ATTN_DIST_TV = Metric("attn_dist", "tv", "consume")
SELECTOR_SCORE_LINF = Metric("selector_score", "linf", "consume")
SELECTOR_DIST_TV = Metric("selector_dist", "tv", "consume")
ATTN_OUT_L2 = Metric("attn_out", "l2", "consume")
KV_BLOCK_L2 = Metric("kv_block", "l2", "write")
"""Token errors of one pooling block aggregated in ℓ2: ``(Σ_j ‖Δ_j‖₂²)^{1/2}`` (input of the ℓ2 pooling form)."""
KV_BLOCK_LINF = Metric("kv_block", "linf", "write")
"""Token errors of one pooling block aggregated by their max: ``max_j ‖Δ_j‖₂`` (input of the ℓ∞ pooling form)."""
