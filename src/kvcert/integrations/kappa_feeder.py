"""RMM's correctness weight fed from ``model.generate``: a ``LogitsProcessor`` over a
:class:`~kvcert.integrations.transformers.CertifiedCache` with an eviction policy."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

from kvcert.integrations.transformers import CertifiedCache


class KappaFeeder(LogitsProcessor):
    """Feeds RMM's correctness weight during ``model.generate``: ``κ`` = probability of the emitted token.

    Greedy decoding emits the argmax, so ``κ = max softmax(scores)`` (kind ``"emitted"``, a confidence
    proxy). Put it first in ``logits_processor`` (it reads the scores as it receives them) and use greedy
    decoding. Scores pass through unchanged.
    """

    def __init__(self, cache: CertifiedCache) -> None:
        if not isinstance(cache, CertifiedCache) or cache.evict is None:
            raise ValueError("cache must be a CertifiedCache built with an eviction policy (eviction=...)")
        self.cache = cache

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """Call ``cache.set_kappa(max softmax prob)`` for the forward that produced ``scores[B, V]``."""
        self.cache.set_kappa(torch.softmax(scores.to(torch.float64), dim=-1).amax(-1))
        return scores
