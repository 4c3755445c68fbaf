"""``dither-int8`` / ``-int6`` / ``-int5`` / ``-int4`` / ``-int3``: subtractive uniform dither (Tier A + B,
``docs/codecs.md#dither-int8``).

At ``b`` bits, ``q = 2^{b−1} − 1`` and ``s = amax_g/(q − ½)`` per token per channel group (fp16, rounded up),
``code = round(x/s + u)``, ``x̂ = s·(code − u)`` with ``u ~ U[−½, ½)`` regenerated from a counter-based keyed
hash. Since ``|x/s| ≤ q − ½`` and ``u ∈ [−½, ½)``, ``code ∈ [−q, q]`` (int8: ``s = amax/126.5``, codes in
``[−127, 127]``; int6: ``amax/30.5``, ``[−31, 31]``, stored offset by ``q`` and packed 4 codes in 3 bytes; int4:
``amax/6.5``, ``[−7, 7]``, two codes a byte; int3: ``amax/2.5``, ``[−3, 3]``, 8 codes in 3 bytes): the
quantiser never saturates, so the residual
``r = x̂ − x = s·(round(v) − v)`` with ``v = x/s + u`` is uniform on ``[−s/2, s/2]`` and independent of ``x``
(Schuchman), giving ``E e^{λr} = sinh(λs/2)/(λs/2) ≤ exp(λ²s²/24)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcert.quant.base import Codec, DitherKey, Packed
from kvcert.quant.kernel_env import fused_log8
from kvcert.quant.packing import pack_bits, unpack_bits
from kvcert.quant.scales import check_positive, per_group, safe_div, symmetric_scales

DITHER_BITS = (8, 6, 5, 4, 3)
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
    (Tier B); int8 codes stored as int8, narrower ones offset to unsigned and bit-packed.

    With ``head_bits=(b_0, …, b_{H−1})`` it is ``dither-mixed[b_0,…]``: head ``h`` of a ``[B, H, T, D]`` tensor gets
    ``b_h`` bits (its own step ``amax/(2^{b_h−1} − 3/2)``), the dither is the same draw as for a uniform width
    (head index ``h`` in the counter), and the codes of the heads of each width are stored together at that width
    (``codes{b}``, ``Packed.heads`` names the heads): the per-(layer, KV head) widths of a certificate-driven
    allocation (``docs/codecs.md#dither-mixed``)."""

    tier_b = True
    needs_key = True

    def __init__(self, bits: int = 8, group_size: int = 32, head_bits: Sequence[int] | None = None) -> None:
        check_positive("group_size", group_size)
        self.group_size = group_size
        widths = (bits,) if head_bits is None else tuple(head_bits)
        if not widths or any(isinstance(b, bool) or b not in DITHER_BITS for b in widths):
            raise ValueError(f"bits must be one of {DITHER_BITS} (per head with head_bits), got {widths}")
        self.widths = widths
        self.head_bits: tuple[int, ...] | None = None if head_bits is None else widths
        if self.head_bits is None:
            self.name = f"dither-int{bits}"
        else:
            self.name = f"dither-mixed[{','.join(map(str, widths))}]"
            self.heads = len(widths)
        self.bits = sum(widths) / len(widths)
        self.qmax = 2 ** (max(widths) - 1) - 1  # the widest head's largest code

    def _divisor(self, x: torch.Tensor) -> float | torch.Tensor:
        """``q − ½`` (``q = 2^{b−1} − 1``): a number, or per head ``[H, 1, 1]`` for mixed widths."""
        if self.head_bits is None:
            return self.qmax - 0.5
        return torch.tensor([2.0 ** (b - 1) - 1.5 for b in self.head_bits], device=x.device).view(-1, 1, 1)

    def _groups(self) -> list[tuple[str, int, list[int]]]:
        """``(tensor name, width, heads)`` per stored width, widest first (one ``"codes"`` tensor when uniform)."""
        if self.head_bits is None:
            return [("codes", self.widths[0], [])]
        return [
            (f"codes{w}", w, [h for h, b in enumerate(self.head_bits) if b == w])
            for w in sorted(set(self.head_bits), reverse=True)
        ]

    def _store(self, code: torch.Tensor, s: torch.Tensor, shape: tuple[int, ...]) -> Packed:
        """The stored form of signed codes ``code[B, H, T, D]`` (int8) and steps ``s``."""
        tensors: dict[str, torch.Tensor] = {}
        heads: dict[str, tuple[int, ...]] = {}
        for name, w, hs in self._groups():
            c = code if not hs else code[:, hs]
            tensors[name] = c if w == 8 else pack_bits(c + (2 ** (w - 1) - 1), w)
            if hs:
                heads[name] = tuple(hs)
        tensors["scales"] = s
        return Packed(self.name, shape, tensors, heads)

    def _encode(self, x: torch.Tensor, key: DitherKey | None) -> Packed:
        assert key is not None  # guaranteed by Codec.encode (needs_key)
        s = symmetric_scales(x, self.group_size, self._divisor(x))
        u = keyed_uniform(key, tuple(x.shape)).to(torch.float64)
        v = safe_div(x.to(torch.float64), per_group(s, self.group_size).to(torch.float64)) + u
        return self._store(torch.round(v).to(torch.int8), s, tuple(x.shape))

    def _encode_decode(self, x: torch.Tensor, key: DitherKey | None) -> tuple[Packed, torch.Tensor]:
        """:meth:`_encode` and :meth:`_decode` of its codes; float32 CPU input on the numba backend in one compiled
        pass from one draw of the dither (:func:`kvcert.quant.dither_numba.round_trip`: the same values)."""
        assert key is not None  # guaranteed by Codec.encode_decode (needs_key)
        if not (fused_log8(x.device) and x.dtype == torch.float32 and key.positions.device.type == "cpu"):
            return super()._encode_decode(x, key)
        from kvcert.quant.dither_numba import round_trip  # numba on first use (kernel_env says why)

        s = symmetric_scales(x, self.group_size, self._divisor(x))
        code, x_hat = round_trip(x, keyed_uniform(key, tuple(x.shape)), s, self.group_size)
        return self._store(code, s, tuple(x.shape)), x_hat

    def codes(self, packed: Packed) -> torch.Tensor:
        """Signed codes in ``[−q_h, q_h]`` (int16 ``[B, H, T, D]``) recovered from the stored tensors."""
        groups = self._groups()
        if self.head_bits is None:
            name, w, _ = groups[0]
            stored = packed.tensors[name]
            return stored.to(torch.int16) if w == 8 else unpack_bits(stored, w).to(torch.int16) - self.qmax
        out = torch.empty(packed.shape, dtype=torch.int16, device=packed.tensors["scales"].device)
        for name, w, hs in groups:
            stored = packed.tensors[name]
            out[:, hs] = (
                stored.to(torch.int16) if w == 8 else unpack_bits(stored, w).to(torch.int16) - (2 ** (w - 1) - 1)
            )
        return out

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
