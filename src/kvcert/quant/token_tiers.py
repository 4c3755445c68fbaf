"""Token tiers (``docs/codecs.md#token-tiers``): each token of each head stored in one of two per-token codecs.

``TokenTiers(light, heavy)`` encodes a write of ``T`` tokens with a boolean choice ``heavy[B, H, T]``: the chosen
tokens in the ``heavy`` (wider) codec, every other one in the ``light`` codec, each token's codes stored *once*. The
stored form holds the light codec's tensors over the ``T − k`` light tokens, the heavy codec's over the ``k`` heavy
ones (in slot order within each tier) and the choice as a bit mask (``⌈T/8⌉`` bytes per head): every byte is a real
tensor. A rectangular stored form needs the same ``k`` on every (row, head); :meth:`TokenTiers.encode_split` refuses
anything else by name. :meth:`Codec.encode` (no choice) stores every token light.

Both codecs must encode each token of each head on its own (block 1, no residual window, not per-head): the codes of
a token do not depend on the others, so a token decodes to what its own tier's codec decodes it to, and the Tier-A
witnesses (computed from the decoded value) hold for either. With Tier-B steps (dithered keys), the heavy codec must
have them too, with the same group size and bypassed channels, so every token's radius is read with one channel mask:
:func:`check_wide` states the conditions, shared with the cache's upgrade repair. Both tiers draw their dither from the
same key: each token is stored in one tier only, so its dither is used once.
"""

from __future__ import annotations

import torch

from kvcert.quant.base import Codec, DitherKey, Packed
from kvcert.quant.outlier import OutlierBypass
from kvcert.quant.packing import pack_bits, unpack_bits

_LIGHT, _HEAVY, _MASK = "light.", "heavy.", "tier"


def bypass_of(codec: Codec) -> tuple[int, str] | None:
    """``(pairs, pairing)`` an outlier-bypass codec keeps exact, ``None`` for a codec without bypass."""
    return (codec.m, codec.pairing) if isinstance(codec, OutlierBypass) else None


def share_bypass(light: Codec, wide: Codec) -> None:
    """Give ``wide`` the bypassed channels ``light`` fixed at its first encode, when both keep the same number of
    pairs exact: a Tier-B radius masks the query with ``light``'s channels, so a token in ``wide``'s codes must keep
    exactly those channels exact."""
    if isinstance(wide, OutlierBypass) and isinstance(light, OutlierBypass) and bypass_of(wide) == bypass_of(light):
        wide.channels, wide.channel_mask = light.channels, light.channel_mask


def check_wide(light: Codec, wide: Codec, what: str) -> None:
    """``ValueError`` naming ``what`` (the role of ``wide``) unless ``wide`` can hold single tokens of a store whose
    codec is ``light``: ``wide`` encodes each token of each head on its own (block 1, no residual window, not
    per-head), and when ``light`` has Tier-B steps ``wide`` has them too, with the same group size and bypassed
    channels (every token's Tier-B radius is read with ``light``'s groups and channel mask)."""
    if wide.block != 1 or wide.residual_window or wide.heads is not None:
        raise ValueError(
            f"{what} must encode each token of each KV head on its own (block 1, no residual window, not per-head); "
            f"{wide.name!r} does not"
        )
    if light.tier_b and not (
        wide.tier_b and wide.group_size == light.group_size and bypass_of(wide) == bypass_of(light)
    ):
        raise ValueError(
            f"the codec {light.name!r} has Tier-B steps, so {what} must have them too, with the same group size "
            f"({light.group_size}) and bypassed channels; {wide.name!r} does not"
        )


def _tiered(name: str) -> tuple[str, str] | None:
    """``(prefix, inner name)`` of a stored tensor of a tiered form (``None`` for the mask)."""
    for prefix in (_LIGHT, _HEAVY):
        if name.startswith(prefix):
            return prefix, name[len(prefix) :]
    return None


