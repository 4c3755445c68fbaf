"""``dither-int8``: subtractive uniform dither int8 (Tier A + B, ``docs/codecs.md#dither-int8``).

``s = amax_g/126.5`` per token per channel group (fp16, rounded up), ``code = round(x/s + u)``,
``x̂ = s·(code − u)`` with ``u ~ U[−½, ½)`` regenerated from a counter-based keyed hash. Since
``|x/s| ≤ 126.5`` and ``u ∈ [−½, ½)``, ``code ∈ [−127, 127]``: the quantiser never saturates, so the residual
``r = x̂ − x = s·(round(v) − v)`` with ``v = x/s + u`` is uniform on ``[−s/2, s/2]`` and independent of ``x``
(Schuchman), giving ``E e^{λr} = sinh(λs/2)/(λs/2) ≤ exp(λ²s²/24)``.
"""

from __future__ import annotations

import torch

from kvcert.quant.base import Codec, DitherKey, Packed
from kvcert.quant.scales import check_positive, per_group, safe_div, symmetric_scales

STEP_DIVISOR = 126.5
_U64 = 1 << 64


def _i64(c: int) -> int:
    """Two's-complement int64 value of an unsigned 64-bit constant."""
    return c - _U64 if c >= 1 << 63 else c


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_M1 = _i64(0xBF58476D1CE4E5B9)
_M2 = _i64(0x94D049BB133111EB)


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 viewed as uint64."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser (a bijection of 64-bit words) in wrapping int64 arithmetic."""
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def keyed_state(key: DitherKey, heads: int) -> torch.Tensor:
    """The hash state ``[B, H, T]`` (int64) of :func:`keyed_uniform` after every field of the counter but the
    channel: ``(seed, request[b], layer, head h, positions[b, t])``. A kernel that regenerates the dither in
    registers stores this one word per token and head and absorbs the channel itself (:func:`dither_from_state`)."""
    b, t = key.positions.shape
    fields = (
        key.request.view(b, 1, 1),
        torch.tensor(key.layer, dtype=torch.int64).view(1, 1, 1),
        torch.arange(heads, dtype=torch.int64).view(1, heads, 1),
        key.positions.view(b, 1, t),
    )
    h = _mix(torch.tensor(key.seed, dtype=torch.int64) + _GOLDEN).expand(b, heads, t)
    for f in fields:
        h = _mix((h ^ f) + _GOLDEN)
    return h


def dither_from_state(state: torch.Tensor, d: int) -> torch.Tensor:
    """``u[..., D] ∈ [−½, ½)`` (float32, multiples of 2^-24) from :func:`keyed_state`: absorb the channel, then
    the top 24 bits of the final word."""
    h = _mix((state.unsqueeze(-1) ^ torch.arange(d, dtype=torch.int64)) + _GOLDEN)
    return (_shr(h, 40).to(torch.float64) * 2.0**-24 - 0.5).to(torch.float32)


def keyed_uniform(key: DitherKey, shape: tuple[int, ...]) -> torch.Tensor:
    """Dither ``u[B, H, T, D] ∈ [−½, ½)`` (float32, multiples of 2^-24) hashed from the counter
    ``(seed, request[b], layer, head h, positions[b, t], channel d)``.

    Each field is absorbed by ``h ← mix(h ⊕ field + golden)``; the top 24 bits of the final word give ``u``.
    Equal keys regenerate identical dither; a different seed, request, layer, head, position or channel
    gives a different counter and (by the mixer's avalanche) an independent-looking draw.
    """
    key.check(shape)
    return dither_from_state(keyed_state(key, shape[1]), shape[3])


class DitherInt8Codec(Codec):
    """``dither-int8``: subtractive-dither int8 with per-token, per-``group_size`` fp16 steps (Tier B)."""

    name = "dither-int8"
    bits = 8.0
    tier_b = True
    needs_key = True

    def __init__(self, group_size: int = 32) -> None:
        check_positive("group_size", group_size)
        self.group_size = group_size

    def _encode(self, x: torch.Tensor, key: DitherKey | None) -> Packed:
        assert key is not None  # guaranteed by Codec.encode (needs_key)
        s = symmetric_scales(x, self.group_size, STEP_DIVISOR)
        u = keyed_uniform(key, tuple(x.shape)).to(torch.float64)
        v = safe_div(x.to(torch.float64), per_group(s, self.group_size).to(torch.float64)) + u
        return Packed(self.name, tuple(x.shape), {"codes": torch.round(v).to(torch.int8), "scales": s})

    def _decode(self, packed: Packed, key: DitherKey | None) -> torch.Tensor:
        assert key is not None  # guaranteed by Codec.decode (needs_key)
        u = keyed_uniform(key, packed.shape).to(torch.float64)
        s = per_group(packed.tensors["scales"], self.group_size).to(torch.float64)
        return (s * (packed.tensors["codes"].to(torch.float64) - u)).to(torch.float32)

    def steps(self, packed: Packed) -> torch.Tensor:
        """The stored steps ``s_{t,g}`` as float32 ``[B, H, T, D/group_size]``."""
        return packed.tensors["scales"].to(torch.float32)
