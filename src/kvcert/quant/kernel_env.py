"""The ``KVCERT_KERNEL`` switch, readable without loading a kernel library.

Importing numba loads llvmlite, and vLLM's CPU worker scans every loaded module for Triton kernels when it starts;
it fails on llvmlite's library object (``docs/serving-vllm.md``, offline use). The vLLM plugin imports the cache
package at start-up, so the switch the cache's write path reads lives here, apart from the numba kernels, and the
write path imports :mod:`kvcert.quant.logcode_numba` only when it first plans a fused write
(``tests/integrations/test_vllm_plugin_imports.py`` pins that importing the plugin loads no numba).
"""

from __future__ import annotations

import os

import torch

#: environment variable that forces a backend (``numba``, ``torch`` or ``triton``) of the read path's kernels
#: (:func:`kvcert.kernels.active`) and, off ``numba``, the tensor path of the ``log8`` witness writes
ENV = "KVCERT_KERNEL"


def fused_log8(device: torch.device) -> bool:
    """Whether a ``log8`` write of tensors on ``device`` runs :func:`kvcert.quant.logcode_numba.plan`: CPU, and
    :data:`ENV` unset or ``numba``."""
    return device.type == "cpu" and os.environ.get(ENV, "").strip().lower() in ("", "numba")
