# `make train` and `make test` do all the set-up on a fresh machine, then run the job.
# TORCH_SPEC is installed first: on CPU machines the pinned version comes from a local wheel, while an
# unpinned torch would pull gigabytes of CUDA packages. GPU machines may pass TORCH_SPEC= to keep their own.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup train test test-fast bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/pip install --quiet "$(TORCH_SPEC)"; fi
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $(STAMP)

setup: $(STAMP)

train: setup
	$(BIN)/tessera train

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

bench: setup
	$(BIN)/python benchmarks/ddp.py

clean:
	rm -rf $(VENV) runs .pytest_cache
