# amdllm: two commands do everything on a fresh machine.
#   make course   execute all notebooks on the embedded default model into build/ and print a summary
#   make test     run the test suite (notebooks included)
# Both create .venv and install the tested pin set (requirements/lock.txt) on first use.

PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PYTEST_WORKERS ?= 2
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1

.PHONY: install test course lab bench model notebooks-clean clean help

help:
	@echo "make course  - run the six notebooks headless into build/ and print a summary"
	@echo "make test    - install (if needed) and run the tests, notebooks included"
	@echo "make lab     - open JupyterLab on notebooks/ with the amdllm kernel"
	@echo "make bench   - run benchmarks/ (writes JSON into bench_results/)"
	@echo "make model   - build the embedded default model into the cache now"

# torch is pinned to the CPU build (2.13.0): an unpinned torch pulls a multi-GB CUDA build.
# On a ROCm machine install torch/jax ROCm wheels first (README: "Install on AMD ROCm").
$(STAMP): pyproject.toml requirements/lock.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c requirements/lock.txt "torch==2.13.0"
	$(BIN)/python -m pip install -q -c requirements/lock.txt -e ".[all]"
	@touch $@

install: $(STAMP)

test: install
	$(BIN)/python -m amdllm.course build
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=15 tests

model: install
	$(BIN)/python -m amdllm.course build

course: install
	$(BIN)/python -m amdllm.course build
	$(BIN)/python -m amdllm.notebooks run --out build

lab: install
	$(BIN)/python -m ipykernel install --sys-prefix --name amdllm --display-name "amdllm (.venv)"
	$(BIN)/jupyter lab notebooks/

bench: install
	$(BIN)/python benchmarks/run_all.py --out bench_results

clean:
	rm -rf build bench_results .pytest_cache
