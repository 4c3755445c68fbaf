"""One fused CPU kernel (numba) for a whole ``log8`` witness write: exponents, bases, codes and decoded values.

:class:`kvcert.cache.buffer.LogBuffer` plans a write in some forty small tensor operations
(:func:`kvcert.quant.logcode.exponent_settle`, the per-head exponent maximum, the base update, the encoder and,
at the store, the decoder). On CPU tensors each operation costs more in dispatch than in arithmetic, and a decode
step writes three such witnesses per layer. :func:`plan` computes the same plan in one pass over the values.

It refines the tensor path exactly, element by element (``tests/quant/test_logcode_numba.py`` pins it):

* the exponent is the unique ``n(x) = min{n in [MIN_N, MAX_N + 1] : n = MAX_N + 1 or dec(n) >= x}`` for positive
  finite ``x`` (``MIN_N`` otherwise): a float64 ``log2`` guess corrected by exact float64 comparisons against
  ``dec`` until neither correction applies, so, as for :func:`~kvcert.quant.logcode.exponent_up`, the result does
  not depend on the accuracy of ``log2`` (and there is never an unsettled exponent to read back);
* ``dec(n) = F[n mod 16] * 2^floor(n/16)`` is the same float32 product (exact: ``F[k]`` has 24 significant bits
  and the factor is a power of two in the normal range), compared in float64 as the tensor path compares it;
* bases, shifts and codes follow :meth:`kvcert.cache.buffer.LogBuffer._plan` and
  :func:`~kvcert.quant.logcode.encode_checked` integer for integer, and the decoded values are
  :func:`~kvcert.quant.logcode.decode` of the codes against the new bases.

The write path uses it where the read path uses its CPU kernels: on CPU tensors unless
:data:`kvcert.quant.kernel_env.ENV` forces another backend (``kvcert.kernels.active``), so the host-sync tests of the
CUDA paths run the tensor path they pin. It is imported on first use, never with the cache package
(:mod:`kvcert.quant.kernel_env` says why).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numba
import numpy as np
import torch

from kvcert.quant import logcode

_F32 = logcode.FRACTIONS.numpy().copy()
_SUB, _MIN_N, _MAX_N, _TOP = logcode.SUB, logcode.MIN_N, logcode.MAX_N, logcode.TOP
_INF_CODE, _HEADROOM, _UNSET = logcode.INF_CODE, logcode.HEADROOM, logcode.UNSET
_NO_HEADS = np.zeros(0, np.int64)


@numba.njit(cache=True, nogil=True)
def _dec(n: int, f32: np.ndarray) -> np.float32:  # pragma: no cover - compiled (tested via numba)
    """``dec(n)`` as float32 for ``MIN_N <= n <= MAX_N`` (exact product, see the module docstring)."""
    octave = n // _SUB  # floor division, as torch.div(..., rounding_mode="floor")
    return f32[n - octave * _SUB] * np.float32(math.ldexp(1.0, octave))


@numba.njit(cache=True, nogil=True)
def _exponent(x: float, f32: np.ndarray) -> int:  # pragma: no cover - compiled (tested via numba)
    """``n(x)`` for positive finite float64 ``x``: the smallest ``n`` in ``[MIN_N, MAX_N + 1]`` with ``n = MAX_N + 1``
    or ``dec(n) >= x`` (``dec`` strictly increasing: step up while below, then down while the previous one reaches)."""
    n = int(min(max(math.ceil(_SUB * math.log2(x)), _MIN_N), _MAX_N + 1))
    while n <= _MAX_N and np.float64(_dec(n, f32)) < x:
        n += 1
    while n > _MIN_N and np.float64(_dec(n - 1, f32)) >= x:
        n -= 1
    return n


@numba.njit(cache=True, nogil=True)
def _plan(
    x: np.ndarray, heads: np.ndarray, per_head: int, base: np.ndarray, f32: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool, bool]:  # pragma: no cover - compiled
    """The kernel of :func:`plan` on flat ``x`` (float64) and ``base`` (int32); value ``i`` belongs to head
    ``heads[i]`` (int64), or ``i // per_head`` when ``heads`` is empty. Returns
    ``(n, codes, decoded, new_base, shift, negative, above_top)``."""
    size = x.size
    if heads.size == 0:
        heads = np.arange(size) // per_head
    n = np.empty(size, np.int32)
    need = np.full(base.size, _MIN_N - 1, np.int64)
    negative = False
    for i in range(size):
        v = x[i]
        e = _MIN_N
        if v > 0.0 and math.isfinite(v):
            e = _exponent(v, f32)
            if e <= _MAX_N and e > need[heads[i]]:
                need[heads[i]] = e
        if v < 0.0:
            negative = True
        n[i] = e
    new = np.empty(base.size, np.int32)
    shift = np.zeros(base.size, np.int32)
    for j in range(base.size):
        b = int(base[j])
        top = int(need[j])
        if top >= _MIN_N:  # seen: some entry of the head is positive, finite, within range
            if b == _UNSET:
                b = max(top - _HEADROOM, _MIN_N)
            else:
                rise = max(top - (b + _TOP - 1), 0)
                shift[j] = rise
                b += rise
        new[j] = b
    codes = np.empty(size, np.uint8)
    decoded = np.empty(size, np.float32)
    above_top = False
    for i in range(size):
        v = x[i]
        c = 0
        if math.isnan(v) or math.isinf(v) or n[i] > _MAX_N:
            c = _INF_CODE
        elif v > 0.0:
            c = max(int(n[i]) - int(new[heads[i]]) + 1, 1)
            if c > _TOP:
                above_top = True
        codes[i] = c & 0xFF  # as the tensor path's uint8 cast (an above-top code is never stored)
        if codes[i] == 0:
            decoded[i] = 0.0
        elif codes[i] == _INF_CODE:
            decoded[i] = np.inf
        else:
            decoded[i] = _dec(min(max(int(new[heads[i]]) + int(codes[i]) - 1, _MIN_N), _MAX_N), f32)
    return n, codes, decoded, new, shift, negative, above_top


class Plan(NamedTuple):
    """A ``log8`` write planned by :func:`plan`: exponents ``n`` (int32), ``codes`` (uint8) and their ``decoded`` values
    (float32), shaped as the values; the bases after the write ``base`` and their rise ``shift`` (int32, shaped as the
    bases given); ``rebased``: how many bases rise; ``negative`` / ``above_top``: the encoder's two checks failed."""

    n: torch.Tensor
    codes: torch.Tensor
    decoded: torch.Tensor
    base: torch.Tensor
    shift: torch.Tensor
    rebased: int
    negative: bool
    above_top: bool


