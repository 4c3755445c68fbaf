"""Channel grouping and fp16 scale storage shared by the grouped codecs.

Scales are stored in fp16 *rounded up* (never below the exact float32 value), so a quantiser that divides by
the stored scale never leaves its code range: ``|x| ≤ amax ≤ qmax·s_fp16`` ⇒ ``|x/s_fp16| ≤ qmax``.
"""

from __future__ import annotations

import torch

from kvcert.checks import fail_if

FP16_MAX = float(torch.finfo(torch.float16).max)


def check_positive(name: str, value: int) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a positive int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_group_size(d: int, group_size: int) -> None:
    """Raise ``ValueError`` unless ``group_size`` is positive and divides the head dimension ``d``."""
    if group_size < 1 or d % group_size:
        raise ValueError(f"group_size={group_size} must be positive and divide the head dimension D={d}")


def grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """View ``x[..., D]`` as ``[..., D/group_size, group_size]`` (contiguous channel groups)."""
    check_group_size(x.shape[-1], group_size)
    return x.unflatten(-1, (x.shape[-1] // group_size, group_size))


def fp16_up(s: torch.Tensor, what: str = "scale") -> torch.Tensor:
    """Round a non-negative float32 tensor to fp16 *upwards*; ``ValueError`` if it exceeds the fp16 range."""
    s = s.to(torch.float32)
    fail_if(
        (s > FP16_MAX).any(),
        lambda: ValueError(f"{what} exceeds the fp16 range ({float(s.max()):.4g} > {FP16_MAX}); x too large"),
    )
    h = s.to(torch.float16)
    return torch.where(h.to(torch.float32) < s, torch.nextafter(h, torch.full_like(h, float("inf"))), h)


def fp16_down(s: torch.Tensor, what: str = "zero-point") -> torch.Tensor:
    """Round a float32 tensor to fp16 *downwards*; ``ValueError`` if it leaves the fp16 range."""
    s = s.to(torch.float32)
    fail_if(
        (s.abs() > FP16_MAX).any(),
        lambda: ValueError(f"{what} exceeds the fp16 range ({float(s.abs().max()):.4g} > {FP16_MAX})"),
    )
    h = s.to(torch.float16)
    return torch.where(h.to(torch.float32) > s, torch.nextafter(h, torch.full_like(h, float("-inf"))), h)


def symmetric_scales(x: torch.Tensor, group_size: int, divisor: float | torch.Tensor) -> torch.Tensor:
    """Per-token, per-group fp16 scales ``s = amax/divisor`` rounded up: float16 ``[..., D/group_size]``
    (``divisor`` a number, or a float32 tensor broadcasting against ``[..., T, D/group_size]``, e.g. per head)."""
    amax = grouped(x.to(torch.float32), group_size).abs().amax(-1)
    return fp16_up(amax / divisor)


def safe_div(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``x/s`` with 0 where ``s == 0`` (an all-zero group); ``s`` broadcasts against ``x``."""
    return torch.where(s > 0, x / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(x))


def per_group(s: torch.Tensor, group_size: int) -> torch.Tensor:
    """Broadcast per-group values ``s[..., G]`` to channels ``[..., G·group_size]`` (float32)."""
    return s.to(torch.float32).repeat_interleave(group_size, dim=-1)
