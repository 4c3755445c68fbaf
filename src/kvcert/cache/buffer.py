"""Token-axis growable tensors with amortised O(1) appends (capacity doubling): :class:`GrowBuffer` (any dtype)
and :class:`LogBuffer` (non-negative witnesses stored as 8-bit logarithmic codes that decode upwards)."""

from __future__ import annotations

import numpy as np
import torch

from kvcert.quant import logcode

#: an index into a ``[B, H, T, ...]`` buffer: ``(rows, heads, tokens)`` as ints, slices or a boolean token mask
TokenIndex = tuple[int | slice | torch.Tensor, ...]


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
        index = index.to(live.device)  # no-op when the index is already on the data's device (no host sync)
        idx = index.reshape(*index.shape, *([1] * (live.dim() - 3))).expand(*index.shape, *live.shape[3:])
        kept = torch.gather(live, 2, idx)
        self._data[:, :, : kept.shape[2]] = kept
        self.n = kept.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of the live prefix (not the reserved capacity)."""
        v = self.view()
        return v.numel() * v.element_size()

    def write(self, index: TokenIndex, values: torch.Tensor | float) -> bool:
        """``view()[index] = values``. Returns False (nothing else changed; see :meth:`LogBuffer.write`)."""
        self.view()[index] = values
        return False


class LogBuffer:
    """A :class:`GrowBuffer` of non-negative float32 witnesses ``[B, H, T, *tail]`` *stored* as 8-bit
    :mod:`kvcert.quant.logcode` codes with one base exponent per (row, head), plus the decoded float32 copy
    the read path reads (decode scratch, as for the served K/V: a kernel would decode in registers).

    Contract: every value :meth:`view` / :meth:`array` returns is ``>=`` the value last written at that place
    (``docs/math.md#compact-witnesses``); ``0`` stays exactly ``0``. :attr:`nbytes` counts the stored codes and
    base exponents only. A head's base is set by its first positive write; a later value above its top code
    raises the base (:func:`kvcert.quant.logcode.rebase`: every stored value can only grow) and is counted
    in :attr:`rebases`.
    """

    def __init__(self, like: torch.Tensor, capacity: int = 256) -> None:
        b, h = like.shape[:2]
        self.codes = GrowBuffer(like.to(torch.uint8), capacity)
        self.decoded = GrowBuffer(like.to(torch.float32), capacity)
        self.base = torch.full((b, h), logcode.UNSET, dtype=torch.int32, device=like.device)
        self.rebases = 0

    @property
    def n(self) -> int:
        """Number of live tokens."""
        return self.codes.n

    @property
    def dtype(self) -> torch.dtype:
        """Element type of the decoded view (float32)."""
        return self.decoded.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of :meth:`view`."""
        return self.decoded.shape

    def view(self) -> torch.Tensor:
        """The decoded live prefix ``[B, H, n, *tail]`` (float32, each entry ``>=`` the value written)."""
        return self.decoded.view()

    def array(self) -> np.ndarray:
        """The decoded allocation as numpy (see :meth:`GrowBuffer.array`)."""
        return self.decoded.array()

    def _per_element(self, t: torch.Tensor, index: TokenIndex) -> torch.Tensor:
        """``t[B, H]`` broadcast to every element of ``view()[index]``."""
        live = self.codes.view()
        return t.view(*t.shape, *([1] * (live.dim() - 2))).expand(live.shape)[index]

    def write(self, index: TokenIndex, values: torch.Tensor | float) -> bool:
        """Store ``values`` (non-negative, broadcast to ``view()[index]``) at ``index``: set the base of heads
        written positive for the first time, raise the base of heads whose new values exceed their top code,
        encode, and refresh the decoded copy. Returns True when some base was raised (values elsewhere in that
        head then decode larger, never smaller)."""
        live = self.codes.view()
        target = live[index]
        x = torch.as_tensor(values, device=live.device)
        x = torch.broadcast_to(x if x.is_floating_point() else x.to(torch.float64), target.shape)  # no rounding
        n, unsettled = logcode.exponent_settle(x)
        base, shift, codes, flags = self._plan(x, n, index)
        # the write's one host sync: whether the exponents settled, how many bases rise, the encoding's checks
        off, rebased, negative, above_top = torch.cat([unsettled.view(1), (shift > 0).sum().view(1), flags]).tolist()
        if off:  # not seen in practice (two correction rounds settle the float64 log2 guess); the exact search decides
            n = logcode.exponent_up(x)
            base, shift, codes, flags = self._plan(x, n, index)
            rebased, negative, above_top = torch.cat([(shift > 0).sum().view(1), flags]).tolist()
        logcode.check_flags(bool(negative), bool(above_top), x)
        raised = rebased > 0
        self.base = base
        if raised:
            self.rebases += int(rebased)
            live.copy_(logcode.rebase(live, shift.view(*shift.shape, *([1] * (live.dim() - 2)))))
        live[index] = codes
        if raised:
            self.decoded.view().copy_(logcode.decode(live, self.base.view(*self.base.shape, *([1] * (live.dim() - 2)))))
        else:
            self.decoded.view()[index] = logcode.decode(live[index], self._per_element(self.base, index))
        return raised

    def _plan(
        self, x: torch.Tensor, n: torch.Tensor, index: TokenIndex
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """On the device, nothing stored yet: the bases after writing ``x`` (exponents ``n``) at ``index`` — set
        for heads written positive for the first time, raised by ``shift`` where a new value exceeds the top code —
        the shift per (row, head), the codes of ``x`` against the new bases and the encoding's flags
        (:func:`~kvcert.quant.logcode.encode_flagged`)."""
        live = self.codes.view()
        finite_pos = torch.isfinite(x) & (x > 0) & (n <= logcode.MAX_N)
        heads = self._per_element(torch.arange(self.base.numel(), device=live.device).view(self.base.shape), index)
        need = torch.full((self.base.numel(),), logcode.MIN_N - 1, dtype=torch.int32, device=live.device)
        # entries that set no exponent offer MIN_N − 1, the neutral start (no boolean indexing: no host sync)
        offered = torch.where(finite_pos, n, logcode.MIN_N - 1).to(need.dtype)
        need = need.scatter_reduce(0, heads.flatten(), offered.flatten(), "amax").view(self.base.shape)
        seen = need >= logcode.MIN_N
        unset = self.base == logcode.UNSET
        base = torch.where(seen & unset, logcode.initial_base(need), self.base)
        shift = torch.where(seen & ~unset, need - (base + logcode.TOP - 1), 0).clamp(min=0)
        base = base + shift
        codes, flags = logcode.encode_flagged(x, self._per_element(base, index), n)
        return base, shift, codes, flags

    def append(self, x: torch.Tensor) -> None:
        """Append ``x[B, H, t, *tail]`` (non-negative) along the token axis."""
        t = x.shape[2]
        self.codes.append(torch.zeros(x.shape, dtype=torch.uint8, device=x.device))
        self.decoded.append(torch.zeros(x.shape, dtype=torch.float32, device=x.device))
        self.write((slice(None), slice(None), slice(self.n - t, self.n)), x)

    def drop_before(self, start: int) -> None:
        """Discard tokens ``[0, start)``."""
        self.codes.drop_before(start)
        self.decoded.drop_before(start)

    def gather(self, index: torch.Tensor) -> None:
        """Keep only tokens ``index[B, H, C]`` (eviction)."""
        self.codes.gather(index)
        self.decoded.gather(index)

    @property
    def nbytes(self) -> int:
        """Stored bytes: the live codes (one byte per value) and the per-(row, head) base exponents."""
        return self.codes.nbytes + self.base.numel() * self.base.element_size()
