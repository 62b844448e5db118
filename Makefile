# nemo_disco: `make demo` and `make test` work on a fresh machine (they create .venv themselves).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
VLLM_VENV := .venv-vllm
PYTEST_ARGS ?=

.PHONY: setup setup-vllm demo test test-vllm lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: the CPU build (an unpinned torch would pull a multi-GB CUDA build).
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[cpu,test]'
	@rm -f $(VENV)/.installed-*
	@touch $@

setup-vllm:
	bash scripts/setup-vllm-venv.sh

demo: setup
	$(BIN)/nemo-disco train --config recipes/tiny-cpu.yaml

test: setup
	$(BIN)/python -m pytest tests -m "not vllm" $(PYTEST_ARGS)

test-vllm: setup setup-vllm
	$(VLLM_VENV)/bin/python -m pytest tests/vllm -m vllm $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: setup
	$(BIN)/python -m pip install -q -e '.[cpu,test,bench]'
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache
