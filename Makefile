# Two commands do all the set-up on a fresh machine:
#   make demo   — create/reuse .venv, install, run the async GRPO example (the main job)
#   make test   — create/reuse .venv, install, run ruff, mypy and the test suite
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
# On CPU machines the CPU build of torch is installed first, so that the package's
# torch range does not pull a multi-GB CUDA build.
TORCH_CPU ?= torch==2.13.0
EXTRAS ?= dev,jax,embedded,ray

.PHONY: setup demo test lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q $(TORCH_CPU); fi
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
	touch $@

demo: setup
	$(BIN)/python examples/async_grpo.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/pytest -q

bench: setup
	for b in benchmarks/*.py; do $(BIN)/python $$b --quick || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
