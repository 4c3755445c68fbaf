"""Token-axis growable tensors with amortised O(1) appends (capacity doubling): :class:`GrowBuffer` (any dtype)
and :class:`LogBuffer` (non-negative witnesses stored as 8-bit logarithmic codes that decode upwards), and
:class:`WriteBatch`, which stores writes to several of them after one host read-back."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from kvcert.cache.host_pages import HostTokens
from kvcert.cache.paged import CellTokens
from kvcert.checks import Checks, deferred
from kvcert.quant import logcode
from kvcert.quant.kernel_env import fused_log8

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
        # the allocations keep this dtype and device; under KVCERT_KERNEL=torch|triton the torch copies (the path a
        # CUDA cache runs, whose host syncs tests/attention/test_host_syncs.py counts on CPU)
        self._numpy_ok = numpy_copyable(self._data) and fused_log8(self._data.device)
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

    @property
    def device(self) -> torch.device:
        """Device of the stored tensor."""
        return self._data.device

    def _reserve(self, t: int) -> None:
        """Make room for ``t`` more tokens (capacity doubling)."""
        if self.n + t > self._data.shape[2]:
            cap = max(2 * self._data.shape[2], 2 * (self.n + t))  # a large chunk leaves room to grow
            new = self._alloc(cap, self._data.dtype, self._data.device)
            new[:, :, : self.n] = self._data[:, :, : self.n]
            self._data = new

    def append(self, x: torch.Tensor) -> None:
        """Append ``x[B, H, t, *tail]`` along the token axis (on CPU, same dtype, numba backend: a numpy copy of the
        same elements, which costs less than a torch one for the few entries of a decode step)."""
        if self._numpy_ok and x.dtype == self._data.dtype and numpy_copyable(x):
            self.append_array(x.numpy())
            return
        t = x.shape[2]
        self._reserve(t)
        self._data.narrow(2, self.n, t).copy_(x)  # as ``[:, :, n : n + t] = x``, without the indexing machinery
        self.n += t

    def append_array(self, x: np.ndarray) -> None:
        """Append the numpy ``x[B, H, t, *tail]`` of this buffer's dtype (:attr:`numpy_ok` buffers only; raises
        ``ValueError`` otherwise): the numpy copy of :meth:`append`."""
        if not self._numpy_ok or x.dtype != self.array().dtype:
            raise ValueError(
                f"append_array: a numpy append to a buffer of {self.dtype} on the numba backend, got {x.dtype}"
            )
        t = x.shape[2]
        self._reserve(t)
        self.array()[:, :, self.n : self.n + t] = x
        self.n += t

    @property
    def numpy_ok(self) -> bool:
        """Whether appends copy through numpy (CPU, a numpy dtype, the numba backend): :meth:`append_array` works."""
        return self._numpy_ok

    def append_fill(self, t: int, value: bool | float) -> None:
        """Append ``t`` tokens whose every element is ``value`` (as :meth:`append` of a full tensor, without one)."""
        self._reserve(t)
        if self._numpy_ok:
            self.array()[:, :, self.n : self.n + t] = value
        else:
            self._data.narrow(2, self.n, t).fill_(value)
        self.n += t

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of :meth:`view` without building the view."""
        b, h, tail = self._shape
        return (b, h, self.n, *tail)

    def view(self) -> torch.Tensor:
        """The live prefix ``[B, H, n, *tail]`` (shares storage)."""
        return self._data.narrow(2, 0, self.n)

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
        """Bytes of the live prefix (not the reserved capacity), from :attr:`shape` (no view is built: the
        device-budget checks read it at every write)."""
        return math.prod(self.shape) * self._data.element_size()

    def write(self, index: TokenIndex, values: torch.Tensor | float) -> None:
        """``view()[index] = values``."""
        self.view()[index] = values


#: dtypes whose CPU tensors numpy views element for element (bit for bit)
_NUMPY_DTYPES = frozenset(
    (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
)


def numpy_copyable(x: torch.Tensor) -> bool:
    """Whether ``x.numpy()`` views ``x``'s elements as they are: a CPU tensor of a numpy dtype, no gradient, no
    conjugate or negative bit."""
    return (
        x.device.type == "cpu"
        and x.dtype in _NUMPY_DTYPES
        and not x.requires_grad
        and not x.is_conj()
        and not x.is_neg()
    )


_ZERO_SCALARS: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _zero_scalars(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 0-dim value, exponent and code of a zero write on ``device`` (float32 0, int32 ``MIN_N``, uint8 0), made
    once per device: a zero plan only expands them (its tensors are read, never written in place)."""
    if device not in _ZERO_SCALARS:
        _ZERO_SCALARS[device] = (
            torch.zeros((), dtype=torch.float32, device=device),
            torch.full((), logcode.MIN_N, dtype=torch.int32, device=device),
            torch.zeros((), dtype=torch.uint8, device=device),
        )
    return _ZERO_SCALARS[device]


#: the index of every (row, head): ``index[:2]`` of a write to whole heads
_ALL2 = (slice(None), slice(None))
#: the index of every token of every (row, head)
_ALL3 = (*_ALL2, slice(None))


class LogBuffer:
    """A :class:`GrowBuffer` of non-negative float32 witnesses ``[B, H, T, *tail]`` *stored* as 8-bit
    :mod:`kvcert.quant.logcode` codes with one base exponent per (row, head), plus the decoded float32 copy
    the read path reads (decode scratch, as for the served K/V: a kernel would decode in registers).

    Contract: every value :meth:`view` / :meth:`array` returns is ``>=`` the value last written at that place
    (``docs/math.md#compact-witnesses``); ``0`` stays exactly ``0``. :attr:`nbytes` counts the stored codes and
    base exponents only. A head's base is set by its first positive write; a later value above its top code
    raises the base (:func:`kvcert.quant.logcode.rebase`: every stored value can only grow) and is counted
    in :attr:`rebases`. The codes are a :class:`GrowBuffer` of their own, or ``codes`` given (a paged store's
    :class:`~kvcert.cache.paged.CellTokens`: the codes in the cells of a serving engine's pages), written through
    the same calls, so both hold the same codes and decode to the same values.
    """

    def __init__(self, like: torch.Tensor, capacity: int = 256, codes: CellTokens | None = None) -> None:
        b, h = like.shape[:2]
        self.codes: GrowBuffer | CellTokens = GrowBuffer(like.to(torch.uint8), capacity) if codes is None else codes
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

    def _spread(self, t: torch.Tensor, index: TokenIndex | None, x: torch.Tensor) -> torch.Tensor:
        """``t[B, H]`` broadcast to every element ``x`` goes to: ``view()[index]``, or with ``index=None`` each
        element of an appended ``x[B, H, t, *tail]``."""
        live = self.codes.view()
        full = t.view(*t.shape, *([1] * (live.dim() - 2)))
        return full.expand(x.shape) if index is None else full.expand(live.shape)[index]

    def write(self, index: TokenIndex, values: torch.Tensor | float) -> bool:
        """Store ``values`` (non-negative, broadcast to ``view()[index]``) at ``index``: set the base of heads
        written positive for the first time, raise the base of heads whose new values exceed their top code,
        encode, and refresh the decoded copy (one host sync; :class:`WriteBatch` for several buffers). Returns
        True when some base was raised (values elsewhere in that head then decode larger, never smaller). Raises
        ``ValueError`` on a negative value, storing nothing."""
        writes = WriteBatch()
        writes.write(self, index, values)
        writes.commit()
        return self in writes.raised

    def append(self, x: torch.Tensor) -> None:
        """Append ``x[B, H, t, *tail]`` (non-negative) along the token axis (as :meth:`write`)."""
        writes = WriteBatch()
        writes.append(self, x)
        writes.commit()

    def _plan(
        self, x: torch.Tensor, n: torch.Tensor, unsettled: torch.Tensor, index: TokenIndex | None, base: torch.Tensor
    ) -> _Planned:
        """On the device, nothing stored: writing ``x`` (exponents ``n``; ``unsettled``: the 0-dim flag of
        :func:`~kvcert.quant.logcode.exponent_settle`) at ``index`` (``None``: appended) of this buffer with bases
        ``base``. The new bases are set for heads written positive for the first time and raised by ``shift``
        where a new value exceeds the top code; the codes of ``x`` are against the new bases. The encoder's
        fail-closed check (:func:`~kvcert.quant.logcode.encode_checked`) goes to the active
        :func:`kvcert.checks.deferred` block (:class:`WriteBatch` plans inside its own)."""
        finite_pos = torch.isfinite(x) & (x > 0) & (n <= logcode.MAX_N)
        heads = self._spread(torch.arange(base.numel(), device=x.device).view(base.shape), index, x)
        need = torch.full((base.numel(),), logcode.MIN_N - 1, dtype=torch.int32, device=x.device)
        # entries that set no exponent offer MIN_N − 1, the neutral start (no boolean indexing: no host sync)
        offered = torch.where(finite_pos, n, logcode.MIN_N - 1).to(need.dtype)
        need = need.scatter_reduce(0, heads.flatten(), offered.flatten(), "amax").view(base.shape)
        seen = need >= logcode.MIN_N
        unset = base == logcode.UNSET
        new = torch.where(seen & unset, logcode.initial_base(need), base)
        shift = torch.where(seen & ~unset, need - (new + logcode.TOP - 1), 0).clamp(min=0)
        new = new + shift
        codes = logcode.encode_checked(x, self._spread(new, index, x), n)
        summary = torch.cat([unsettled.view(1), (shift > 0).sum().view(1)]).to(torch.int64)
        return _Planned(self, index, x, n, new, shift, codes, summary)

    def _plan_fused(self, x: torch.Tensor, index: TokenIndex | None, base: torch.Tensor) -> _Planned:
        """:meth:`_plan` on CPU in one :func:`kvcert.quant.logcode_numba.plan` call, exponents searched exactly (so
        nothing is unsettled): the same bases, shifts and codes, the same deferred encoder check, and the decoded
        values :meth:`_store` would compute (``tests/quant/test_logcode_numba.py`` pins the equality per element)."""
        whole_heads = index is None or (
            len(index) == 3 and all(isinstance(i, slice) for i in index) and index[:2] == _ALL2
        )
        from kvcert.quant.logcode_numba import plan  # numba on first use only (kvcert.quant.kernel_env says why)

        dev = x.device
        heads = None if whole_heads else self._spread(torch.arange(base.numel(), device=dev).view(base.shape), index, x)
        p = plan(x, heads, base)
        if p.negative or p.above_top:  # a check that cannot fail is not recorded
            logcode.check_codes(x, torch.tensor(p.negative, device=dev), torch.tensor(p.above_top, device=dev))
        return _Planned(self, index, x, p.n, p.base, p.shift, p.codes, (0, p.rebased), p.decoded)

    def _plan_zeros(self, shape: tuple[int, ...], index: TokenIndex | None, base: torch.Tensor) -> _Planned:
        """:meth:`_plan` of writing zeros of ``shape`` at ``index`` (``None``: appended), built directly: a zero is
        code 0 against any base (which decodes to 0) and sets no exponent, so the bases stay, nothing can fail a
        check, and no exponent is searched (``n`` is ``MIN_N``, what the search gives a zero)."""
        zero, n_zero, code_zero = _zero_scalars(base.device)
        x = zero.expand(shape)
        return _Planned(
            self, index, x, n_zero.expand(shape), base, torch.zeros_like(base), code_zero.expand(shape), (0, 0), x
        )

    def _store(self, p: _Planned, rebased: int) -> None:
        """Store the checked plan ``p`` (this buffer's next write, ``rebased``: how many of its bases rise)."""
        self.base = p.base
        if rebased:
            live = self.codes.view()
            self.rebases += rebased
            live = logcode.rebase(live, p.shift.view(*p.shift.shape, *([1] * (live.dim() - 2))))
            self.codes.write(_ALL3, live)  # every stored code re-coded in place: max(c − shift, 1)
            self.decoded.view().copy_(logcode.decode(live, self.base.view(*self.base.shape, *([1] * (live.dim() - 2)))))
        decoded = p.decoded if p.decoded is not None else logcode.decode(p.codes, self._spread(self.base, p.index, p.x))
        if p.index is None:
            self.codes.append(p.codes)
            self.decoded.append(decoded)
        else:
            self.codes.write(p.index, p.codes)
            self.decoded.view()[p.index] = decoded

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


def _settle_together(xs: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`~kvcert.quant.logcode.exponent_settle` of every tensor of ``xs`` in one call: ``(n, unsettled)`` per
    tensor, ``n`` shaped as it, ``unsettled`` the flag of the whole call (True when any entry may be off)."""
    if not xs:
        return []
    if len(xs) == 1:
        return [logcode.exponent_settle(xs[0])]
    flat = torch.cat([x.reshape(-1).to(torch.float64) for x in xs])
    n, unsettled = logcode.exponent_settle(flat)
    parts = n.split([x.numel() for x in xs])
    return [(part.view(x.shape), unsettled) for part, x in zip(parts, xs, strict=True)]


@dataclass
class _Planned:
    """A :class:`LogBuffer` write planned on the device, nothing stored yet: ``x`` (exponents ``n``) at ``index``
    (``None``: appended), the buffer's bases after it, the ``shift`` per (row, head) that raises them, the codes,
    ``summary``: exponents unsettled, bases rising (int64 ``[2]`` on the device, or two ints when the planner knows
    them on the host: the fused and the zero plans, which need no read-back), and, when the planner computed them,
    the codes' decoded values against the new bases."""

    buffer: LogBuffer
    index: TokenIndex | None
    x: torch.Tensor
    n: torch.Tensor
    base: torch.Tensor
    shift: torch.Tensor
    codes: torch.Tensor
    summary: torch.Tensor | tuple[int, int]
    decoded: torch.Tensor | None = None


class WriteBatch:
    """Writes and appends to token buffers, deferred checks, counters and other state changes, stored by
    :meth:`commit` after *one* host read-back for all of them. :class:`LogBuffer` writes are planned on the device
    as they are recorded; everything else runs at the commit, in the order recorded.

    Contract: each :class:`LogBuffer` write is planned against the buffer as the writes recorded before it leave it
    (a buffer may take several writes: each sees the earlier ones' bases), so committing gives exactly what the
    same :meth:`LogBuffer.write` / :meth:`LogBuffer.append` calls in that order give. A write's index is taken
    against the buffer as it stands when the write is recorded; a :class:`LogBuffer` with an append recorded takes
    no further write until the commit (``ValueError``). A commit that raises stores nothing.
    """

    def __init__(self) -> None:
        self._ops: list[_Planned | Callable[[], object]] = []
        self._checks = Checks()
        self._counts: dict[str, torch.Tensor] = {}
        #: the :class:`LogBuffer` s whose bases the last :meth:`commit` raised
        self.raised: set[LogBuffer] = set()

    def base_of(self, buffer: LogBuffer) -> torch.Tensor:
        """``buffer``'s bases after the writes recorded so far."""
        return next(
            (p.base for p in reversed(self._ops) if isinstance(p, _Planned) and p.buffer is buffer), buffer.base
        )

    def write(self, buffer: GrowBuffer | LogBuffer, index: TokenIndex, values: torch.Tensor | float) -> None:
        """Record ``buffer.view()[index] = values`` (for a :class:`LogBuffer`: non-negative, stored upwards; a
        Python scalar zero is planned directly, as :meth:`append_zeros`, with the same codes, bases and values)."""
        if isinstance(buffer, GrowBuffer):
            self.then(partial(buffer.write, index, values))
            return
        if any(isinstance(p, _Planned) and p.buffer is buffer and p.index is None for p in self._ops):
            raise ValueError("a write after an append to the same buffer needs a commit in between")
        target = buffer.codes.view()[index]
        if isinstance(values, int | float) and values == 0:  # a literal zero (as a repair's radius): no search
            self._ops.append(buffer._plan_zeros(target.shape, index, self.base_of(buffer)))
            return
        x = torch.as_tensor(values, device=target.device)
        x = torch.broadcast_to(x if x.is_floating_point() else x.to(torch.float64), target.shape)  # no rounding
        with deferred(self._checks):
            if fused_log8(x.device):
                self._ops.append(buffer._plan_fused(x, index, self.base_of(buffer)))
            else:
                self._ops.append(buffer._plan(x, *logcode.exponent_settle(x), index, self.base_of(buffer)))

    def append(self, buffer: GrowBuffer | HostTokens | LogBuffer, x: torch.Tensor) -> None:
        """Record appending ``x[B, H, t, *tail]`` along the token axis of ``buffer`` (a paged store's host tier,
        :class:`~kvcert.cache.host_pages.HostTokens`, as a :class:`GrowBuffer`)."""
        if not isinstance(buffer, LogBuffer):
            self.then(partial(buffer.append, x))
            return
        self.appends([(buffer, x)])

    def appends(self, items: Sequence[tuple[GrowBuffer | LogBuffer, torch.Tensor]]) -> None:
        """Record each ``(buffer, x)`` append, in order (as :meth:`append` one by one). The :class:`LogBuffer`
        values off CPU share one :func:`~kvcert.quant.logcode.exponent_settle` (its cost is a fixed number of small
        device operations per call, whatever the size), with one unsettled flag for all of them: an exponent left
        unsettled anywhere replans every one of these writes at the commit, each from its exact exponents. On CPU
        each is one :meth:`LogBuffer._plan_fused` call."""
        logs = [x if x.is_floating_point() else x.to(torch.float64) for b, x in items if isinstance(b, LogBuffer)]
        fused = [fused_log8(x.device) for x in logs]
        settled = iter(_settle_together([x for x, f in zip(logs, fused, strict=True) if not f]))
        values, flags = iter(logs), iter(fused)
        for buffer, x in items:
            if isinstance(buffer, GrowBuffer):
                self.then(partial(buffer.append, x))
                continue
            x = next(values)
            with deferred(self._checks):
                if next(flags):
                    self._ops.append(buffer._plan_fused(x, None, self.base_of(buffer)))
                else:
                    self._ops.append(buffer._plan(x, *next(settled), None, self.base_of(buffer)))

    def append_zeros(self, buffer: GrowBuffer | LogBuffer, shape: tuple[int, ...]) -> None:
        """Record appending zeros ``[B, H, t, *tail]`` of ``shape`` (as :meth:`append` of a zero tensor, float32 for a
        :class:`GrowBuffer` of floats, without the exponent search of a :class:`LogBuffer`)."""
        if isinstance(buffer, GrowBuffer):
            if tuple(shape) != buffer.shape[:2] + (shape[2],) + buffer.shape[3:]:
                raise ValueError(f"append_zeros: shape {tuple(shape)} does not extend a buffer of shape {buffer.shape}")
            self.append_fill(buffer, shape[2], 0)
            return
        self._ops.append(buffer._plan_zeros(shape, None, self.base_of(buffer)))

    def append_fill(self, buffer: GrowBuffer, t: int, value: bool | float) -> None:
        """Record appending ``t`` tokens of ``buffer`` whose every element is ``value``."""
        self.then(partial(buffer.append_fill, t, value))

    def then(self, change: Callable[[], object]) -> None:
        """Record a state change to run at the commit, in order, once every check has passed."""
        self._ops.append(change)

    def require(self, bad: torch.Tensor, error: Callable[[], Exception]) -> None:
        """Record a check (a :data:`kvcert.checks.Sink`): the commit raises ``error()`` and stores nothing
        when the 0-dim bool ``bad`` is True."""
        self._checks(bad, error)

    def count(self, name: str, value: torch.Tensor) -> None:
        """Add the 0-dim integer tensor ``value`` to the counter ``name``, read back with the commit."""
        value = value.view(1).to(torch.int64)
        self._counts[name] = self._counts[name] + value if name in self._counts else value

    def indices(self, buffer: LogBuffer) -> list[TokenIndex]:
        """The indices of the writes (not appends) recorded so far to ``buffer``, in order."""
        return [p.index for p in self._ops if isinstance(p, _Planned) and p.buffer is buffer and p.index is not None]

    def commit(self) -> dict[str, int]:
        """Check everything recorded, then store it and return the :meth:`count` counters, with one host sync
        (two when some exponent did not settle: those writes are planned again from
        :func:`~kvcert.quant.logcode.exponent_up`, and their encoder checks made again and read back with the second).
        Nothing is stored unless every check passes: the first failed check (a :meth:`require` check or a planned
        write's encoder check, :func:`~kvcert.quant.logcode.encode_checked`, in the order recorded) raises its error.
        An unsettled plan's check may raise before the replan: a negative entry does not depend on the exponents,
        and no plan's codes exceed the top code of the bases planned from its own exponents, settled or not.
        Clears what was recorded; sets :attr:`raised`."""
        planned = [p for p in self._ops if isinstance(p, _Planned)]
        checks, counts, self._checks, self._counts = self._checks, self._counts, Checks(), {}
        try:
            on_device = [p.summary for p in planned if isinstance(p.summary, torch.Tensor)]
            back = checks.read_back(on_device + list(counts.values()))  # the one host sync (none if nothing to read)
            assert back is not None  # no guard
            read = iter(back[2 * i : 2 * i + 2] for i in range(len(on_device)))
            rows = [list(p.summary) if isinstance(p.summary, tuple) else next(read) for p in planned]
            counted = dict(zip(counts, back[2 * len(on_device) :], strict=True))
            if any(row[0] for row in rows):  # not seen in practice: the exact search decides the unsettled exponents
                recheck = Checks()
                with deferred(recheck):
                    self._replan({id(p) for p, row in zip(planned, rows, strict=True) if row[0]})
                planned = [p for p in self._ops if isinstance(p, _Planned)]
                replanned = recheck.read_back([torch.as_tensor(p.summary) for p in planned])  # all on the device
                assert replanned is not None
                rows = [replanned[2 * i : 2 * i + 2] for i in range(len(planned))]
        finally:
            ops, self._ops = self._ops, []
        rebased = {id(p): row[1] for p, row in zip(planned, rows, strict=True)}
        self.raised = set()
        for op in ops:
            if isinstance(op, _Planned):
                op.buffer._store(op, rebased[id(op)])
                if rebased[id(op)]:
                    self.raised.add(op.buffer)
            else:
                op()
        return counted

    def _replan(self, unsettled: set[int]) -> None:
        """Plan every :class:`LogBuffer` write again, in order, with the exact exponents where ``unsettled``
        holds its plan's id (the others settled: their exponents are exact already)."""
        ops, self._ops = self._ops, []
        for op in ops:
            if isinstance(op, _Planned):
                n = logcode.exponent_up(op.x) if id(op) in unsettled else op.n
                settled = torch.zeros((), dtype=torch.bool, device=op.x.device)
                op = op.buffer._plan(op.x, n, settled, op.index, self.base_of(op.buffer))
            self._ops.append(op)
