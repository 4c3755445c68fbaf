"""A token-axis growable tensor with amortised O(1) appends (capacity doubling)."""

from __future__ import annotations

import numpy as np
import torch


class GrowBuffer:
    """Holds ``[B, H, T, *tail]`` tensors growing along the token axis (dim 2) without O(T) copies per append.

    ``view()`` returns the live ``[B, H, n, *tail]`` prefix (a view, not a copy).
    """

    def __init__(self, like: torch.Tensor, capacity: int = 256, pin: bool = False) -> None:
        b, h, _, *tail = like.shape
        self._shape = (b, h, tail)
        self._pin = pin
        self._data = self._alloc(max(capacity, like.shape[2]), like.dtype, like.device)
        self._array: np.ndarray | None = None
        self._array_of: torch.Tensor | None = None  # the allocation ``_array`` views
        self.n = 0

    def _alloc(self, cap: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        b, h, tail = self._shape
        data = torch.empty((b, h, cap, *tail), dtype=dtype, device=device)
        return data.pin_memory() if self._pin else data

    @property
    def dtype(self) -> torch.dtype:
        """Element type of the stored tensor."""
        return self._data.dtype

    def append(self, x: torch.Tensor) -> None:
        """Append ``x[B, H, t, *tail]`` along the token axis."""
        t = x.shape[2]
        if self.n + t > self._data.shape[2]:
            cap = max(2 * self._data.shape[2], 2 * (self.n + t))  # a large chunk leaves room to grow
            new = self._alloc(cap, self._data.dtype, self._data.device)
            new[:, :, : self.n] = self._data[:, :, : self.n]
            self._data = new
        self._data[:, :, self.n : self.n + t] = x
        self.n += t

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of :meth:`view` without building the view."""
        b, h, tail = self._shape
        return (b, h, self.n, *tail)

    def view(self) -> torch.Tensor:
        """The live prefix ``[B, H, n, *tail]`` (shares storage)."""
        return self._data[:, :, : self.n]

    def array(self) -> np.ndarray:
        """The whole C-contiguous allocation ``[B, H, capacity, *tail]`` as a numpy array sharing its memory
        (CPU only; cached until the buffer reallocates); tokens ``[0, n)`` are live. For kernels that read a
        token prefix without the copy a strided view would cost them."""
        if self._array is None or self._array_of is not self._data:
            self._array, self._array_of = self._data.numpy(), self._data
        return self._array

    def drop_before(self, start: int) -> None:
        """Discard tokens ``[0, start)`` (sliding-window trimming); later tokens shift to the front."""
        if start <= 0:
            return
        keep = self._data[:, :, start : self.n].clone()
        self._data[:, :, : keep.shape[2]] = keep
        self.n = keep.shape[2]

    def gather(self, index: torch.Tensor) -> None:
        """Keep only tokens ``index[B, H, C]`` (sorted), in that order (eviction)."""
        live = self.view()
        idx = index.reshape(*index.shape, *([1] * (live.dim() - 3))).expand(*index.shape, *live.shape[3:])
        kept = torch.gather(live, 2, idx)
        self._data[:, :, : kept.shape[2]] = kept
        self.n = kept.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of the live prefix (not the reserved capacity)."""
        v = self.view()
        return v.numel() * v.element_size()
