"""Codec registry: built-in codecs by name plus user-registered black-box tensor functions.

``get(name, **options)`` returns a fresh codec each call (codecs may hold calibration state). Options are
forwarded to the codec constructor (e.g. ``group_size=32``, ``axis="value"`` for KIVI, ``block=`` for
KVQuant, ``seed=`` for the Hadamard codecs); ``bypass=m`` wraps the codec in
:class:`~kvcert.quant.outlier.OutlierBypass` with ``pairing=``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, Literal

import torch

from kvcert.bounds.rope import Pairing
from kvcert.quant.base import Codec
from kvcert.quant.blackbox import BlackBoxCodec, check_function
from kvcert.quant.dither import DitherCodec, DitherInt8Codec
from kvcert.quant.fp8 import Fp8Codec
from kvcert.quant.hadamard import HadamardCodec
from kvcert.quant.identity import NoneCodec
from kvcert.quant.kivi import KiviCodec
from kvcert.quant.kvquant import KVQuantCodec
from kvcert.quant.minmax import MinMaxCodec
from kvcert.quant.outlier import OutlierBypass
from kvcert.quant.rtn import RTNCodec
from kvcert.quant.sign import SignCodec

BUILTINS: dict[str, Callable[..., Codec]] = {
    "none": NoneCodec,
    "int8": partial(RTNCodec, 8),
    "int4": partial(RTNCodec, 4),
    "int2": partial(RTNCodec, 2),
    "dither-int8": DitherInt8Codec,
    "dither-int6": partial(DitherCodec, 6),
    "dither-int5": partial(DitherCodec, 5),
    "dither-int4": partial(DitherCodec, 4),
    "dither-int3": partial(DitherCodec, 3),
    "fp8-e4m3": partial(Fp8Codec, "e4m3"),
    "fp8-e5m2": partial(Fp8Codec, "e5m2"),
    "fp8-e4m3-scaled": partial(Fp8Codec, "e4m3", True),
    "fp8-e5m2-scaled": partial(Fp8Codec, "e5m2", True),
    "kivi-2": partial(KiviCodec, 2),
    "kivi-4": partial(KiviCodec, 4),
    "minmax-int2": partial(MinMaxCodec, 2),
    "minmax-int4": partial(MinMaxCodec, 4),
    "kvquant-4": KVQuantCodec,
    "sign-1": SignCodec,
    "hadamard-int4": partial(HadamardCodec, 4),
    "hadamard-int2": partial(HadamardCodec, 2),
}
_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
BYPASS_SUFFIX = "+bypass"


def names() -> list[str]:
    """All codec names: built-ins first (registry order), then registered functions (sorted)."""
    return list(BUILTINS) + sorted(_FUNCTIONS)


def register(name: str, fn: Callable[[torch.Tensor], torch.Tensor], *, overwrite: bool = False) -> None:
    """Register black-box ``fn: x[..., D] → x̂[..., D]`` as codec ``name`` (Tier A, measured via its residual).

    Raises ``ValueError`` if ``fn`` is not callable, ``name`` is empty or a built-in, or already registered
    without ``overwrite=True``. Shape preservation is checked at every encode.
    """
    check_function(name, fn)
    if any(c.isspace() or c in "/,:[]" for c in name):
        raise ValueError(
            f"codec name {name!r} must not contain whitespace or any of / , : [ ] (they separate codecs, schemes and "
            "options on the command line and in mixed[...] names)"
        )
    if BYPASS_SUFFIX in name:
        raise ValueError(f"codec name {name!r} must not contain {BYPASS_SUFFIX!r} (it names an outlier bypass)")
    if name in BUILTINS:
        raise ValueError(f"codec name {name!r} is a built-in and cannot be replaced")
    if name in _FUNCTIONS and not overwrite:
        raise ValueError(f"codec {name!r} is already registered (pass overwrite=True to replace it)")
    _FUNCTIONS[name] = fn


def unregister(name: str) -> None:
    """Remove a registered function; ``ValueError`` if ``name`` was not registered."""
    if name not in _FUNCTIONS:
        raise ValueError(f"no registered function named {name!r}")
    del _FUNCTIONS[name]


def split_bypass(name: str) -> tuple[str, int]:
    """``"dither-int8+bypass32"`` -> ``("dither-int8", 32)`` (the name an :class:`OutlierBypass` gives itself);
    ``(name, 0)`` without the suffix. ``ValueError`` for a suffix whose count is not a positive integer."""
    base, sep, count = name.rpartition(BYPASS_SUFFIX)
    if not sep:
        return name, 0
    if not count.isdigit() or int(count) < 1 or not base:
        raise ValueError(f"codec {name!r}: expected <codec>{BYPASS_SUFFIX}<pairs kept exact, a positive integer>")
    return base, int(count)


def get(name: str, *, bypass: int = 0, pairing: Pairing = "rotate_half", **options: object) -> Codec:
    """A fresh codec ``name`` built with ``options``; ``bypass=m > 0``, or the suffix ``+bypass{m}`` on the name
    (``"dither-int8+bypass32"``), wraps it in the outlier bypass.

    Raises ``ValueError`` for an unknown name (listing :func:`names`), options the codec does not take, or a bypass
    given both ways.
    """
    name, suffixed = split_bypass(name)
    if suffixed:
        if bypass:
            raise ValueError(f"bypass given twice: as {BYPASS_SUFFIX}{suffixed} in the name and as bypass={bypass}")
        bypass = suffixed
    if name in BUILTINS:
        try:
            codec = BUILTINS[name](**options)
        except TypeError as err:
            raise ValueError(f"invalid options {sorted(options)} for codec {name!r}: {err}") from None
    elif name in _FUNCTIONS:
        if options:
            raise ValueError(f"registered function {name!r} takes no options, got {sorted(options)}")
        codec = BlackBoxCodec(name, _FUNCTIONS[name])
    else:
        raise ValueError(f"unknown codec {name!r}; known: {names()}")
    return OutlierBypass(codec, bypass, pairing) if bypass else codec


def resolve(spec: str | Codec, axis: Literal["key", "value"], options: Mapping[str, Any] | None = None) -> Codec:
    """The codec of a cache's ``axis`` tensor: ``spec`` itself when it is a :class:`Codec`, else
    ``get(spec, **options)`` with KIVI's quantization axis defaulting to ``axis`` (per-channel keys, per-token
    values). Raises ``ValueError`` as :func:`get` does."""
    if axis not in ("key", "value"):
        raise ValueError(f"axis must be 'key' or 'value', got {axis!r}")
    if isinstance(spec, Codec):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a codec is a name or a kvcert.quant.Codec, got {spec!r}")
    opts = dict(options or {})
    base = split_bypass(spec)[0]
    if base in BUILTINS and base.startswith("kivi"):  # the built-in KIVI codecs only, not a registered name
        opts.setdefault("axis", axis)
    return get(spec, **opts)
