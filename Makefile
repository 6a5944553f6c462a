# Set-up and test entry points; README.md names `make demo` and `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
PLUGINS := $(wildcard plugins/nixl plugins/ucx plugins/mixers)
EXAMPLES := $(wildcard docs/examples/kvcore-cma)

.PHONY: install demo test lint

# torch first and pinned: 2.13.0 is the CPU build; an unpinned torch would pull a multi-GB CUDA build.
install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(foreach p,$(PLUGINS) $(EXAMPLES),$(PIP) install -q -e $(p) &&) true

demo: install
	kvcore demo

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check kvcore plugins

test: install lint
	$(PYTHON) -m pytest
