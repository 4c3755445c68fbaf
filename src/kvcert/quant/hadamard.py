"""``hadamard-int4`` / ``hadamard-int2``: symmetric RTN in a randomized-Hadamard basis of the head dimension.

Encode: ``y = R x`` with ``R = H_n·diag(σ)/√n`` per block of ``n`` contiguous channels (``n`` the largest
power of two dividing ``D``, ``H_n`` the Sylvester–Hadamard matrix, ``σ ∈ {±1}^D`` a sign vector drawn from
``seed``); then :class:`~kvcert.quant.rtn.RTNCodec` on ``y`` (per-token, per-``group_size`` fp16 scales rounded
up, codes bit-packed). Decode: ``x̂ = Rᵀ ŷ`` with ``ŷ`` the dequantised codes.

``R`` is orthogonal (``H_nᵀH_n = n·I``, ``σ_i² = 1``), so for every query ``⟨q, x̂ − x⟩ = ⟨Rq, ŷ − y⟩``:
the logit error is the same whichever basis it is measured in, and the store's Tier-A witness (band norms of
the residual ``x̂ − x`` of the *served* keys in the original channel basis, over whole RoPE pairs) bounds it for
any query with no change to the read path. The rotation spreads outlier channels over the block, so the
amax of a group — hence the step and the residual — shrinks on keys with outlier channels
(``docs/math.md#rotated-key-codecs``). Stored tensors are those of the inner RTN codec (the sign vector is
regenerated from ``seed``, like the dither of ``dither-int8``); bytes are measured from them.
"""

from __future__ import annotations

import math
from functools import cache

import torch

from kvcert.quant.base import Codec, DitherKey, Packed
from kvcert.quant.rtn import RTNCodec
from kvcert.quant.scales import check_positive


def hadamard_block(d: int) -> int:
    """The rotation block size for head dimension ``d``: the largest power of two dividing ``d`` (≥ 2)."""
    if d < 2:
        raise ValueError(f"head dimension must be >= 2 for a Hadamard rotation, got D={d}")
    n = d & -d
    if n < 2:
        raise ValueError(f"head dimension D={d} is odd: no Hadamard block of size >= 2 divides it")
    return n


def random_signs(d: int, seed: int) -> torch.Tensor:
    """The seeded sign vector ``σ ∈ {±1}^d`` (float64) of the rotation: a pure function of ``(d, seed)``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (d,), generator=gen).to(torch.float64).mul_(2.0).sub_(1.0)


@cache
def hadamard_matrix(n: int) -> torch.Tensor:
    """The Sylvester–Hadamard matrix ``H_n`` (float64, entries ±1, ``H_n H_nᵀ = n·I``; ``n`` a power of two)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"n must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def _blockwise(x: torch.Tensor, n: int) -> torch.Tensor:
    """``H_n`` applied to each block of ``n`` contiguous channels of ``x[..., D]`` (``H_n`` is symmetric)."""
    return (x.unflatten(-1, (x.shape[-1] // n, n)) @ hadamard_matrix(n).to(x.dtype)).flatten(-2)


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``R x = H_n(σ ⊙ x)/√n`` blockwise (``signs[D]`` ±1, ``x[..., D]``), in ``x``'s precision (at least float32).

    Rounding is harmless: the encoder quantises whatever ``y`` it computes, and the store's witness measures the
    residual of the key it finally serves against the exact key (``docs/math.md#rotated-key-codecs``)."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    n = hadamard_block(x.shape[-1])
    return _blockwise(x.to(dtype) * signs.to(dtype), n) / math.sqrt(n)


def unrotate(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``Rᵀ y = σ ⊙ H_n y/√n`` blockwise: the inverse of :func:`rotate`, in ``y``'s precision (at least float32)."""
    dtype = torch.promote_types(y.dtype, torch.float32)
    n = hadamard_block(y.shape[-1])
    return _blockwise(y.to(dtype), n) / math.sqrt(n) * signs.to(dtype)


class HadamardCodec(Codec):
    """``hadamard-int{bits}``: RTN (``bits`` ∈ {8, 4, 2}) of the keys rotated by a seeded randomized Hadamard.

    ``group_size=None`` quantises each token's whole rotated head vector with one fp16 scale (the rotation
    makes the coordinates comparable, so one scale suffices); an int must divide ``D``.
    """

    def __init__(self, bits: int = 4, group_size: int | None = None, seed: int = 0) -> None:
        if group_size is not None:
            check_positive("group_size", group_size)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self._inner_bits = bits
        RTNCodec(bits)  # validates bits
        self.name = f"hadamard-int{bits}"
        self.bits = float(bits)
        self._group = group_size
        self.seed = seed

    def _rtn(self, d: int) -> RTNCodec:
        return RTNCodec(self._inner_bits, d if self._group is None else self._group)

    def _encode(self, x: torch.Tensor, key: DitherKey | None) -> Packed:
        d = x.shape[-1]
        y = rotate(x.to(torch.float32), random_signs(d, self.seed))
        inner = self._rtn(d).encode(y)
        return Packed(self.name, tuple(x.shape), inner.tensors)

    def _decode(self, packed: Packed, key: DitherKey | None) -> torch.Tensor:
        d = packed.shape[-1]
        rtn = self._rtn(d)
        y_hat = rtn.decode(Packed(rtn.name, packed.shape, packed.tensors))
        return unrotate(y_hat.to(torch.float32), random_signs(d, self.seed))
