# Set-up and test entry points; README.md names `make demo` and `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# Each plugin with the extra that brings its native library (nixl: the CUDA-12 flavour of the NIXL wheel,
# which also works on host memory without a GPU).
PLUGINS := 'plugins/nixl[cu12]' plugins/ucx plugins/mixers docs/examples/kvcore-cma

.PHONY: install demo test lint mutations

# torch first and pinned: 2.13.0 is the CPU build; an unpinned torch would pull a multi-GB CUDA build.
install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(foreach p,$(PLUGINS),$(PIP) install -q -e $(p) &&) true

demo: install
	kvcore demo

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check kvcore plugins
	$(PYTHON) -m mypy kvcore

test: install lint
	$(PYTHON) -m pytest

# Break each guarantee on purpose (tools/mutations.toml) and require the tests to catch it; slow (minutes), not in CI.
mutations:
	$(PYTHON) tools/mutations.py
