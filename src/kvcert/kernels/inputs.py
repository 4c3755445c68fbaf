"""The arguments of one decode read, as one named structure for every backend (``docs/glossary.md#store-names``).

:class:`DecodeInputs` carries the grouped query and the store's allocations under the store's own names
(``k_served``, ``k_band``, ``k_hat_norm``, ``k_wit``, ``v_served``, ``v_res``, ``v_dist``, ``v_hat_norm``), so
:func:`kvcert.kernels.numba_read.decode_read` (numpy arrays: the whole allocations, of which the first
``n_tokens`` are read) and :func:`kvcert.kernels.triton_read.decode_read` (tensors: the live views) take the same
fields. :func:`store_inputs` builds it from a :class:`~kvcert.cache.store.LayerStore`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from kvcert.bounds.rc import gamma_f32
from kvcert.cache.store import LayerStore

__all__ = ["DecodeInputs", "store_inputs"]

A = TypeVar("A", np.ndarray, torch.Tensor)


@dataclass(frozen=True)
class DecodeInputs(Generic[A]):
    """One decode read's inputs (``A``: ``numpy.ndarray`` for the numba kernels, ``torch.Tensor`` for Triton).

    Every store field is float32 and token-major, ``[B, Hkv, ≥ n_tokens, ...]``; the kernels read the first
    ``n_tokens`` tokens. ``q[B, Hkv, M, D]``: float32 grouped queries (row ``i`` is query ``i mod nq``);
    ``mask[B, 1|Hkv, nq, ≥ n_tokens]``: booleans (True = visible; ``None``: every token); ``gamma``: the float32
    dot-product constant ``γ_{D+1}``; ``rotate_half``: the RoPE pairing of the band norms (else interleaved);
    ``k_from`` / ``v_from``: the first key / value not checked finite at write time (pending entries).
    """

    q: A
    k_served: A  # [B, Hkv, S, D] served (decoded) keys k̂
    k_band: A  # [B, Hkv, S, nb] band norms ρ_{t,b} of the key residual
    k_hat_norm: A  # [B, Hkv, S] ≥ ‖k̂_t‖
    k_wit: A  # [B, Hkv, S] key witness W_t ≥ ‖k̂_t − k_t‖
    v_served: A  # [B, Hkv, S, Dv] served values v̂
    v_res: A  # [B, Hkv, S] ≥ ‖Δv_t‖
    v_dist: A  # [B, Hkv, S] ≥ ‖v̂_t − centre‖
    v_hat_norm: A  # [B, Hkv, S] ≥ ‖v̂_t‖
    n_tokens: int
    scale: float
    gamma: float
    rotate_half: bool
    mask: A | None
    nq: int
    k_from: int
    v_from: int


def store_inputs(
    q: torch.Tensor, store: LayerStore, mask: torch.Tensor | None, nq: int, scale: float, *, arrays: bool
) -> DecodeInputs:
    """The decode read of grouped float32 queries ``q[B, Hkv, M, D]`` over ``store``: ``arrays=True`` gives numpy
    views of the store's whole allocations (no copy; for :func:`kvcert.kernels.numba_read.decode_read`), else its
    live tensor views (for :func:`kvcert.kernels.triton_read.decode_read`)."""
    assert store.k is not None and store.v is not None
    buffers = {
        "k_served": store.k.served,
        "k_band": store.k_band,
        "k_hat_norm": store.k_hat_norm,
        "k_wit": store.k_wit,
        "v_served": store.v.served,
        "v_res": store.v_res,
        "v_dist": store.v_dist,
        "v_hat_norm": store.v_hat_norm,
    }
    fields: dict[str, Any]
    if arrays:
        fields = {name: buf.array() for name, buf in buffers.items()}
        fields["q"] = np.ascontiguousarray(q.detach().numpy())
        fields["mask"] = None if mask is None else mask.to(torch.bool).numpy()
    else:
        fields = {name: buf.view() for name, buf in buffers.items()}
        fields["q"], fields["mask"] = q.detach().contiguous(), mask
    return DecodeInputs(
        **fields,
        n_tokens=store.k.served.shape[2],
        scale=scale,
        gamma=gamma_f32(q.shape[-1] + 1),
        rotate_half=store.pairing == "rotate_half",
        nq=nq,
        k_from=store.k.n_encoded,
        v_from=store.v.n_encoded,
    )
