"""SnapKV: attention of the last ``window`` queries, pooled over neighbour slots, plus the window
(``docs/eviction.md#policies``)."""

from __future__ import annotations

import math
from collections import deque
from typing import Literal

import numba
import numpy as np
import torch
from torch import Tensor

from kvcert.evict.base import EvictionPolicy, LayerState, _host
from kvcert.evict.prefill_attention import PrefillAttention, PrefillReads

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
    by ``kernel``; the maximum ignores it). One O(S·kernel) pass, summing left to right: a numba loop on CPU,
    ``kernel`` shifted adds (or maxima) of the padded row on other devices; both fold each window in the same
    order, so they agree bit for bit (``0 + x = x`` and ``max(−inf, x) = x`` for the padding)."""
    b, h, s = scores.shape
    x = scores.detach().to(torch.float64)
    if _host(x):
        flat = np.ascontiguousarray(x.numpy().reshape(b * h, s))
        out = np.empty_like(flat)
        _pool(flat, kernel, pooling == "avgpool", out)
        return torch.from_numpy(out).view(b, h, s)
    r = kernel // 2
    average = pooling == "avgpool"
    padded = torch.nn.functional.pad(x, (r, r), value=0.0 if average else -math.inf)
    acc = padded[..., :s].clone()
    for j in range(1, kernel):
        acc = acc + padded[..., j : j + s] if average else torch.maximum(acc, padded[..., j : j + s])
    return acc / kernel if average else acc


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


def _subtract_by_position_torch(scores: Tensor, positions: Tensor, n: int, old_pos: Tensor, old_row: Tensor) -> None:
    """:func:`_subtract_by_position` as torch operations on the scores' device: each old position is looked up
    among the held ones (``searchsorted``; both strictly increasing, so a position matches at most one slot) and
    its value subtracted there; unmatched positions subtract ``0`` (exact), so the result is the numba walk's."""
    held = positions[..., :n].contiguous()
    if n == 0:
        return
    at = torch.searchsorted(held, old_pos.contiguous()).clamp_(max=n - 1)
    hit = held.gather(-1, at) == old_pos
    scores[..., :n].scatter_add_(-1, at, torch.where(hit, -old_row, 0.0))


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
        # (positions, row) per layer: numpy views of CPU states, tensors on the state's device otherwise
        self._windows: dict[int, deque[tuple[np.ndarray | Tensor, np.ndarray | Tensor]]] = {}

    @property
    def prefill_reads(self) -> PrefillReads:
        """The ``window`` newest prefill rows."""
        return PrefillReads(rows=self.window)

    def reset(self) -> None:
        """Forget all per-item state and the recorded windows (new request)."""
        super().reset()
        self._windows = {}

    def _accumulate(self, layer: int, state: LayerState, attn: Tensor, qpos: Tensor) -> None:
        q, s = attn.shape[2:]
        win = self._windows.setdefault(layer, deque())
        if _host(state.buffers[0]):
            scores, positions = state.views()
            pos = positions[..., :s].copy()  # shared by this call's rows
            rows = attn[:, :, max(q - self.window, 0) :].numpy()
            for r in range(rows.shape[2]):
                row = rows[:, :, r].copy()
                scores[..., :s] += row
                win.append((pos, row))
                if len(win) > self.window:
                    old_pos, old_row = win.popleft()
                    assert isinstance(old_pos, np.ndarray) and isinstance(old_row, np.ndarray)
                    _subtract_by_position(scores, positions, state.n, old_pos, old_row)
            return
        pos_t = state.buffers[1][..., :s].clone()
        rows_t = attn[:, :, max(q - self.window, 0) :]
        for r in range(rows_t.shape[2]):
            row_t = rows_t[:, :, r].clone()
            state.buffers[0][..., :s] += row_t
            win.append((pos_t, row_t))
            if len(win) > self.window:
                old_pos, old_row = win.popleft()
                assert isinstance(old_pos, Tensor) and isinstance(old_row, Tensor)
                _subtract_by_position_torch(state.buffers[0], state.buffers[1], state.n, old_pos, old_row)

    def _scores(self, layer: int, state: LayerState) -> Tensor:
        return pool_scores(state.scores, self.kernel, self.pooling)

    def _prefill_scores(
        self, layer: int, attn: PrefillAttention | None, positions: Tensor, kappa: Tensor | None
    ) -> Tensor:
        assert attn is not None
        return pool_scores(attn.newest(self.window).sum(2), self.kernel, self.pooling)
