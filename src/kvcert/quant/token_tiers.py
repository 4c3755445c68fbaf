"""Token tiers (``docs/codecs.md#token-tiers``): each token of each head stored in one of two per-token codecs.

``TokenTiers(light, heavy)`` encodes a write of ``T`` tokens with a boolean choice ``heavy[B, H, T]``: the chosen
tokens in the ``heavy`` (wider) codec, every other one in the ``light`` codec, each token's codes stored *once*. The
stored form holds the light codec's tensors over the light entries and the heavy codec's over the heavy ones, each
flattened in (row, head, slot) order (``[N, ·]``, so every (row, head) may have its own count), and the choice as a
bit mask (``⌈T/8⌉`` bytes per head): every byte is a real tensor. :meth:`Codec.encode` (no choice) stores every token
light.

An entry's codes can be dropped (:meth:`TokenTiers.drop`, e.g. once a cache serves the entry from other codes) and
given back (:meth:`TokenTiers.restore`, by encoding its original again): a second bit mask ``gone`` records the
dropped entries, which decode to NaN (fail closed: nothing serves them by mistake).

Both codecs must encode each token of each head on its own (block 1, no residual window, not per-head): the codes of
a token depend on that token, its position and the dither key alone, so a token decodes to what its own tier's codec
decodes it to, the Tier-A witnesses (computed from the decoded value) hold for either, and encoding it again gives
back the same codes. With Tier-B steps (dithered keys), the heavy codec must have them too, with the same group size
and bypassed channels, so every token's radius is read with one channel mask: :func:`check_wide` states the
conditions, shared with the cache's upgrade repair. Both tiers draw their dither from the same key: each token is
stored in one tier only, so its dither is used once.
"""

from __future__ import annotations

import torch

from kvcert.quant.base import Codec, DitherKey, Packed
from kvcert.quant.outlier import OutlierBypass
from kvcert.quant.packing import pack_bits, unpack_bits

