#!/usr/bin/env bash
# One prepared device run (an H200 lent through the `device` tool): environment, correctness check, GPU decode
# benchmark. Run from the repository root:   bash benchmarks/device/run.sh        (results under $OUT)
# The machine has no network: it runs the image's python3 on this checkout through PYTHONPATH, so nothing is
# installed (the image holds torch, triton, numba, transformers; the version line below records them). Budget: under 8 minutes in all — the benchmark is cut at 7 (timeout 420);
# gpu_decode.py writes its JSON after every configuration, so a run cut short keeps what it measured.
# Dry run on a CPU machine (tiny sizes, Triton interpreter):  PYTHON=.venv/bin/python bash benchmarks/device/run.sh --smoke
set -euo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/kvcert-gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src" KVCERT_KERNEL=triton
unset TRITON_INTERPRET
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || echo "no nvidia-smi"
  "$PY" -c "import sys, torch, triton, numba, numpy; print(sys.version.split()[0], 'torch', torch.__version__,
'triton', triton.__version__, 'numba', numba.__version__, 'numpy', numpy.__version__)"
} 2>&1 | tee "$OUT/env.txt"
# gpu_decode.py checks the compiled Triton read against the eager reference on the device first (per cell, with
# the float64 exp), and takes no timings if that check fails
timeout 420 "$PY" benchmarks/gpu_decode.py --out "$OUT/gpu_decode.json" "$@" 2>&1 | tee "$OUT/gpu_decode.log"
