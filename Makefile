# `make serve` and `make test` each set up everything they need on a fresh machine.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
# Installed once per version of the dependency list.
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)

.PHONY: install serve test lint typecheck sim clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

serve: $(STAMP)
	$(VENV)/bin/tiergate serve

# Triton kernels run under the interpreter on machines without a GPU.
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	TRITON_INTERPRET=1 $(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Tiered vs FCFS scheduling on the simulated machine (fake runner), workload-serve-600.
sim: $(STAMP)
	$(PY) -m engine.simulation --workload ../shared/bench/workload-serve-600.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
