"""fp8 codecs: raw saturating cast (``fp8-e4m3``, ``fp8-e5m2``) and per-token-group scaled variants.

Raw: ``x̂ = fp8(clamp(x, ±fmax))`` — identical to torch's ``x.to(float8)`` for ``|x| ≤ fmax`` and saturating
to ``±fmax`` beyond it (e4m3 fmax = 448, e5m2 fmax = 57344); 1 byte per element, no scale.
Scaled: ``s = amax_g/fmax`` (fp16, rounded up), ``x̂ = s·fp8(x/s)``, so ``|x/s| ≤ fmax`` never saturates and
``|x̂ − x| ≤ s·(2^-(m+1)·|x/s| + 2^(emin−m−1))`` with ``m`` mantissa bits and ``emin`` the least normal
exponent (round-to-nearest in the normal and subnormal ranges).
"""

from __future__ import annotations

import torch

from kvcert.quant.base import Codec, DitherKey, Packed
from kvcert.quant.scales import check_positive, per_group, safe_div, symmetric_scales

FP8_FORMATS: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
MANTISSA_BITS: dict[str, int] = {"e4m3": 3, "e5m2": 2}


def fp8_max(fmt: str) -> float:
    """Largest finite value of the fp8 format ``fmt``."""
    return float(torch.finfo(FP8_FORMATS[fmt]).max)


class Fp8Codec(Codec):
    """``fp8-{fmt}`` (raw saturating cast) or ``fp8-{fmt}-scaled`` (per-token, per-group fp16 scale)."""

    bits = 8.0

    def __init__(self, fmt: str, scaled: bool = False, group_size: int = 32) -> None:
        if fmt not in FP8_FORMATS:
            raise ValueError(f"fmt must be one of {tuple(FP8_FORMATS)}, got {fmt!r}")
        check_positive("group_size", group_size)
        self.fmt = fmt
        self.scaled = scaled
        self.group_size = group_size
        self.dtype = FP8_FORMATS[fmt]
        self.fmax = fp8_max(fmt)
        self.name = f"fp8-{fmt}" + ("-scaled" if scaled else "")

    def _encode(self, x: torch.Tensor, key: DitherKey | None) -> Packed:
        x32 = x.to(torch.float32)
        if not self.scaled:
            codes = x32.clamp(-self.fmax, self.fmax).to(self.dtype)
            return Packed(self.name, tuple(x.shape), {"codes": codes})
        s = symmetric_scales(x32, self.group_size, self.fmax)
        codes = safe_div(x32, per_group(s, self.group_size)).to(self.dtype)
        return Packed(self.name, tuple(x.shape), {"codes": codes, "scales": s})

    def _decode(self, packed: Packed, key: DitherKey | None) -> torch.Tensor:
        values = packed.tensors["codes"].to(torch.float32)
        if not self.scaled:
            return values
        return values * per_group(packed.tensors["scales"], self.group_size)
