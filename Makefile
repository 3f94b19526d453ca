# The README's two quick-start commands are `make bench` and `make test`; .ci/run calls `make test`.
PYTHON ?= python3
# torch is pinned only when none is installed: a bare `pip install torch` would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: setup test bench info

setup:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install $(TORCH_PIN)
	# a no-isolation build uses the env's own build tools (Python >= 3.12 venvs ship no setuptools)
	$(PYTHON) -m pip install "setuptools>=64" wheel ninja
	# --no-build-isolation: the optional C++ extension builds against the torch installed above.
	$(PYTHON) -m pip install --no-build-isolation -e ".[test,bench,triton,diagnostics]"

test: setup
	$(PYTHON) -m fastgrad.info
	$(PYTHON) -m pytest -q tests

bench: setup
	$(PYTHON) -m fastgrad.bench --quick

info:
	$(PYTHON) -m fastgrad.info
