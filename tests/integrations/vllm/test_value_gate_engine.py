"""The value gate inside a real vLLM engine (SmolLM2-135M, fp32, CPU): ``certified:0.2:values=NU`` in validate
mode. A paged store has no upgrade codecs, so a head whose value term is above ``NU`` times its value spread is served
its exact values from the host blocks for the read: the records count those reads and their page-in, and no cell is
above its certificate or above the output bound of what was served.

The engine runs in a process of its own (``vllm_value_gate.py``): an in-process engine cannot start in a pytest
process where another module's engine already imported kvcert's read path (vLLM's Triton dispatcher scans the loaded
modules when an engine starts and fails on numba's llvmlite object)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcert.integrations.vllm.records import RequestRecord


@pytest.fixture(scope="module")
def records():
    script = Path(__file__).with_name("vllm_value_gate.py")
    done = subprocess.run(
        [sys.executable, str(script)], env=dict(os.environ), capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [RequestRecord.from_json(json.dumps(r)) for r in json.loads(done.stdout.strip().splitlines()[-1])]


def test_the_value_gate_serves_exact_values_and_every_cell_stays_within_its_bounds(records):
    assert len(records) == 2
    for rec in records:
        assert rec.validated_cells == rec.cells > 0
        assert rec.violations == 0 and rec.out_violations == 0  # per cell, TV and output error
        assert rec.value_repaired_reads > 0 and rec.bytes_paged > 0
        assert rec.summary()["tiers"]["out_violations"] == "measured (validate mode)"