class TokenTiers(Codec):
    """``tiers(light,heavy)``: each token in one of two per-token codecs, chosen per write (module doc)."""

    def __init__(self, light: Codec, heavy: Codec) -> None:
        check_wide(light, light, "the light codec")
        check_wide(light, heavy, "the heavy codec")
        self.light, self.heavy = light, heavy
        self.name = f"tiers({light.name},{heavy.name})"
        self.bits = light.bits  # the light codes' width; the stored bytes are measured
        self.tier_b = light.tier_b
        self.needs_key = light.needs_key or heavy.needs_key
        self.group_size = light.group_size

    @property
    def channel_mask(self) -> torch.Tensor | None:
        """The light codec's bypass mask (fixed at its first encode; the heavy codec shares it)."""
        return self.light.channel_mask

    @channel_mask.setter
    def channel_mask(self, mask: torch.Tensor | None) -> None:
        raise AttributeError("a token-tier codec's channel mask is its light codec's")

    def encode_split(self, x: torch.Tensor, key: DitherKey | None, heavy: torch.Tensor) -> Packed:
        """Encode ``x[B, H, T, D]`` with the tokens of ``heavy[B, H, T]`` (bool, the same count on every (row,
        head)) in the heavy codec; ``ValueError`` on a bad shape or uneven counts."""
        return self.encode_decode_split(x, key, heavy)[0]

    def encode_decode_split(
        self, x: torch.Tensor, key: DitherKey | None, heavy: torch.Tensor
    ) -> tuple[Packed, torch.Tensor]:
        """``(encode_split(x, key, heavy), its decode)`` with :meth:`Codec.encode`'s checks."""
        self._check_encode(x, key)
        return self._split(x, key, self._check_choice(heavy, tuple(x.shape)))

    def _check_choice(self, heavy: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        if not isinstance(heavy, torch.Tensor) or heavy.dtype != torch.bool or tuple(heavy.shape) != shape[:3]:
            got = f"{heavy.dtype} {tuple(heavy.shape)}" if isinstance(heavy, torch.Tensor) else type(heavy).__name__
            raise ValueError(f"heavy must be a bool [B, H, T] = {shape[:3]} tensor, got {got}")
        counts = heavy.sum(-1)
        if bool((counts != counts.flatten()[0]).any()):
            raise ValueError(
                f"codec {self.name!r} stores the same number of heavy tokens on every (row, head) of a write, got "
                f"counts from {int(counts.min())} to {int(counts.max())}"
            )
        return heavy

    def _encode(self, x: torch.Tensor, key: DitherKey | None) -> Packed:
        return self._split(x, key, torch.zeros(x.shape[:3], dtype=torch.bool, device=x.device))[0]

    def _encode_decode(self, x: torch.Tensor, key: DitherKey | None) -> tuple[Packed, torch.Tensor]:
        return self._split(x, key, torch.zeros(x.shape[:3], dtype=torch.bool, device=x.device))

    def _split(self, x: torch.Tensor, key: DitherKey | None, heavy: torch.Tensor) -> tuple[Packed, torch.Tensor]:
        """Encode every token in both codecs (a codec's codes of a token depend on that token alone), keep each
        token's codes of its own tier, and decode as :meth:`_decode` would."""
        lp, lx = self.light.encode_decode(x, key=key if self.light.needs_key else None)
        share_bypass(self.light, self.heavy)
        hp, hx = self.heavy.encode_decode(x, key=key if self.heavy.needs_key else None)
        b, h, t = x.shape[:3]
        k = int(heavy[0, 0].sum()) if heavy.numel() else 0
        tensors = {_MASK: _pack_mask(heavy)}
        for prefix, packed, keep, n in ((_LIGHT, lp, ~heavy, t - k), (_HEAVY, hp, heavy, k)):
            idx = _slots(keep, n)
            for name, tensor in packed.tensors.items():
                if tensor.dim() < 3 or tensor.shape[:3] != (b, h, t):
                    raise ValueError(
                        f"codec {packed.codec!r} stores {name!r} as {tuple(tensor.shape)}, not per token [B, H, T, ·]"
                    )
                tensors[prefix + name] = _take(tensor, idx)
        return Packed(self.name, tuple(x.shape), tensors), torch.where(heavy.unsqueeze(-1), hx, lx)

    def _parts(self, packed: Packed) -> tuple[torch.Tensor, Packed, Packed]:
        """``(heavy[B, H, T], the light codec's form, the heavy codec's form)``, each over all ``T`` slots (the
        other tier's slots hold zeros: decoded, they are discarded)."""
        b, h, t = packed.shape[:3]
        heavy = _unpack_mask(packed.tensors[_MASK], t)
        k = int(heavy[0, 0].sum()) if heavy.numel() else 0
        parts: dict[str, dict[str, torch.Tensor]] = {_LIGHT: {}, _HEAVY: {}}
        for name, tensor in packed.tensors.items():
            split = _tiered(name)
            if split is None:
                continue
            prefix, inner = split
            keep = heavy if prefix == _HEAVY else ~heavy
            parts[prefix][inner] = _put(tensor, _slots(keep, k if prefix == _HEAVY else t - k), t)
        return (
            heavy,
            Packed(self.light.name, packed.shape, parts[_LIGHT]),
            Packed(self.heavy.name, packed.shape, parts[_HEAVY]),
        )

    def _decode(self, packed: Packed, key: DitherKey | None) -> torch.Tensor:
        heavy, lp, hp = self._parts(packed)
        lx = self.light.decode(lp, key if self.light.needs_key else None)
        hx = self.heavy.decode(hp, key if self.heavy.needs_key else None)
        return torch.where(heavy.unsqueeze(-1), hx, lx)

    def steps(self, packed: Packed) -> torch.Tensor | None:
        """Each token's Tier-B steps from its own tier's codec (``None`` without Tier B)."""
        if not self.tier_b:
            return None
        heavy, lp, hp = self._parts(packed)
        ls, hs = self.light.steps(lp), self.heavy.steps(hp)
        assert ls is not None and hs is not None  # check_wide: both codecs have steps
        return torch.where(heavy.unsqueeze(-1), hs, ls)

    @staticmethod
    def heavy_mask(packed: Packed) -> torch.Tensor:
        """``[B, H, T]`` bool: the tokens of a tiered form stored in the heavy codec."""
        return _unpack_mask(packed.tensors[_MASK], packed.shape[2])


def _pack_mask(heavy: torch.Tensor) -> torch.Tensor:
    """``heavy[B, H, T]`` as uint8 bits ``[B, H, ⌈T/8⌉]``."""
    pad = -heavy.shape[-1] % 8
    bits = torch.nn.functional.pad(heavy.to(torch.uint8), (0, pad))
    return pack_bits(bits, 1)


def _unpack_mask(bits: torch.Tensor, t: int) -> torch.Tensor:
    return unpack_bits(bits, 1)[..., :t].to(torch.bool)


def _slots(keep: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, H, n]`` int64: the slots of ``keep[B, H, T]`` (``n`` on every (row, head)), ascending."""
    order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)  # kept slots first, in slot order
    return order[..., :n]


def _take(tensor: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``tensor[B, H, T, ·]`` at the token slots ``idx[B, H, n]``."""
    tail = tensor.shape[3:]
    return tensor.gather(2, idx.view(*idx.shape, *([1] * len(tail))).expand(*idx.shape, *tail))


def _put(tensor: torch.Tensor, idx: torch.Tensor, t: int) -> torch.Tensor:
    """The inverse of :func:`_take` into zeros over ``t`` slots."""
    tail = tensor.shape[3:]
    out = tensor.new_zeros(*tensor.shape[:2], t, *tail)
    return out.scatter(2, idx.view(*idx.shape, *([1] * len(tail))).expand(*idx.shape, *tail), tensor)
