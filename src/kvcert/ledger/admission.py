"""The three admission rules of the certified ledger (``docs/ledger.md#admission-rules``).

1. **Empirical** objects never enter: every entry is kept exact (:func:`empirical`).
2. **Deterministic** certificates enter at ``δ = 0``: compress iff the machine-checked premise holds,
   e.g. ``witness ≤ threshold`` (:func:`deterministic`, :func:`observed`).
3. **Probabilistic** (stochastic rounding / dither): the pre-authorisation radius ``u_e`` is computed
   from the request's own telescoping share **before** any random bit is drawn; unauthorised entries are
   kept exact without drawing; authorised ones are drawn, the realised witness is audited in the same
   call and any ``W_e > u_e`` is restored to exact bytes (:class:`DitheredAdmission`).

A *decide* callable receives the per-entry shares ``δ`` (0 for deterministic rules) and owners and
returns a :class:`Decision`; the :class:`~kvcert.ledger.ledger.Ledger` calls it after invalidating the
slots.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvcert.bounds.eprocess import KAPPA, eprocess_log_factor
from kvcert.ledger.slots import SlotState


@dataclass(frozen=True)
class Decision:
    """Final per-entry slot states and e-process log-factors (NaN where no authorised draw happened)."""

    states: np.ndarray
    log_factors: np.ndarray


Decide = Callable[[np.ndarray, np.ndarray], Decision]


def _nan(n: int) -> np.ndarray:
    return np.full(n, np.nan, dtype=np.float64)


def empirical(shares: np.ndarray, owners: np.ndarray) -> Decision:
    """Rule 1: an empirical object never enters the certified ledger; every entry is kept exact."""
    n = shares.shape[0]
    return Decision(np.full(n, SlotState.KEPT_EXACT, dtype=np.uint8), _nan(n))


def observed(compressed: np.ndarray, log_factors: np.ndarray | None = None) -> Decide:
    """Rule 2 for a writer that already applied its certificate (e.g. the certified cache).

    ``log_factors`` (optional, per entry) are the writer's realised e-process log-factors, e.g. from the
    dither witness ``W`` and its moments ``(m, C)`` (:func:`kvcert.bounds.radii.dither_witness_moments`).
    """
    mask = np.asarray(compressed, dtype=bool)
    factors = _nan(mask.size) if log_factors is None else np.asarray(log_factors, dtype=np.float64)
    if factors.shape != (mask.size,):
        raise ValueError(f"log_factors has shape {factors.shape}, expected ({mask.size},)")

    def decide(shares: np.ndarray, owners: np.ndarray) -> Decision:
        if mask.shape != shares.shape:
            raise ValueError(f"compressed has shape {mask.shape}, expected {shares.shape}")
        states = np.where(mask, SlotState.COMPRESSED, SlotState.KEPT_EXACT).astype(np.uint8)
        return Decision(states, np.where(mask, factors, np.nan))

    return decide


def deterministic(witness: np.ndarray, threshold: float) -> Decide:
    """Rule 2: compress iff ``witness ≤ threshold`` (a runtime-decided premise, ``δ = 0``)."""
    if not (math.isfinite(threshold) and threshold >= 0):
        raise ValueError(f"threshold must be finite and >= 0, got {threshold}")
    w = np.asarray(witness, dtype=np.float64)
    # NaN witnesses fail the comparison and are kept exact (fail closed).
    return observed(w <= threshold)


def sr_prior_radius(
    x: np.ndarray, step: np.ndarray, n_event: np.ndarray, delta: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pre-draw radius of stochastic rounding ``x[N, D]`` onto the grid ``step[N, D]``
    (``docs/ledger.md#admission-rules``).

    With ``θ = frac(x/Δ)`` the rounding residual ``r_c ∈ {−θΔ, (1−θ)Δ}`` has ``E r_c = 0`` and
    ``E r_c² = θ(1−θ)Δ²``; the witness ``W = ‖r‖₂`` satisfies ``E W ≤ m := √(Σ θ(1−θ)Δ²)`` (Jensen) and
    has bounded differences ``Δ_c`` (triangle inequality), so McDiarmid gives
    ``P(W > m + √(C/2 · ln(n/δ))) ≤ δ/n`` with ``C = ΣΔ²``; a union over the ``n`` entries of the event
    costs ``δ``. Returns ``(u, m, C)`` per entry (float64). ``delta`` must be in (0, 1].
    """
    x64 = np.asarray(x, dtype=np.float64)
    d64 = np.broadcast_to(np.asarray(step, dtype=np.float64), x64.shape)
    if not (np.all(np.isfinite(x64)) and np.all(np.isfinite(d64)) and np.all(d64 > 0)):
        raise ValueError("x must be finite and step finite and > 0")
    dl = np.asarray(delta, dtype=np.float64)
    if np.any(dl <= 0) or np.any(dl > 1):
        raise ValueError("delta must lie in (0, 1]")
    theta = x64 / d64 - np.floor(x64 / d64)
    m = np.sqrt(np.sum(theta * (1 - theta) * d64 * d64, axis=-1))
    c = np.sum(d64 * d64, axis=-1)
    tail = np.sqrt(c / 2.0 * np.log(np.asarray(n_event, dtype=np.float64) / dl))
    return m + tail, m, c


