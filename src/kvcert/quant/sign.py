"""``sign-1``: 1-bit sign codec (stress case): ``x̂ = sign(x)·s`` with ``s = mean_g |x|`` per token group.

Sign bits (``x ≥ 0`` → +1) are packed 8 per byte; scales are fp16 (round to nearest).
"""

from __future__ import annotations

import torch

from kvcert.checks import fail_if
from kvcert.quant.base import Codec, DitherKey, Packed
from kvcert.quant.packing import pack_bits, unpack_bits
from kvcert.quant.scales import FP16_MAX, check_positive, grouped, per_group


class SignCodec(Codec):
    """``sign-1``: sign bits + per-token, per-``group_size`` fp16 mean-|x| scales."""

    name = "sign-1"
    bits = 1.0

    def __init__(self, group_size: int = 32) -> None:
        check_positive("group_size", group_size)
        self.group_size = group_size

    def _encode(self, x: torch.Tensor, key: DitherKey | None) -> Packed:
        x32 = x.to(torch.float32)
        mean_abs = grouped(x32, self.group_size).abs().mean(-1)
        fail_if(
            (mean_abs > FP16_MAX).any(),
            lambda: ValueError(f"mean |x| exceeds the fp16 range ({FP16_MAX}); input too large"),
        )
        bits = pack_bits((x32 >= 0).to(torch.uint8), 1)
        return Packed(self.name, tuple(x.shape), {"codes": bits, "scales": mean_abs.to(torch.float16)})

    def _decode(self, packed: Packed, key: DitherKey | None) -> torch.Tensor:
        sign = unpack_bits(packed.tensors["codes"], 1).to(torch.float32) * 2.0 - 1.0
        return sign * per_group(packed.tensors["scales"], self.group_size)
