# The README's quick start: in a fresh virtual environment (python3 -m venv .venv && . .venv/bin/activate),
# `make bench` and `make test`; .ci/run calls `make test`.
#
# Each installs only what it needs, and says what and why before installing (WHY_* below):
#   make bench  fastgrad with its C++ extension and the `bench` extra (tqdm, matplotlib), plus triton only when
#               torch is a CUDA build (triton runs on GPUs; on a CPU-only torch it would be ~1 GB of nothing)
#   make test   also the test, diagnostics, frameworks (lightning, accelerate, transformers), logs (tensorboard)
#               and triton extras
#               (CI runs the Triton kernels in the interpreter on CPU)
# Comments live out here, not in the recipes, so make does not echo them.
PYTHON ?= python3
# bash for `set -o pipefail`: the installs' output goes through a filter and pip's own exit status must count.
SHELL := /bin/bash
# torch is pinned only when none is installed: a bare `pip install torch` would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
BENCH_EXTRAS := bench
TEST_EXTRAS := test,bench,triton,diagnostics,frameworks,logs
# What each extra is for, printed before an install (pyproject.toml lists the packages).
WHY_bench := bench: tqdm, matplotlib - progress bar and plots of python -m fastgrad.bench
WHY_triton := triton: the Triton backend - on a CPU-only torch the tests run its kernels in the interpreter (TRITON_INTERPRET=1)
WHY_test := test: pytest, pytest-timeout - the test suite, a time limit per test
WHY_diagnostics := diagnostics: rich, matplotlib - the rich report tables and the monitor/check plots, which tests/test_report.py, test_monitor.py, test_check.py exercise
WHY_logs := logs: tensorboard - python -m fastgrad.check --log reads TensorBoard event files (tests/test_check_logs.py writes and reads them)
WHY_frameworks := frameworks: lightning, accelerate, transformers - tests/test_frameworks.py runs patch_torch() under the real trainers (the large download)

# An install is redone only when something it depends on changed: the build files and C++/CUDA sources
# (file times against the stamp), or the environment (written into the stamp): which python, and the torch and
# the fastgrad that python imports, as seen from outside the clone (-I: neither the working directory, where a
# `pip install .` leaves fastgrad.egg-info, nor PYTHONPATH counts). The fastgrad is its version and the source
# it was installed from, not how: `pip install .` and make's editable install of the same clone build the same
# in-place extension, so switching between them rebuilds nothing. `make -B setup` forces it. The stamps live in the ignored build/ folder,
# so a clean clone installs everything. One stamp per install kind: `make test` after `make bench` adds
# the test extras' packages without rebuilding fastgrad (a rebuild recompiles the extension: minutes), as
# long as the benchmark's install is current; `make bench` after `make test` finds everything there.
TEST_STAMP := build/.make-install-test
BENCH_STAMP := build/.make-install-bench
ENV_ID_PY := import sys, json, hashlib, importlib.metadata as m; \
  dist = lambda n: next(iter(m.distributions(name=n)), None); \
  src = lambda d: d and (d.version, json.loads(d.read_text('direct_url.json') or '{}').get('url', '')); \
  print(hashlib.sha1(repr((sys.executable, src(dist('torch')), src(dist('fastgrad')))).encode()).hexdigest())
ENV_ID_RUN := $(PYTHON) -I -c "$(ENV_ID_PY)"
ENV_ID := $(shell $(ENV_ID_RUN) 2>/dev/null)
INSTALL_DEPS := setup.py pyproject.toml $(shell find csrc -type f 2>/dev/null)
# The requirements the installed fastgrad declares for the extras in argv[1], their extra clause dropped so
# pip still evaluates the rest of a marker (transformers only on Python >= 3.11).
define EXTRA_REQS_PY
import sys, importlib.metadata as m
want = set(sys.argv[1].split(","))
for r in m.requires("fastgrad") or []:
    req, _, marker = r.partition(";")
    conds = [c.strip() for c in marker.split(" and ") if c.strip()]
    extras = {c.split("==")[1].strip().strip("'\"") for c in conds if c.startswith("extra ")}
    rest = [c for c in conds if not c.startswith("extra ")]
    if extras & want:
        print(req.strip() + ("; " + " and ".join(rest) if rest else ""))
