"""``kivi-2`` / ``kivi-4``: KIVI-style asymmetric min/max quantisation (``docs/codecs.md#kivi``).

``zero = min`` (fp16, rounded down), ``scale = (max − zero)/(2^b − 1)`` (fp16, rounded up),
``code = round((x − zero)/scale) ∈ [0, 2^b − 1]``, ``x̂ = zero + scale·code``; hence ``|x̂ − x| ≤ scale/2``.

* ``axis="key"``: per-channel statistics over token groups of ``block = group_size`` tokens (encode needs
  ``T % block == 0``);
* ``axis="value"``: per-token statistics over groups of ``group_size`` channels.

Codes are bit-packed (4 per byte at 2 bits, 2 at 4 bits). ``residual_window`` recent tokens are kept at full
precision by the cache (the codec only declares the window).
"""

from __future__ import annotations

import torch

from kvcert.quant.base import Codec, DitherKey, Packed
from kvcert.quant.packing import pack_bits, unpack_bits
from kvcert.quant.scales import check_positive, fp16_down, fp16_up, grouped, per_group, safe_div

AXES = ("key", "value")


def minmax_params(lo: torch.Tensor, hi: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric ``(scale, zero)`` in fp16 with ``zero ≤ lo`` and ``zero + levels·scale ≥ hi``."""
    zero = fp16_down(lo)
    scale = fp16_up((hi - zero.to(torch.float32)) / levels)
    return scale, zero


class KiviCodec(Codec):
    """``kivi-{bits}`` on ``axis`` ("key": per channel over token groups; "value": per token)."""

    def __init__(self, bits: int, axis: str = "key", group_size: int = 32, residual_window: int = 32) -> None:
        if bits not in (2, 4):
            raise ValueError(f"bits must be 2 or 4, got {bits}")
        if axis not in AXES:
            raise ValueError(f"axis must be one of {AXES}, got {axis!r}")
        check_positive("group_size", group_size)
        if isinstance(residual_window, bool) or not isinstance(residual_window, int) or residual_window < 0:
            raise ValueError(f"residual_window must be a non-negative int, got {residual_window!r}")
        self.name = f"kivi-{bits}"
        self.bits = float(bits)
        self.levels = (1 << bits) - 1
        self.axis = axis
        self.group_size = group_size
        self.block = group_size if axis == "key" else 1
        self.residual_window = residual_window

    def expand(self, p: torch.Tensor, d: int) -> torch.Tensor:
        """Broadcast stored per-group parameters (``scales`` or ``zeros``) to ``[B, H, T, d]`` (float32), ``d`` the
        head dimension (a value-axis group holds ``d / G`` channels, ``G`` the groups stored per token)."""
        if self.axis == "key":
            return p.to(torch.float32).repeat_interleave(self.block, dim=-2)
        return per_group(p, d // p.shape[-1])

    def channel_group(self, d: int) -> int:
        """The channels per value-axis group at head dimension ``d``: ``group_size``."""
        return self.group_size

    def _encode(self, x: torch.Tensor, key: DitherKey | None) -> Packed:
        x32 = x.to(torch.float32)
        if self.axis == "key":
            blocks = x32.unflatten(-2, (x.shape[-2] // self.block, self.block))
            lo, hi = blocks.amin(-2), blocks.amax(-2)  # [B, H, T/block, D]
        else:
            g = grouped(x32, self.channel_group(x.shape[-1]))
            lo, hi = g.amin(-1), g.amax(-1)  # [B, H, T, D/group_size]
        scale, zero = minmax_params(lo, hi, self.levels)
        d = x.shape[-1]
        code = torch.round(safe_div(x32 - self.expand(zero, d), self.expand(scale, d)))
        return Packed(
            self.name,
            tuple(x.shape),
            {"codes": pack_bits(code.to(torch.uint8), int(self.bits)), "scales": scale, "zeros": zero},
        )

    def _decode(self, packed: Packed, key: DitherKey | None) -> torch.Tensor:
        code = unpack_bits(packed.tensors["codes"], int(self.bits)).to(torch.float32)
        d = packed.shape[-1]
        return self.expand(packed.tensors["zeros"], d) + code * self.expand(packed.tensors["scales"], d)
