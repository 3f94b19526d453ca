# The README's two quick-start commands are `make bench` and `make test`; .ci/run calls `make test`.
PYTHON ?= python3
# torch is pinned only when none is installed: a bare `pip install torch` would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0

# The install is redone only when something it depends on changed: the build files and C++/CUDA sources
# (file times against the stamp), or the environment (which python, which torch, what fastgrad install it
# sees; written into the stamp). `make -B setup` forces it. The stamp lives in the ignored build/ folder,
# so a clean clone installs everything.
STAMP := build/.make-install-stamp
ENV_ID_PY := import sys, hashlib, importlib.metadata as m; \
  print(hashlib.sha1(repr((sys.executable, [d.version for d in m.distributions(name='torch')], \
        [(d.read_text('direct_url.json') or '') + d.version for d in m.distributions(name='fastgrad')])).encode()).hexdigest())
ENV_ID := $(shell $(PYTHON) -c "$(ENV_ID_PY)" 2>/dev/null)
INSTALL_DEPS := setup.py pyproject.toml $(shell find csrc -type f 2>/dev/null)

.PHONY: setup test bench info

ifneq ($(ENV_ID),$(shell cat $(STAMP) 2>/dev/null))
.PHONY: $(STAMP)
endif

setup: $(STAMP)

$(STAMP): $(INSTALL_DEPS)
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install $(TORCH_PIN)
	# a no-isolation build uses the env's own build tools (Python >= 3.12 venvs ship no setuptools)
	$(PYTHON) -m pip install "setuptools>=64" wheel ninja
	# --no-build-isolation: the optional C++ extension builds against the torch installed above.
	$(PYTHON) -m pip install --no-build-isolation -e ".[test,bench,triton,diagnostics,frameworks]"
	@mkdir -p $(dir $@)
	# the environment as it is after the install (torch may have just arrived)
	@$(PYTHON) -c "$(ENV_ID_PY)" > $@

test: setup
	$(PYTHON) -m fastgrad.info
	$(PYTHON) -m pytest -q tests

bench: setup
	$(PYTHON) -m fastgrad.bench --quick

info:
	$(PYTHON) -m fastgrad.info
