"""Clairvoyant references over a recorded trace (``docs/eviction.md#belady``): the Belady policy and the served-mass
ceiling.

A *use* of item ``p`` at step ``s`` is ``κ_s · a_{s,p} >= threshold`` (attention by a correct prediction).

- ``Belady(variant="next_use")``: classic MIN, evict the items whose next use is farthest in the future
  (never used again = farthest). Realisable (kept sets are nested like any policy's) but, because an
  evicted item can never come back, it is *not* guaranteed optimal here: it is the reference for
  kept-set overlap, not a ceiling.
- ``Belady(variant="future_mass")``: keep the top-C items by total future κ-weighted attention
  ``Σ_{s > now} κ_s a_{s,p}``.
- ``served_mass_ceiling``: the relaxed clairvoyant optimum of the served correct mass. At step ``s`` the
  read sees the new item ``s`` plus at most ``C`` earlier items, so for *every* policy with budget ``C``

      κ_s · Σ_{p present at s} a_{s,p}  <=  κ_s · (a_{s,s} + top-C sum of {a_{s,p} : p < s})

  (the top-C sum of non-negative numbers maximises any ≤C-subset sum). This is the Belady value used for
  the H2O -> Belady gap.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from kvcert.evict.base import F64, EvictionPolicy, LayerState
from kvcert.evict.prefill_attention import PrefillAttention

BeladyVariant = Literal["next_use", "future_mass"]


def _check_trace(attn: Tensor, kappa: Tensor) -> None:
    if attn.dim() != 4 or attn.shape[0] != attn.shape[-1]:
        raise ValueError(f"attn must be [T, L, Hkv, T] (row s = query at position s), got {tuple(attn.shape)}")
    if kappa.shape != attn.shape[:1]:
        raise ValueError(f"kappa must be [T] = [{attn.shape[0]}], got {tuple(kappa.shape)}")


class Belady(EvictionPolicy):
    """Offline oracle over a recorded trace ``attn[n, L, Hkv, first + n]`` (full attention; row ``i`` is the
    query at step ``first + i`` over positions ``<= first + i``) and ``kappa[n]``; batch size 1. Scores item
    ``p`` after step ``now`` by ``−(next use step)`` or by its future κ-weighted attention; nothing is
    protected. ``first = 0`` (the default) records every step; ``first = S`` records only the steps after an
    ``S``-token prompt (the answer), which is all a prefill selection at ``now = S − 1`` looks at, without the
    ``O(S²)`` prompt rows. Steps before ``first − 1`` cannot be looked up.
    """

    needs_attention = False

    def __init__(
        self,
        attn: Tensor,
        kappa: Tensor,
        variant: BeladyVariant = "next_use",
        threshold: float = 0.01,
        first: int = 0,
    ) -> None:
        if first < 0 or attn.dim() != 4 or attn.shape[-1] != first + attn.shape[0]:
            raise ValueError(
                f"attn must be [n, L, Hkv, first + n] with first = {first} >= 0 (row i = query at step first + i), "
                f"got {tuple(attn.shape)}"
            )
        if kappa.shape != attn.shape[:1]:
            raise ValueError(f"kappa must be [n] = [{attn.shape[0]}], got {tuple(kappa.shape)}")
        if variant not in ("next_use", "future_mass"):
            raise ValueError(f"variant must be 'next_use' or 'future_mass', got {variant!r}")
        if not threshold > 0:
            raise ValueError(f"threshold must be positive, got {threshold}")
        super().__init__(sinks=0, recent=0)
        self.variant, self.threshold, self.first = variant, threshold, first
        weighted = kappa.to(F64)[:, None, None, None] * attn.to(F64)
        rows = weighted.shape[0]
        # table[t − first + 1] is the score after step t, for t in [first − 1, first + n − 1]
        if variant == "future_mass":
            suffix = weighted.flip(0).cumsum(0).flip(0)  # suffix[i] = Σ_{recorded rows >= i} = Σ_{s > first + i − 1}
            self._table = torch.cat([suffix, torch.zeros_like(suffix[:1])])
        else:
            uses = weighted >= threshold
            table = torch.empty(rows + 1, *weighted.shape[1:], dtype=F64, device=weighted.device)
            nxt = torch.full(
                weighted.shape[1:], float(first + rows), dtype=F64, device=weighted.device
            )  # "never" = first + n (farthest)
            for i in range(rows - 1, -1, -1):
                table[i + 1] = -nxt
                nxt = torch.where(uses[i], float(first + i), nxt)
            table[0] = -nxt
            self._table = table

    def _lookup(self, layer: int, positions: Tensor, now: Tensor) -> Tensor:
        if positions.shape[0] != 1:
            raise ValueError("Belady replays a recorded trace of batch size 1")
        i = int(now[0]) - self.first + 1
        if not 0 <= i < self._table.shape[0] or int(positions.max()) >= self._table.shape[-1]:
            raise ValueError(
                f"step {int(now[0])} or a position lies outside the recorded trace (steps {self.first} to "
                f"{self.first + self._table.shape[0] - 2})"
            )
        # the trace's table stays where it was recorded; the scores follow the positions' device
        return self._table[i, layer].gather(-1, positions[0].to(self._table.device))[None].to(positions.device)

    def _scores(self, layer: int, state: LayerState) -> Tensor:
        return self._lookup(layer, state.positions, state.now)

    def _prefill_scores(
        self, layer: int, attn: PrefillAttention | None, positions: Tensor, kappa: Tensor | None
    ) -> Tensor:
        return self._lookup(layer, positions, torch.full((1,), positions.shape[-1] - 1, device=positions.device))


def served_mass_ceiling(attn: Tensor, kappa: Tensor, budget: int) -> Tensor:
    """Per-(step, layer, head) upper bound ``[T, L, Hkv]`` on any budget-``C`` policy's served correct mass
    ``κ_s Σ_{p present at s} a_{s,p}`` (module doc); float64.
    """
    _check_trace(attn, kappa)
    if budget <= 0:
        raise ValueError(f"budget must be positive, got {budget}")
    a = attn.to(F64)
    steps = a.shape[0]
    idx = torch.arange(steps, device=a.device)
    earlier = (idx[None, :] < idx[:, None]).to(F64)[:, None, None, :]  # [s, 1, 1, p]: p < s
    diag = a[idx, :, :, idx]  # [T, L, Hkv]
    top = (a * earlier).sort(dim=-1, descending=True).values[..., :budget].sum(-1)
    return kappa.to(F64)[:, None, None] * (diag + top)
