"""``dither-int8`` / ``dither-int6`` / ``dither-int5``: subtractive uniform dither (Tier A + B,
``docs/codecs.md#dither-int8``).

At ``b`` bits, ``q = 2^{b−1} − 1`` and ``s = amax_g/(q − ½)`` per token per channel group (fp16, rounded up),
``code = round(x/s + u)``, ``x̂ = s·(code − u)`` with ``u ~ U[−½, ½)`` regenerated from a counter-based keyed
hash. Since ``|x/s| ≤ q − ½`` and ``u ∈ [−½, ½)``, ``code ∈ [−q, q]`` (int8: ``s = amax/126.5``, codes in
``[−127, 127]``; int6: ``amax/30.5``, ``[−31, 31]``, stored offset by ``q`` and packed 4 codes in 3 bytes): the
quantiser never saturates, so the residual
``r = x̂ − x = s·(round(v) − v)`` with ``v = x/s + u`` is uniform on ``[−s/2, s/2]`` and independent of ``x``
(Schuchman), giving ``E e^{λr} = sinh(λs/2)/(λs/2) ≤ exp(λ²s²/24)``.
"""

from __future__ import annotations

import torch

from kvcert.quant.base import Codec, DitherKey, Packed
from kvcert.quant.kernel_env import fused_log8
from kvcert.quant.packing import pack_bits, unpack_bits
from kvcert.quant.scales import check_positive, per_group, safe_div, symmetric_scales

DITHER_BITS = (8, 6, 5)
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
    gives a different counter and (by the mixer's avalanche) an independent-looking draw. On CPU with the numba
    backend (:func:`kvcert.quant.kernel_env.fused_log8`) one compiled pass gives the same values bit for bit
    (:mod:`kvcert.quant.dither_numba`).
    """
    key.check(shape)
    if fused_log8(key.request.device) and key.positions.device.type == "cpu":  # the numba backend's CPU kernels
        from kvcert.quant.dither_numba import keyed_uniform as fused  # numba on first use (kernel_env says why)

        return fused(key.seed, key.request, key.layer, key.positions, shape[1], shape[3])
    return dither_from_state(keyed_state(key, shape[1]), shape[3])


class DitherCodec(Codec):
    """``dither-int{bits}``: subtractive-dither ``bits``-bit codes with per-token, per-``group_size`` fp16 steps
    (Tier B); int8 codes stored as int8, narrower ones offset to unsigned and bit-packed."""

    tier_b = True
    needs_key = True

    def __init__(self, bits: int = 8, group_size: int = 32) -> None:
        if bits not in DITHER_BITS:
            raise ValueError(f"bits must be one of {DITHER_BITS}, got {bits}")
        check_positive("group_size", group_size)
        self.name = f"dither-int{bits}"
        self.bits = float(bits)
        self.qmax = 2 ** (bits - 1) - 1
        self.group_size = group_size

    def _encode(self, x: torch.Tensor, key: DitherKey | None) -> Packed:
        assert key is not None  # guaranteed by Codec.encode (needs_key)
        s = symmetric_scales(x, self.group_size, self.qmax - 0.5)
        u = keyed_uniform(key, tuple(x.shape)).to(torch.float64)
        v = safe_div(x.to(torch.float64), per_group(s, self.group_size).to(torch.float64)) + u
        code = torch.round(v).to(torch.int8)
        stored = code if self.bits == 8 else pack_bits(code + self.qmax, int(self.bits))
        return Packed(self.name, tuple(x.shape), {"codes": stored, "scales": s})

    def _encode_decode(self, x: torch.Tensor, key: DitherKey | None) -> tuple[Packed, torch.Tensor]:
        """:meth:`_encode` and :meth:`_decode` of its codes; float32 CPU input on the numba backend in one compiled
        pass from one draw of the dither (:func:`kvcert.quant.dither_numba.round_trip`: the same values)."""
        assert key is not None  # guaranteed by Codec.encode_decode (needs_key)
        if not (fused_log8(x.device) and x.dtype == torch.float32 and key.positions.device.type == "cpu"):
            return super()._encode_decode(x, key)
        from kvcert.quant.dither_numba import round_trip  # numba on first use (kernel_env says why)

        s = symmetric_scales(x, self.group_size, self.qmax - 0.5)
        code, x_hat = round_trip(x, keyed_uniform(key, tuple(x.shape)), s, self.group_size)
        stored = code if self.bits == 8 else pack_bits(code + self.qmax, int(self.bits))
        return Packed(self.name, tuple(x.shape), {"codes": stored, "scales": s}), x_hat

    def codes(self, packed: Packed) -> torch.Tensor:
        """Signed codes in ``[−qmax, qmax]`` (int16) recovered from the stored tensors."""
        stored = packed.tensors["codes"]
        if self.bits == 8:
            return stored.to(torch.int16)
        return unpack_bits(stored, int(self.bits)).to(torch.int16) - self.qmax

    def _decode(self, packed: Packed, key: DitherKey | None) -> torch.Tensor:
        assert key is not None  # guaranteed by Codec.decode (needs_key)
        u = keyed_uniform(key, packed.shape).to(torch.float64)
        s = per_group(packed.tensors["scales"], self.group_size).to(torch.float64)
        return (s * (self.codes(packed).to(torch.float64) - u)).to(torch.float32)

    def steps(self, packed: Packed) -> torch.Tensor:
        """The stored steps ``s_{t,g}`` as float32 ``[B, H, T, D/group_size]``."""
        return packed.tensors["scales"].to(torch.float32)


class DitherInt8Codec(DitherCodec):
    """``dither-int8`` (the 8-bit :class:`DitherCodec`)."""

    def __init__(self, group_size: int = 32) -> None:
        super().__init__(8, group_size)
