"""The dense fallback every read path repairs from: exact attention over exact (host-tier) keys and values.

An adapter (the transformers cache, a serving backend) implements :class:`ExactAttention` with its own dense
kernel, so that a repaired head is *the* output the dense model would have produced: the read paths of
:mod:`kvcert.attention.read_path` call it, never a kernel of their own, for every head they serve exactly.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["ExactAttention"]


class ExactAttention(Protocol):
    """Dense attention of one read's queries over exact keys and values.

    ``keys[B, Hkv, S, D]`` / ``values[B, Hkv, S, Dv]`` are exact entries (host tier, any dtype and device),
    ``mask[B, 1|Hkv, Q, S]`` the per-KV-head visibility (True = attend), ``heads = (h0, h1)`` restricts the
    result to the KV heads ``h0 ≤ h < h1`` and their query heads (all heads when ``None``). Returns the attention
    output ``[B, Q, (h1 − h0)·G, Dv]`` (HF layout: query heads after the query axis) in at least float32, the
    precision the read path's output bound models for an exactly served head.
    """

    def __call__(
        self, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, heads: tuple[int, int] | None = None
    ) -> torch.Tensor: ...