endef
export EXTRA_REQS_PY
# The benchmark's install is current (and no `make -B` asks for a full reinstall).
FORCED := $(findstring B,$(firstword -$(MAKEFLAGS)))
BENCH_CURRENT = [ -z "$(FORCED)" ] && [ "$(ENV_ID)" = "$$(cat $(BENCH_STAMP) 2>/dev/null)" ] && \
  [ -z "$$(find $(INSTALL_DEPS) -newer $(BENCH_STAMP) 2>/dev/null)" ]

# pip -v streams the build's output (pip alone shows "still running..." for minutes): the lines below reach the
# screen - pip's progress, setup.py's notes (what is compiled, how long it took) and ninja's status lines, cut to
# "fastgrad build [done/total files, seconds] csrc/<file>" - and the whole log goes to build/<name>.log, whose
# end is shown when pip fails.
PIP_SHOWN := ^ *(fastgrad (setup|build)|Collecting |Downloading |Installing collected|Successfully (installed|built)|ERROR)
SHORT_CC := s|^ *(fastgrad build \[[^]]*\]) .* -c [^ ]*(csrc/[^ ]+) .*|   \1 \2|; s|^ *(fastgrad setup:)|   \1|
# watched_pip(log name, pip arguments)
define watched_pip
mkdir -p build && set -o pipefail && $(PYTHON) -m pip $(2) -v 2>&1 | tee build/$(1).log | \
  { grep -E --line-buffered '$(PIP_SHOWN)' | sed -E -u '$(SHORT_CC)' || true; } || \
  { echo "== pip failed; the end of its log (all of it: build/$(1).log):"; tail -n 40 build/$(1).log; exit 1; }
endef

.PHONY: setup setup-bench test test-slow bench info install-test add-test-extras wheel-check first-use-check bench-cases

ifneq ($(ENV_ID),$(shell cat $(TEST_STAMP) 2>/dev/null))
.PHONY: $(TEST_STAMP)
endif
ifneq ($(ENV_ID),$(shell cat $(BENCH_STAMP) 2>/dev/null))
.PHONY: $(BENCH_STAMP)
endif

# install(extras, stamp): torch if missing; the build tools a no-isolation build needs (Python >= 3.12 venvs
# ship no setuptools); then fastgrad editable, built against that torch (--no-build-isolation), timed, since
# compiling the C++ extension is most of a first install. The stamp records the environment as it is after
# the install (torch may have just arrived).
define install
	@$(PYTHON) -c "import torch" 2>/dev/null || { echo "== no torch here: installing $(TORCH_PIN) from pip's default index"; \
	  echo "   (on Linux the CUDA build, several GB; without a GPU, stop and first run:"; \
	  echo "   $(PYTHON) -m pip install $(TORCH_PIN) --index-url https://download.pytorch.org/whl/cpu)"; \
	  $(PYTHON) -m pip install $(TORCH_PIN); }
	@$(PYTHON) -m pip install -q "setuptools>=64" wheel ninja
	@extras="$(1)"; \
	if [ "$(1)" = "$(BENCH_EXTRAS)" ] && $(PYTHON) -W "ignore:Failed to initialize NumPy" -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)"; then \
	  extras="$$extras,triton"; fi; \
	echo "== installing fastgrad[$$extras] for $(3), and compiling its C++ extension: a few minutes on 2 CPU cores"; \
	for e in $$(echo $$extras | tr , ' '); do case $$e in \
	  bench) echo "   $(WHY_bench)";; triton) echo "   $(WHY_triton)";; test) echo "   $(WHY_test)";; \
	  diagnostics) echo "   $(WHY_diagnostics)";; frameworks) echo "   $(WHY_frameworks)";; logs) echo "   $(WHY_logs)";; esac; done; \
	echo "   (6 files, about 2.5 min of CPU time on a 2-core VM: 271 s of wall time at load 5-7; longer with CUDA"; \
	echo "   kernels, built when torch has CUDA and nvcc is found; each compiled file is listed as it is done)"; \
	start=$$(date +%s); \
	$(call watched_pip,install,install --no-build-isolation -e ".[$$extras]") || exit 1; \
	echo "== fastgrad[$$extras] installed in $$(( $$(date +%s) - start )) s"
	@mkdir -p $(dir $(2))
	@$(ENV_ID_RUN) > $(2)
