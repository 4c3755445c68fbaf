"""Bit packing of small unsigned codes into uint8 along the last dimension.

``pack_bits(codes, bits)`` for ``bits`` in 1..8. Widths dividing 8 store ``8/bits`` codes per byte
(little-endian within the byte: code ``i`` of a byte occupies bits ``[i·bits, (i+1)·bits)``); the other widths
(3, 5, 6, 7) store every 8 codes in ``bits`` bytes (code ``i`` of the run occupies bits ``[i·bits, (i+1)·bits)``
of a little-endian ``8·bits``-bit word), so 6-bit codes take exactly 3/4 byte each. ``unpack_bits`` is the
exact inverse.
"""

from __future__ import annotations

import torch

from kvcert.checks import fail_if

PACKABLE_BITS = (1, 2, 3, 4, 5, 6, 7, 8)
_PER_BYTE = (1, 2, 4, 8)
_RUN = 8  # codes per packed run for the widths that do not divide 8


def _check_bits(bits: int) -> None:
    if bits not in PACKABLE_BITS:
        raise ValueError(f"bits must be one of {PACKABLE_BITS}, got {bits}")


def _per_run(bits: int, n: int) -> int:
    _check_bits(bits)
    per = 8 // bits if bits in _PER_BYTE else _RUN
    if n % per:
        raise ValueError(f"last dimension {n} must be a multiple of {per} to pack {bits}-bit codes")
    return per


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes in ``[0, 2^bits)`` (any integer dtype) into uint8 ``[..., n·bits/8]``."""
    per = _per_run(bits, codes.shape[-1])
    c = codes.to(torch.int64)
    fail_if(
        ((c < 0) | (c >= 1 << bits)).any(),
        lambda: ValueError(f"codes must lie in [0, {1 << bits}) to pack at {bits} bits"),
    )
    c = c.unflatten(-1, (codes.shape[-1] // per, per))
    word = (c << (torch.arange(per, dtype=torch.int64, device=c.device) * bits)).sum(
        -1
    )  # disjoint bit fields: sum = or
    if bits in _PER_BYTE:
        return word.to(torch.uint8)
    return ((word.unsqueeze(-1) >> (torch.arange(bits, dtype=torch.int64) * 8)) & 0xFF).flatten(-2).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: uint8 ``[..., m]`` → uint8 codes ``[..., m·8/bits]``."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8, got {packed.dtype}")
    _check_bits(bits)
    if bits in _PER_BYTE:
        per = 8 // bits
        word = packed.to(torch.int64).unsqueeze(-1)
    else:
        per = _RUN
        if packed.shape[-1] % bits:
            raise ValueError(
                f"last dimension {packed.shape[-1]} must be a multiple of {bits} to unpack {bits}-bit codes"
            )
        byte = packed.to(torch.int64).unflatten(-1, (packed.shape[-1] // bits, bits))
        word = (byte << (torch.arange(bits, dtype=torch.int64, device=byte.device) * 8)).sum(-1, keepdim=True)
    c = (word >> (torch.arange(per, dtype=torch.int64, device=word.device) * bits)) & ((1 << bits) - 1)
    return c.flatten(-2).to(torch.uint8)
