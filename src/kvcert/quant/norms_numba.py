"""One fused CPU kernel (numba) for the three rounded-up norms of a pending (exact) KV entry.

A decode step appends, per layer, one exact token per KV head whose write-time witnesses are ``‖k_t‖``, ``‖v_t‖``
and ``‖v_t − c‖`` (``c`` the store's fixed value centre), each rounded up to float32 as
:func:`kvcert.bounds.rope.norm_up_f32` rounds it. On CPU tensors the tensor form costs some ten small operations
(casts, a stack, the norm, the inflation, the cast down, ``nextafter``), each more dispatch than arithmetic;
:func:`pending_norms_up` computes the three in one pass.

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

import numba
import numpy as np
import torch

__all__ = ["pending_norms_up"]

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
    """``out[0] = ‖k‖``, ``out[1] = ‖v‖``, ``out[2] = ‖v − centre‖`` per ``[b, h, t]``, each rounded up
    (:func:`_up_f32`)."""
    nb, nh, nt, dk = k.shape
    dv = v.shape[3]
    for b in range(nb):
        for h in range(nh):
            ch = centre[b, h]
            for t in range(nt):
                out[0, b, h, t] = _up_f32(_sumsq(k[b, h, t], ch, False), dk)
                out[1, b, h, t] = _up_f32(_sumsq(v[b, h, t], ch, False), dv)
                out[2, b, h, t] = _up_f32(_sumsq(v[b, h, t], ch, True), dv)


def pending_norms_up(
    k: torch.Tensor, v: torch.Tensor, centre: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(‖k_t‖, ‖v_t‖, ‖v_t − c‖)`` ``[B, H, T]`` float32, each never below the exact norm (module docstring), of
    float32 CPU tensors ``k[B, H, T, Dk]``, ``v[B, H, T, Dv]`` and the float32 centre ``c[B, H, 1, Dv]``."""
    b, h, t, _ = k.shape
    dv = v.shape[-1]
    if (
        k.dtype != torch.float32
        or v.dtype != torch.float32
        or centre.dtype != torch.float32
        or v.shape[:3] != (b, h, t)
        or centre.shape != (b, h, 1, dv)
    ):
        raise ValueError(
            f"pending_norms_up: float32 k [B, H, T, Dk], v [B, H, T, Dv] and centre [B, H, 1, Dv], got "
            f"{k.dtype} {tuple(k.shape)}, {v.dtype} {tuple(v.shape)}, {centre.dtype} {tuple(centre.shape)}"
        )
    out = np.empty((3, b, h, t), dtype=np.float32)
    _norms(k.detach().numpy(), v.detach().numpy(), centre.detach().numpy()[:, :, 0], out)
    return torch.from_numpy(out[0]), torch.from_numpy(out[1]), torch.from_numpy(out[2])
