# `make test` is what CI runs (through .ci/run); `make run` is the main job.
VENV ?= .venv
PY := $(VENV)/bin/python
# Only used when torch is missing: the CPU build this project is developed on.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install test test-fast lint fmt run bench

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,dev]"
	touch $@

install: $(VENV)/.installed

test: lint
	$(PY) -m pytest

test-fast: install
	$(PY) -m pytest -m "not slow"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

fmt: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

run: install
	$(PY) -m launch

bench: install
	$(PY) -m dscale.bench --quick