def plan(x: torch.Tensor, heads: torch.Tensor | None, base: torch.Tensor) -> Plan:
    """Plan writing the non-negative witnesses ``x`` (CPU) to a ``log8`` buffer whose per-(row, head) base exponents
    are ``base`` (int32), ``heads`` (int64, shaped as ``x``) giving each value's flat index into ``base``; ``None``:
    ``x`` is ``[B, H, ...]`` over the ``[B, H]`` bases, in order.

    Same plan as the tensor path (module docstring): a head written positive for the first time gets the base
    ``max(n_max − HEADROOM, MIN_N)``; a set base rises by ``shift = max(n_max − (e + TOP − 1), 0)`` so the largest new
    value fits the top code; each positive finite value gets the code ``max(n(x) − e' + 1, 1)`` against its head's new
    base ``e'`` (``dec(e' + c − 1) >= x``), ``0`` stays ``0`` and NaN, ``±inf`` and values beyond ``dec(MAX_N)`` get
    :data:`~kvcert.quant.logcode.INF_CODE`. The codes are valid only when neither check failed."""
    if x.dtype not in (torch.float32, torch.float64):
        x = x.to(torch.float64)  # exact: every integer and narrower float is a float64
    x64 = np.ascontiguousarray(x.detach().numpy(), dtype=np.float64).reshape(-1)
    flat_heads = _NO_HEADS if heads is None else np.ascontiguousarray(heads.numpy(), dtype=np.int64).reshape(-1)
    per_head = max(x64.size // max(base.numel(), 1), 1)
    n, codes, decoded, new, shift, negative, above_top = _plan(
        x64, flat_heads, per_head, np.ascontiguousarray(base.numpy(), dtype=np.int32).reshape(-1), _F32
    )
    # numpy reshapes, then one from_numpy each: a torch ``view`` per output costs more than the kernel
    shape, base_shape = tuple(x.shape), tuple(base.shape)
    return Plan(
        torch.from_numpy(n.reshape(shape)),
        torch.from_numpy(codes.reshape(shape)),
        torch.from_numpy(decoded.reshape(shape)),
        torch.from_numpy(new.reshape(base_shape)),
        torch.from_numpy(shift.reshape(base_shape)),
        int(np.count_nonzero(shift)),
        bool(negative),
        bool(above_top),
    )
