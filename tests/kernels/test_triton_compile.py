"""The Triton read's kernels compile for a Hopper GPU (sm_90) on this CPU-only machine.

The interpreter tests (``TRITON_INTERPRET=1``) run the kernels' Python and miss what only the compiler rejects;
``benchmarks/device/compile_check.py`` runs the real compiler down to a cubin with the ``ptxas`` shipped in the
``triton`` wheel (no GPU, no driver). It runs in a child process: this session imported triton in interpreter
mode. About 1.5 minutes on 2 CPU cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcert.kernels.packed import MODES

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.slow
@pytest.mark.skipif(not PTXAS.is_file(), reason="the triton wheel ships no ptxas here: nothing to compile with")
def test_every_kernel_variant_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "device" / "compile_check.py")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    lines = [line for line in run.stdout.splitlines() if "B cubin" in line]
    # the two kernels that read the store (logits, sums) once per codec mode, the two codec-free ones once
    expected = 2 * len(MODES) + 2
    assert len(lines) == expected and f"compiled {expected} kernel variants for sm_90" in run.stdout, run.stdout
