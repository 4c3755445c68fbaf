"""Shared scorer interface for eviction policies (spec §11): per-item scores + protected set -> top-C.

Every policy is a *scorer*: it keeps a float64 score per cached item (per layer, batch row, KV head)
and a rule for which items are protected (sinks, recent window / commit lag). Selection is shared:

    keep = the ``C`` items with the highest key, where key = +inf for protected items, else the score;
    ties are broken deterministically by physical index (the lower index, i.e. the older item, wins,
    because physical order equals logical order: kept indices are always returned sorted).

Two modes, one interface:

- **decode budget**: ``observe`` each attention read, ``set_kappa`` when the step's correctness weight
  arrives (after the logits), ``select(layer, budget)`` -> sorted physical indices ``[B, Hkv, C]`` to
  keep (``None`` when nothing needs evicting), then ``on_evict(layer, keep)`` after the cache gathered
  the same indices. Every KV head of a layer keeps the same count (storage stays rectangular); each head
  chooses its own items. The budget holds after each ``select``; the next read sees ``<= C + q`` items.
- **prefill compression** (kvpress convention): ``prefill_keep(layer, keys, values, ratio, ...)`` keeps
  ``prefill_kept_count(S, ratio)`` items per KV head.

Attention passed to ``observe`` is already aggregated over the ``G`` query heads of each KV head
(``aggregate_gqa``: ``"mean"`` = sum / G, a distribution, used by traces and the mass readings; ``"sum"``
ranks identically; ``"max"`` is the per-item maximum over the group and is not a distribution).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

GqaAggregation = Literal["sum", "mean", "max"]
F64 = torch.float64


def aggregate_gqa(attn: Tensor, n_kv_heads: int, how: GqaAggregation = "mean") -> Tensor:
    """Aggregate ``attn[B, Hq, q, S]`` over the ``G = Hq / Hkv`` query heads of each KV head.

    Returns ``[B, Hkv, q, S]``.

    Query head ``h`` belongs to KV head ``h // G`` (transformers' ``repeat_kv`` layout).
    """
    if attn.dim() != 4:
        raise ValueError(f"attn must be [B, Hq, q, S], got shape {tuple(attn.shape)}")
    if n_kv_heads <= 0 or attn.shape[1] % n_kv_heads:
        raise ValueError(f"n_kv_heads={n_kv_heads} must divide the {attn.shape[1]} query heads")
    b, hq, q, s = attn.shape
    grouped = attn.reshape(b, n_kv_heads, hq // n_kv_heads, q, s)
    if how == "sum":
        return grouped.sum(2)
    if how == "mean":
        return grouped.mean(2)
    if how == "max":
        return grouped.amax(2)
    raise ValueError(f"how must be 'sum', 'mean' or 'max', got {how!r}")


def prefill_kept_count(seq_len: int, ratio: float) -> int:
    """Items kept when compressing ``seq_len`` items by ``ratio`` (fraction removed, kvpress convention).

    Rule: ``removed = floor(ratio · S + 1e-9)`` (the tolerance absorbs float noise such as ``0.3 · 10``),
    ``kept = S − removed``, i.e. ``ceil((1 − ratio) · S)`` up to that tolerance. ``ratio ∈ [0, 1)``.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if not (0.0 <= ratio < 1.0) or math.isnan(ratio):
        raise ValueError(f"ratio (compression_ratio) must be in [0, 1), got {ratio}")
    return seq_len - math.floor(ratio * seq_len + 1e-9)


def causal_attention(queries: Tensor, keys: Tensor) -> Tensor:
    """Causal softmax attention ``[B, Hq, S, S]`` (float64) of ``queries[B, Hq, S, D]`` over
    ``keys[B, Hkv, S, D]``.

    Scale ``1/sqrt(D)``; query head ``h`` reads KV head ``h // G``. Used when a prefill caller has no
    eager attention weights.
    """
    if queries.dim() != 4 or keys.dim() != 4 or queries.shape[-1] != keys.shape[-1]:
        raise ValueError(
            f"queries [B,Hq,S,D] and keys [B,Hkv,S,D] disagree: {tuple(queries.shape)}, {tuple(keys.shape)}"
        )
    if queries.shape[1] % keys.shape[1] or queries.shape[2] != keys.shape[2]:
        raise ValueError("queries must have a multiple of the KV heads and the same length S as keys")
    g = queries.shape[1] // keys.shape[1]
    k = keys.to(F64).repeat_interleave(g, dim=1)
    logits = queries.to(F64) @ k.transpose(-1, -2) / math.sqrt(queries.shape[-1])
    s = queries.shape[2]
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    return torch.softmax(logits.masked_fill(mask, -math.inf), dim=-1)


