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
# glibc malloc asks for transparent huge pages on the large blocks it maps (glibc >= 2.35; ignored elsewhere):
# XLA:CPU allocates a step's ~1 GB of temporaries afresh every step, and faulting them in 4 KB pages cost
# ~1 s of kernel time per LoRA step of benchmarks/bench_lora.py. The benchmarks run the peer in this and
# other environments and compare with its fastest (benchmarks/common.py, child_plan). README: "CPU speed".
export GLIBC_TUNABLES ?= glibc.malloc.hugetlb=1

.PHONY: install test course lab bench model notebooks-clean clean help

help:
	@echo "make course  - run the six notebooks headless into build/ and print a summary"
	@echo "make test    - install (if needed) and run the tests, notebooks included"
	@echo "make lab     - open JupyterLab on notebooks/ with the amdllm kernel"
	@echo "make bench   - run benchmarks/ (writes JSON into bench_results/)"
	@echo "make model   - rebuild the default model from its recipe (20-30 min) and compare with data/default_model"

# torch is pinned to the CPU build (2.13.0): an unpinned torch pulls a multi-GB CUDA build.
# On a ROCm machine install torch/jax ROCm wheels first (README: "Install on AMD ROCm").
$(STAMP): pyproject.toml requirements/lock.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c requirements/lock.txt "torch==2.13.0"
	@# PYTHONWARNINGS: setuptools prints a notice on every editable install that the source tree is
	@# imported from directly (which is the point); nothing to act on
	PYTHONWARNINGS=ignore $(BIN)/python -m pip install -q -c requirements/lock.txt -e ".[all]"
	$(BIN)/python -m amdllm.course.notebooks kernel
	@touch $@

install: $(STAMP)

test: install
	$(BIN)/python -m amdllm.course build
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=15 tests

model: install
	$(BIN)/python -m amdllm.course build --force

course: install
	$(BIN)/python -m amdllm.course build
	$(BIN)/python -m amdllm.course.notebooks run --out build

lab: install
	$(BIN)/python -m amdllm.course.notebooks kernel
	$(BIN)/jupyter lab notebooks/

# GPTQModel, the reference side of benchmarks/bench_gptq.py, goes in its own venv that sees .venv's packages
# through a .pth file: it declares torch>=2.14.1, which pip cannot install next to torch 2.13.0 (it runs on
# 2.13.0), and in .venv its torchao/datasets/pandas would sit under the tests. requirements/bench-gptqmodel.txt.
GM_VENV  := $(VENV)/gptqmodel-env
GM_STAMP := $(GM_VENV)/.installed
$(GM_STAMP): $(STAMP) requirements/bench-gptqmodel.txt
	@test -x $(GM_VENV)/bin/python || $(PY) -m venv $(GM_VENV)
	@base=$$($(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"); \
	 own=$$($(GM_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"); \
	 echo "import site; site.addsitedir('$$base')" > "$$own/amdllm-venv.pth"
	$(GM_VENV)/bin/python -m pip install -q --upgrade pip
	$(GM_VENV)/bin/python -m pip install -q -c requirements/lock.txt -r requirements/bench-gptqmodel.txt
	$(GM_VENV)/bin/python -m pip install -q --no-deps gptqmodel==7.7.0 optimum==2.3.0
	$(GM_VENV)/bin/python -c "import torch, transformers; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	@touch $@

bench: install $(GM_STAMP)
	AMDLLM_GPTQMODEL_PYTHON=$(abspath $(GM_VENV))/bin/python $(BIN)/python benchmarks/run_all.py --out bench_results

clean:
	rm -rf build bench_results .pytest_cache
