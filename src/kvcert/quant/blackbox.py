"""Registered black-box codecs: any tensor function ``x[..., D] → x̂[..., D]`` (``docs/codecs.md#black-box-codecs``).

Such a scheme is measured only through its residual ``x̂ − x`` (Tier A); its stored form is the returned
``x̂`` itself, so its byte count is that tensor's (dtype as returned by the function).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvcert.checks import fail_if
from kvcert.quant.base import Codec, DitherKey, Packed


def check_function(name: str, fn: object) -> None:
    """Raise ``ValueError`` unless ``name`` is a non-empty str and ``fn`` is callable."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"codec name must be a non-empty str, got {name!r}")
    if not callable(fn):
        raise ValueError(f"fn for codec {name!r} must be callable, got {type(fn).__name__}")


class BlackBoxCodec(Codec):
    """Wrap ``fn`` as a codec; ``encode`` rejects outputs that change shape or are not finite floats.

    ``bits`` is the bit width of the stored ``x̂`` dtype, known after the first encode (NaN before).
    """

    def __init__(self, name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        check_function(name, fn)
        self.name = name
        self.fn = fn
        self.bits = float("nan")

    def _encode(self, x: torch.Tensor, key: DitherKey | None) -> Packed:
        x_hat = self.fn(x)
        if not isinstance(x_hat, torch.Tensor) or tuple(x_hat.shape) != tuple(x.shape):
            got = tuple(x_hat.shape) if isinstance(x_hat, torch.Tensor) else type(x_hat).__name__
            raise ValueError(f"codec {self.name!r}: fn must return shape {tuple(x.shape)}, got {got}")
        finite_floats = ValueError(f"codec {self.name!r}: fn must return finite floating-point values")
        if not x_hat.is_floating_point():
            raise finite_floats
        fail_if(~torch.isfinite(x_hat).all(), lambda: finite_floats)
        self.bits = float(x_hat.element_size() * 8)
        return Packed(self.name, tuple(x.shape), {"x_hat": x_hat.detach().clone()})

    def _decode(self, packed: Packed, key: DitherKey | None) -> torch.Tensor:
        return packed.tensors["x_hat"].to(torch.float32)
