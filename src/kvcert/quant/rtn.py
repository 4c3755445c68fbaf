"""Symmetric round-to-nearest (RTN) integer codecs with per-token, per-channel-group fp16 scales.

``s = amax_g/qmax`` (fp16, rounded up), ``code = round(x/s) ∈ [−qmax, qmax]``, ``x̂ = s·code``; hence
``|x̂ − x| ≤ s/2`` per element and no code ever saturates (``|x/s| ≤ qmax``).

Levels: int8 ``qmax = 127`` (codes stored as int8), int4 ``qmax = 7`` (offset by 8, nibble-packed 2 per
byte), int2 ``qmax = 1`` — the three levels ``{−1, 0, 1}·s`` (offset by 1, 2-bit packed 4 per byte; the
fourth 2-bit pattern is unused, keeping the grid symmetric so that ``x̂ = 0`` for ``x = 0``).
"""

from __future__ import annotations

import torch

from kvcert.quant.base import Codec, DitherKey, Packed
from kvcert.quant.kernel_env import fused_log8
from kvcert.quant.packing import pack_bits, unpack_bits
from kvcert.quant.scales import check_positive, per_group, safe_div, symmetric_scales

QMAX: dict[int, int] = {8: 127, 4: 7, 2: 1}
OFFSET: dict[int, int] = {4: 8, 2: 1}  # unsigned storage offset of the packed widths


class RTNCodec(Codec):
    """``int{bits}``: symmetric RTN with fp16 scales per token per ``group_size`` channels."""

    def __init__(self, bits: int, group_size: int = 32) -> None:
        if bits not in QMAX:
            raise ValueError(f"bits must be one of {tuple(QMAX)}, got {bits}")
        check_positive("group_size", group_size)
        self.name = f"int{bits}"
        self.bits = float(bits)
        self.group_size = group_size
        self.qmax = QMAX[bits]

    def _encode(self, x: torch.Tensor, key: DitherKey | None) -> Packed:
        s = symmetric_scales(x, self.group_size, self.qmax)
        code = torch.round(safe_div(x.to(torch.float32), per_group(s, self.group_size))).to(torch.int8)
        stored = code if self.bits == 8 else pack_bits(code + OFFSET[int(self.bits)], int(self.bits))
        return Packed(self.name, tuple(x.shape), {"codes": stored, "scales": s})

    def _encode_decode(self, x: torch.Tensor, key: DitherKey | None) -> tuple[Packed, torch.Tensor]:
        """:meth:`_encode` and :meth:`_decode` of its codes; float32 CPU input on the numba backend in one compiled
        pass (:func:`kvcert.quant.rtn_numba.round_trip`: the same values)."""
        if not (fused_log8(x.device) and x.dtype == torch.float32):
            return super()._encode_decode(x, key)
        from kvcert.quant.rtn_numba import round_trip  # numba on first use (kernel_env says why)

        s = symmetric_scales(x, self.group_size, self.qmax)
        code, x_hat = round_trip(x, s, self.group_size)
        stored = code if self.bits == 8 else pack_bits(code + OFFSET[int(self.bits)], int(self.bits))
        return Packed(self.name, tuple(x.shape), {"codes": stored, "scales": s}), x_hat

    def codes(self, packed: Packed) -> torch.Tensor:
        """Signed integer codes in ``[−qmax, qmax]`` (int16) recovered from the stored tensors."""
        stored = packed.tensors["codes"]
        if self.bits == 8:
            return stored.to(torch.int16)
        return unpack_bits(stored, int(self.bits)).to(torch.int16) - OFFSET[int(self.bits)]

    def _decode(self, packed: Packed, key: DitherKey | None) -> torch.Tensor:
        return self.codes(packed).to(torch.float32) * per_group(packed.tensors["scales"], self.group_size)
