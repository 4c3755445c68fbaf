"""``mixed[c_0,…,c_{H−1}]``: one codec per head of a ``[B, H, T, D]`` tensor (the value codec of a per-(layer, KV
head) bit allocation, ``docs/codecs.md#per-head-values``).

Head ``h`` is encoded by member codec ``c_h`` exactly as ``c_h`` encodes that head alone: the heads that share a
member are encoded together as one ``[B, H_c, T, D]`` tensor (every member here encodes each head on its own, so
grouping changes no value), and the member's stored tensors are kept under ``"{member}/{tensor}"`` with
:attr:`~kvcert.quant.base.Packed.heads` naming the heads they hold. Hence the residual of head ``h`` is the
residual of ``c_h`` and every per-element or per-token guarantee of ``c_h`` (e.g. ``|x̂ − x| ≤ s/2`` for RTN) holds
on head ``h``; the bytes are the sum of the members' stored tensors.

Members must be keyless codecs that encode every token on its own (``block == 1``) and are not themselves per-head;
a member's residual window (KIVI) makes the mixed codec declare the widest window, so the cache keeps at least as
many recent tokens exact for every head as each member asks for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from kvcert.quant.base import Codec, DitherKey, Packed
from kvcert.quant.registry import resolve


class PerHeadCodec(Codec):
    """``mixed[...]``: member codec ``members[h]`` (a name resolved for ``axis``, or a :class:`Codec`) on head ``h``."""

    def __init__(self, members: Sequence[str | Codec], axis: Literal["key", "value"] = "value") -> None:
        if not members:
            raise ValueError("a per-head codec needs one member codec per head, got none")
        if axis not in ("key", "value"):
            raise ValueError(f"axis must be 'key' or 'value', got {axis!r}")
        codecs = [resolve(m, axis) for m in members]
        by_name: dict[str, Codec] = {}
        for c in codecs:
            if c.needs_key or c.block != 1 or c.heads is not None:
                raise ValueError(
                    f"member {c.name!r} of a per-head codec must be keyless, encode each token on its own and hold "
                    "every head at one width"
                )
            if "/" in c.name:
                raise ValueError(f"member name {c.name!r} must not contain '/'")
            by_name.setdefault(c.name, c)
        self.members = tuple(by_name[c.name] for c in codecs)  # one instance per distinct member
        self.name = f"mixed[{','.join(c.name for c in self.members)}]"
        self.heads = len(self.members)
        self.bits = sum(c.bits for c in self.members) / self.heads
        self.residual_window = max(c.residual_window for c in self.members)

    def _groups(self) -> list[tuple[Codec, list[int]]]:
        """``(member, heads)`` per distinct member, in order of first appearance."""
        groups: dict[str, tuple[Codec, list[int]]] = {}
        for h, c in enumerate(self.members):
            groups.setdefault(c.name, (c, []))[1].append(h)
        return list(groups.values())

    def _pack(self, parts: list[tuple[Codec, list[int], Packed]], shape: tuple[int, ...]) -> Packed:
        tensors: dict[str, torch.Tensor] = {}
        heads: dict[str, tuple[int, ...]] = {}
        for codec, hs, packed in parts:
            for name, t in packed.tensors.items():
                tensors[f"{codec.name}/{name}"] = t
                heads[f"{codec.name}/{name}"] = tuple(hs)
        return Packed(self.name, shape, tensors, heads)

    def _encode(self, x: torch.Tensor, key: DitherKey | None) -> Packed:
        parts = [(c, hs, c.encode(x[:, hs])) for c, hs in self._groups()]
        return self._pack(parts, tuple(x.shape))

    def _encode_decode(self, x: torch.Tensor, key: DitherKey | None) -> tuple[Packed, torch.Tensor]:
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        parts = []
        for c, hs in self._groups():
            packed, decoded = c.encode_decode(x[:, hs])
            out[:, hs] = decoded
            parts.append((c, hs, packed))
        return self._pack(parts, tuple(x.shape)), out

    def member_packed(self, packed: Packed, member: str) -> Packed:
        """The stored form of the heads of ``member`` alone, as that member wrote it."""
        prefix = f"{member}/"
        tensors = {n.removeprefix(prefix): t for n, t in packed.tensors.items() if n.startswith(prefix)}
        if not tensors:
            raise ValueError(f"packed holds no tensors of member {member!r}")
        hs = packed.heads[next(n for n in packed.tensors if n.startswith(prefix))]
        return Packed(member, (packed.shape[0], len(hs), *packed.shape[2:]), tensors)

    def _decode(self, packed: Packed, key: DitherKey | None) -> torch.Tensor:
        out = torch.empty(packed.shape, dtype=torch.float32, device=next(iter(packed.tensors.values())).device)
        for c, hs in self._groups():
            out[:, hs] = c.decode(self.member_packed(packed, c.name))
        return out
