# Two commands a newcomer runs: `make demo` (the main job: the ground-truth hammer) and
# `make test` (the test suite).
# Each creates .venv and installs on first use; repeated runs skip the install.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch is pinned here, for set-up on machines like CI's; pyproject keeps a range.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo walkthrough test lint bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check '$(TORCH_SPEC)'
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,dev,hf,prometheus,redis]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/radixcache hammer

walkthrough: $(STAMP)
	$(VENV)/bin/radixcache demo

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) benchmarks/bench_pool.py --quick

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
