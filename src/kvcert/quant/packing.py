"""Bit packing of small unsigned codes into uint8 along the last dimension.

``pack_bits(codes, bits)`` stores ``8/bits`` codes per byte (little-endian within the byte: code ``i`` of a
byte occupies bits ``[i·bits, (i+1)·bits)``); ``unpack_bits`` is its exact inverse.
"""

from __future__ import annotations

import torch

PACKABLE_BITS = (1, 2, 4, 8)


def _check_bits(bits: int) -> int:
    if bits not in PACKABLE_BITS:
        raise ValueError(f"bits must be one of {PACKABLE_BITS}, got {bits}")
    return 8 // bits


def _per_byte(bits: int, n: int) -> int:
    per = _check_bits(bits)
    if n % per:
        raise ValueError(f"last dimension {n} must be a multiple of {per} to pack {bits}-bit codes")
    return per


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes in ``[0, 2^bits)`` (any integer dtype) into uint8 ``[..., n·bits/8]``."""
    per = _per_byte(bits, codes.shape[-1])
    c = codes.to(torch.int32)
    if bool(((c < 0) | (c >= 1 << bits)).any()):
        raise ValueError(f"codes must lie in [0, {1 << bits}) to pack at {bits} bits")
    c = c.unflatten(-1, (codes.shape[-1] // per, per))
    shifts = torch.arange(per, dtype=torch.int32) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: uint8 ``[..., m]`` → uint8 codes ``[..., m·8/bits]``."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8, got {packed.dtype}")
    per = _check_bits(bits)
    shifts = torch.arange(per, dtype=torch.int32) * bits
    c = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return c.flatten(-2).to(torch.uint8)
