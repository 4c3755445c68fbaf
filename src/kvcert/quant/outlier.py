"""Outlier-bypass wrapper (``docs/codecs.md#outlier-bypass``): keep ``m`` RoPE pairs per head exact in fp16.

At the first encode the top-``m`` pairs by energy ``Σ_{b,t} |z_j|²`` are chosen per head and then fixed
(calibrated once). The inner codec sees those channels **zeroed**, so they are excluded from the amax of its
group scales; at decode they are overwritten with the stored fp16 values (``Δ = 0`` for fp16-representable
input). Extra storage: ``2m`` fp16 values per token-head.
"""

from __future__ import annotations

import torch

from kvcert.bounds.rope import Pairing, check_pairing, pair_sq_moduli
from kvcert.checks import fail_if
from kvcert.quant.base import Codec, DitherKey, Packed
from kvcert.quant.scales import FP16_MAX

_INNER = "inner."


def pair_channels(pairs: torch.Tensor, d: int, pairing: Pairing) -> torch.Tensor:
    """Channel indices ``[..., 2m]`` of rotary pairs ``pairs[..., m]`` under ``pairing`` (re, then im)."""
    if pairing == "rotate_half":
        return torch.cat([pairs, pairs + d // 2], dim=-1)
    return torch.cat([2 * pairs, 2 * pairs + 1], dim=-1)


class OutlierBypass(Codec):
    """``{inner}+bypass{m}``: ``m`` fixed top-energy RoPE pairs per head stored exact, excluded from amax."""

    def __init__(self, inner: Codec, m: int, pairing: Pairing = "rotate_half") -> None:
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"bypass must be a positive int (pairs kept exact), got {m!r}")
        check_pairing(pairing)
        self.inner = inner
        self.m = m
        self.pairing: Pairing = pairing
        self.name = f"{inner.name}+bypass{m}"
        self.bits = inner.bits
        self.block = inner.block
        self.residual_window = inner.residual_window
        self.tier_b = inner.tier_b
        self.needs_key = inner.needs_key
        self.group_size = inner.group_size
        self.heads = inner.heads
        self.channels: torch.Tensor | None = None  # [H, 2m] bypassed channels, fixed at first encode
        self.channel_mask: torch.Tensor | None = None

    def calibrate(self, x: torch.Tensor) -> None:
        """Fix the bypassed pairs: top-``m`` by energy per head over ``x[B, H, T, D]``."""
        energy = pair_sq_moduli(x, self.pairing).sum(dim=(0, 2))  # [H, D/2]
        if self.m > energy.shape[-1]:
            raise ValueError(f"bypass={self.m} exceeds the {energy.shape[-1]} rotary pairs of x")
        pairs = energy.topk(self.m, dim=-1).indices.sort(dim=-1).values
        self.channels = pair_channels(pairs, x.shape[-1], self.pairing)
        mask = torch.ones(x.shape[1], x.shape[-1])
        self.channel_mask = mask.scatter_(-1, self.channels, 0.0)

    def _encode(self, x: torch.Tensor, key: DitherKey | None) -> Packed:
        if self.channels is None:
            self.calibrate(x)
        assert self.channels is not None and self.channel_mask is not None
        b, h, t, d = x.shape
        if self.channel_mask.shape != (h, d):
            calibrated = tuple(self.channel_mask.shape)
            raise ValueError(f"x has (H, D)={(h, d)} but bypass was calibrated for {calibrated}")
        idx = self.channels.view(1, h, 1, -1).expand(b, h, t, -1)
        exact = x.gather(-1, idx)
        fail_if(
            (exact.abs() > FP16_MAX).any(), lambda: ValueError(f"bypassed channels exceed the fp16 range ({FP16_MAX})")
        )
        inner = self.inner.encode(x * self.channel_mask.view(1, h, 1, d).to(x.dtype), key)
        tensors = {_INNER + k: v for k, v in inner.tensors.items()}
        tensors["bypass"] = exact.to(torch.float16)
        heads = {_INNER + k: v for k, v in inner.heads.items()}  # a per-head inner codec's tensors of some heads
        return Packed(self.name, tuple(x.shape), tensors, heads)

    def _inner_packed(self, packed: Packed) -> Packed:
        inner = {k[len(_INNER) :]: v for k, v in packed.tensors.items() if k.startswith(_INNER)}
        heads = {k[len(_INNER) :]: v for k, v in packed.heads.items() if k.startswith(_INNER)}
        return Packed(self.inner.name, packed.shape, inner, heads)

    def _decode(self, packed: Packed, key: DitherKey | None) -> torch.Tensor:
        if self.channels is None:
            raise ValueError(f"codec {self.name!r} has not been calibrated (encode first)")
        b, h, t, _ = packed.shape
        x_hat = self.inner.decode(self._inner_packed(packed), key)
        idx = self.channels.view(1, h, 1, -1).expand(b, h, t, -1)
        return x_hat.scatter(-1, idx, packed.tensors["bypass"].to(torch.float32))

    def steps(self, packed: Packed) -> torch.Tensor | None:
        """The inner codec's Tier-B steps (bypassed channels are removed via ``channel_mask``)."""
        return self.inner.steps(self._inner_packed(packed))