_LIGHT, _HEAVY, _MASK, _GONE = "light.", "heavy.", "tier", "gone"


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
        """Encode ``x[B, H, T, D]`` with the tokens of ``heavy[B, H, T]`` (bool) in the heavy codec; ``ValueError`` on
        a bad shape."""
        return self.encode_decode_split(x, key, heavy)[0]

    def encode_decode_split(
        self, x: torch.Tensor, key: DitherKey | None, heavy: torch.Tensor
    ) -> tuple[Packed, torch.Tensor]:
        """``(encode_split(x, key, heavy), its decode)`` with :meth:`Codec.encode`'s checks."""
        self._check_encode(x, key)
        return self._split(x, key, _check_mask(heavy, tuple(x.shape), "heavy"))

    def _encode(self, x: torch.Tensor, key: DitherKey | None) -> Packed:
        return self._split(x, key, torch.zeros(x.shape[:3], dtype=torch.bool, device=x.device))[0]

    def _encode_decode(self, x: torch.Tensor, key: DitherKey | None) -> tuple[Packed, torch.Tensor]:
        return self._split(x, key, torch.zeros(x.shape[:3], dtype=torch.bool, device=x.device))

    def _both(self, x: torch.Tensor, key: DitherKey | None) -> tuple[tuple[Packed, torch.Tensor], ...]:
        """Every token of ``x`` encoded and decoded by the light codec, then by the heavy one."""
        light = self.light.encode_decode(x, key=key if self.light.needs_key else None)
        share_bypass(self.light, self.heavy)
        return light, self.heavy.encode_decode(x, key=key if self.heavy.needs_key else None)

    def _split(self, x: torch.Tensor, key: DitherKey | None, heavy: torch.Tensor) -> tuple[Packed, torch.Tensor]:
        """Encode every token in both codecs (a codec's codes of a token depend on that token alone), keep each
        token's codes of its own tier, and decode as :meth:`_decode` would."""
        (lp, lx), (hp, hx) = self._both(x, key)
        tensors = {_MASK: _pack_mask(heavy)}
        for prefix, packed, keep in ((_LIGHT, lp, ~heavy), (_HEAVY, hp, heavy)):
            for name, tensor in packed.tensors.items():
                if tensor.dim() < 3 or tensor.shape[:3] != x.shape[:3]:
                    raise ValueError(
                        f"codec {packed.codec!r} stores {name!r} as {tuple(tensor.shape)}, not per token [B, H, T, ·]"
                    )
                tensors[prefix + name] = tensor[keep.to(tensor.device)]
        return Packed(self.name, tuple(x.shape), tensors), torch.where(heavy.unsqueeze(-1), hx, lx)

    def _masks(self, packed: Packed) -> tuple[torch.Tensor, torch.Tensor]:
        """``(heavy, gone)``, each ``[B, H, T]`` bool, of a tiered form."""
        t = packed.shape[2]
        heavy = _unpack_mask(packed.tensors[_MASK], t)
        gone = _unpack_mask(packed.tensors[_GONE], t) if _GONE in packed.tensors else torch.zeros_like(heavy)
        return heavy, gone

    def _full(self, packed: Packed, heavy: torch.Tensor, gone: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
        """``{prefix: {name: [B, H, T, ·]}}``: each tier's stored tensors put back at their slots (zeros at the other
        tier's slots and at dropped entries), given the form's masks (:meth:`_masks`)."""
        full: dict[str, dict[str, torch.Tensor]] = {_LIGHT: {}, _HEAVY: {}}
        for name, tensor in packed.tensors.items():
            split = _tiered(name)
            if split is None:
                continue
            prefix, inner = split
            keep = (heavy if prefix == _HEAVY else ~heavy) & ~gone
            out = tensor.new_zeros(*packed.shape[:3], *tensor.shape[1:])
            out[keep.to(out.device)] = tensor
            full[prefix][inner] = out
        return full

    def _stored(
        self, full: dict[str, dict[str, torch.Tensor]], heavy: torch.Tensor, gone: torch.Tensor, shape: tuple[int, ...]
    ) -> Packed:
        """The stored form (of ``shape``) of the full-size tensors ``full`` (:meth:`_full`) with the masks ``heavy``
        and ``gone``."""
        tensors = {_MASK: _pack_mask(heavy)}
        if bool(gone.any()):
            tensors[_GONE] = _pack_mask(gone)
        for prefix, names in full.items():
            keep = (heavy if prefix == _HEAVY else ~heavy) & ~gone
            for inner, tensor in names.items():
                tensors[prefix + inner] = tensor[keep.to(tensor.device)]
        return Packed(self.name, shape, tensors)

    def _parts(self, packed: Packed) -> tuple[torch.Tensor, torch.Tensor, Packed, Packed]:
        """``(heavy, gone, the light codec's form, the heavy codec's form)``, each form over all ``T`` slots."""
        heavy, gone = self._masks(packed)
        full = self._full(packed, heavy, gone)
        return (
            heavy,
            gone,
            Packed(self.light.name, packed.shape, full[_LIGHT]),
            Packed(self.heavy.name, packed.shape, full[_HEAVY]),
        )

    def _decode(self, packed: Packed, key: DitherKey | None) -> torch.Tensor:
        heavy, gone, lp, hp = self._parts(packed)
        lx = self.light.decode(lp, key if self.light.needs_key else None)
        hx = self.heavy.decode(hp, key if self.heavy.needs_key else None)
        return _nan_at(gone, torch.where(heavy.unsqueeze(-1), hx, lx))

    def steps(self, packed: Packed) -> torch.Tensor | None:
        """Each token's Tier-B steps from its own tier's codec (``None`` without Tier B; NaN at dropped entries)."""
        if not self.tier_b:
            return None
        heavy, gone, lp, hp = self._parts(packed)
        ls, hs = self.light.steps(lp), self.heavy.steps(hp)
        assert ls is not None and hs is not None  # check_wide: both codecs have steps
        return _nan_at(gone, torch.where(heavy.unsqueeze(-1), hs, ls))

    def drop(self, packed: Packed, which: torch.Tensor) -> Packed:
        """``packed`` without the codes of the entries ``which[B, H, T]`` (bool; already dropped ones stay dropped):
        they decode to NaN until :meth:`restore` gives them back. ``ValueError`` on a bad mask. Each stored tensor
        loses the rows of its newly dropped entries, in place of a rebuild (the cost of a row selection)."""
        heavy, gone = self._masks(packed)
        which = _check_mask(which, packed.shape, "which").to(heavy.device)
        tensors = {_MASK: packed.tensors[_MASK], _GONE: _pack_mask(gone | which)}
        stays = {prefix: ~which[(heavy if prefix == _HEAVY else ~heavy) & ~gone] for prefix in (_LIGHT, _HEAVY)}
        for name, tensor in packed.tensors.items():
            split = _tiered(name)
            if split is not None:
                tensors[name] = tensor[stays[split[0]].to(tensor.device)]
        return Packed(self.name, packed.shape, tensors)

    def restore(self, packed: Packed, x: torch.Tensor, key: DitherKey | None, which: torch.Tensor) -> Packed:
        """``packed`` with the codes of the dropped entries ``which[B, H, T]`` given back: ``x[B, H, T, D]`` holds the
        originals the form was encoded from at those entries (finite everywhere; other entries are not read) and
        ``key`` the form's dither key. A token's codes depend on it, its position and the key alone, so encoding it
        again gives the codes it was stored with. ``ValueError`` on a bad mask or an entry that was not dropped."""
        heavy, gone = self._masks(packed)
        which = _check_mask(which, packed.shape, "which").to(heavy.device)
        if bool((which & ~gone).any()):
            raise ValueError("restore gives back dropped entries only; some entries of which were not dropped")
        self._check_encode(x, key)
        if tuple(x.shape) != tuple(packed.shape):
            raise ValueError(f"x must be the form's shape {tuple(packed.shape)}, got {tuple(x.shape)}")
        full = self._full(packed, heavy, gone)
        for prefix, (fresh, _) in zip((_LIGHT, _HEAVY), self._both(x, key), strict=True):
            put = (which & (heavy if prefix == _HEAVY else ~heavy)).to(x.device)
            for inner, tensor in full[prefix].items():
                tensor[put.to(tensor.device)] = fresh.tensors[inner][put.to(fresh.tensors[inner].device)]
        return self._stored(full, heavy, gone & ~which, packed.shape)

    @staticmethod
    def heavy_mask(packed: Packed) -> torch.Tensor:
        """``[B, H, T]`` bool: the tokens of a tiered form stored in the heavy codec."""
        return _unpack_mask(packed.tensors[_MASK], packed.shape[2])

    @staticmethod
    def dropped_mask(packed: Packed) -> torch.Tensor:
        """``[B, H, T]`` bool: the entries of a tiered form whose codes were dropped (:meth:`drop`)."""
        if _GONE not in packed.tensors:
            return torch.zeros(packed.shape[:3], dtype=torch.bool)
        return _unpack_mask(packed.tensors[_GONE], packed.shape[2])


def _check_mask(mask: torch.Tensor, shape: tuple[int, ...], what: str) -> torch.Tensor:
    """``mask`` when it is a bool ``[B, H, T]`` tensor of the form ``shape``; ``ValueError`` naming ``what`` else."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != tuple(shape[:3]):
        got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"{what} must be a bool [B, H, T] = {tuple(shape[:3])} tensor, got {got}")
    return mask


def _nan_at(gone: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x[B, H, T, ·]`` with NaN at the dropped entries ``gone[B, H, T]``."""
    return x.masked_fill(gone.to(x.device).unsqueeze(-1), float("nan"))


def _pack_mask(heavy: torch.Tensor) -> torch.Tensor:
    """``heavy[B, H, T]`` as uint8 bits ``[B, H, ⌈T/8⌉]``."""
    pad = -heavy.shape[-1] % 8
    bits = torch.nn.functional.pad(heavy.to(torch.uint8), (0, pad))
    return pack_bits(bits, 1)


def _unpack_mask(bits: torch.Tensor, t: int) -> torch.Tensor:
    return unpack_bits(bits, 1)[..., :t].to(torch.bool)
