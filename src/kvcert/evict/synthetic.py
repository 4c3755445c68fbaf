"""A controlled task where reuse is endogenous and separated in time (delayed reuse).

Items arrive one per step. Three kinds:

- *facts* (probability ``fact_prob``): referenced by a correct prediction shortly after arrival (the
  *prime*, delay in ``prime_delay``) and again much later (the *reuse*, delay in ``reuse_delay``);
- *distractors* (``distractor_prob``): attract attention at *confused* steps (probability
  ``confusion_prob`` when no fact is referenced), whose predictions are wrong (low κ);
- ordinary items: only a recency-decaying background (``exp(−age / tau)``).

A referencing step puts ``ref_mass`` on its facts (κ = ``kappa_correct``), a confused step puts
``ref_mass`` on the distractors seen so far (κ = ``kappa_confused``), other steps have κ ~ U(0.3, 0.9);
the rest of each row is background. Accumulated attention (H2O) favours distractors; demonstrated
utility (RMM) favours facts once their prime has been observed, which needs a commit lag
``H >= prime delay``. Heads share events and κ and differ in background jitter.
"""

from __future__ import annotations

import torch

from kvcert.evict.base import F64
from kvcert.evict.trace import AttentionTrace


def delayed_reuse_trace(
    steps: int = 256,
    layers: int = 1,
    heads: int = 2,
    fact_prob: float = 0.05,
    distractor_prob: float = 0.1,
    confusion_prob: float = 0.3,
    prime_delay: tuple[int, int] = (2, 6),
    reuse_delay: tuple[int, int] = (48, 96),
    tau: float = 2.0,
    ref_mass: float = 0.8,
    kappa_correct: float = 0.9,
    kappa_confused: float = 0.0,
    seed: int = 0,
) -> AttentionTrace:
    """Generate the task's trace (``kappa["realised"]`` = the κ above); deterministic in ``seed``."""
    if steps < 2 or layers < 1 or heads < 1:
        raise ValueError(f"steps >= 2, layers >= 1, heads >= 1 required, got {steps}, {layers}, {heads}")
    for name, p in (
        ("fact_prob", fact_prob),
        ("distractor_prob", distractor_prob),
        ("confusion_prob", confusion_prob),
        ("ref_mass", ref_mass),
    ):
        if not 0.0 <= p < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {p}")
    if not (1 <= prime_delay[0] <= prime_delay[1] < reuse_delay[0] <= reuse_delay[1]):
        raise ValueError(f"need 1 <= prime_delay <= ... < reuse_delay, got {prime_delay}, {reuse_delay}")
    g = torch.Generator().manual_seed(seed)
    kind = torch.rand(steps, generator=g)
    is_fact = kind < fact_prob
    is_distractor = (kind >= fact_prob) & (kind < fact_prob + distractor_prob)
    refs: list[list[int]] = [[] for _ in range(steps)]
    for i in torch.nonzero(is_fact).flatten().tolist():
        for lo, hi in (prime_delay, reuse_delay):
            s = i + int(torch.randint(lo, hi + 1, (1,), generator=g))
            if s < steps:
                refs[s].append(i)
    kappa = torch.empty(steps, dtype=F64)
    attn = torch.zeros(steps, layers, heads, steps, dtype=F64)
    for s in range(steps):
        age = torch.arange(s, -1, -1, dtype=F64)
        jitter = 1 + 0.2 * torch.rand(layers, heads, s + 1, generator=g, dtype=F64)
        background = torch.exp(-age / tau) * jitter
        background = background / background.sum(-1, keepdim=True)
        focus = torch.zeros(s + 1, dtype=F64)
        if refs[s]:
            focus[refs[s]] = 1.0
            kappa[s] = kappa_correct
        elif s > 0 and float(torch.rand(1, generator=g)) < confusion_prob and is_distractor[:s].any():
            focus[:s] = is_distractor[:s].to(F64)
            kappa[s] = kappa_confused
        else:
            kappa[s] = 0.3 + 0.6 * float(torch.rand(1, generator=g))
        if focus.sum() > 0:
            row = (1 - ref_mass) * background + ref_mass * focus / focus.sum()
        else:
            row = background
        attn[s, :, :, : s + 1] = row
    return AttentionTrace(attn, {"realised": kappa})
