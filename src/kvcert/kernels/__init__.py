"""Read-path kernels bound to the store's memory layout, and the choice of backend per read.

Three backends compute the same certified decode read (served logits, Tier-A radii with the float32 logit
slack, softmax, meter, output and the output bound's per-read terms; ``docs/math.md#kernel-rounding``):

* ``"numba"`` — :mod:`kvcert.kernels.numba_read`, CPU tensors (the default on CPU);
* ``"triton"`` — :mod:`kvcert.kernels.triton_read`, CUDA tensors (the default there), or CPU tensors under the
  Triton interpreter (``TRITON_INTERPRET=1`` set before ``triton`` is first imported; how CI tests it);
* ``"torch"`` — the eager reference forms of :mod:`kvcert.attention.certified` (any device; the only one for
  devices other than CPU and CUDA, prefill-size reads and reads that meet a non-finite entry).

``KVCERT_KERNEL=numba|torch|triton`` forces a backend; :func:`active` says which one a read on a device uses.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from kvcert.quant.kernel_env import ENV

__all__ = ["BACKENDS", "ENV", "active"]

BACKENDS: tuple[str, ...] = ("numba", "torch", "triton")


@functools.cache
def _triton_installed() -> bool:
    """Whether ``triton`` can be imported (looked up once per process: :func:`active` runs on every read)."""
    return importlib.util.find_spec("triton") is not None


def active(device: torch.device | str | None = None) -> str:
    """The read-path backend a read of tensors on ``device`` uses: ``"numba"``, ``"torch"`` or ``"triton"``.

    ``device=None``: CUDA when it is available, else CPU. ``KVCERT_KERNEL`` (one of :data:`BACKENDS`) overrides
    the default (``"triton"`` on CUDA when ``triton`` is installed, ``"numba"`` on CPU, ``"torch"`` elsewhere).
    Raises ``ValueError`` for an unknown ``KVCERT_KERNEL`` value and for a forced backend that cannot run on
    ``device`` (``numba`` off CPU; ``triton`` on CPU without ``TRITON_INTERPRET=1``; ``triton`` on devices other
    than CPU and CUDA).
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    kind = torch.device(device).type
    forced = os.environ.get(ENV, "").strip().lower()
    if forced and forced not in BACKENDS:
        raise ValueError(f"{ENV}={os.environ[ENV]!r} is not a read-path backend; use one of {', '.join(BACKENDS)}")
    name = forced or {"cuda": "triton" if kind == "cuda" and _triton_installed() else "torch", "cpu": "numba"}.get(
        kind, "torch"
    )
    if name == "numba" and kind != "cpu":
        raise ValueError(f"{ENV}=numba runs on CPU tensors only; this read is on {kind}")
    if name == "triton":
        if kind == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"{ENV}=triton on CPU tensors needs TRITON_INTERPRET=1 (set before importing triton)")
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"the triton read path runs on CUDA tensors (or CPU under the interpreter), not {kind}")
    return name
