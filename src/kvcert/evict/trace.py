"""Recorded attention traces and offline replay of a policy over them.

A trace is teacher-forced: row ``s`` of ``attn[T, L, Hkv, T]`` is the full (unevicted) attention of the
query at position ``s`` over positions ``<= s``, averaged over each KV head's query heads (so every row
is a distribution), and ``kappa[kind][T]`` the correctness weight of the prediction made at ``s``.

Replay drives a policy exactly as a cache would (one token per step, B = 1): at step ``s`` item ``s`` is
appended, the policy observes the *served* row (the full row restricted to present items and
renormalised), κ_s arrives, then ``select``/``on_evict`` bring every layer back to the budget. Replay is
an offline approximation: later layers would see different inputs under real eviction. What it reports
per (step, layer, head): the present set, the evicted mass ``1 − Σ_present a_{s,p}`` (exact for the
recorded full row, = TV between full and served attention, see ``mass.py``) and the served correct
mass ``κ_s · Σ_present a_{s,p}``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvcert.evict.base import F64, EvictionPolicy, aggregate_gqa
from kvcert.evict.kappa import KAPPA_KINDS, KappaKind, compute_kappa


@dataclass(frozen=True)
class AttentionTrace:
    """``attn[T, L, Hkv, T]`` float64 causal rows summing to 1; ``kappa`` maps a κ kind to ``[T]``."""

    attn: Tensor
    kappa: dict[str, Tensor]

    def __post_init__(self) -> None:
        a = self.attn
        if a.dim() != 4 or a.shape[0] != a.shape[-1] or a.dtype != F64:
            raise ValueError(f"attn must be float64 [T, L, Hkv, T], got {a.dtype} {tuple(a.shape)}")
        future = torch.ones(a.shape[0], a.shape[0], dtype=torch.bool).triu(1)[:, None, None, :]
        if not torch.isfinite(a).all() or (a < 0).any() or (a * future).abs().max() > 0:
            raise ValueError("attn must be finite, non-negative and causal (zero beyond the query position)")
        if (a.sum(-1) - 1).abs().max() > 1e-6:
            raise ValueError("attn rows must sum to 1 (average, not sum, over the query heads of a KV head)")
        for kind, k in self.kappa.items():
            if kind not in KAPPA_KINDS or k.shape != a.shape[:1] or (k < 0).any() or (k > 1).any():
                raise ValueError(f"kappa[{kind!r}] must be a known kind with values in [0, 1] and shape [T]")

    @property
    def steps(self) -> int:
        """Number of recorded steps ``T``."""
        return self.attn.shape[0]

    def kappa_of(self, kind: KappaKind) -> Tensor:
        """``κ[T]`` of ``kind`` (``"uniform"`` is always available)."""
        if kind == "uniform":
            return torch.ones(self.steps, dtype=F64)
        if kind not in self.kappa:
            raise ValueError(f"trace has no kappa of kind {kind!r}; recorded: {sorted(self.kappa)}")
        return self.kappa[kind]


def trace_from_attentions(
    attentions: Sequence[Tensor], logits: Tensor, tokens: Tensor, n_kv_heads: int
) -> AttentionTrace:
    """Build a trace from one teacher-forced forward pass (batch 1).

    ``attentions``: per layer ``[1, Hq, T, T]`` (eager weights); ``logits[1, T, V]``; ``tokens[1, T]`` the
    input. Row ``s`` predicts ``tokens[s + 1]``, so the last row is dropped: the trace has ``T − 1`` steps.
    κ kinds recorded: ``realised`` and ``argmax`` against the true next token, ``emitted`` = probability of
    the greedy token (what free greedy decoding would emit).
    """
    if not attentions or logits.dim() != 3 or logits.shape[0] != 1 or tokens.shape != logits.shape[:2]:
        raise ValueError("need per-layer attentions, logits [1, T, V] and tokens [1, T]")
    n = tokens.shape[1] - 1
    if n < 1:
        raise ValueError("tokens must hold at least 2 positions")
    layers = [aggregate_gqa(a.to(F64), n_kv_heads, "mean")[0, :, :n, :n] for a in attentions]  # [Hkv, T, T]
    attn = torch.stack(layers, 0).permute(2, 0, 1, 3).contiguous()  # [T, L, Hkv, T]
    rows, nxt = logits[:, :n], tokens[:, 1:]
    kappa = {
        "realised": compute_kappa("realised", rows, nxt)[0],
        "argmax": compute_kappa("argmax", rows, nxt)[0],
        "emitted": compute_kappa("emitted", rows, rows.argmax(-1))[0],
    }
    attn = attn / attn.sum(-1, keepdim=True)  # re-normalise float rounding of the eager softmax
    return AttentionTrace(attn, kappa)


@dataclass(frozen=True)
class ReplayResult:
    """Per (step, layer, head) replay record; ``present[T, L, Hkv, T]``: positions present at each read."""

    present: Tensor
    evicted_mass: Tensor  # [T, L, Hkv] float64
    served_mass: Tensor  # [T, L, Hkv] float64, κ-weighted
    max_items: int  # largest cache size after any select (must be <= budget once eviction started)

    @property
    def total_served(self) -> float:
        """Σ over steps, layers and heads of the served correct mass."""
        return float(self.served_mass.sum())


def replay(
    policy: EvictionPolicy, trace: AttentionTrace, budget: int, kappa: KappaKind = "realised", chunk: int = 1
) -> ReplayResult:
    """Run ``policy`` over ``trace`` with ``budget`` items per KV head, evicting ``chunk`` at a time (see module
    doc and ``EvictionPolicy.select``)."""
    if budget <= 0:
        raise ValueError(f"budget must be positive, got {budget}")
    policy.reset()
    k = trace.kappa_of(kappa)
    t_steps, n_layers, n_heads, _ = trace.attn.shape
    present = torch.zeros(t_steps, n_layers, n_heads, t_steps, dtype=torch.bool)
    positions = [torch.empty(1, n_heads, 0, dtype=torch.long) for _ in range(n_layers)]
    max_items = 0
    for s in range(t_steps):
        for layer in range(n_layers):
            pos = torch.cat([positions[layer], torch.full((1, n_heads, 1), s, dtype=torch.long)], -1)
            positions[layer] = pos
            row = trace.attn[s, layer].gather(-1, pos[0])  # [Hkv, S]
            present[s, layer].scatter_(-1, pos[0], True)
            policy.observe(layer, (row / row.sum(-1, keepdim=True))[None, :, None, :], pos)
        policy.set_kappa(torch.tensor([[s]]), k[s : s + 1][None])
        for layer in range(n_layers):
            keep = policy.select(layer, budget, chunk)
            if keep is not None:
                positions[layer] = positions[layer].gather(-1, keep)
                policy.on_evict(layer, keep)
            max_items = max(max_items, positions[layer].shape[-1])
    kept = (trace.attn * present).sum(-1)
    return ReplayResult(present, 1 - kept, k[:, None, None] * kept, max_items)


def overlap(result: ReplayResult, reference: ReplayResult) -> Tensor:
    """``|P ∩ R| / |R|`` per (step, layer, head): share of the reference's present set the policy holds."""
    both = (result.present & reference.present).sum(-1)
    return both.to(F64) / reference.present.sum(-1).to(F64)


def gap_closed(value: float, low: float, high: float) -> float:
    """``(value − low) / (high − low)``: fraction of the ``low -> high`` gap (H2O -> Belady) closed by
    ``value``; ``nan`` when the gap is not positive (nothing to close)."""
    gap = high - low
    return (value - low) / gap if gap > 0 else math.nan