def keep_top(scores: Tensor, protected: Tensor, budget: int) -> Tensor:
    """Sorted physical indices ``[B, Hkv, C]`` of the ``C = min(budget, S)`` items with the highest key.

    key = ``+inf`` for protected items, else ``scores``; ties go to the lower physical index (stable sort).
    ``ValueError`` if some head has more protected items than ``budget`` (the budget cannot be honoured).
    """
    if budget <= 0:
        raise ValueError(f"budget must be positive, got {budget}")
    n_protected = int(protected.sum(-1).max()) if protected.numel() else 0
    if n_protected > budget:
        raise ValueError(f"budget={budget} is smaller than the {n_protected} protected items (sinks + recent/lag)")
    key = scores.to(F64).masked_fill(protected, math.inf)
    s = scores.shape[-1]
    c = min(budget, s)
    if s - c > _ARGMIN_MAX_EVICT:
        order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :c]
        return order.sort(dim=-1).values
    # Few evictions (the decode case): pick the minimum key s − c times, ties to the highest index —
    # the same set the stable sort drops, in O(S) per pick instead of a full sort.
    picks = []
    for _ in range(s - c):
        idx = (s - 1) - key.flip(-1).argmin(dim=-1, keepdim=True)  # argmin returns the first minimum
        picks.append(idx)
        key = key.scatter(-1, idx, math.inf)
    keep = torch.arange(c).expand(*scores.shape[:-1], c)
    for e in torch.cat(picks, -1).sort(dim=-1).values.unbind(-1):  # skip evicted slots, ascending
        keep = keep + (keep >= e[..., None])
    return keep


_ARGMIN_MAX_EVICT = 8


def fit_slots(x: Tensor, length: int) -> Tensor:
    """Zero-pad the last dim of ``x`` to ``length`` (items appended after ``x`` was recorded)."""
    return torch.nn.functional.pad(x, (0, length - x.shape[-1])) if x.shape[-1] < length else x


@dataclass
class LayerState:
    """Per-layer item state, kept in the cache's physical slot order."""

    scores: Tensor  # [B, Hkv, S] float64
    positions: Tensor  # [B, Hkv, S] long, logical position of each slot
    now: Tensor  # [B] long, position of the latest query observed
    rows: list[Tensor] = field(default_factory=list)  # recorded query groups [B, Hkv, q, S_then] (policy-specific)
    row_positions: list[Tensor] = field(default_factory=list)  # [B, q] query positions of each group
    issued: Tensor | None = None  # the keep tensor the last select returned (validated by construction)


