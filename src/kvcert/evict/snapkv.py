"""SnapKV: attention of the last ``window`` queries, pooled over neighbour slots, plus the window
(``docs/eviction.md#policies``)."""

from __future__ import annotations

from collections import deque
from typing import Literal

import numba
import numpy as np
import torch
from torch import Tensor

from kvcert.evict.base import EvictionPolicy, LayerState

Pooling = Literal["avgpool", "maxpool"]


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _pool(x: np.ndarray, kernel: int, average: bool, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """Each output folds its in-range window left to right (``acc = x[lo]; acc op= x[lo + 1]; ...``), as
    torch's pooling does; interior windows are swept offset-major into a local accumulator (vectorises)."""
    r = kernel // 2
    n = x.shape[-1]
    m = max(n - 2 * r, 0)
    acc = np.empty(m)
    for row in range(x.shape[0]):
        xr = x[row]
        for t in range(m):  # interior: output t + r, window xr[t .. t + 2r]
            acc[t] = xr[t]
        for j in range(1, kernel):
            if average:
                for t in range(m):
                    acc[t] = acc[t] + xr[t + j]
            else:
                for t in range(m):
                    acc[t] = max(acc[t], xr[t + j])
        if average:
            for t in range(m):
                out[row, t + r] = acc[t] / kernel
        else:
            out[row, r : r + m] = acc
        for t in range(min(r, n)):  # edge windows, clipped to the row
            out[row, t] = _edge(xr, t, r, kernel, average)
        for t in range(max(n - r, r), n):
            out[row, t] = _edge(xr, t, r, kernel, average)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _edge(xr: np.ndarray, t: int, r: int, kernel: int, average: bool) -> float:  # pragma: no cover - compiled
    lo, hi = max(t - r, 0), min(t + r + 1, xr.shape[0])
    v = xr[lo]
    for i in range(lo + 1, hi):
        v = v + xr[i] if average else max(v, xr[i])
    return v / kernel if average else v


def pool_scores(scores: Tensor, kernel: int, pooling: Pooling) -> Tensor:
    """1-D pooling of float64 ``scores[B, H, S]`` over the slot axis, stride 1, ``kernel // 2`` on each side
    (torch's ``avg_pool1d`` / ``max_pool1d`` semantics: the average counts the zero padding, i.e. divides
    by ``kernel``; the maximum ignores it). One O(S·kernel) pass, summing left to right."""
    b, h, s = scores.shape
    flat = np.ascontiguousarray(scores.detach().to(torch.float64).numpy().reshape(b * h, s))
    out = np.empty_like(flat)
    _pool(flat, kernel, pooling == "avgpool", out)
    return torch.from_numpy(out).view(b, h, s)


@numba.njit(cache=True, nogil=True)
def _subtract_by_position(
    scores: np.ndarray, positions: np.ndarray, n: int, old_pos: np.ndarray, old_row: np.ndarray
) -> None:  # pragma: no cover - compiled (covered by tests via numba)
    """``scores[b, h, j] −= old_row[b, h, k]`` for every held slot ``j < n`` whose position equals
    ``old_pos[b, h, k]`` (both position arrays strictly increasing: one merge walk per head, O(S))."""
    nb, nh, m = old_pos.shape
    for b in range(nb):
        for h in range(nh):
            j = 0
            for k in range(m):
                p = old_pos[b, h, k]
                while j < n and positions[b, h, j] < p:
                    j += 1
                if j == n:
                    break
                if positions[b, h, j] == p:
                    scores[b, h, j] -= old_row[b, h, k]


class SnapKV(EvictionPolicy):
    """``SnapKV(window, kernel, pooling)``: score_i = pool(Σ_{s in last window queries} a_{s,i}); the last
    ``window`` positions are protected. ``kernel`` odd. Decode mode applies the same score to the last
    ``window`` observed query rows; pooling runs over physical slots (neighbours after eviction).

    Decode cost is O(S) per step: the window sum lives in the state's score buffer (so evictions move it
    with the slots), each new row is added and the row that leaves the window is subtracted from the slots
    that still hold its positions; it equals the fresh sum of the last ``window`` rows up to the float64
    rounding of the running sum (~1e-16 relative).
    """

    def __init__(self, window: int = 32, kernel: int = 5, pooling: Pooling = "avgpool", sinks: int = 0) -> None:
        if window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        if kernel <= 0 or kernel % 2 == 0:
            raise ValueError(f"kernel must be a positive odd integer, got {kernel}")
        if pooling not in ("avgpool", "maxpool"):
            raise ValueError(f"pooling must be 'avgpool' or 'maxpool', got {pooling!r}")
        super().__init__(sinks=sinks, recent=window)
        self.window, self.kernel, self.pooling = window, kernel, pooling
        self._windows: dict[int, deque[tuple[np.ndarray, np.ndarray]]] = {}  # (positions, row) per layer

    def reset(self) -> None:
        """Forget all per-item state and the recorded windows (new request)."""
        super().reset()
        self._windows = {}

    def _accumulate(self, layer: int, state: LayerState, attn: Tensor, qpos: np.ndarray) -> None:
        q, s = attn.shape[2:]
        win = self._windows.setdefault(layer, deque())
        pos = state.buffers[1][..., :s].copy()  # shared by this call's rows
        rows = attn[:, :, max(q - self.window, 0) :].numpy()
        for r in range(rows.shape[2]):
            row = rows[:, :, r].copy()
            state.buffers[0][..., :s] += row
            win.append((pos, row))
            if len(win) > self.window:
                _subtract_by_position(state.buffers[0], state.buffers[1], state.n, *win.popleft())

    def _scores(self, layer: int, state: LayerState) -> Tensor:
        return pool_scores(state.scores, self.kernel, self.pooling)

    def _prefill_scores(self, layer: int, attn: Tensor | None, positions: Tensor, kappa: Tensor | None) -> Tensor:
        assert attn is not None
        return pool_scores(attn[:, :, -self.window :, :].sum(2), self.kernel, self.pooling)
