"""Shared inputs for the quant tests (small, seeded)."""

from __future__ import annotations

import torch


def fp16_exact(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    """Seeded normal float32 tensor whose entries are exactly representable in fp16."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(torch.float16).to(torch.float32)


def with_outlier_channels(
    b: int = 2, h: int = 2, t: int = 64, d: int = 64, seed: int = 0, channels: tuple[int, ...] = (3, 35)
) -> torch.Tensor:
    """fp16-exact keys with a few large-magnitude channels (like post-RoPE outlier pairs)."""
    x = fp16_exact(b, h, t, d, seed=seed)
    x[..., list(channels)] *= 40.0
    return x.to(torch.float16).to(torch.float32)


def ulp32(x: torch.Tensor) -> torch.Tensor:
    """One float32 ulp at |x| (a rounding allowance for a single float32 operation)."""
    a = x.abs().to(torch.float32)
    return (torch.nextafter(a, torch.full_like(a, float("inf"))) - a).to(torch.float64)
