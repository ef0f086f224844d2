# amdllm: two commands do everything on a fresh machine.
#   make course   execute all notebooks on the embedded default model into build/ and print a summary
#                 (MODEL=smollm2: on the real pretrained chat model SmolLM2-135M-Instruct, into build-smollm2/)
#   make test     run the test suite (notebooks included)
# Both create .venv and install the tested pin set (requirements/lock.txt) on first use.

PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PYTEST_WORKERS ?= 2
# which model the lessons run on (amdllm/course/models.py): the embedded toy, or smollm2
MODEL   ?= default
COURSE_OUT := $(if $(filter default,$(MODEL)),build,build-$(MODEL))
# ACCEL=auto: where $(PY)'s own JAX computes on a GPU or TPU, .venv is built on top of it and keeps its JAX
# and PyTorch; ACCEL=cpu: always the CPU set. TORCH_INDEX: where the CPU build of PyTorch comes from.
ACCEL   ?= auto
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1
# glibc (2.35+) maps XLA:CPU's large temporaries in huge pages: faulting a training step's afresh in 4 KB
# pages costs kernel time every step (ignored where glibc lacks the tunable). docs/cli.md, "Common rules"
export GLIBC_TUNABLES ?= glibc.malloc.hugetlb=1

.PHONY: install test test-core course lab bench model notebooks-clean clean help

help:
	@echo "make course  - run the six notebooks headless into build/ and print a summary"
	@echo "               (MODEL=smollm2: on the real chat model SmolLM2-135M-Instruct, into build-smollm2/)"
	@echo "make test    - install (if needed) and run the tests, notebooks included"
	@echo "make lab     - open JupyterLab on notebooks/ with the amdllm kernel"
	@echo "make bench   - run benchmarks/ (writes JSON into bench_results/)"
	@echo "make model   - rebuild the default model from its recipe (20-30 min) and compare with data/default_model"

# requirements/install.py: the venv, PyTorch (the CPU build unless one is there), the lock and amdllm
$(STAMP): pyproject.toml requirements/lock.txt requirements/install.py
	$(PY) requirements/install.py --venv $(VENV) --accel $(ACCEL) --torch-index $(TORCH_INDEX)
	@touch $@

install: $(STAMP)

test: install
	$(BIN)/python -m amdllm.course build
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=15 tests

# the suite with the CPU backend off and no C or C++ compiler on PATH: the core alone (.ci/run runs both).
# The lessons on the real model (tests/test_course_real.py) run once, in `make test`: they exercise no
# backend code that the default model's lessons do not, and are the slowest file of the suite.
test-core: install
	$(BIN)/python -m amdllm.course build
	AMDLLM_BACKEND=off .ci/without_compiler $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile \
	    --durations=15 --ignore=tests/test_course_real.py tests

model: install
	$(BIN)/python -m amdllm.course build --force

course: install
	$(BIN)/python -m amdllm.course build
	$(BIN)/python -m amdllm.course.notebooks run --out $(COURSE_OUT) --model $(MODEL)

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
