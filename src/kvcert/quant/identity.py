"""``none``: the fp16 reference codec (identity up to fp16 rounding, 2 bytes per element)."""

from __future__ import annotations

import torch

from kvcert.checks import fail_if
from kvcert.quant.base import Codec, DitherKey, Packed
from kvcert.quant.scales import FP16_MAX


class NoneCodec(Codec):
    """Store ``x`` as fp16: ``x̂ = fp16(x)``, so ``|x̂ − x| ≤ 2^-11·|x|`` (normal range) per element."""

    name = "none"
    bits = 16.0

    def _encode(self, x: torch.Tensor, key: DitherKey | None) -> Packed:
        fail_if(
            (x.abs() > FP16_MAX).any(),
            lambda: ValueError(f"x exceeds the fp16 range (|x| max {float(x.abs().max()):.4g} > {FP16_MAX})"),
        )
        return Packed(self.name, tuple(x.shape), {"values": x.to(torch.float16)})

    def _decode(self, packed: Packed, key: DitherKey | None) -> torch.Tensor:
        return packed.tensors["values"].to(torch.float32)
