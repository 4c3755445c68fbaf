"""Importing the vLLM plugin (every vLLM process does, at start-up) must not load numba: vLLM's CPU worker scans
every loaded module for Triton kernels and fails on llvmlite's library object (``kvcert.quant.kernel_env``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

LOADED = "import sys, {module}; print(sorted(m for m in ('numba', 'llvmlite') if m in sys.modules))"


@pytest.mark.parametrize("module", ["kvcert.integrations.vllm.plugin", "kvcert.cache", "kvcert.cache.buffer"])
def test_importing_loads_no_numba(module: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", LOADED.format(module=module)], capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_cpu_log8_write_still_runs_the_fused_plan() -> None:
    """The lazy import keeps the fused plan: a CPU write in a fresh process loads it (and numba) on first use."""
    code = (
        "import sys, torch; from kvcert.cache.buffer import LogBuffer, WriteBatch; "
        "b = LogBuffer(torch.zeros(1, 2, 0)); w = WriteBatch(); w.append(b, torch.rand(1, 2, 3)); w.commit(); "
        "print('kvcert.quant.logcode_numba' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k != "KVCERT_KERNEL"}  # the default backend: numba on CPU
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300, env=env)
    assert out.stdout.strip() == "True", out.stdout + out.stderr
