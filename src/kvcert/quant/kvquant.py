"""``kvquant-4``: KVQuant-like dense-and-sparse 4-bit codec (``docs/codecs.md#kvquant-4``).

Per token block of ``block`` tokens and per (batch row, head): the top ``outlier_frac`` of entries by
magnitude (``k = ceil(outlier_frac·block·D)``) are stored sparse as fp16 values + int16 in-block flat indices;
the remaining entries are quantised per channel over the block with asymmetric min/max 4-bit levels
(non-uniform NUQ codebooks are approximated by uniform levels). Guarantees per element: dense entries
``|x̂ − x| ≤ scale_c/2``; outliers ``x̂ = fp16(x)``.
"""

from __future__ import annotations

import math

import torch

from kvcert.checks import fail_if
from kvcert.quant.base import Codec, DitherKey, Packed
from kvcert.quant.kivi import minmax_params
from kvcert.quant.packing import pack_bits, unpack_bits
from kvcert.quant.scales import FP16_MAX, check_positive, safe_div


class KVQuantCodec(Codec):
    """``kvquant-4``: per-channel 4-bit asymmetric over token blocks + sparse fp16 top-magnitude outliers."""

    name = "kvquant-4"
    bits = 4.0

    def __init__(self, block: int = 32, outlier_frac: float = 0.01) -> None:
        check_positive("block", block)
        if not 0.0 <= outlier_frac < 1.0:
            raise ValueError(f"outlier_frac must lie in [0, 1), got {outlier_frac!r}")
        self.block = block
        self.outlier_frac = outlier_frac
        self.levels = 15

    def n_outliers(self, d: int) -> int:
        """Sparse entries kept per (row, head, block): ``ceil(outlier_frac·block·d)``."""
        return math.ceil(self.outlier_frac * self.block * d)

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, H, T, D]`` → ``[B, H, T/block, block·D]``."""
        return x.unflatten(-2, (x.shape[-2] // self.block, self.block)).flatten(-2)

    def _encode(self, x: torch.Tensor, key: DitherKey | None) -> Packed:
        b, h, t, d = x.shape
        if self.block * d > 32767:
            raise ValueError(f"block·D={self.block * d} exceeds the int16 index range")
        flat = self._blocks(x.to(torch.float32))
        k = self.n_outliers(d)
        idx = flat.abs().topk(k, dim=-1).indices
        values = flat.gather(-1, idx)
        fail_if(
            (values.abs() > FP16_MAX).any(), lambda: ValueError(f"x has outliers beyond the fp16 range ({FP16_MAX})")
        )
        is_out = torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, idx, True)
        dense = flat.unflatten(-1, (self.block, d))
        mask = is_out.unflatten(-1, (self.block, d))
        inf = torch.full_like(dense, float("inf"))
        lo = torch.where(mask, inf, dense).amin(-2)
        hi = torch.where(mask, -inf, dense).amax(-2)  # [B, H, T/block, D]
        empty = lo > hi  # a channel whose block entries are all outliers
        lo, hi = torch.where(empty, 0.0, lo), torch.where(empty, 0.0, hi)
        scale, zero = minmax_params(lo, hi, self.levels)
        z, s = zero.to(torch.float32).unsqueeze(-2), scale.to(torch.float32).unsqueeze(-2)
        code = torch.round(safe_div(torch.where(mask, z, dense) - z, s)).to(torch.uint8)
        return Packed(
            self.name,
            (b, h, t, d),
            {
                "codes": pack_bits(code.flatten(-3, -2), 4),
                "scales": scale,
                "zeros": zero,
                "outlier_values": values.to(torch.float16),
                "outlier_index": idx.to(torch.int16),
            },
        )

    def _decode(self, packed: Packed, key: DitherKey | None) -> torch.Tensor:
        b, h, t, d = packed.shape
        tensors = packed.tensors
        code = unpack_bits(tensors["codes"], 4).to(torch.float32).unflatten(-2, (t // self.block, self.block))
        zero, scale = tensors["zeros"].to(torch.float32), tensors["scales"].to(torch.float32)
        dense = zero.unsqueeze(-2) + code * scale.unsqueeze(-2)
        index, values = tensors["outlier_index"].to(torch.long), tensors["outlier_values"].to(torch.float32)
        flat = dense.flatten(-2).scatter(-1, index, values)
        return flat.unflatten(-1, (self.block, d)).flatten(-3, -2)
