"""RMM(C, H): fixed-lag eviction on demonstrated utility (``docs/eviction.md#eviction-model``, a reconstruction).

    DU_i(t) = Σ_{s = i..t} κ_s · a_{s,i}     (attention from predictions that turned out correct)

Every item is *pending* for ``H`` steps (logical position ``> now − H``) and cannot be evicted; among
committed items (age ``>= H``) the lowest ``DU`` goes first. ``κ_s`` arrives after step ``s``'s logits
(``set_kappa``); until then the step's attention rows are buffered and do not count. With ``κ ≡ 1`` and
``H = r``, ``DU`` is H2O's accumulated attention (added row by row in the same order, hence bit-identical)
and the pending set is H2O's recent window, so the kept sets equal ``H2O(recent=r)`` exactly
(``docs/eviction.md#h2o-reduction``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvcert.evict.base import EvictionPolicy, LayerState, accumulate_rows
from kvcert.evict.kappa import KAPPA_KINDS, KappaKind
from kvcert.evict.prefill_attention import EVERY_ROW, PrefillAttention, PrefillReads


class RMM(EvictionPolicy):
    """``RMM(lag, kappa, sinks)``: commit lag ``H = lag``; ``kappa`` names the correctness weight the driver
    feeds through ``set_kappa`` (see ``kvcert.evict.kappa``); ``sinks`` first positions always kept.

    Prefill variant (``docs/eviction.md#prefill-scores``, "all later queries"):
    score_i = Σ_{s >= i} κ_s a_{s,i} / (S − i) over the prefill
    queries (``observed_attention``: divided by the number of queries that see key ``i``, exactly as H2O's
    prefill score, so κ ≡ 1 keeps H2O's sets), last ``lag`` positions protected; ``kappa[B, S]`` is
    required unless ``kappa="uniform"``.
    """

    def __init__(self, lag: int, kappa: KappaKind = "realised", sinks: int = 0) -> None:
        if kappa not in KAPPA_KINDS:
            raise ValueError(f"kappa must be one of {KAPPA_KINDS}, got {kappa!r}")
        super().__init__(sinks=sinks, recent=lag)
        self.lag = lag
        self.kappa_kind = kappa

    @property
    def prefill_reads(self) -> PrefillReads:
        """``kappa="uniform"``: the column sums over every prefill row; otherwise every row (the κ of the prompt,
        known only after the prefill, weights each row)."""
        return PrefillReads(column_sums=True) if self.kappa_kind == "uniform" else EVERY_ROW

    def _accumulate(self, layer: int, state: LayerState, attn: Tensor, qpos: Tensor) -> None:
        state.add_rows(attn)
        state.row_positions.append(qpos.clone())

    def set_kappa(self, step_positions: Tensor, kappa: Tensor) -> None:
        """Apply ``κ[B, q]`` to the oldest buffered query group of every layer (FIFO).

        ``ValueError`` (and no state change) if a layer has no buffered group or the group's query
        positions differ from ``step_positions``. The positions of every layer are compared in one reduction
        (one host synchronisation off the CPU).
        """
        super().set_kappa(step_positions, kappa)
        matches = []
        for layer, state in self._layers.items():
            if not state.row_positions or state.row_positions[0].shape != step_positions.shape:
                raise ValueError(f"step_positions do not match the oldest unscored query group of layer {layer}")
            matches.append((state.row_positions[0] == step_positions.to(state.device)).all().to(step_positions.device))
        if matches:
            agree = torch.stack(matches).tolist()  # the one sync
            if not all(agree):
                layer = list(self._layers)[agree.index(False)]
                raise ValueError(f"step_positions do not match the oldest unscored query group of layer {layer}")
        for state in self._layers.values():
            rows = state.row(0)
            state.drop_rows(1)
            state.row_positions.pop(0)
            accumulate_rows(state.buffers[0][..., : state.n], rows, kappa)

    def _prefill_scores(
        self, layer: int, attn: PrefillAttention | None, positions: Tensor, kappa: Tensor | None
    ) -> Tensor:
        assert attn is not None
        if kappa is None and self.kappa_kind != "uniform":
            raise ValueError(f"kappa [B, S] is required for RMM prefill with kappa={self.kappa_kind!r}")
        return attn.observed(kappa)
