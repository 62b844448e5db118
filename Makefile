# nemo_disco: `make demo` and `make test` work on a fresh machine (they create .venv themselves).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
VLLM_VENV := .venv-vllm
MCORE_LATEST_VENV := .venv-mcore-latest
PYTEST_ARGS ?=

.PHONY: setup setup-vllm setup-mcore-latest demo test test-faults test-vllm test-mcore-latest gpu-check-smoke \
	setup-gpu-rehearsal gpu-check-rehearsal lint bench clean

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

# Python 3.12 + the newest megatron-core (what GPU containers ship); see scripts/setup-mcore-latest-venv.sh.
setup-mcore-latest:
	bash scripts/setup-mcore-latest-venv.sh

demo: setup
	$(BIN)/nemo-disco train --config recipes/tiny-cpu.yaml

test: setup
	$(BIN)/python -m pytest tests -m "not vllm" $(PYTEST_ARGS)

# The fault-injection suites alone (a part of make test): a real Slurm cluster, killed, frozen and hung ranks.
test-faults: setup
	$(BIN)/python -m pytest tests/faults tests/slurm -m "not vllm" -p no:cacheprovider $(PYTEST_ARGS)

test-vllm: setup setup-vllm
	$(VLLM_VENV)/bin/python -m pytest tests/vllm -m vllm $(PYTEST_ARGS)

# The unit and distributed tests that name Megatron (marker mcore, tests/conftest.py) against megatron-core 0.19 on
# Python 3.12 (make test runs every test on 0.16.1 and 3.11; the GPU check rehearsal runs the package on 3.12 too).
test-mcore-latest: setup-mcore-latest
	$(MCORE_LATEST_VENV)/bin/python -m pytest tests/unit tests/distributed -m "mcore and not vllm" -p no:cacheprovider \
		$(PYTEST_ARGS)

# The GPU validation's stages on CPU at tiny shapes (also part of make test); on a GPU: bash scripts/gpu-check.sh
gpu-check-smoke: setup
	PYTHON=$(BIN)/python bash scripts/gpu-check.sh --smoke --out runs/gpu-check-smoke

# The GPU check rehearsed against the GPU validation machine's limits (its package set on Python 3.12, the carried
# wheels, the 64 MiB carry, the two-call split and budget, what comes back); see scripts/gpu-check-rehearsal.sh.
setup-gpu-rehearsal: setup-mcore-latest
	bash scripts/gpu-check-rehearsal.sh --setup-only

gpu-check-rehearsal: setup-gpu-rehearsal
	bash scripts/gpu-check-rehearsal.sh

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: setup
	$(BIN)/python -m pip install -q -e '.[cpu,test,bench]'
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(MCORE_LATEST_VENV) .venv-gpu-rehearsal wheels runs .pytest_cache
