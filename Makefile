# Two commands do all the set-up on a fresh machine:
#   make demo   — create/reuse .venv, install, run the async GRPO example (the main job)
#   make test   — create/reuse .venv, install, run ruff, mypy and the test suite
#                 (JOBS pytest-xdist processes, each given whole test modules, the
#                 Ray tests to one of them: tests/conftest.py; JOBS=1: serially)
#   make test-profile — the suite with a JUnit report, then its slowest tests and
#                 the time per folder (tests/_support/timing.py)
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
# On CPU machines the CPU build of torch is installed first, so that the package's
# torch range does not pull a multi-GB CUDA build.
TORCH_CPU ?= torch==2.13.0
EXTRAS ?= dev,jax,embedded,ray
# Test processes: most tests wait on other processes (engine workers, servers,
# rank scripts) much of the time, so 3 keep CI's 2 cores busy.
JOBS ?= 3
ifeq ($(JOBS),1)
PYTEST_JOBS :=
else
PYTEST_JOBS := -n $(JOBS)
endif

.PHONY: setup demo test test-profile lint bench clean

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
	$(BIN)/pytest -q $(PYTEST_JOBS)

test-profile: setup
	$(BIN)/pytest -q $(PYTEST_JOBS) --junitxml=.pytest-report.xml || true
	$(BIN)/python -m tests._support.timing .pytest-report.xml

bench: setup
	for b in benchmarks/*.py; do $(BIN)/python $$b --quick || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .pytest-report.xml