def stochastic_round(x: np.ndarray, step: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Round ``x`` to a multiple of ``step``, up w.p. ``θ = frac(x/Δ)`` (conditional mean exactly ``x``)."""
    lo = np.floor(x / step)
    theta = x / step - lo
    return (lo + (rng.random(x.shape) < theta)) * step


@dataclass
class DitheredAdmission:
    """Rule 3 for entries ``x[N, D]`` on grid ``step`` with authorisation threshold ``threshold``.

    ``draw(x, step, rng)`` realises the stored values (default: :func:`stochastic_round`); after the call
    ``stored`` holds what must be written (exact bytes wherever the entry is not ``compressed``).
    """

    x: np.ndarray
    step: np.ndarray
    threshold: float
    rng: np.random.Generator
    draw: Callable[[np.ndarray, np.ndarray, np.random.Generator], np.ndarray] = stochastic_round
    kappa: float = KAPPA
    stored: np.ndarray | None = field(default=None, init=False)
    radius: np.ndarray | None = field(default=None, init=False)

    def __call__(self, shares: np.ndarray, owners: np.ndarray) -> Decision:
        """Authorise before drawing, draw the authorised entries, audit and restore; return the decision."""
        x = np.asarray(self.x, dtype=np.float64)
        n = x.shape[0]
        if shares.shape != (n,):
            raise ValueError(f"x has {n} entries but {shares.shape[0]} shares were given")
        step = np.broadcast_to(np.asarray(self.step, dtype=np.float64), x.shape)
        _, inverse, counts = np.unique(owners, return_inverse=True, return_counts=True)
        usable = shares > 0
        u = np.full(n, np.inf)
        m = np.zeros(n)
        c = np.ones(n)
        if usable.any():
            u[usable], m[usable], c[usable] = sr_prior_radius(
                x[usable], step[usable], counts[inverse][usable], shares[usable]
            )
        self.radius = u
        authorised = usable & (u <= self.threshold)  # decided before any random bit is drawn
        stored = x.copy()
        states = np.full(n, SlotState.KEPT_EXACT, dtype=np.uint8)
        factors = _nan(n)
        if authorised.any():
            drawn = self.draw(x[authorised], step[authorised], self.rng)
            w = np.linalg.norm(drawn - x[authorised], axis=-1)  # audit inside the same call
            ok = w <= u[authorised]
            idx = np.flatnonzero(authorised)
            stored[idx[ok]] = drawn[ok]
            states[idx] = np.where(ok, SlotState.COMPRESSED, SlotState.RESTORED_EXACT)
            factors[idx] = eprocess_log_factor(w, m[authorised], c[authorised], self.kappa)
        self.stored = stored
        return Decision(states, factors)
