"""One fused CPU kernel (numba) for the three rounded-up norms of a pending (exact) KV entry.

A decode step appends, per layer, one exact token per KV head whose write-time witnesses are ``‖k_t‖``, ``‖v_t‖``
and ``‖v_t − c‖`` (``c`` the store's fixed value centre), each rounded up to float32 as
:func:`kvcert.bounds.rope.norm_up_f32` rounds it. On CPU tensors the tensor form costs some ten small operations
(casts, a stack, the norm, the inflation, the cast down, ``nextafter``), each more dispatch than arithmetic;
:func:`norms_up` computes the three in one pass (and, for the entries a persistent repair
makes exact, the same norms of their served values).

Rounding (``docs/math.md#pending-norms``): per row ``x`` (float32 ``k_t`` or ``v_t`` widened exactly, or the float64
difference ``fl(v_t − c)``, one IEEE subtraction exactly as the tensor form makes it) the sum of squares is
evaluated in float64 in any order, with or without fused multiply-adds; each of its ``D`` terms passes through at
most ``D`` roundings, so the computed sum is within ``γ_D`` of the exact one and its square root within ``(D/2 +
2)·2^-53`` relatively, the same bound the tensor form's (unspecified) reduction order has. The result is then
inflated by ``1 + (D + 4)·2^-53``, cast to float32 (nearest) and moved one float32 step up, exactly as
:func:`~kvcert.bounds.rope.norm_up_f32` does: never below the exact norm of ``x``, and within two float32 steps of
the tensor form (both lie in the same interval; ``tests/quant/test_norms_numba.py`` checks both per element).
Non-finite rows give NaN or ``inf`` as the tensor form does (the ``log8`` encoder then stores its infinity code).

Imported on first use, never with the cache package (:mod:`kvcert.quant.kernel_env` says why).
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

__all__ = ["norms_up"]

_U64 = 2.0**-53


@numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "contract"})
def _sumsq(x: np.ndarray, c: np.ndarray, centred: bool) -> float:  # pragma: no cover - compiled (tested via numba)
    """``Σ_j y_j²`` in float64, any order, ``y_j = float64(x_j) − float64(c_j)`` (one rounding) when ``centred``,
    else ``float64(x_j)`` (exact)."""
    acc = 0.0
    for j in range(x.shape[0]):
        y = np.float64(x[j]) - np.float64(c[j]) if centred else np.float64(x[j])
        acc += y * y
    return acc


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _up_f32(sumsq: float, d: int) -> np.float32:  # pragma: no cover - compiled (tested via numba)
    """``nextafter(float32(sqrt(sumsq)·(1 + (d + 4)·2^-53)), +inf)`` (``norm_up_f32``'s rounding, in order)."""
    return np.nextafter(np.float32(np.sqrt(sumsq) * (1.0 + (d + 4) * _U64)), np.float32(np.inf))


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _norms(k: np.ndarray, v: np.ndarray, centre: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - compiled
    """``out[0, r] = ‖k[r]‖``, ``out[1, r] = ‖v[r]‖``, ``out[2, r] = ‖v[r] − centre[r]‖``, each rounded up
    (:func:`_up_f32`)."""
    dk, dv = k.shape[1], v.shape[1]
    for r in range(k.shape[0]):
        out[0, r] = _up_f32(_sumsq(k[r], centre[r], False), dk)
        out[1, r] = _up_f32(_sumsq(v[r], centre[r], False), dv)
        out[2, r] = _up_f32(_sumsq(v[r], centre[r], True), dv)


def norms_up(k: torch.Tensor, v: torch.Tensor, centre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(‖k‖, ‖v‖, ‖v − c‖)`` over the last dimension, float32 shaped as the leading dimensions, each never below
    the exact norm (module docstring), of float32 CPU tensors ``k[..., Dk]``, ``v[..., Dv]`` (the same leading
    dimensions) and the float32 centre ``c`` (broadcastable to ``v``)."""
    lead, dk, dv = tuple(k.shape[:-1]), k.shape[-1], v.shape[-1]
    if k.dtype != torch.float32 or v.dtype != torch.float32 or centre.dtype != torch.float32 or v.shape[:-1] != lead:
        raise ValueError(
            f"norms_up: float32 k [..., Dk] and v [..., Dv] with the same leading dimensions, got "
            f"{k.dtype} {tuple(k.shape)} and {v.dtype} {tuple(v.shape)} (centre {centre.dtype})"
        )
    try:
        c = torch.broadcast_to(centre.detach(), v.shape)
    except RuntimeError as e:
        raise ValueError(f"norms_up: the centre {tuple(centre.shape)} does not broadcast to v {tuple(v.shape)}") from e
    rows = math.prod(lead)
    out = np.empty((3, rows), dtype=np.float32)
    _norms(k.detach().reshape(rows, dk).numpy(), v.detach().reshape(rows, dv).numpy(), c.reshape(rows, dv).numpy(), out)
    k_norm, v_norm, v_dist = (torch.from_numpy(x.reshape(lead)) for x in out)
    return k_norm, v_norm, v_dist