class EvictionPolicy(ABC):
    """Base scorer policy. Subclasses set ``sinks``/``recent`` and override the scoring hooks.

    Protected items (never evicted): logical position ``< sinks``, or ``> now − recent`` (the ``recent``
    newest positions, where ``now`` is the latest query position). Subclasses override
    ``_accumulate`` (decode-mode state update), ``_scores`` (decode scores) and ``_prefill_scores``.
    """

    needs_attention: bool = True  # False for policies whose prefill scores ignore attention

    def __init__(self, sinks: int = 0, recent: int = 0) -> None:
        if sinks < 0 or recent < 0:
            raise ValueError(f"sinks and recent must be >= 0, got sinks={sinks}, recent={recent}")
        self.sinks = sinks
        self.recent = recent
        self._layers: dict[int, LayerState] = {}

    # ---- lifecycle -------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget all per-item state (new request)."""
        self._layers = {}

    def observe(self, layer: int, attn: Tensor, positions: Tensor) -> None:
        """Record one attention read of ``layer``.

        ``attn[B, Hkv, q, S]``: probabilities aggregated over each KV head's query heads (see module doc);
        ``positions[B, S]`` or ``[B, Hkv, S]``: strictly increasing logical positions of the physical slots.
        The ``q`` queries are the newest ``q`` slots (decode appends before reading). ``S`` may only grow
        between evictions.
        """
        if attn.dim() != 4:
            raise ValueError(f"attn must be [B, Hkv, q, S], got shape {tuple(attn.shape)}")
        if attn.numel() and not (float(attn.min()) >= 0 and math.isfinite(float(attn.sum()))):
            raise ValueError("attn must be finite and non-negative")  # NaN fails the min, ±inf the sum
        b, h, q, s = attn.shape
        if positions.dim() == 2:
            positions = positions[:, None, :].expand(b, h, s)
        if positions.shape != (b, h, s) or positions.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"positions must be integer [B, S] or [B, Hkv, S] matching attn {tuple(attn.shape)}")
        if q > s:
            raise ValueError(f"attn has q={q} queries but only S={s} slots")
        positions = positions.long()
        state = self._layers.get(layer)
        if state is None:
            state = LayerState(torch.zeros(b, h, 0, dtype=F64), positions[..., :0], positions[:, 0, -1])
            self._layers[layer] = state
        old = state.scores.shape[-1]
        if s < old or state.scores.shape[:2] != (b, h):
            raise ValueError(f"attn slots shrank or batch/heads changed without on_evict (layer {layer})")
        # slots the policy already holds must be unchanged (catches a cache/policy gather mismatch);
        # only the appended tail needs the strictly-increasing check
        if not torch.equal(positions[..., :old], state.positions):
            raise ValueError(f"positions disagree with the slots the policy holds for layer {layer}")
        if s - old > 0 and not (positions[..., max(old - 1, 0) :].diff(dim=-1) > 0).all():
            raise ValueError("positions must be strictly increasing along the slot axis")
        state.issued = None
        state.scores = fit_slots(state.scores, s)
        state.positions = positions.clone()
        qpos = positions[:, 0, s - q :]
        state.now = qpos[:, -1]
        self._accumulate(layer, state, attn.to(F64), qpos)

    def set_kappa(self, step_positions: Tensor, kappa: Tensor) -> None:
        """Correctness weights ``kappa[B, q] ∈ [0, 1]`` of the queries at ``step_positions[B, q]``.

        Arrives after the step's logits, i.e. after ``observe``. Policies that do not weight by
        correctness validate and ignore it.
        """
        if step_positions.shape != kappa.shape or kappa.dim() != 2:
            raise ValueError(
                f"step_positions and kappa must both be [B, q], got {tuple(step_positions.shape)}, {tuple(kappa.shape)}"
            )
        if not torch.isfinite(kappa).all() or (kappa < 0).any() or (kappa > 1).any():
            raise ValueError("kappa must be finite and in [0, 1]")

    def select(self, layer: int, budget: int) -> Tensor | None:
        """Sorted physical indices ``[B, Hkv, C]`` to keep, ``C = budget``; ``None`` if ``S <= budget``."""
        state = self._state(layer)
        if state.scores.shape[-1] <= budget:
            return None
        state.issued = keep_top(self._scores(layer, state), self._protected(state.positions, state.now), budget)
        return state.issued

    def on_evict(self, layer: int, keep: Tensor) -> None:
        """Compact the layer's per-item state with the same gather the cache applied (``keep[B, Hkv, C]``)."""
        state = self._state(layer)
        s = state.scores.shape[-1]
        if keep is not state.issued:  # select's own output for the current state is valid by construction
            if keep.dim() != 3 or keep.shape[:2] != state.scores.shape[:2] or keep.dtype != torch.long:
                raise ValueError(f"keep must be long [B, Hkv, C] matching the layer state, got {tuple(keep.shape)}")
            if keep.numel() and (int(keep.min()) < 0 or int(keep.max()) >= s or not (keep.diff(dim=-1) > 0).all()):
                raise ValueError(f"keep must be strictly increasing physical indices in [0, {s})")
        state.issued = None
        state.scores = state.scores.gather(-1, keep)
        state.positions = state.positions.gather(-1, keep)
        state.rows = [
            fit_slots(r, s).gather(-1, keep[:, :, None, :].expand(-1, -1, r.shape[2], -1)) for r in state.rows
        ]

    # ---- prefill ---------------------------------------------------------------------------
    def prefill_keep(
        self,
        layer: int,
        keys: Tensor,
        values: Tensor,
        ratio: float,
        attn: Tensor | None = None,
        queries: Tensor | None = None,
        kappa: Tensor | None = None,
    ) -> Tensor:
        """Sorted indices ``[B, Hkv, C]`` to keep after prefill, ``C = prefill_kept_count(S, ratio)``.

        ``keys``/``values``: ``[B, Hkv, S, D]``; attention from ``attn[B, Hq, S, S]`` (eager weights) or
        recomputed causally from ``queries[B, Hq, S, D]``; ``kappa[B, S]`` correctness weights of the
        prefill queries (used only by correctness-weighted policies). Positions are ``0..S-1``.
        """
        if keys.dim() != 4 or values.shape[:3] != keys.shape[:3]:
            raise ValueError(
                f"keys/values must be [B, Hkv, S, D] alike, got {tuple(keys.shape)}, {tuple(values.shape)}"
            )
        b, h, s, _ = keys.shape
        kept = prefill_kept_count(s, ratio)
        positions = torch.arange(s).expand(b, h, s)
        now = torch.full((b,), s - 1, dtype=torch.long)
        if kept == s:
            return positions.clone()
        attn_kv = self._prefill_attention(keys, attn, queries) if self.needs_attention else None
        scores = self._prefill_scores(layer, attn_kv, positions, kappa)
        return keep_top(scores, self._protected(positions, now), kept)

    @staticmethod
    def _prefill_attention(keys: Tensor, attn: Tensor | None, queries: Tensor | None) -> Tensor:
        if attn is None:
            if queries is None:
                raise ValueError("prefill_keep needs attn [B, Hq, S, S] or queries [B, Hq, S, D]")
            attn = causal_attention(queries, keys)
        s = keys.shape[2]
        if attn.dim() != 4 or attn.shape[-2:] != (s, s) or attn.shape[0] != keys.shape[0]:
            raise ValueError(f"attn must be [B, Hq, S, S] with S={s}, got {tuple(attn.shape)}")
        if not torch.isfinite(attn).all():
            raise ValueError("attn must be finite")
        return aggregate_gqa(attn.to(F64), keys.shape[1], "sum")

    # ---- hooks -----------------------------------------------------------------------------
    def _protected(self, positions: Tensor, now: Tensor) -> Tensor:
        return (positions < self.sinks) | (positions > (now[:, None, None] - self.recent))

    def _accumulate(self, layer: int, state: LayerState, attn: Tensor, qpos: Tensor) -> None:
        """Update decode-mode state from ``attn[B, Hkv, q, S]`` (float64); default: no state to update."""
        return None

    def _scores(self, layer: int, state: LayerState) -> Tensor:
        return state.scores

    @abstractmethod
    def _prefill_scores(self, layer: int, attn: Tensor | None, positions: Tensor, kappa: Tensor | None) -> Tensor:
        """Prefill scores ``[B, Hkv, S]`` from ``attn[B, Hkv, S, S]`` (GQA-summed; ``None`` when
        ``needs_attention`` is False) and ``kappa[B, S]`` (or ``None``)."""

    def _state(self, layer: int) -> LayerState:
        state = self._layers.get(layer)
        if state is None:
            raise ValueError(f"layer {layer} has not been observed")
        return state


def accumulate_rows(scores: Tensor, attn: Tensor, weights: Tensor | None = None) -> Tensor:
    """``scores + Σ_r w_r · attn[:, :, r, :]`` added row by row in query order (float64).

    The fixed order makes the κ ≡ 1 sum bit-identical to the unweighted one (``1.0 · x == x``), which
    the RMM -> H2O reduction relies on. ``weights``: ``[B, q]`` or ``None`` (unweighted).
    """
    out = fit_slots(scores, attn.shape[-1]).clone()
    for r in range(attn.shape[2]):
        row = attn[:, :, r, :]
        out.add_(row if weights is None else weights[:, r, None, None].to(F64) * row)
    return out