endef

setup: $(TEST_STAMP)
	@echo "== fastgrad[$(TEST_EXTRAS)] is installed for the tests (reinstalled only when setup.py, pyproject.toml,"
	@echo "   csrc/ or the Python/torch environment change; make -B setup forces it)"

setup-bench:
	@if [ "$(ENV_ID)" = "$$(cat $(TEST_STAMP) 2>/dev/null)" ] && [ -z "$$(find $(INSTALL_DEPS) -newer $(TEST_STAMP) 2>/dev/null)" ]; \
	then echo "== fastgrad is installed with the test extras, which include the benchmark's"; \
	else $(MAKE) --no-print-directory $(BENCH_STAMP) && \
	  echo "== fastgrad[$(BENCH_EXTRAS)] is installed for the benchmark (reinstalled only when setup.py, pyproject.toml," && \
	  echo "   csrc/ or the Python/torch environment change; make -B setup-bench forces it)"; fi

$(TEST_STAMP): $(INSTALL_DEPS)
	@if $(BENCH_CURRENT); then $(MAKE) --no-print-directory add-test-extras; \
	else $(MAKE) --no-print-directory install-test; fi

install-test:
	$(call install,$(TEST_EXTRAS),$(TEST_STAMP),make test)

# fastgrad[bench] is built and current: install only the packages the other test extras add.
add-test-extras:
	@echo "== fastgrad is built and installed (make bench); adding the packages of the test extras, no recompile:"
	@for e in $$(echo $(TEST_EXTRAS) | tr , ' '); do case $$e in \
	  triton) echo "   $(WHY_triton)";; test) echo "   $(WHY_test)";; \
	  diagnostics) echo "   $(WHY_diagnostics)";; frameworks) echo "   $(WHY_frameworks)";; logs) echo "   $(WHY_logs)";; esac; done
	@$(PYTHON) -c "$$EXTRA_REQS_PY" $(TEST_EXTRAS) > build/.make-test-requirements.txt
	@$(PYTHON) -m pip install -r build/.make-test-requirements.txt
	@$(ENV_ID_RUN) > $(TEST_STAMP)

$(BENCH_STAMP): $(INSTALL_DEPS)
	$(call install,$(BENCH_EXTRAS),$@,make bench)

# The suite in two tiers (docs/testing.md, "Tiers"): `make test` the fast one, within 12 minutes on a 2-core
# machine; `make test-slow` the tests marked slow (tests/conftest.py SLOW_TESTS). CI runs both.
test: setup
	$(PYTHON) -m fastgrad.info
	$(PYTHON) -m pytest -q -m "not slow" tests

test-slow: setup
	$(PYTHON) -m pytest -q -m slow tests

bench: setup-bench
	$(PYTHON) -m fastgrad.bench --quick

info:
	$(PYTHON) -m fastgrad.info

# benchmarks/test_bench_ops.py's cases, once each and untimed (pytest-benchmark is in no extra): every op on
# every usable backend, on real models' shapes scaled to 2 MiB of gradients, with its accuracy check. CI runs
# them before the suite.
bench-cases: setup
	FASTGRAD_BENCH_MAX_MB=2 $(PYTHON) -m pytest -q benchmarks/test_bench_ops.py

