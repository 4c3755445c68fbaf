"""Compile every variant of the Triton read's kernels for a Hopper GPU (sm_90) on a machine without one.

The interpreter (``TRITON_INTERPRET=1``, how the tests run the kernels on CPU) executes the kernels' Python, so it
does not see what only the compiler rejects (a non-constexpr global, a type the code generator refuses, a
ptxas failure). This script runs the real compiler to a cubin with the ``ptxas`` bundled in the ``triton``
wheel, for every ``MODE`` of :mod:`kvcert.kernels.packed` (one codec per mode), without a GPU or driver: it
records the kernels' launch arguments from :func:`kvcert.kernels.triton_read.decode_read` (launches replaced by a
recorder), derives the signature, and calls ``triton.compile`` for ``GPUTarget("cuda", 90, 32)``. A check that
the code compiles, not that it runs: the device script (``run.sh``) checks that.

    PYTHONPATH=src python benchmarks/device/compile_check.py          # about a minute of CPU
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # the compiler, not the interpreter (before triton is imported)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, stated (it warns when unset)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from kvcert import quant  # noqa: E402
from kvcert.cache.store import LayerStore  # noqa: E402
from kvcert.kernels import triton_read  # noqa: E402
from kvcert.kernels.packed import MODES  # noqa: E402

KERNELS = ("_logits_radii_kernel", "_exp_kernel", "_sums_kernel", "_gap_kernel")
#: one codec (with options) per kernel mode
CODECS: dict[str, tuple[str, dict]] = {
    "scratch": ("fp8-e4m3", {}),
    "rtn8": ("int8", {}),
    "rtn_packed": ("int4", {}),
    "dither": ("dither-int8", {}),
    "kivi_tokens": ("kivi-2", {"group_size": 8, "residual_window": 0}),
    "kivi_channels": ("kivi-4", {"axis": "value", "residual_window": 0}),
    "fp16": ("none", {}),
}
_TYPES = {
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.float16: "fp16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.int32: "i32",
    torch.int64: "i64",
}


def _launches(codec: str, opts: dict) -> list[tuple[object, tuple, dict]]:
    """``(kernel, args, constexprs)`` of every launch of one decode read over a store written through ``codec``."""
    calls: list[tuple[object, tuple, dict]] = []
    real = {name: getattr(triton_read, name) for name in KERNELS}

    class _Recorder:
        def __init__(self, fn: object) -> None:
            self.fn = fn

        def __getitem__(self, grid: tuple):
            return lambda *args, **kw: calls.append((self.fn, args, kw))

    gen = torch.Generator().manual_seed(0)
    store = LayerStore(
        0, quant.get(codec, **opts), quant.get(codec, **opts), bands=8, pairing="rotate_half", seed=0, write_block=8
    )
    k, v = torch.randn(1, 2, 48, 128, generator=gen), torch.randn(1, 2, 48, 128, generator=gen)
    rows, keep = torch.arange(1), torch.zeros(1, dtype=torch.bool)
    store.append(k[:, :, :40], v[:, :, :40], rows, keep)
    store.append(k[:, :, 40:], v[:, :, 40:], rows, keep)
    q = torch.randn(1, 2, 4, 128, generator=gen)
    try:
        for name in KERNELS:
            setattr(triton_read, name, _Recorder(real[name]))
        triton_read.read_store(q, store, None, 1, 128**-0.5)
    finally:
        for name in KERNELS:
            setattr(triton_read, name, real[name])
    return calls


def _type(a: object) -> object:
    """Triton's type string of one launch argument (a named tuple such as ``TileSource``: the same tuple of types)."""
    if isinstance(a, tuple):
        return type(a)(*(_type(x) for x in a))
    if isinstance(a, torch.Tensor):
        return "*" + _TYPES[a.dtype]
    if isinstance(a, bool):
        return "i1"
    if isinstance(a, int):
        return "i64" if abs(a) >= 2**31 else "i32"
    return "fp32"


def _signature(fn: object, args: tuple, consts: dict) -> dict[str, object]:
    sig = {name: _type(a) for name, a in zip(fn.arg_names, args, strict=False)}
    return sig | dict.fromkeys(consts, "constexpr")


def main() -> None:
    target = GPUTarget("cuda", 90, 32)
    done: set[tuple] = set()
    for mode, (codec, opts) in CODECS.items():
        for fn, args, consts in _launches(codec, opts):
            key = (fn.__name__, tuple(sorted(consts.items())))
            if key in done:
                continue
            done.add(key)
            compiled = triton.compile(
                triton.compiler.ASTSource(fn, _signature(fn, args, consts), consts), target=target
            )
            print(
                f"{mode:>13} ({codec}, mode {MODES[mode]}): {fn.__name__} -> {len(compiled.asm['cubin'])} B cubin",
                flush=True,
            )
    print(f"compiled {len(done)} kernel variants for sm_90 (triton {triton.__version__})")


if __name__ == "__main__":
    sys.exit(main())
