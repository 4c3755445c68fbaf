"""One fused CPU kernel (numba) for the keyed dither of :func:`kvcert.quant.dither.keyed_uniform`.

The tensor form hashes the counter ``(seed, request[b], layer, head h, positions[b, t], channel d)`` through six
splitmix64 finalisers, each some ten small int64 tensor operations; for the few tokens of a write block that is
mostly dispatch, and a dithered block is encoded and then decoded (two draws). :func:`keyed_uniform` computes the
same words in one pass: the tensor form's int64 arithmetic wraps modulo ``2^64``, as unsigned 64-bit arithmetic
does, its masked right shift is the unsigned shift, and the last step (the top 24 bits times ``2^-24``, minus ½)
is exact in float64 and in float32. So every value equals the tensor form's bit for bit
(``tests/quant/test_dither_numba.py`` pins it per element over the whole int64 range of the key's fields).

A block write then encodes the block and decodes it again (the served values are the decoded codes).
:func:`round_trip` does the quantiser and the reconstruction in one pass over the block, from one draw, with the
tensor form's float64 operations in its order (``v = x/s + u``, ``code = round(v)`` to nearest even,
``x̂ = float32(s·(code − u))``, ``0`` in place of ``x/s`` where ``s = 0``): each is one IEEE operation whose
result does not depend on how it is scheduled, so codes and decoded values equal
:meth:`kvcert.quant.dither.DitherCodec.encode` / ``decode``'s bit for bit (``tests/quant/test_dither_numba.py``).

Imported on first use (:mod:`kvcert.quant.kernel_env` says why).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from kvcert.quant.rtn_numba import round_trip_rows

__all__ = ["keyed_uniform", "round_trip"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


@numba.njit(cache=True, nogil=True)
def _mix(z: np.uint64) -> np.uint64:  # pragma: no cover - compiled (tested via numba)
    """splitmix64's finaliser in unsigned 64-bit arithmetic (:func:`kvcert.quant.dither._mix`)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@numba.njit(cache=True, nogil=True)
def _absorb(h: np.uint64, field: np.uint64) -> np.uint64:  # pragma: no cover - compiled (tested via numba)
    """``mix((h ^ field) + golden)``: one field of the counter."""
    return _mix((h ^ field) + _GOLDEN)


@numba.njit(cache=True, nogil=True)
def _uniform(
    seed: np.uint64, request: np.ndarray, layer: np.uint64, positions: np.ndarray, heads: int, d: int
) -> np.ndarray:  # pragma: no cover - compiled (tested via numba)
    """``u[B, heads, T, d]`` (float32) of the counter (module docstring); ``request[B]`` and ``positions[B, T]`` as
    uint64 words."""
    b, t = positions.shape
    out = np.empty((b, heads, t, d), np.float32)
    start = _mix(seed + _GOLDEN)
    for i in range(b):
        hr = _absorb(_absorb(start, request[i]), layer)
        for h in range(heads):
            hh = _absorb(hr, np.uint64(h))
            for j in range(t):
                state = _absorb(hh, positions[i, j])
                for c in range(d):
                    word = _absorb(state, np.uint64(c))
                    out[i, h, j, c] = np.float32(np.float64(word >> np.uint64(40)) * 2.0**-24 - 0.5)
    return out


def keyed_uniform(
    seed: int, request: torch.Tensor, layer: int, positions: torch.Tensor, heads: int, d: int
) -> torch.Tensor:
    """:func:`kvcert.quant.dither.keyed_uniform` of the key ``(seed, request[B], layer, positions[B, T])`` (int64 CPU
    tensors; the caller checked them against the shape ``[B, heads, T, d]``): the same float32 values."""
    req = np.ascontiguousarray(request.numpy()).view(np.uint64)  # two's complement words, as the tensor form's
    pos = np.ascontiguousarray(positions.numpy()).view(np.uint64)
    u = _uniform(np.uint64(seed % 2**64), req, np.uint64(layer % 2**64), pos, heads, d)
    return torch.from_numpy(u)


@numba.njit(cache=True, nogil=True)
def _round_trip(
    x: np.ndarray, u: np.ndarray, s: np.ndarray, group: int, code: np.ndarray, xhat: np.ndarray
) -> None:  # pragma: no cover - compiled (tested via numba)
    """Rows ``x[R, D]`` (float32) with dither ``u[R, D]`` (float32) and steps ``s[R, D/group]`` (float32, each an
    fp16 value): ``code = round_half_even(x/s + u)`` (int8; ``x/s`` read as 0 where ``s = 0``) and
    ``xhat = float32(s·(code − u))``, every operation in float64."""
    rows, d = x.shape
    for r in range(rows):
        for c in range(d):
            sc = np.float64(s[r, c // group])
            ur = np.float64(u[r, c])
            v = (np.float64(x[r, c]) / sc if sc > 0.0 else 0.0) + ur
            code[r, c] = np.int8(np.rint(v))
            xhat[r, c] = np.float32(sc * (np.float64(code[r, c]) - ur))  # from the stored code: −0 reads as +0


def round_trip(x: torch.Tensor, u: torch.Tensor, s: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 codes and the decoded values (float32), both shaped as ``x``, of a dithered block: float32 CPU
    ``x[..., D]`` and dither ``u[..., D]``, steps ``s[..., D/group]`` (float16 or float32), the values of the
    tensor form (module docstring). The caller checks that ``|x/s + u|`` stays within the int8 range (the codec's
    steps ensure it)."""
    return round_trip_rows(_round_trip, x, (u,), s, group)