# What a user installs, built and tried as they would (CI runs it before the tests): the sdist, a wheel built
# from it alone (FASTGRAD_BUILD_EXT=1: a wheel without the compiled extension is an error), installed in a
# fresh venv, and .ci/wheel_smoke.py run there from outside the checkout. The venv takes torch from this
# Python's site-packages, listed after its own in a .pth file (as a plain path, so the .pth files there, an
# editable fastgrad's among them, are not run): no second torch download.
# The wheel's compile is most of its time.
WHEEL_DIR := build/wheel-check
wheel-check:
	@$(PYTHON) -c "import torch" 2>/dev/null || { echo "== no torch here: installing $(TORCH_PIN)"; \
	  $(PYTHON) -m pip install $(TORCH_PIN); }
	@$(PYTHON) -m pip install -q "setuptools>=64" wheel ninja build
	@rm -rf $(WHEEL_DIR) && mkdir -p $(WHEEL_DIR)
	@echo "== wheel-check 1/3: the source distribution (python -m build --sdist)"
	@$(PYTHON) -m build --sdist --no-isolation --outdir $(WHEEL_DIR) . > $(WHEEL_DIR)/sdist.log 2>&1 || \
	  { tail -n 40 $(WHEEL_DIR)/sdist.log; exit 1; }
	@ls $(WHEEL_DIR)/*.tar.gz
	@echo "== wheel-check 2/3: a wheel from the sdist alone, compiling the C++ extension (FASTGRAD_BUILD_EXT=1)"
	@start=$$(date +%s); \
	export FASTGRAD_BUILD_EXT=1; $(call watched_pip,wheel-check/wheel,wheel --no-build-isolation --no-deps -w $(WHEEL_DIR) $(WHEEL_DIR)/*.tar.gz) && \
	echo "== wheel built in $$(( $$(date +%s) - start )) s: $$(ls $(WHEEL_DIR)/*.whl)"
	@echo "== wheel-check 3/3: installed in a fresh venv ($(WHEEL_DIR)/venv), smoke-tested from outside the checkout"
	@$(PYTHON) -m venv $(WHEEL_DIR)/venv
	@$(WHEEL_DIR)/venv/bin/python -m pip install -q --no-deps $(WHEEL_DIR)/*.whl
	@$(PYTHON) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > \
	  "$$($(WHEEL_DIR)/venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz-torch-from-host.pth"
	@cd "$$(mktemp -d)" && $(CURDIR)/$(WHEEL_DIR)/venv/bin/python $(CURDIR)/.ci/wheel_smoke.py

# What a plain `pip install .` gives (CI runs it after wheel-check): a fresh venv, torch pinned first (TORCH_PIN; a
# bare `pip install .` would let pip pick torch, a CUDA build on Linux), then `pip install .` with build isolation
# (no torch in the build env: a pure-Python wheel with the C++ sources, in seconds), then .ci/first_use_check.py
# from outside the checkout: the first use compiles the kernels into an empty cache (FASTGRAD_CACHE_DIR) and they
# work; a second process loads them from there without compiling. Each step is timed.
FIRST_USE_DIR := build/first-use-check
first-use-check:
	@rm -rf $(FIRST_USE_DIR) && mkdir -p $(FIRST_USE_DIR)
	@echo "== first-use-check 1/3: a fresh venv ($(FIRST_USE_DIR)/venv), torch first: pip install $(TORCH_PIN)"
	@$(PYTHON) -m venv $(FIRST_USE_DIR)/venv
	@start=$$(date +%s); $(FIRST_USE_DIR)/venv/bin/python -m pip install -q $(TORCH_PIN) && \
	  echo "   torch installed in $$(( $$(date +%s) - start )) s"
	@echo "== first-use-check 2/3: pip install . (build isolation)"
	@start=$$(date +%s); $(FIRST_USE_DIR)/venv/bin/python -m pip install -q . > $(FIRST_USE_DIR)/install.log 2>&1 || \
	  { tail -n 40 $(FIRST_USE_DIR)/install.log; exit 1; }; \
	echo "   fastgrad installed in $$(( $$(date +%s) - start )) s"
	@echo "== first-use-check 3/3: the first use compiles the kernels, a second process loads them from the cache"
	@start=$$(date +%s); cd "$$(mktemp -d)" && FASTGRAD_CACHE_DIR=$(CURDIR)/$(FIRST_USE_DIR)/cache \
	  $(CURDIR)/$(FIRST_USE_DIR)/venv/bin/python $(CURDIR)/.ci/first_use_check.py && \
	  echo "== first-use-check: the checks took $$(( $$(date +%s) - start )) s"
