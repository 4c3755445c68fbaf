"""Per-layer split of a resident budget by estimated attention mass (``docs/eviction.md``, "Per-layer allocation of
the resident set").

A resident set keeps ``C_l`` tokens of layer ``l`` per (row, KV head); every head of a layer keeps the same count (the
store stays rectangular). :func:`allocate_kept` chooses the counts under a fixed total ``Σ_l C_l``: it normalises a
policy's prefill scores per (layer, row, KV head) to sum to 1 (an estimate of each token's share of that head's
attention) and gives each layer its protected tokens (sinks, recent window) plus the unprotected tokens whose
normalised scores are largest over all layers. Adding one token to layer ``l`` adds, summed over its rows and heads,
the next-largest normalised score of each head; these gains never grow with the count, so taking the largest gains
over all layers (a global top-k) maximises the total kept score mass, i.e. minimises the estimated omitted mass
``Σ_{l, b, h} (1 − kept mass)``. The only input besides the scores is the total.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

F64 = torch.float64


def allocate_kept(scores: Sequence[Tensor], protected: Sequence[Tensor], total: int) -> list[int]:
    """Kept count per layer ``C_l`` with ``Σ_l C_l = total`` and ``P_l <= C_l <= S_l`` that maximises the kept
    normalised score mass summed over layers, rows and KV heads (module doc).

    ``scores[l]``: non-negative finite ``[B, Hkv_l, S_l]`` per-item scores of layer ``l`` (any device), normalised
    here per (row, KV head) to sum to 1 (a head whose scores are all 0 adds no mass anywhere); ``protected[l]``:
    the bool mask of the same shape of items every head keeps (``P_l`` = the most any head protects). Ties go to the
    lower layer, then to the lower rank. One host synchronisation. ``ValueError`` if the scores are negative or not
    finite, the shapes disagree, or ``total`` is not in ``[Σ P_l, Σ S_l]``.
    """
    if not scores or len(scores) != len(protected):
        raise ValueError(f"need one protected mask per layer's scores, got {len(scores)} scores, {len(protected)}")
    device = scores[0].device
    gains, owners, bad = [], [], []
    for layer, (s, p) in enumerate(zip(scores, protected, strict=True)):
        if s.dim() != 3 or p.shape != s.shape or p.dtype != torch.bool:
            raise ValueError(f"layer {layer}: scores [B, Hkv, S] and a bool protected mask alike, got {tuple(s.shape)}")
        x = s.to(F64)
        bad.append((~torch.isfinite(x) | (x < 0)).any().to(device))
        norm = x / x.sum(-1, keepdim=True).clamp(min=torch.finfo(F64).tiny)
        # per head: protected first (+inf), then the normalised scores in decreasing order; the gain of a layer's
        # j-th token is the sum over its heads at rank j (+inf while any head still has a protected token there)
        ranked = norm.masked_fill(p, math.inf).sort(-1, descending=True).values
        gains.append(ranked.sum((0, 1)).to(device))
        owners.append(torch.full((s.shape[-1],), layer, dtype=torch.int64, device=device))
    gain, owner = torch.cat(gains), torch.cat(owners)
    forced = torch.isinf(gain).sum()
    if not 0 <= total <= gain.numel():
        raise ValueError(f"total={total} kept items must be in [0, {gain.numel()}] (every layer's items)")
    # stable: among equal gains the lower layer, then the lower rank (each layer's picks stay a prefix of its ranks)
    picked = owner[gain.sort(descending=True, stable=True).indices[:total]]
    counts = torch.bincount(picked, minlength=len(scores))
    *kept, n_forced, any_bad = torch.cat([counts, forced[None], torch.stack(bad).any()[None].long()]).tolist()
    if any_bad:
        raise ValueError("allocate_kept needs non-negative finite scores (an attention-mass estimate)")
    if n_forced > total:
        raise ValueError(f"total={total} kept items is smaller than the {n_forced} protected items of all layers")
    return kept
