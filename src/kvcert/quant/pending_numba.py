"""One fused CPU kernel (numba) for the ``log8`` witnesses of pending (exact) KV entries: norms and codes together.

A decode step appends, per layer, one exact token per KV head; its stored witnesses are the rounded-up norms
``‖k_t‖``, ``‖v_t‖``, ``‖v_t − c‖`` (:mod:`kvcert.quant.norms_numba`), each written to its own ``log8`` buffer
(:mod:`kvcert.quant.logcode_numba`). Called one by one, that is four kernels and their conversions per layer and
token; :func:`pending_codes` runs the same compiled functions, :func:`kvcert.quant.norms_numba._norms` then
:func:`kvcert.quant.logcode_numba._plan` once per buffer, in one call, so its norms, codes and decoded values are
those calls' values bit for bit (``tests/quant/test_pending_numba.py`` pins it per element).

It serves the steady state of a decode only: it returns ``None`` (the caller then plans the writes one by one)
when a write would change a base (a head written positive for the first time, or a norm above its head's top
code) or fail the encoder's check, so the codes it returns are valid against the bases given, which stay.

Imported on first use, never with the cache package (:mod:`kvcert.quant.kernel_env` says why).
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from kvcert.quant.logcode_numba import _F32, _NO_HEADS, _plan
from kvcert.quant.norms_numba import _norms

__all__ = ["held_codes", "pending_codes"]


@numba.njit(cache=True, nogil=True)
def _pending(
    k: np.ndarray,
    v: np.ndarray,
    centre: np.ndarray,
    heads: np.ndarray,
    base_k: np.ndarray,
    base_v: np.ndarray,
    base_dist: np.ndarray,
    per_head: int,
    f32: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, bool]:  # pragma: no cover - compiled (tested via numba)
    """The three norms of rows ``k[R, Dk]``, ``v[R, Dv]`` (centre ``centre[R, Dv]``) planned against the int32
    ``[B, H]`` bases of their three buffers (row ``r`` in the flat head ``heads[r]``, or ``r // per_head`` when
    ``heads`` is empty): ``(codes[3, R], decoded[3, R], ok)``; ``ok`` is False when some base would change or some
    check fail (the codes are then not to be used)."""
    rows = k.shape[0]
    norms = np.empty((3, rows), np.float32)
    _norms(k, v, centre, norms)
    codes = np.empty((3, rows), np.uint8)
    decoded = np.empty((3, rows), np.float32)
    ok = True
    bases = (base_k, base_v, base_dist)
    for w in range(3):
        base = bases[w].reshape(-1)
        _, c, d, new, _, negative, above_top = _plan(norms[w].astype(np.float64), heads, per_head, base, f32)
        if negative or above_top or not np.array_equal(new, base):
            ok = False
        codes[w] = c
        decoded[w] = d
    return codes, decoded, ok


def pending_codes(
    k: torch.Tensor, v: torch.Tensor, centre: torch.Tensor, bases: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> tuple[np.ndarray, np.ndarray] | None:
    """The ``log8`` codes and decoded values ``[3, B, H, T]`` (uint8, float32) of ``‖k‖``, ``‖v‖`` and ``‖v − c‖``
    (float32 CPU ``k[B, H, T, Dk]``, ``v[B, H, T, Dv]``, ``T >= 1``, centre broadcastable to ``v``) written to three
    buffers with the ``[B, H]`` int32 base exponents ``bases``, or ``None`` when a base would change or a check fail
    (module docstring). Row by row the same norms as :func:`kvcert.quant.norms_up` and the same codes, decoded
    values and checks as :func:`kvcert.quant.logcode_numba.plan` of each norm against its buffer's bases. Works on
    numpy views of the tensors (a torch operation per input would cost more than the kernel)."""
    k_np, v_np, c_np = k.numpy(), v.numpy(), centre.numpy()  # (torch refuses a tensor that requires grad)
    lead, dk, dv = k_np.shape[:-1], k_np.shape[-1], v_np.shape[-1]
    b_np = tuple(np.ascontiguousarray(b.numpy()) for b in bases)
    if (
        k_np.ndim != 4
        or lead[2] < 1
        or k_np.dtype != np.float32
        or v_np.dtype != np.float32
        or c_np.dtype != np.float32
        or v_np.shape[:-1] != lead
        or any(b.dtype != np.int32 or b.shape != lead[:2] for b in b_np)
    ):
        raise ValueError(
            f"pending_codes: float32 k [B, H, T >= 1, Dk], v [B, H, T, Dv] and centre, three int32 [B, H] bases; got "
            f"k {k.dtype} {tuple(k.shape)}, v {v.dtype} {tuple(v.shape)}, centre {centre.dtype}, bases "
            f"{[(b.dtype, tuple(b.shape)) for b in bases]}"
        )
    rows = math.prod(lead)
    if c_np.shape != v_np.shape:  # (a decode step's centre has the shape of its one token: nothing to spread)
        try:
            c_np = np.broadcast_to(c_np, v_np.shape)
        except ValueError as e:
            raise ValueError(f"pending_codes: the centre {c_np.shape} does not broadcast to v {v_np.shape}") from e
    c_rows = c_np.reshape(rows, dv)
    b_k, b_v, b_dist = b_np
    codes, decoded, ok = _pending(
        k_np.reshape(rows, dk), v_np.reshape(rows, dv), c_rows, _NO_HEADS, b_k, b_v, b_dist, lead[2], _F32
    )
    if not ok:
        return None
    return codes.reshape(3, *lead), decoded.reshape(3, *lead)


def held_codes(
    k: np.ndarray,
    v: np.ndarray,
    centre: np.ndarray,
    heads: np.ndarray,
    bases: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`pending_codes` of entries at scattered places (those a persistent repair makes exact): rows
    ``k[N, Dk]``, ``v[N, Dv]`` and ``centre[N, Dv]`` (float32 numpy), row ``r`` in the head ``heads[r]`` (int64, a
    flat index into the ``[B, H]`` int32 ``bases``); codes and decoded values ``[3, N]``, or ``None`` as there.
    Row by row the same values as :func:`kvcert.quant.logcode_numba.plan` with these ``heads`` of each norm."""
    n = k.shape[0] if k.ndim == 2 else -1
    if (
        n < 0
        or k.dtype != np.float32
        or v.dtype != np.float32
        or centre.dtype != np.float32
        or v.ndim != 2
        or v.shape[0] != n
        or centre.shape != v.shape
        or heads.dtype != np.int64
        or heads.shape != (n,)
        or any(b.dtype != np.int32 or b.ndim != 2 or b.shape != bases[0].shape for b in bases)
        or (n and not 0 <= heads.min() <= heads.max() < bases[0].size)
    ):
        raise ValueError(
            "held_codes: float32 rows k [N, Dk], v [N, Dv], centre [N, Dv], int64 heads [N] within three int32 "
            f"[B, H] bases; got k {k.dtype} {k.shape}, v {v.dtype} {v.shape}, centre {centre.dtype} {centre.shape}, "
            f"heads {heads.dtype} {heads.shape}, bases {[(b.dtype, b.shape) for b in bases]}"
        )
    b_k, b_v, b_dist = (np.ascontiguousarray(b) for b in bases)
    codes, decoded, ok = _pending(k, v, centre, heads, b_k, b_v, b_dist, 1, _F32)
    return (codes, decoded) if ok else None
