"""One fused CPU kernel (numba) for the round trip of a write block through the RTN codecs (:mod:`kvcert.quant.rtn`).

A block write encodes the block and decodes it again (the served values are the decoded codes): in the tensor form
some ten small operations after the steps (the division, its zero guard, the rounding, the casts, the broadcast of
the steps, the product), each more dispatch than arithmetic for the few tokens of a write block. :func:`round_trip`
does the quantiser and the reconstruction in one pass: ``code = round(x/s)`` to nearest even (``0`` where ``s = 0``)
and ``x̂ = code·s``, both in float32 as the tensor form computes them. Each is evaluated in float64 and cast to float32
once: the float64 quotient of two float32 values rounded to float32 is the correctly rounded float32 quotient (53 ≥
2·24 + 2, so the double rounding is innocuous), and the float64 product of a code (at most 8 bits) and a float32 step
is exact, so its one cast is the correctly rounded float32 product. Codes and decoded values therefore equal
:meth:`kvcert.quant.rtn.RTNCodec.encode` / ``decode``'s bit for bit (``tests/quant/test_rtn_numba.py`` per element).

Imported on first use (:mod:`kvcert.quant.kernel_env` says why).
"""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np
import torch

__all__ = ["round_trip", "round_trip_rows"]


@numba.njit(cache=True, nogil=True)
def _round_trip(
    x: np.ndarray, s: np.ndarray, group: int, code: np.ndarray, xhat: np.ndarray
) -> None:  # pragma: no cover - compiled (tested via numba)
    """Rows ``x[R, D]`` with steps ``s[R, D/group]`` (float32): ``code = round_half_even(float32(x/s))`` (int8; 0
    where ``s = 0``) and ``xhat = float32(code·s)``."""
    rows, d = x.shape
    for r in range(rows):
        for c in range(d):
            sc = np.float64(s[r, c // group])
            q = np.rint(np.float64(np.float32(np.float64(x[r, c]) / sc))) if sc > 0.0 else 0.0
            code[r, c] = np.int8(q)
            xhat[r, c] = np.float32(np.float64(code[r, c]) * sc)  # from the stored code: −0 reads as +0


def round_trip(x: torch.Tensor, s: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 codes and the decoded values (float32), both shaped as ``x``, of an RTN block: float32 CPU
    ``x[..., D]``, steps ``s[..., D/group]`` (float16 or float32), the values of the tensor form (module docstring).
    The caller checks that ``|x/s|`` stays within the int8 range (the codec's steps ensure it)."""
    return round_trip_rows(_round_trip, x, (), s, group)


def round_trip_rows(
    kernel: Callable[..., None], x: torch.Tensor, beside: tuple[torch.Tensor, ...], s: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a round-trip row kernel ``kernel(x, *beside, s, group, code, xhat)`` over float32 CPU ``x[..., D]``
    flattened to rows, with the float32 tensors ``beside`` shaped as ``x`` (the dither) and the steps
    ``s[..., D/group]`` (float16 or float32, widened exactly to float32): the int8 codes and float32 decoded values,
    shaped as ``x``. Anything else is a ``ValueError`` naming the shapes and dtypes."""
    d = x.shape[-1]
    if (
        x.dtype != torch.float32
        or any(t.dtype != torch.float32 or t.shape != x.shape for t in beside)
        or group < 1
        or d % group
        or s.shape != (*x.shape[:-1], d // group)
        or s.dtype not in (torch.float16, torch.float32)
    ):
        got = ", ".join(f"{t.dtype} {tuple(t.shape)}" for t in (x, *beside))
        raise ValueError(
            f"round_trip: float32 x [..., D] (and any dither of its shape), steps [..., D/group]; got {got}, "
            f"s {s.dtype} {tuple(s.shape)}, group {group}"
        )
    rows = x.numel() // max(d, 1)
    arrays = [np.ascontiguousarray(t.detach().numpy()).reshape(rows, d) for t in (x, *beside)]
    s_np = np.ascontiguousarray(s.detach().to(torch.float32).numpy()).reshape(rows, d // group)  # exact widening
    code = np.empty((rows, d), np.int8)
    xhat = np.empty((rows, d), np.float32)
    kernel(*arrays, s_np, group, code, xhat)
    return torch.from_numpy(code.reshape(x.shape)), torch.from_numpy(xhat.reshape(x.shape))
