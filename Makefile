# `make test` is what CI runs (through .ci/run); `make run` is the main job.
VENV ?= .venv
PY := $(VENV)/bin/python
# Only used when torch is missing: the CPU build this project is developed on.
TORCH_SPEC ?= torch==2.13.0
# Every later install is held to the torch that is there, so no requirement swaps it for a CUDA build.
TORCH_PIN := $(VENV)/torch-constraint.txt
# timm's NativeScaler is tested as timm ships it, but timm requires torchvision, whose registry
# build is CUDA's (and breaks `import lightning`): timm alone, without its requirements.
TIMM_SPEC ?= timm==1.0.31
# apt-get runs through sudo unless we are root.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install system-tools test test-fast lint fmt run bench gpu-site gpu-check

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -W 'ignore:Failed to initialize NumPy' -c "import torch; print('torch==' + torch.__version__)" > $(TORCH_PIN)
	$(PY) -m pip install -q -c $(TORCH_PIN) -e ".[test,dev,fp8,tensorboard]"
	$(PY) -m pip install -q --no-deps "$(TIMM_SPEC)"
	touch $@ $(VENV)/.installed-run

# `make run` needs the project and matplotlib (for `python -m dscale.report`), not the test and
# dev extras (Lightning, accelerate, transformers: minutes to install).
$(VENV)/.installed-run: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -W 'ignore:Failed to initialize NumPy' -c "import torch; print('torch==' + torch.__version__)" > $(TORCH_PIN)
	$(PY) -m pip install -q -c $(TORCH_PIN) -e ".[report]"
	touch $@

install: $(VENV)/.installed

# The tools the tests run that PyPI lacks, from Debian: Prometheus (server and promtool),
# Alertmanager, and a one-node Slurm (slurmctld, slurmd, munge, the client commands). Nothing
# starts on install; the tests start their own daemons under a temp folder.
SYSTEM_TOOLS := prometheus promtool prometheus-alertmanager munged slurmctld slurmd sbatch scontrol
SYSTEM_PACKAGES := prometheus prometheus-alertmanager slurm-wlm slurmctld slurmd munge
system-tools:
	@missing=""; for t in $(SYSTEM_TOOLS); do command -v $$t >/dev/null 2>&1 || missing="$$missing $$t"; done; \
	if [ -z "$$missing" ]; then :; \
	elif command -v apt-get >/dev/null 2>&1; then \
	  echo "installing Debian's $(SYSTEM_PACKAGES) for the tests (missing:$$missing)"; \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends $(SYSTEM_PACKAGES); \
	else \
	  echo "make test needs$$missing on PATH (Debian: apt-get install $(SYSTEM_PACKAGES))" >&2; \
	  exit 1; \
	fi

# Two workers, each file whole on one of them (module fixtures share one spawn): the end-to-end
# tests spend much of their time waiting on subprocesses and daemons.
test: lint system-tools
	$(PY) -m pytest -n 2 --dist loadfile

test-fast: install
	$(PY) -m pytest -m "not slow"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

fmt: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

run: $(VENV)/.installed-run
	$(PY) -m launch

bench: install
	$(PY) -m dscale.bench --quick

# What a session with a lent GPU runs there (.ci/gpu-check; results under $$OUT). The GPU image
# has its own torch but no Hydra: gpu-site copies the pure-Python packages it lacks from this venv.
GPU_SITE_PACKAGES := hydra omegaconf antlr4 yamllint trustme hydra_core-*.dist-info \
  omegaconf-*.dist-info antlr4_python3_runtime-*.dist-info yamllint-*.dist-info trustme-*.dist-info
gpu-site: install
	rm -rf .gpu-site && mkdir -p .gpu-site
	cd $(VENV)/lib/python3*/site-packages && cp -r $(GPU_SITE_PACKAGES) $(CURDIR)/.gpu-site/
	find .gpu-site -name __pycache__ -prune -exec rm -rf {} +

gpu-check:
	bash .ci/gpu-check
